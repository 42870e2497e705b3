#!/bin/bash
# Builds the CUDA extension here, on a machine with no GPU, for the GPU machine's torch and architecture,
# into .carry/kernels (gitignored): a device call that carries `.carry` and sets
# VOLTLLM_KERNEL_CACHE=$PWD/.carry/kernels (tools/gpu_run.sh does) loads it instead of spending ~100 s of
# device time on the build. The cache key (voltllm.ops.build.cache_dir) holds the torch and CUDA versions,
# the architecture and a digest of the sources, so a library built from other sources is never loaded:
# the call then builds as before.
#
#   bash tools/prebuild_kernels.sh [ARCH] [TORCH_VERSION]     # default: 9.0 (H100/H200), 2.11.0
#
# The toolchain comes from PyPI, once, into ~/.cache/voltllm/prebuild: torch==TORCH_VERSION (the CUDA
# build PyPI serves: 2.11.0 is cu130, the GPU machine's 2.11.0+cu130), and nvcc of that CUDA version.
# The library does not depend on Python's version (the glue includes no Python header). The build takes
# ~1,200 CPU-s (~10-12 min on 2 idle cores; 52 min beside a CI run); the sm_90 library is ~12 MB. Only
# CUDA 13's wheel layout (nvidia/cu13/) is handled.
set -euo pipefail
cd "$(dirname "$0")/.."
arch=${1:-9.0}
torch_version=${2:-2.11.0}
home=${VOLTLLM_PREBUILD_DIR:-$HOME/.cache/voltllm/prebuild}/torch$torch_version
venv=$home/venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$torch_version" ninja numpy setuptools
fi
cuda_version=$("$venv/bin/python" -c "import torch; print(torch.version.cuda)")
cuda=$home/cuda  # a CUDA_HOME laid out as cpp_extension expects, over the nvidia-* wheels' cu13 folder
if [ ! -x "$cuda/bin/nvcc" ]; then
  nvcc="nvidia-cuda-nvcc==$cuda_version.* nvidia-cuda-crt==$cuda_version.* nvidia-nvvm==$cuda_version.*"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install -q $nvcc "nvidia-cuda-cccl==$cuda_version.*"
  wheels=$("$venv/bin/python" -c "import nvidia, os; print(os.path.join(nvidia.__path__[0], 'cu13'))")
  mkdir -p "$cuda"
  for dir in bin include nvvm; do ln -sfn "$wheels/$dir" "$cuda/$dir"; done
  ln -sfn "$wheels/lib" "$cuda/lib64"
  ln -sf libcudart.so.13 "$wheels/lib/libcudart.so"  # what -lcudart looks for
fi
# Built into a cache of its own (kept between sessions where the machine is), then only the library is
# copied to .carry/kernels: the objects and ninja's files are several times its size and the loader
# needs none of them. Sources already built there load at once (the same key).
export PATH=$venv/bin:$PATH CUDA_HOME=$cuda PYTHONPATH=$PWD/python
export VOLTLLM_KERNEL_CACHE=$home/kernels MAX_JOBS=${MAX_JOBS:-2}
# New sources make a new key, so a folder of their own: seed it with the objects and ninja's logs of the
# newest earlier build (not its library, which would load as is), and ninja rebuilds only the units whose
# sources or headers changed (one edited unit: ~1 min instead of ~18). ninja goes by modification times,
# and a file can differ from the seed's yet be older than its objects (a snapshot unpacked with the
# commit's times): every file whose content differs from the seed's record (sources.sha256, written
# after each build) is touched first. Only finished builds seed (they have that record): a build that was
# stopped halfway is passed over for the newest finished one.
key_dir=$("$venv/bin/python" -c "from voltllm.ops import build; print(build.cache_dir('$arch'))")
if [ ! -e "$key_dir/build.ninja" ]; then
  seed=$(ls -td "$(dirname "$key_dir")"/*/ 2>/dev/null | grep -v "^$key_dir/\?$" |
    while read -r dir; do [ -e "$dir/sources.sha256" ] && [ -e "$dir/.ninja_log" ] && echo "$dir"; done |
    head -1 || true)
  if [ -n "$seed" ]; then
    mkdir -p "$key_dir"
    cp -a "$seed"/*.o "$seed"/.ninja_log "$seed"/.ninja_deps "$seed"/build.ninja "$key_dir/"
    (sha256sum -c "$seed/sources.sha256" 2>/dev/null || true) | sed -n 's/: FAILED$//p' | xargs -r touch
    echo "seeded $key_dir from $seed"
  fi
fi
nice -n 10 "$venv/bin/python" -m voltllm.ops --arch "$arch"
find csrc -type f | sort | xargs sha256sum >"$key_dir/sources.sha256"
built=$key_dir
carried=.carry/kernels/$(basename "$built")
mkdir -p "$carried"
cp "$built"/*.so "$carried/"
du -sh "$carried"
