# timeout: 60
# Issue 21 items 2-3: the draw alone, select vs race_first, device us per call at batch 1 to 256 (tokens
# checked against the torch reference). voltllm.ops.sampling.resolve_sampling_method ("auto") follows
# these numbers: re-check its thresholds (RACE_FIRST_MAX_ROWS_*, RACE_FIRST_MIN_TOP_P) on a new GPU.
python benches/sampling.py --batches 1 4 8 16 32 64 128 256 --reps 30
