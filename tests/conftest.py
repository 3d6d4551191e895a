"""Shared fixtures: small random-weight HF checkpoints written on the fly (fp32, a few hundred KB).

Without a GPU, TRITON_INTERPRET=1 is set here, before any test module imports triton or a kernel: @triton.jit
functions are decorated for the interpreter when their module is first imported, so every Triton test of the
suite runs in this process (tests/interp.py). Static audits compile for sm_90 in a subprocess without it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Configs are resolved through transformers in every test (and the CLI's subprocesses), never read from a disk
# cache an earlier run left: tests/test_config_cache.py turns it on in a temporary directory.
os.environ["MEGADECODE_CONFIG_CACHE"] = "off"
# The tests' tensors are tiny: one intra-op thread. With more, OpenMP workers spin on every small op, and on a
# loaded 2-core machine a [2, 64] x [64, 13] matmul took ~7 ms instead of ~3 us (pyvm's generate: 13.5 s -> 0.2 s).
torch.set_num_threads(int(os.environ.get("MEGADECODE_TEST_THREADS", "1")))

import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, at most 4, on a CPU-only machine (2 cores in CI: the
    suite took 10 min 1 s in one process and 5 min 27 s in two, 1213 tests); one worker with a GPU, so that GPU
    tests never share the device. MEGADECODE_TEST_WORKERS=N overrides both: the tests not marked `gpu` reached 48%
    in 575 s in one worker on the H200 machine (bf18192), and they only touch the GPU with tiny tensors
    (bench/gpu_evidence.sh runs them in 14: 1239 tests in 243 s at 5936e56)."""
    if os.environ.get("MEGADECODE_TEST_WORKERS"):
        return max(1, int(os.environ["MEGADECODE_TEST_WORKERS"]))
    if torch.cuda.is_available():
        return 1
    return max(1, min(4, os.cpu_count() or 1))

from megadecode.checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture
def tiny_ckpt(tmp_path):
    """tiny_ckpt(preset="tiny-deepseek-v3", **make_checkpoint kwargs) -> fresh checkpoint directory (fp32)."""
    count = iter(range(1000))

    def make(preset: str = "tiny-deepseek-v3", **kw):
        kw.setdefault("dtype", torch.float32)
        return make_checkpoint(tmp_path / f"ckpt{next(count)}", preset, **kw)

    return make
