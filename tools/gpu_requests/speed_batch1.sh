# timeout: 100
# Issue 21 item 2 (and 3's batch-1 half): batch-1 decode through LLM.generate, greedy on both shapes and
# temperature 0.6 / top-p 0.95 on Qwen3-0.6B.
python benches/decode_latency.py --api llm --models qwen3-0.6b llama-3-8b --no-eager --tokens 64 2>&1 | grep "^|"
python benches/decode_latency.py --api llm --models qwen3-0.6b --no-eager --tokens 64 --temperature 0.6 \
  --top-p 0.95 2>&1 | grep "^|"
