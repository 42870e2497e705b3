# timeout: 400
# Issue 17 item 3, all three figures in one process: the Qwen3-30B-A3B shape (fp16, dummy weights),
# batch-1 decode against its byte floor (target >= 0.6), a batch-64 decode step against a per-expert torch
# loop (target >= 5x), and the nano-vllm workload against transformers' generate_batch (target >= 10x),
# the ratio on the model cut to its first 2 layers (transformers' expert loop takes many minutes at 48),
# voltllm's full-depth throughput printed beside it.
python benches/moe.py --only decode step offline --baseline-layers 2 2>&1 | grep -v -i "capturing\|warn"
