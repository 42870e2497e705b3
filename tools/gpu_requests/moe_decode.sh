# timeout: 150
# Issue 17 item 3: the Qwen3-30B-A3B shape (fp16, dummy weights), batch-1 decode against its byte floor
# (target >= 0.6) and a batch-64 decode step against a per-expert torch loop (target >= 5x), one process.
python benches/moe.py --only decode step 2>&1 | grep -v -i "capturing\|warn"
