# Sourced by the device scripts (gpu_run.sh, gpu_compare.sh). The GPU machine lacks msgspec and pyzmq:
# put their cp312 manylinux wheels in .carry/ (gitignored; `pip download --no-deps --only-binary=:all:
# --python-version 3.12 --platform manylinux2014_x86_64 -d .carry msgspec pyzmq`) and name `.carry` in
# the call's carry list; install_carried_wheels puts them in /tmp/site (add it to PYTHONPATH).
install_carried_wheels() {
  ls .carry/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/msgspec-*cp312*.whl \
    .carry/pyzmq-*.whl
}
