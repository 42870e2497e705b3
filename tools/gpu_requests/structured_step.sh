# timeout: 100
# Issue 20 item 6 (a JSON-schema-constrained decode step at batch 64 <= 1.05x an unconstrained one): measures
# it, both async, one process, Qwen3-0.6B shape with dummy weights. The "ratio" line is item 6; the
# "exactness" lines must say "equal" and the "grammar check" line must be printed. pool-1 / pool-4 are
# TokenMasks.pool_threads = 1 / 4 (accept and fill in one llguidance call each on a pool) against
# "JSON schema" (one call per matcher in the mask thread, the default): the default follows the faster.
bash benches/structured_ab.sh --no-tests
