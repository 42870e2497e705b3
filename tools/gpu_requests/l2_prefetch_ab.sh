# timeout: 230
# A/B (issues 21 and 17): the decode kernel asking L2 for the layer's next weights (o_proj and the MLP's
# weights, or the MoE router) while it attends, at batch 1 through LLM.generate, against main; and the
# MoE block's add + RMSNorm inside the router's GEMV against its own kernel (norm-apart).
python benches/batch1_ab.py --models qwen3-0.6b --variants fold+ticket/64+lm32 fold+ticket/64+lm32+l2 \
  --sampling greedy 0.6/0.95 --rounds 3 2>&1 | grep "^|"
python benches/batch1_ab.py --models qwen3-30b-a3b --variants fold+ticket/64+lm32 fold+ticket/64+lm32+l2 \
  fold+ticket/64+lm32/norm-apart --rounds 2 2>&1 | grep "^|"
