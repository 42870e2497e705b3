# timeout: 60
# Issue 21 item 2: where a Qwen3-0.6B batch-1 decode step (CUDA-graph replay) goes, kernel by kernel, with
# each kernel's critical-path share (PDL overlaps a kernel with its predecessor). Last: it takes what is left.
python benches/decode_profile.py --model qwen3-0.6b --batch 1 --context 256 --graphs 2>&1 | grep -v -i "capturing\|warn" | head -70
