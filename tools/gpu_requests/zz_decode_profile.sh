# timeout: 150
# Issues 21 item 2 and 17 item 3: where a batch-1 decode step (CUDA-graph replay) goes, kernel by kernel,
# with each kernel's critical-path share (PDL overlaps a kernel with its predecessor): Qwen3-0.6B, then the
# Qwen3-30B-A3B MoE shape. Last: it takes what is left.
python benches/decode_profile.py --model qwen3-0.6b --batch 1 --context 256 --graphs 2>&1 | grep -v -i "capturing\|warn" | head -40
python benches/decode_profile.py --model qwen3-30b-a3b --batch 1 --context 256 --graphs 2>&1 | grep -v -i "capturing\|warn" | head -40
