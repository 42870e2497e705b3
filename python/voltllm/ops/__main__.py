"""`python -m voltllm.ops [--arch 7.0]`: build the CUDA kernels ahead of time (see `voltllm.ops.build`)."""

from voltllm.ops.build import main

main()
