# timeout: 110
# Issue 16 item 3 (quantgemm helper, session 11): W4A16 at 16 and 64 rows >= 1.5x cuBLAS fp16 on the
# Llama-3-8B projections. The register-dequantizing GEMM (quant_gemm_frag: codes in the probed WMMA fragment
# order; 1 and 2 weight fragments per warp, the deep ring) against the dispatched streaming GEMM and cuBLAS
# at 16 / 64 / 128 rows, every output checked against the torch reference first (the GPU tests phase runs
# tests/kernels/test_quant_cuda.py, frag tests included). Decides CudaQuantizedMatmul's `gemm` default
# ("stream" or "frag") and the frag kernel's n_frags / deep defaults.
python benches/quant_gemm_ab.py
