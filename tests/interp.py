"""Importing Triton kernels for CPU tests: their @triton.jit functions run under the interpreter only
if TRITON_INTERPRET=1 is set when they are decorated (first import). Without a GPU this imports the
named modules with the variable set, then restores the environment so no other test module sees it."""

from __future__ import annotations

import importlib
import os

import torch

ON_GPU = torch.cuda.is_available()


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


def rerun_file_in_subprocess(path: str) -> None:
    """Run a test file afresh (triton was imported here without the interpreter); fail with its output."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
