"""MLA absorbed decode attention over the latent cache in one Triton kernel (issue 5: "MLA absorbed decode
attention over the cache").

Per decode token b (cache slot s = rows[b], position pos = positions[b]) and head h, with the cache row of
position l holding [c_l (C latent values), r_l (R shared key values)]:
    score_l = scale * (q_lat[b, h] . c_l + q_pe[b, h] . r_l)      for l <= pos
    o_lat   = sum_l softmax(score)_l * c_l                         [C]
(reference/attention.py mla_attention, the `attend` of a decode step; the kv_b up-projections stay outside:
q_lat = q_nope W_UK, out = o_lat W_UV). Program (b, block of BLOCK_H heads, chunk) streams its chunk of the
sequence's cache in BLOCK_L-row tiles once for all its heads (the heads share the latent: MLA's point), scores on tensor cores,
an online softmax in fp32 (running max and sum), o accumulated in fp32; the probabilities are rounded to the
cache dtype before the second product, as the reference rounds them. Without a split a batch-1 step would
have cdiv(H, BLOCK_H) programs (6 for K3's 96 heads), so the cache is cut into chunks (backends/fused/kernels/splitk.py) for
~2 programs per SM, and a fixed-order merge gives o_lat.

The cache rows of this step were written by an earlier op of the same step (a separate launch): plain
loads. fp32 caches use IEEE fp32 dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import ATTN_MLA
from ....reference.attention import mla_attention
from .common import dot, online_softmax_step
from .splitk import audit_specs as splitk_specs
from .splitk import combine, partials, split_plan, store_partials


@triton.jit
def mla_split_kernel(ql_ptr, qp_ptr, cache_ptr, rows_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, stride_cs, stride_cl,
                     scale, S, CHUNK, H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr):
    """Program (b, head block, chunk sp): the partial softmax of the block's heads over the cache positions
    [sp * CHUNK, (sp + 1) * CHUNK) that are <= positions[b], times the latent rows (backends/fused/kernels/splitk.py)."""
    b = tl.program_id(0)
    sp = tl.program_id(2)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    slot = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < C
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    bh = b.to(tl.int64) * H + h
    ql = tl.load(ql_ptr + bh[:, None] * C + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    qp = tl.load(qp_ptr + bh[:, None] * R + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    base = cache_ptr + slot * stride_cs
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
    l0 = sp * CHUNK
    end = tl.minimum(l0 + CHUNK, pos + 1)
    while l0 < end:  # a while loop: the interpreter cannot take a range() over a loaded bound
        ll = l0 + tl.arange(0, BLOCK_L)
        l_ok = ll < end
        lat = tl.load(base + ll[:, None].to(tl.int64) * stride_cl + c[None, :], mask=l_ok[:, None] & c_ok[None, :],
                      other=0.0)  # [BLOCK_L, BLOCK_C]
        pe = tl.load(base + ll[:, None].to(tl.int64) * stride_cl + C + r[None, :],
                     mask=l_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_L, BLOCK_R]
        s = dot(ql, tl.trans(lat), tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32), IEEE)
        s = dot(qp, tl.trans(pe), s, IEEE) * scale
        m_i, l_i, acc = online_softmax_step(s, l_ok, lat, m_i, l_i, acc, IEEE)
        l0 += BLOCK_L
    store_partials(m_ptr, l_ptr, acc_ptr, bh, h_ok, sp, S, m_i, l_i, acc, c, c_ok, C)


def mla_decode_core(q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, step, scale: float,
                    block_h: int = 16, block_l: int = 32, splits: int | None = None) -> torch.Tensor:
    """The `core` of reference/attention.py mla_attention for a decode step: q_lat [N, H, C], q_pe [N, H, R],
    latent_cache [S, Lmax, C + R] (unit stride over the last dim) -> o_lat [N, H, C] fp32. The cache is split
    into chunks over positions < step.kv_len (backends/fused/kernels/splitk.py; `splits` forces the number). No host sync."""
    N, H, C = q_lat.shape
    R = q_pe.shape[-1]
    if latent_cache.dim() != 3 or latent_cache.shape[-1] != C + R or latent_cache.stride(-1) != 1:
        raise ValueError(f"latent_cache must be [S, L, {C} + {R}] with unit stride over the last dim, got "
                         f"{tuple(latent_cache.shape)}")
    if q_pe.shape[:2] != (N, H):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} must be [{N}, {H}, R]")
    rows = torch.arange(N, device=q_lat.device) if step.contiguous_slots else step.slots
    dt = latent_cache.dtype
    ql, qp = q_lat.to(dt).contiguous(), q_pe.to(dt).contiguous()
    o = torch.empty(N, H, C, dtype=torch.float32, device=q_lat.device)
    if N == 0:
        return o
    block_c = max(16, triton.next_power_of_2(C))
    block_r = max(16, triton.next_power_of_2(R))
    hb = triton.cdiv(H, block_h)
    S, chunk = split_plan(N * hb, step.kv_len, block_l, q_lat.device, splits)
    m, l, acc = partials(N * H, S, C, q_lat.device)
    mla_split_kernel[(N, hb, S)](
        ql, qp, latent_cache, rows.contiguous(), step.positions.contiguous(), m, l, acc, latent_cache.stride(0),
        latent_cache.stride(1), float(scale), S, chunk, H=H, C=C, R=R, BLOCK_H=block_h, BLOCK_L=block_l,
        BLOCK_C=block_c, BLOCK_R=block_r, IEEE=dt == torch.float32)
    return combine(m, l, acc, o)


def audit_specs(dtype: str = "bf16", H: int = 96, C: int = 512, R: int = 64) -> list:
    sig = {"ql_ptr": f"*{dtype}", "qp_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}", "rows_ptr": "*i64",
           "pos_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "stride_cs": "i64",
           "stride_cl": "i32", "scale": "fp32", "S": "i32", "CHUNK": "i32"}
    consts = {"H": H, "C": C, "R": R, "BLOCK_H": 16, "BLOCK_L": 32, "BLOCK_C": C, "BLOCK_R": R,
              "IEEE": dtype == "fp32"}
    return [kernel_spec(mla_split_kernel, sig, consts, free=("IEEE",)), *splitk_specs("fp32")]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    from ....reference.rope import rope_cos_sin

    x = inputs[op.inputs[0]]
    rope = rope_cos_sin(cfg, step.positions, x.dtype) if cfg.mla_rope else None
    (latent,) = cache
    outputs[op.outputs[0]].copy_(mla_attention(cfg, weights, f"model.layers.{op.layer}.self_attn", x, step, rope,
                                               latent, core=mla_decode_core))


MLA_VARIANT = register(Variant(Manifest(
    name="triton-mla-decode",
    description="MLA decode attention over the latent cache, split over the cache length: one Triton program "
                "per (sequence, head block, chunk), scores on tensor cores, online fp32 softmax, latent read once "
                "for all heads of the block, then a fixed-order merge; projections and kv_b absorption stay the "
                "reference ops",
    replaces=(ATTN_MLA,),
    scope=Scope(families=("deepseek_v3", "kimi_linear", "kimi_k3"), dtypes=("float32", "float16", "bfloat16"),
                devices=("cpu", "cuda"), batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/mla.py", "megadecode/backends/fused/kernels/splitk.py", "megadecode/reference/attention.py",
             "megadecode/backends/fused/kernels/common.py"), uses_triton=True,
    graph_capturable=True, kernels=audit_specs),
    _run, kernel=mla_split_kernel))
