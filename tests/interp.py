"""Triton kernels in CPU tests: their @triton.jit functions run under the interpreter only if TRITON_INTERPRET=1
is set when they are decorated (first import). tests/conftest.py sets it for the whole suite when there is no
GPU; `import_interpreted` also sets it around the import for a test file run alone from another harness."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def interpreter_env(monkeypatch):
    """TRITON_INTERPRET=1 during each test when there is no GPU (kernels a test imports late are interpreted).
    A kernel test module imports this fixture by name, which makes it autouse there."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def triton_gate(kernel):
    """(True, marker) when `kernel` can run here (on the GPU, or interpreted on the CPU). A kernel decorated
    without the interpreter on a CPU-only machine is an error of the suite's import order, not a reason to skip
    (a skipped test passes with nothing run): collection fails, naming it."""
    from megadecode.contract import triton_interpreted

    if not (ON_GPU or triton_interpreted(kernel)):
        raise RuntimeError(f"{kernel.fn.__module__}.{kernel.fn.__name__} was decorated without TRITON_INTERPRET=1 on "
                           "a machine without a GPU: triton was imported before tests/conftest.py set it")
    return True, (lambda test: test)


def import_interpreted(*modules: str):
    """Import `modules` (dotted names) for the interpreter when there is no GPU; returns the first."""
    saved = os.environ.get("TRITON_INTERPRET")
    if not ON_GPU:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = [importlib.import_module(m) for m in modules]
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return mods[0]


def static_audits(*groups) -> list:
    """Static sm_90 audits of kernels described by modules' `audit_specs(**kw)`: groups are (module name,
    [kw, ...]). Through the harness's own audit (megadecode.validate.kernel_audit: interpreted kernels are
    compiled in a fresh process without TRITON_INTERPRET); asserts each passed with the coherent-load rule
    checked; returns rows [kernel name, passed, rules checked, markdown report]."""
    from megadecode.validate.kernel_audit import audit_specs

    specs = [s for module, calls in groups for kw in calls for s in importlib.import_module(module).audit_specs(**kw)]
    reports = audit_specs(specs)
    rows = [[r.kernel, r.passed, r.rules_checked, r.to_markdown()] for r in reports]
    for name, passed, rules, md in rows:  # every kernel passes, and the coherence rule was among the checks
        assert passed, md
        assert "nc-load-of-produced" in rules, (name, rules)
    return rows


def greedy_run(cfg, weights, executor: str, prompts, steps: int, max_seq_len: int = 40):
    """(engine, tokens [B, steps + 1], logits [B, steps, V]): prefill, then `steps` greedy decode steps."""
    from megadecode import Engine

    e = Engine(cfg, weights, executor=executor, max_batch=len(prompts), max_seq_len=max_seq_len)
    toks, logits = [e.prefill(prompts).argmax(-1)], []
    for _ in range(steps):
        logits.append(e.decode(toks[-1]).clone())
        toks.append(logits[-1].argmax(-1))
    return e, torch.stack(toks, 1), torch.stack(logits, 1)


class Recorder:
    """Stands in for a @triton.jit kernel: records each launch's grid and keyword arguments instead of running."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((grid, kw))
