# timeout: 240
# A/B (issues 21 and 16): the decode kernel asking L2 for the layer's next weights (o_proj and the MLP's
# weights) through the TMA's bulk prefetch while it attends, at batch 1 through LLM.generate, against
# main; Qwen3-0.6B (issue 21's batch-1 figure), Llama-3-8B with dummy AWQ weights and in fp16 (issue 16's
# end-to-end shape). (Qwen3-30B-A3B, whose layers would prefetch only the router: --models qwen3-30b-a3b.)
# Its own GPU tests first, for a call made with --no-tests.
python -m pytest -q -p no:cacheprovider tests/kernels/test_decode_fusions_cuda.py tests/kernels/test_kernels_cuda.py \
  -k "l2 or fused or sm70_backend" 2>&1 | tail -2
python benches/batch1_ab.py --models qwen3-0.6b --variants fold+ticket/64+lm32 fold+ticket/64+lm32+l2 \
  --sampling greedy 0.6/0.95 --rounds 2 2>&1 | grep "^|"
python benches/batch1_ab.py --models llama-3-8b-awq llama-3-8b --variants fold+ticket/64+lm32 \
  fold+ticket/64+lm32+l2 --rounds 2 2>&1 | grep "^|"
