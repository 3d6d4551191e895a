"""bench/mega_icache_probe.py's program: each instruction of the chosen opcodes gets a signal-free copy queued just
before it on its CTA. On the CPU, with pyvm: the copies change no output (every arena word and cache the same bits
as the program without them), every wait still holds, and in-place adds are never copied."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import mega_icache_probe as probe  # noqa: E402

from megadecode.backends.mega.isa import F_RESID  # noqa: E402
from megadecode.backends.mega.lower import lower  # noqa: E402
from megadecode.backends.mega.pyvm import PyVM  # noqa: E402
from megadecode.backends.mega.schedule import schedule  # noqa: E402
from megadecode.cache import KVCache  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402


def _run(prog, batch: int, pos: int) -> PyVM:
    vm = PyVM(prog)
    for name, val in (("tokens", torch.arange(batch) + 3), ("positions", torch.full((batch,), pos)),
                      ("slots", torch.arange(batch))):
        off, n = prog.i32[name]
        vm.i32[off:off + n] = val.to(torch.int32)
    vm.launch(order="random", seed=1)
    return vm


@pytest.mark.parametrize("batch", [1, 3])
def test_copies_change_no_output(batch):
    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, "cpu", torch.float32, 0)
    caches = []
    for _ in range(2):
        c = KVCache(cfg, batch, 40, "cpu", torch.float32)
        torch.manual_seed(5)
        for parts in c.layers.values():
            for t in parts:
                t.normal_()
        caches.append(c)
    base = schedule(lower(cfg, w, caches[0], batch, 8), 8)
    copied = probe.with_copies(schedule(lower(cfg, w, caches[1], batch, 8), 8), set(probe.SAFE))
    copied.check()
    extra = [i for i in copied.instrs if i.name.endswith(probe.COPY)]
    assert extra and all(i.signal == -1 for i in extra)
    assert not any(i.op in ("MATVEC", "GLU") and i.flags & F_RESID for i in extra)
    assert len(extra) == sum(1 for i in base.instrs
                             if i.op in probe.SAFE and not (i.op in ("MATVEC", "GLU") and i.flags & F_RESID))
    for q in copied.queues:  # each copy right before its original, on the same CTA
        for k, i in enumerate(q):
            if copied.instrs[i].name.endswith(probe.COPY):
                assert copied.instrs[q[k + 1]].name + probe.COPY == copied.instrs[i].name
    a, b = _run(base, batch, 30), _run(copied, batch, 30)
    assert torch.equal(a.f32, b.f32) and torch.equal(a.i32, b.i32)
    for x, y in zip(base.tensors, copied.tensors):
        if x.role == "produced":
            assert torch.equal(x.tensor, y.tensor), x.name


def test_unsafe_opcodes_are_refused(capsys):
    with pytest.raises(SystemExit):
        probe.main(["--ops", "EXPERT_DOWN"])
    assert "plain stores only" in capsys.readouterr().err
