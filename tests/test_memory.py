"""megadecode/memory.py: the memory a model needs (weights + cache), counted without allocating, against what
the device has, checked before anything is built."""

from __future__ import annotations

import os

import pytest
import torch

from megadecode import memory
from megadecode.cache import KVCache, cache_bytes
from megadecode.engine import Engine
from megadecode.presets import preset_config
from megadecode.weights import random_weights, weight_bytes


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-linear", "tiny-k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counted_bytes_equal_what_is_allocated(preset, dtype):
    cfg = preset_config(preset)
    assert cache_bytes(cfg, 3, 40, dtype) == KVCache(cfg, 3, 40, "cpu", dtype).nbytes()
    w = random_weights(cfg, "cpu", dtype)
    assert weight_bytes(cfg, dtype.itemsize)["total"] == sum(t.numel() * t.element_size() for t in w.values())


def test_host_available_bytes_is_plausible():
    avail = memory.available_bytes("cpu")
    assert 0 < avail <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_model_too_large_fails_before_anything_is_built(monkeypatch):
    cfg = preset_config("tiny-qwen3-moe")
    need = weight_bytes(cfg, 4)["total"] + cache_bytes(cfg, 2, 64, torch.float32)
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    built = []
    monkeypatch.setattr("megadecode.engine.random_weights", lambda *a, **k: built.append(1))
    with pytest.raises(memory.InsufficientMemory) as e:
        Engine.from_pretrained("tiny-qwen3-moe", max_batch=2, max_seq_len=64)
    msg = str(e.value)
    assert msg.startswith(f"tiny-qwen3-moe needs {need / 1e9:.2f} GB on cpu") and "2 sequences x 64 positions" in msg
    assert "GB is available" in msg and built == []
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)  # exactly enough: builds
    monkeypatch.undo()
    assert Engine.from_pretrained("tiny-qwen3-moe", max_batch=2, max_seq_len=64).cache.nbytes() > 0


def test_checkpoint_too_large_fails_before_loading(tiny_ckpt, monkeypatch):
    ckpt = tiny_ckpt("tiny-deepseek-v3")
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    monkeypatch.setattr("megadecode.engine.load_weights", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(memory.InsufficientMemory, match=f"{ckpt} needs .* GB on cpu"):
        Engine.from_pretrained(str(ckpt), max_batch=1, max_seq_len=8)
