# timeout: 120
# Issue 21 item 2 (batch1 helper, session 11): Qwen3-0.6B batch-1 decode through LLM.generate, sampler
# "select" vs "race_first" x lm_head cast vs fp32 GEMV (+lm32), greedy and T=0.6/top-p 0.95, one process;
# then both methods' draw alone at batch 1/256 (device us; "mismatches" must be ~0). Decides: Sampler's
# default method becomes race_first iff its greedy and 0.6/0.95 steps are not slower than select's and
# its batch-256 rows are not slower (else delete race_first_sampling.cuh); ParallelLMHead.fp32_gemv goes
# on iff +lm32 is not slower (else delete it). The tests phase runs test_sampling_cuda.py / test_gemv_cuda.py.
bash benches/gpu_batch1_ab.sh --no-tests
