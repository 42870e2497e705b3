# timeout: 100
# Issue 20 item 6 (a JSON-schema-constrained decode step at batch 64 <= 1.05x an unconstrained one): measures
# it, both async, one process, Qwen3-0.6B shape with dummy weights. The "ratio" line is item 6; the
# "exactness" lines must say "equal" and the "grammar check" line must be printed. The mask thread accepts
# and fills one matcher after another (llguidance's pool gained nothing, split threads were slower:
# python/voltllm/structured_output/masks.py).
bash benches/structured_ab.sh --no-tests
