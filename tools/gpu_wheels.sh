# Sourced by the device scripts (gpu_run.sh, gpu_compare.sh). The GPU machine lacks some of what the
# engine and its tests import: msgspec and pyzmq (the engine's wire), llguidance (structured outputs),
# compressed-tensors with pydantic, pydantic-core, annotated-types, typing-inspection and loguru (its
# checkpoint tests). tools/gpu_prepare.sh downloads them into .carry/ (gitignored), one version of each:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .carry msgspec pyzmq llguidance compressed-tensors pydantic pydantic_core annotated-types \
#     typing-inspection loguru
# (llguidance needs --platform manylinux_2_31_x86_64 too), and name `.carry` in the call's carry list;
# install_carried_wheels puts every carried wheel in /tmp/site (add it to PYTHONPATH).
install_carried_wheels() {
  ls .carry/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/*.whl
}
