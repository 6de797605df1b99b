#!/usr/bin/env bash
# Downloads the Python wheels that a GPU machine without a package registry lacks into .whl/ at the project root:
#   nvshmem4py-cu13==0.4.1  the NVSHMEM transport of the cuda backend (moe_ep[gpu])
#   torchao==0.18.0         the FP8 peer baseline of the benchmarks
# and into .whl/tt/ torchtitan 0.3.0 with the few pure-Python packages its MoE module imports (no other dependencies:
# tests/test_torchtitan_integration.py needs only torchtitan.models.common.moe, which imports triton: present next to
# a CUDA torch); install them with --target /tmp/ttsite the same way.
# for CPython 3.12 on manylinux x86_64 (the lent H200 machines), whatever this machine's own Python is. .whl/ is kept
# out of git through .git/info/exclude. Extra arguments go to pip download (e.g. another --python-version).
# Run it where pip can reach a registry, then carry .whl/ over and install it there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .git ] || [ -f .git ]; then
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl nvshmem4py-cu13==0.4.1 torchao==0.18.0 "$@"
python3 -m pip download -q --no-deps -d .whl/tt torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 \
    docstring-parser typeguard einops
ls -la .whl .whl/tt
