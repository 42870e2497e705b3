# timeout: 90
# Issue 16: where the Llama-3-8B AWQ batch-1 step goes, kernel by kernel (critical-path shares).
python benches/decode_profile.py --model llama-3-8b-awq --batch 1 --context 256 --graphs 2>&1 | grep -v -i "capturing\|warn" | head -45
