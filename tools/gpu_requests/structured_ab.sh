# timeout: 100
# Issue 20 item 6 (structured helper, session 11): a JSON-schema-constrained decode step at batch 64 against
# an unconstrained one, both async, one process. Decides: item 6 (the "ratio" line <= 1.05); turn
# ModelRunner.async_constrained_steps on by default iff the "A/B" line (JSON schema-wait / JSON schema) > 1
# and tests/engine/test_grammar_steps_gpu.py passed in the tests phase; whether sys.setswitchinterval(2e-4)
# pays (JSON schema-switch200us vs JSON schema); the "exactness" lines must say "equal".
bash benches/structured_ab.sh --no-tests
