"""Mixture-of-experts: the routed experts (routing is in `routing.py`).

Legend: T tokens, E experts, A active experts per token (top-k), D hidden, I expert intermediate.
A pair (t, a) whose id is -1 is skipped: under expert parallelism (megadecode/parallel) its expert is another
rank's, and this rank's sum leaves it out.
FP8 experts (quant/fp8.py FP8Tensor): the reference dequantizes each selected expert exactly (the fp32 product of
value and block scale) and runs it in fp32; the output is cast to the activations' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant.fp8 import FP8Tensor
from .activations import GLUS, silu_glu


def _expert_ffn(x: torch.Tensor, gate_up, down) -> torch.Tensor:
    if isinstance(gate_up, FP8Tensor):
        return _expert_ffn(x.float(), gate_up.dequantize(torch.float32), down.dequantize(torch.float32))
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(silu_glu(g, u), down)


def experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum_a weights[t, a] * FFN_{ids[t, a]}(x[t]) over the pairs with ids >= 0; gate_up [E, 2I, D], down [E, D, I].

    Loops over the experts that received tokens (a host sync: the reference is not graph-capturable).
    Accumulates in fp32; the result is cast to `out_dtype` (None: x.dtype).
    """
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = _expert_ffn(x[tok], gate_up[e], down[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None].float())
    return out.to(out_dtype or x.dtype)


def experts_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu",
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same function without host syncs (CUDA-graph capturable): the T*A (token, expert) pairs are
    sorted by expert and run through `torch._grouped_mm` with device-side group offsets, so each
    selected expert's weights are read once. The combine is a deterministic sum over A (no atomics). Skipped pairs
    (ids -1) sort after every expert's run, outside the groups, and add 0. Result in `out_dtype` (None: x.dtype).
    act: "silu" (SwiGLU) or "situ" (K3's SiTU-GLU, reference/latent_moe.py). FP8 experts are dequantized whole
    into the activations' dtype first (a copy of every expert: the graph executor's eager prefill; its decode
    runs backends/fused/kernels/fp8_experts.py)."""
    if act not in GLUS:
        raise ValueError(f"act must be one of {sorted(GLUS)}, got {act!r}")
    if isinstance(gate_up, FP8Tensor):
        gate_up, down = gate_up.dequantize(x.dtype), down.dequantize(x.dtype)
    glu = GLUS[act]
    T, A = ids.shape
    E = gate_up.shape[0]
    flat = ids.reshape(-1)
    live = flat >= 0
    key = torch.where(live, flat, E)  # skipped pairs after the last expert's run
    order = torch.argsort(key, stable=True)  # pairs grouped by expert
    counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device).index_add_(
        0, key, torch.ones_like(flat, dtype=torch.int32))[:E]  # bincount would sync to size its output
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // A]  # [T*A, D]
    if x.is_cuda and x.dtype == torch.float32:
        # _grouped_mm has no fp32 CUDA kernel: gather each pair's expert (reads E_sel*A copies; fp32 only).
        eid = key[order].clamp(max=E - 1)  # skipped pairs: any expert, their rows are zeroed below
        h = torch.bmm(gate_up[eid], xs[:, :, None])[..., 0]
        g, u = h.chunk(2, -1)
        y = torch.bmm(down[eid], glu(g, u)[:, :, None])[..., 0]
    else:
        h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*A, 2I]
        g, u = h.chunk(2, -1)
        y = torch._grouped_mm(glu(g, u).contiguous(), down.transpose(1, 2), offs=offs)  # [T*A, D]
    y = torch.where(live[order][:, None], y, 0)  # rows past the groups are left undefined by _grouped_mm
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return (unsorted.view(T, A, -1).float() * weights[..., None].float()).sum(1).to(out_dtype or x.dtype)
