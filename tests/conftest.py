"""Shared fixtures: small random-weight HF checkpoints written on the fly (fp32, a few hundred KB)."""

from __future__ import annotations

import pytest
import torch

from megadecode.checkpoint import make_checkpoint


@pytest.fixture
def tiny_ckpt(tmp_path):
    """tiny_ckpt(preset="tiny-deepseek-v3", **make_checkpoint kwargs) -> fresh checkpoint directory (fp32)."""
    count = iter(range(1000))

    def make(preset: str = "tiny-deepseek-v3", **kw):
        kw.setdefault("dtype", torch.float32)
        return make_checkpoint(tmp_path / f"ckpt{next(count)}", preset, **kw)

    return make
