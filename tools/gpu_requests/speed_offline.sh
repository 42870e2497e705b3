# timeout: 330
# Issue 21 item 1: nano-vllm's workload through LLM.generate at temperature 0.6 (async scheduling, the
# default), and transformers' generate_batch on the same prompts in the same run (~180 s of the limit).
python benches/offline_throughput.py --api llm --temperature 0.6 2>&1 | grep -v -i "capturing\|warn"
