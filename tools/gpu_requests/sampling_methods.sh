# timeout: 60
# Issue 21 items 2-3: the draw alone, select vs race_first, device us per call at batch 1 to 256 (tokens
# checked against the torch reference). voltllm.ops.sampling.RACE_FIRST_MAX_ROWS ("auto" races first up
# to that many sampled rows) must sit below the batch where race_first stops being the faster one.
python benches/sampling.py --batches 1 4 8 16 32 64 128 256 --reps 30
