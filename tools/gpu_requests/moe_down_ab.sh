# timeout: 120
# Issue 17 item 3 (moe helper, session 11): batch-1 decode of the Qwen3-30B-A3B shape >= 0.6 of its floor.
# The pair path's down stage, chunks 0 (the shipped kernel) vs the staged kernel at 12 / 24 loads in flight,
# one layer at 1-64 tokens, then the batch-1 (and 8) decode step of 0, 12, 24, 12R, 24R (R: routed inside the
# pair stages, no top-k launch) in one engine against the floor measured in the same run. Decides
# voltllm.ops.moe.PAIR_DOWN_CHUNKS / PAIR_ROUTED: the fastest at batch 1 that is not slower at batch 8 and
# whose tests (tests/kernels/test_moe_cuda.py, the tests phase) passed.
bash benches/moe_down_ab.sh --no-tests
