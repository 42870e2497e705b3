# timeout: 150
# Issue 16 item 3 on this card: the one-row GEMV against copy bandwidth and the W4A16 GEMMs against cuBLAS
# fp16 at 16, 64, 128 and 2,048 rows (AWQ int4 g128).
python benches/quantization.py --only gemv,gemm --formats "AWQ int4 g128" 2>&1 | grep -v -i "warn"
