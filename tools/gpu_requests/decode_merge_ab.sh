# timeout: 110
# Issue 21 item 2: who merges the decode kernel's splits at batch 1. A batch-1 CUDA graph's grid holds ~33
# splits (64-token splits, one wave), over the 16 that "auto" lets the kernel merge itself, so every layer
# launches the merge kernel too (49.5 of an 893.5 us critical path on the H100, zz_decode_profile.sh).
# Decides ops.attention.TICKET_MERGE_MAX_SPLITS (and DECODE_MIN_SPLIT): LLM.generate batch 1 with "auto"
# vs "ticket" (always the kernel; also with 128-token splits), then the decode kernel alone at long and
# short contexts under both, then its GPU tests.
timeout 70 python benches/batch1_ab.py --models qwen3-0.6b --variants fold+ticket/64+lm32 fold+allticket/64+lm32 \
  fold+allticket/128+lm32 \
  --samplers auto --sampling greedy 0.6/0.95 --rounds 3 2>&1 | grep "^|\|target"
timeout 40 python benches/kernel_bench.py --only decode 2>&1 | grep -v -i warn
timeout 40 python -m pytest -q -p no:cacheprovider tests/kernels/test_decode_fusions_cuda.py 2>&1 | tail -2
