# timeout: 330
# A/B (issues 21, 17 and 16): the decode kernel asking L2 for the layer's next weights (o_proj and the
# MLP's weights, or the MoE router) while it attends, at batch 1 through LLM.generate, against main; the
# MoE block's add + RMSNorm inside the router's GEMV against its own kernel (norm-apart); and the +l2
# variant on Llama-3-8B in fp16 and with dummy AWQ weights (issue 16's end-to-end shape).
python benches/batch1_ab.py --models qwen3-0.6b --variants fold+ticket/64+lm32 fold+ticket/64+lm32+l2 \
  --sampling greedy 0.6/0.95 --rounds 3 2>&1 | grep "^|"
python benches/batch1_ab.py --models qwen3-30b-a3b --variants fold+ticket/64+lm32 fold+ticket/64+lm32+l2 \
  fold+ticket/64+lm32/norm-apart --rounds 2 2>&1 | grep "^|"
python benches/batch1_ab.py --models llama-3-8b-awq llama-3-8b --variants fold+ticket/64+lm32 \
  fold+ticket/64+lm32+l2 --rounds 2 2>&1 | grep "^|"
