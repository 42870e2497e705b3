# timeout: 200
# Issue 16: the SM80 register-dequantizing 4-bit GEMM (quant_gemm_mma_sm80.cuh, new in session 17): its
# GPU tests, then its times against the streaming WMMA GEMM and cuBLAS fp16 at 16-128 rows on the
# Llama-3-8B projections (the 64-row target: 1.5x cuBLAS).
python -m pytest -q -p no:cacheprovider tests/kernels/test_quant_cuda.py -k "mma or stream or dispatch" 2>&1 | tail -4
python benches/quantization.py --only mma 2>&1 | grep -v -i "warn"
