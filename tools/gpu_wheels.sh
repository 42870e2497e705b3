# Sourced by the device scripts (gpu_run.sh, gpu_compare.sh). The GPU machine lacks some of what the
# engine and its tests import: msgspec and pyzmq (the engine's wire), llguidance (structured outputs),
# compressed-tensors with pydantic, pydantic-core, annotated-types, typing-inspection and loguru (its
# checkpoint tests). tools/gpu_prepare.sh downloads their cp312 manylinux wheels into .carry/ (gitignored),
# one version of each (its pip download line is the list); name `.carry` in the call's carry list.
# install_carried_wheels puts every carried wheel in /tmp/site (add it to PYTHONPATH).
install_carried_wheels() {
  ls .carry/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/*.whl
}
