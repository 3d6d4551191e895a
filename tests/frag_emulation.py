"""A torch stand-in for backends/fused/kernels/cute_experts.cute_experts, so that the CPU suite can run the fused executor's
fragment-order paths (backends/expert_layout.py; prefill, chunked decode, expert parallelism) where the CuTe
kernels cannot run: the same arguments, the records turned back into the checkpoint's order
(quant/mxfp4_frag.restore_experts) and the experts computed as the reference does, in fp32. What it checks is the
executor's wiring (which weights, which ids, which chunks, the combine), not the kernel (tests/test_cute_experts.py
does that on the GPU).

    with_emulated_cute(monkeypatch)   in a test
    undo = patch_cute()               elsewhere (tests/ep_workers.py)
"""

from __future__ import annotations

import torch

from megadecode.quant.mxfp4_frag import MXFP4Frag, restore_experts
from megadecode.reference.activations import GLUS


def emulated_cute_experts(x, ids, weights, gate_up: MXFP4Frag, down: MXFP4Frag, *, act="situ", out=None,
                          split=None, **_):
    assert isinstance(gate_up, MXFP4Frag) and isinstance(down, MXFP4Frag)
    gu = restore_experts(gate_up).dequantize(torch.float32)
    dn = restore_experts(down).dequantize(torch.float32)
    I = dn.shape[2]
    res = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            if e < 0:
                continue
            gu_x = gu[e] @ x[t].float()
            res[t] += float(weights[t, a]) * (dn[e] @ GLUS[act](gu_x[:I], gu_x[I:]))
    if out is None:
        return res.to(x.dtype)
    out.copy_(res)
    return out


def patch_cute(setattr_=None):
    """Apply the stand-in with `setattr_(obj, name, value)` (default: setattr); returns a function that undoes it
    (the default's case)."""
    from megadecode.backends.fused.executor import FusedExecutor
    from megadecode.backends.fused.kernels import cute_experts as ce

    saved = [(FusedExecutor, "_expert_order", FusedExecutor.__dict__["_expert_order"]),
             (ce, "cute_experts", ce.cute_experts)]
    _patch(setattr_ or setattr)
    return lambda: [setattr(o, n, v) for o, n, v in saved]


def _patch(setattr_) -> None:
    """setattr_(obj, name, value): the fused executor reads K3's experts in fragment order wherever the model's
    dims allow it (not only on an H200 with CuTe DSL), and cute_experts is the stand-in."""
    from megadecode.backends import expert_layout
    from megadecode.backends.fused.executor import FusedExecutor
    from megadecode.backends.fused.kernels import cute_experts as ce

    def order(self, plan, weights):
        cfg = plan.config
        ok = expert_layout.expert_pairs(plan) and cfg.latent_size % 256 == 0 and cfg.moe_intermediate_size % 256 == 0
        return expert_layout.FRAGMENT if ok else expert_layout.CHECKPOINT

    setattr_(FusedExecutor, "_expert_order", order)
    setattr_(ce, "cute_experts", emulated_cute_experts)


def with_emulated_cute(monkeypatch) -> None:
    _patch(monkeypatch.setattr)
