"""GQA decode attention over the KV cache in one Triton kernel (Qwen3-MoE's attention core).

Per decode token b (slot s = rows[b], position pos = positions[b]) and kv head j, the G = H / K query heads
of that kv head attend to the cache positions l <= pos:
    o[b, j, g] = sum_l softmax_l(scale * q[b, j, g] . k[s, l, j]) v[s, l, j]
(reference/attention.py gqa_attention, the SDPA of a decode step; q/k norms, RoPE and the cache write stay
outside). Program (b, j) streams the head's keys and values in BLOCK_L-row tiles once for its G query rows
(padded to 16 for the MMA), scores and the value product on tensor cores, an online softmax in fp32; the
probabilities are rounded to the cache dtype before the value product. No split over the cache length yet
(the known next step for long contexts at batch 1). The cache rows of this step were written by an earlier
launch of the same step: plain loads. fp32 caches use IEEE fp32 dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import ATTN_GQA
from ..reference.attention import gqa_attention
from ..validate.variant import Manifest, Scope, Variant, register
from .mla import _dot, _online_softmax_step


@triton.jit
def gqa_decode_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, o_ptr, stride_cs, stride_cl, stride_ch, scale,
                      KH: tl.constexpr, G: tl.constexpr, d: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Program (b, kv head j): o[b, j, :G] over the cache positions <= positions[b]."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    c = tl.arange(0, BLOCK_D)
    c_ok = c < d
    qrow = (b.to(tl.int64) * KH + j) * G + g
    q = tl.load(q_ptr + qrow[:, None] * d + c[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0)
    base = slot * stride_cs + j * stride_ch
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    l0 = pos * 0
    while l0 <= pos:  # a while loop: the interpreter cannot take a range() over a loaded bound
        ll = l0 + tl.arange(0, BLOCK_L)
        l_ok = ll <= pos
        offs = base + ll[:, None].to(tl.int64) * stride_cl + c[None, :]
        m = l_ok[:, None] & c_ok[None, :]
        kt = tl.load(k_ptr + offs, mask=m, other=0.0)  # [BLOCK_L, BLOCK_D]
        vt = tl.load(v_ptr + offs, mask=m, other=0.0)
        s = _dot(q, tl.trans(kt), tl.zeros((BLOCK_G, BLOCK_L), dtype=tl.float32), IEEE) * scale
        m_i, l_i, acc = _online_softmax_step(s, l_ok, vt, m_i, l_i, acc, IEEE)
        l0 += BLOCK_L
    tl.store(o_ptr + qrow[:, None] * d + c[None, :], acc / l_i[:, None], mask=g_ok[:, None] & c_ok[None, :])


def gqa_decode_core(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step, scale: float,
                    block_l: int = 32) -> torch.Tensor:
    """The `core` of reference/attention.py gqa_attention for a decode step: qg [N, K, G, d], caches
    [S, Lmax, K, d] (unit stride over d, same strides) -> o [N, K, G, d] fp32. No host sync."""
    N, KH, G, d = qg.shape
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != (KH, d) \
            or k_cache.stride(-1) != 1:
        raise ValueError(f"caches must be [S, L, {KH}, {d}] with equal strides and unit stride over d, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    rows = torch.arange(N, device=qg.device) if step.contiguous_slots else step.slots
    q = qg.to(k_cache.dtype).contiguous()
    o = torch.empty(N, KH, G, d, dtype=torch.float32, device=qg.device)
    if N == 0:
        return o
    gqa_decode_kernel[(N, KH)](
        q, k_cache, v_cache, rows.contiguous(), step.positions.contiguous(), o, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), float(scale), KH=KH, G=G, d=d,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_L=block_l, BLOCK_D=max(16, triton.next_power_of_2(d)),
        IEEE=k_cache.dtype == torch.float32)
    return o


def audit_specs(dtype: str = "bf16", KH: int = 4, G: int = 8, d: int = 128) -> list[tuple]:
    sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "rows_ptr": "*i64", "pos_ptr": "*i64",
           "o_ptr": "*fp32", "stride_cs": "i64", "stride_cl": "i32", "stride_ch": "i32", "scale": "fp32"}
    consts = {"KH": KH, "G": G, "d": d, "BLOCK_G": 16, "BLOCK_L": 32, "BLOCK_D": d, "IEEE": dtype == "fp32"}
    sig.update({k: "constexpr" for k in consts})
    roles = {n: "produced" for n in sig if n.endswith("_ptr")}
    return [(gqa_decode_kernel, sig, roles, consts)]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    from ..reference.rope import rope_cos_sin

    x = inputs[op.inputs[0]]
    k, v = cache
    outputs[op.outputs[0]].copy_(gqa_attention(cfg, weights, f"model.layers.{op.layer}.self_attn", x, step,
                                               rope_cos_sin(cfg, step.positions, x.dtype), k, v,
                                               core=gqa_decode_core))


GQA_VARIANT = register(Variant(Manifest(
    name="triton-gqa-decode",
    description="GQA decode attention over the KV cache in one Triton kernel per (sequence, kv head): the G "
                "query heads of a kv head share each key/value tile, online fp32 softmax; projections, q/k "
                "norms and RoPE stay the reference ops",
    replaces=(ATTN_GQA,),
    scope=Scope(families=("qwen3_moe",), dtypes=("float32", "float16", "bfloat16"), devices=("cpu", "cuda"),
                batch=(1, 256), arch="sm_90"),
    sources=("megadecode/kernels/gqa.py", "megadecode/reference/attention.py"), uses_triton=True,
    graph_capturable=True),
    _run, kernel=gqa_decode_kernel))
