"""The KDA decode recurrence in one Triton kernel (issue 5: "the KDA recurrent update").

Per decode token of sequence b (slot s = rows[b]) and head h, with S = rec_state[s, h] [K, V] fp32:
    S    = exp(g)[:, None] * S                 per-key-channel decay
    S   += k[:, None] * (beta * (v - k^T S))   delta rule
    o    = q^T S                               [V]
(reference/kda.py delta_rule_step / decode_recurrence). The reference runs this as separate torch ops, each a
pass over the state (decay, read, update, read, gather and scatter of the slots): about eight passes over
B x H x K x V x 4 bytes, which at K3 dims (96 heads of 128 x 128: 6.3 MB per sequence per layer) is the
largest memory stream of a KDA layer at batch >= 8. Here program (b, h, v-tile) reads its [K, BLOCK_V] tile
of the state once, keeps it in registers through the three steps, writes it back once and writes o.

Each program owns its tile (slots are distinct per step), so no program reads what another writes: no
ordering between programs is needed. The state comes from earlier launches: plain loads. fp32 throughout.
The rest of the KDA op (projections, short conv, l2norm, gates, gated RMSNorm, o_proj) stays the reference
ops; `kda_attention(..., recur=kda_decode_recurrence)` is the variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import ATTN_KDA
from ....reference.kda import kda_attention


@triton.jit
def kda_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, rows_ptr, H: tl.constexpr, K: tl.constexpr,
                    V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (b, h, v-tile): advance rec_state[rows[b], h, :, v-tile] by one token; o[b, h, v-tile]."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < K
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vv < V
    bh = b.to(tl.int64) * H + h
    q = tl.load(q_ptr + bh * K + kk, mask=k_ok, other=0.0)
    k = tl.load(k_ptr + bh * K + kk, mask=k_ok, other=0.0)
    g = tl.load(g_ptr + bh * K + kk, mask=k_ok, other=0.0)
    v = tl.load(v_ptr + bh * V + vv, mask=v_ok, other=0.0)
    beta = tl.load(beta_ptr + bh)
    sp = s_ptr + ((slot * H + h) * K + kk[:, None]) * V + vv[None, :]
    m = k_ok[:, None] & v_ok[None, :]
    S = tl.load(sp, mask=m, other=0.0) * tl.exp(g)[:, None]
    read = tl.sum(k[:, None] * S, axis=0)
    S = S + k[:, None] * ((v - read) * beta)[None, :]
    tl.store(sp, S, mask=m)
    tl.store(o_ptr + bh * V + vv, tl.sum(q[:, None] * S, axis=0), mask=v_ok)


def kda_decode_recurrence(q, k, v, g, beta, rec_state: torch.Tensor, rows, block_v: int = 32) -> torch.Tensor:
    """Drop-in for reference/kda.py decode_recurrence: q, k, g [B, H, K], v [B, H, V], beta [B, H] (fp32),
    rec_state [S, H, K, V] fp32 (advanced in place), rows a slice(0, B) or a [B] tensor of distinct slots.
    Returns o [B, H, V] fp32. No host sync."""
    B, H, K = q.shape
    V = v.shape[-1]
    if rec_state.dtype != torch.float32 or not rec_state.is_contiguous() or rec_state.shape[1:] != (H, K, V):
        raise ValueError(f"rec_state must be contiguous fp32 [S, {H}, {K}, {V}], got {tuple(rec_state.shape)} "
                         f"{rec_state.dtype}")
    if isinstance(rows, slice):
        rows = torch.arange(rows.start or 0, rows.stop, device=q.device)
    if rows.shape != (B,):
        raise ValueError(f"rows must name {B} slots, got {tuple(rows.shape)}")
    q, k, g, v = (t.float().contiguous() for t in (q, k, g, v))
    beta = beta.float().contiguous()
    o = torch.empty(B, H, V, dtype=torch.float32, device=q.device)
    if B == 0:
        return o
    bv = min(block_v, triton.next_power_of_2(V))
    kda_step_kernel[(B, H, triton.cdiv(V, bv))](q, k, v, g, beta, rec_state, o, rows.contiguous(), H=H, K=K, V=V,
                                                BLOCK_K=triton.next_power_of_2(K), BLOCK_V=bv)
    return o


def audit_specs(H: int = 96, K: int = 128, V: int = 128) -> list:
    sig = {n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "s_ptr", "o_ptr")}
    sig["rows_ptr"] = "*i64"
    consts = {"H": H, "K": K, "V": V, "BLOCK_K": triton.next_power_of_2(K), "BLOCK_V": 32}
    return [kernel_spec(kda_step_kernel, sig, consts)]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    conv_state, rec_state = cache  # kda_attention takes `recur` on decode steps only (prefill: the reference)
    outputs[op.outputs[0]].copy_(kda_attention(cfg, weights, f"model.layers.{op.layer}.self_attn",
                                               inputs[op.inputs[0]], step, conv_state, rec_state,
                                               recur=kda_decode_recurrence))


KDA_VARIANT = register(Variant(Manifest(
    name="triton-kda-decode",
    description="KDA attention with the decode recurrence (decay, delta-rule update, readout) fused in one "
                "Triton kernel: one read and one write of each sequence's state per step; projections, short "
                "conv and gated norm stay the reference ops",
    replaces=(ATTN_KDA,),
    scope=Scope(families=("kimi_linear", "kimi_k3"), dtypes=("float32", "float16", "bfloat16"),
                devices=("cpu", "cuda"), batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/kda.py", "megadecode/reference/kda.py"), uses_triton=True, graph_capturable=True,
    kernels=audit_specs),
    _run, kernel=kda_step_kernel))
