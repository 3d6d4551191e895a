#!/usr/bin/env bash
# The serve stack for the GPU machine, which has torch and transformers but not fastapi / uvicorn /
# prometheus-client / httpx (seen 2026-12-04: `megadecode serve` there said "No module named 'uvicorn'", then
# 'fastapi'), and cannot reach a package index. Run here once per checkout: it downloads the wheels for the GPU
# machine's CPython 3.12 on x86-64 into .device/wheels (~3.8 MB, inside the carry's room beside the CuTe DSL
# bundle). Then, on the device, in the same command as the serve run (carry: [".device"]):
#   pip install -q --no-index --find-links .device/wheels --target /tmp/serve-deps fastapi uvicorn \
#     prometheus-client httpx && export PYTHONPATH=$PYTHONPATH:/tmp/serve-deps && \
#     python bench/serve_load.py --serve "..." ...
# (--target and the path last: the machine's own packages are left as they are and win where both have one)
set -euo pipefail
top=$(git rev-parse --show-toplevel)
mkdir -p "$top/.device/wheels"
grep -qxF '/.device/' "$top/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$top/.git/info/exclude"
pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --python-version 3.12 --implementation cp -d "$top/.device/wheels" fastapi uvicorn prometheus-client httpx
du -sh "$top/.device/wheels"
