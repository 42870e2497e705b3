#!/bin/bash
# Compile the CUDA torch glue (and the kernels it includes) for sm_90 on a machine with no GPU and no CUDA
# toolkit, as the GPU machine's `python -m voltllm.ops` build does: catches host-side errors (ambiguous
# names, signatures) that the sm_70 gate's NVRTC pass of the kernels alone cannot see. Uses nvcc 13.0 and
# its headers from PyPI (downloaded once into ~/.cache/voltllm/cuda13) and the installed CPU torch's
# headers; the cuBLAS/cuSPARSE/cuSOLVER headers torch's CUDA headers include are stubbed with the few
# typedefs they need (the glue calls none of them).
#
#   bash tools/glue_check.sh [csrc/torch_glue/ops_X.cu ...]      # default: every glue file
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
cache=${VOLTLLM_CUDA_CACHE:-$HOME/.cache/voltllm/cuda13}
cuda=$cache/nvidia/cu13
if [ ! -x "$cuda/bin/nvcc" ]; then
  mkdir -p "$cache/wheels"
  "$python" -m pip download -q --no-deps -d "$cache/wheels" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-nvvm==13.0.88 "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" || exit 1
  for w in "$cache"/wheels/*.whl; do "$python" -m zipfile -e "$w" "$cache"; done
  chmod +x "$cuda"/bin/* "$cuda"/nvvm/bin/*
fi
stub=$cache/stub
mkdir -p "$stub"
printf '#pragma once\ntypedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\nconst char* cusparseGetErrorString(cusparseStatus_t);\n' > "$stub/cusparse.h"
printf '#pragma once\ntypedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n' > "$stub/cublas_v2.h"
printf '#pragma once\ntypedef struct cublasLtContext* cublasLtHandle_t;\n' > "$stub/cublasLt.h"
printf '#pragma once\ntypedef struct cusolverDnContext* cusolverDnHandle_t;\n' > "$stub/cusolverDn.h"
printf '#pragma once\ntypedef int cusolverStatus_t;\n' > "$stub/cusolver_common.h"
torch_inc=$("$python" -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])") || exit 1
py_inc=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
cd "$root"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(csrc/torch_glue/*.cu)
out=$(mktemp -d)
rc=0
for f in "${files[@]}"; do
  if nice "$cuda/bin/nvcc" -c -I csrc -isystem "$torch_inc" -isystem "$torch_inc/torch/csrc/api/include" \
      -isystem "$cuda/include" -isystem "$stub" -isystem "$cuda/include/cccl" -isystem "$py_inc" \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
      -D__CUDA_NO_HALF2_OPERATORS__ -DTORCH_EXTENSION_NAME=glue_check --expt-relaxed-constexpr -std=c++20 \
      -gencode=arch=compute_90,code=sm_90 --compiler-options -fPIC -O0 "$f" -o "$out/x.o" > "$out/log" 2>&1; then
    echo "ok   $f"
  else
    echo "FAIL $f"; grep -m8 "error" "$out/log"; rc=1
  fi
done
rm -rf "$out"
exit $rc
