"""GQA decode attention for Qwen3-MoE in Triton: q/k norms, RoPE and the cache write in one kernel, then the
attention over the KV cache split over the cache length.

Per decode token b (slot s = rows[b], position pos = positions[b]) and kv head j, the G = H / K query heads
of that kv head attend to the cache positions l <= pos:
    o[b, j, g] = sum_l softmax_l(scale * q[b, j, g] . k[s, l, j]) v[s, l, j]
(reference/attention.py gqa_attention, the SDPA of a decode step).
- qk_norm_rope_kernel replaces the reference's chain of small ops after the projections (two RMSNorms, RoPE
  with its cos/sin, two cache index-puts: some 25 launches per layer at batch 1) with one launch; cos/sin are
  computed in the kernel from positions x inv_freq (fp32, as reference/rope.py), so no per-layer RoPE table.
- gqa_split_kernel: program (b, j, chunk) streams its chunk of the head's keys and values in BLOCK_L-row tiles
  once for the G query rows (padded to 16 for the MMA), scores and the value product on tensor cores, online
  softmax in fp32, the probabilities rounded to the cache dtype before the value product (as the reference).
  Chunks (backends/fused/kernels/splitk.py) so that a batch-1 step has ~2 programs per SM instead of K = 4; their merge writes
  the o_proj input in the activation dtype.
The cache rows of this step were written by an earlier launch of the same step: plain loads. fp32 caches use
IEEE fp32 dots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import ATTN_GQA
from ....reference.rope import inv_freq_on
from .common import dot, online_softmax_step
from .splitk import audit_specs as splitk_specs
from .splitk import combine, partials, split_plan, store_partials


@triton.jit
def gqa_split_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, stride_cs, stride_cl, stride_ch,
                     scale, S, CHUNK, KH: tl.constexpr, G: tl.constexpr, d: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Program (b, kv head j, chunk sp): the partial softmax of the G query rows of (b, j) over the cache
    positions [sp * CHUNK, (sp + 1) * CHUNK) that are <= positions[b] (backends/fused/kernels/splitk.py)."""
    b = tl.program_id(0)
    j = tl.program_id(1)
    sp = tl.program_id(2)
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
    l0 = sp * CHUNK
    end = tl.minimum(l0 + CHUNK, pos + 1)
    while l0 < end:  # a while loop: the interpreter cannot take a range() over a loaded bound
        ll = l0 + tl.arange(0, BLOCK_L)
        l_ok = ll < end
        offs = base + ll[:, None].to(tl.int64) * stride_cl + c[None, :]
        m = l_ok[:, None] & c_ok[None, :]
        kt = tl.load(k_ptr + offs, mask=m, other=0.0)  # [BLOCK_L, BLOCK_D]
        vt = tl.load(v_ptr + offs, mask=m, other=0.0)
        s = dot(q, tl.trans(kt), tl.zeros((BLOCK_G, BLOCK_L), dtype=tl.float32), IEEE) * scale
        m_i, l_i, acc = online_softmax_step(s, l_ok, vt, m_i, l_i, acc, IEEE)
        l0 += BLOCK_L
    store_partials(m_ptr, l_ptr, acc_ptr, qrow, g_ok, sp, S, m_i, l_i, acc, c, c_ok, d)


@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, inv_ptr, pos_ptr, slots_ptr, qo_ptr, kc_ptr, vc_ptr,
                        stride_cs, stride_cl, stride_ch, eps, att, H: tl.constexpr, KH: tl.constexpr,
                        d: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Program (b, head hh of the H query then KH key heads): the per-head RMSNorm (statistics in fp32, the
    normed row rounded to the dtype before the weight, as reference/norm.py), then RoPE with the half-split
    pairing (cos/sin of positions[b] * inv_freq in fp32, times the attention factor, rounded to the dtype),
    stored to qo [N, H, d] for a query head; for a key head into the cache row (slots[b], positions[b]),
    together with the value row. Rotation products in fp32, rounded once."""
    b = tl.program_id(0)
    hh = tl.program_id(1)
    pos = tl.load(pos_ptr + b)
    half = d // 2
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < half
    f = pos.to(tl.float32) * tl.load(inv_ptr + i, mask=i_ok, other=0.0)
    dt = qo_ptr.dtype.element_ty
    cos = (tl.cos(f) * att).to(dt).to(tl.float32)
    sin = (tl.sin(f) * att).to(dt).to(tl.float32)
    is_q = hh < H
    jk = hh - H
    src = tl.where(is_q, q_ptr + (b.to(tl.int64) * H + hh) * d, k_ptr + (b.to(tl.int64) * KH + jk) * d)
    wsrc = tl.where(is_q, qw_ptr, kw_ptr)
    a = tl.load(src + i, mask=i_ok, other=0.0).to(tl.float32)
    z = tl.load(src + half + i, mask=i_ok, other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(z * z, axis=0)) / d + eps)
    a = ((a * r).to(dt).to(tl.float32) * tl.load(wsrc + i, mask=i_ok, other=0.0).to(tl.float32)).to(dt)
    z = ((z * r).to(dt).to(tl.float32) * tl.load(wsrc + half + i, mask=i_ok, other=0.0).to(tl.float32)).to(dt)
    a = a.to(tl.float32)
    z = z.to(tl.float32)
    ra = (a * cos - z * sin).to(dt)
    rz = (z * cos + a * sin).to(dt)
    if is_q:
        dst = qo_ptr + (b.to(tl.int64) * H + hh) * d
        tl.store(dst + i, ra, mask=i_ok)
        tl.store(dst + half + i, rz, mask=i_ok)
    else:
        row = tl.load(slots_ptr + b).to(tl.int64) * stride_cs + pos.to(tl.int64) * stride_cl + jk * stride_ch
        tl.store(kc_ptr + row + i, ra, mask=i_ok)
        tl.store(kc_ptr + row + half + i, rz, mask=i_ok)
        vsrc = v_ptr + (b.to(tl.int64) * KH + jk) * d
        tl.store(vc_ptr + row + i, tl.load(vsrc + i, mask=i_ok, other=0.0), mask=i_ok)
        tl.store(vc_ptr + row + half + i, tl.load(vsrc + half + i, mask=i_ok, other=0.0), mask=i_ok)


def _check_caches(k_cache, v_cache, KH, d):
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.shape[2:] != (KH, d) \
            or k_cache.stride(-1) != 1 or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"caches must be [S, L, {KH}, {d}] of one dtype with equal strides and unit stride over "
                         f"d, got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")


def gqa_decode_core(qg: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step, scale: float,
                    block_l: int = 32, splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `core` of reference/attention.py gqa_attention for a decode step: qg [N, K, G, d], caches
    [S, Lmax, K, d] (unit stride over d, same strides) -> o [N, K, G, d] (fp32, or written into `out`, any float
    dtype, contiguous). The cache is split into chunks over positions < step.kv_len (backends/fused/kernels/splitk.py; `splits`
    forces the number). No host sync."""
    N, KH, G, d = qg.shape
    _check_caches(k_cache, v_cache, KH, d)
    rows = torch.arange(N, device=qg.device) if step.contiguous_slots else step.slots
    q = qg.to(k_cache.dtype).contiguous()
    if out is None:
        out = torch.empty(N, KH, G, d, dtype=torch.float32, device=qg.device)
    if N == 0:
        return out
    S, chunk = split_plan(N * KH, step.kv_len, block_l, qg.device, splits)
    m, l, acc = partials(N * KH * G, S, d, qg.device)
    gqa_split_kernel[(N, KH, S)](
        q, k_cache, v_cache, rows.contiguous(), step.positions.contiguous(), m, l, acc, k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), float(scale), S, chunk, KH=KH, G=G, d=d,
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_L=block_l, BLOCK_D=max(16, triton.next_power_of_2(d)),
        IEEE=k_cache.dtype == torch.float32)
    return combine(m, l, acc, out)


def gqa_decode_attention(cfg, w: dict, prefix: str, x: torch.Tensor, step, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, splits: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """reference/attention.py gqa_attention for a decode step (step.segments is None), in seven launches: the
    q, k, v projections (torch), one kernel for the q/k norms, RoPE and the cache write, the split attention and
    its merge (written in x's dtype as the o_proj input), the o_proj (torch, into `out` [N, D] when given)."""
    N, H, KH, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if step.segments is not None:
        raise ValueError("gqa_decode_attention is for decode steps (one token per sequence)")
    if cfg.rope_dim != d or d % 2:
        raise ValueError(f"RoPE over the whole head is required (rope dim {cfg.rope_dim}, head dim {d})")
    _check_caches(k_cache, v_cache, KH, d)
    q = F.linear(x, w[f"{prefix}.q_proj.weight"]).contiguous()
    k = F.linear(x, w[f"{prefix}.k_proj.weight"]).contiguous()
    v = F.linear(x, w[f"{prefix}.v_proj.weight"]).contiguous()
    qn = torch.empty(N, H, d, dtype=x.dtype, device=x.device)
    if N:
        inv, att = inv_freq_on(cfg.rope, cfg.rope_dim, x.device)
        qk_norm_rope_kernel[(N, H + KH)](
            q, k, v, w[f"{prefix}.q_norm.weight"], w[f"{prefix}.k_norm.weight"], inv, step.positions.contiguous(),
            step.slots.contiguous(), qn, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            float(cfg.rms_norm_eps), float(att), H=H, KH=KH, d=d, BLOCK_HALF=triton.next_power_of_2(d // 2))
    o = gqa_decode_core(qn.view(N, KH, H // KH, d), k_cache, v_cache, step, d ** -0.5, splits=splits,
                        out=torch.empty(N, H * d, dtype=x.dtype, device=x.device))
    if out is None:
        return F.linear(o, w[f"{prefix}.o_proj.weight"])
    return torch.mm(o, w[f"{prefix}.o_proj.weight"].t(), out=out)


def audit_specs(dtype: str = "bf16", KH: int = 4, G: int = 8, d: int = 128) -> list:
    sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "rows_ptr": "*i64", "pos_ptr": "*i64",
           "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "stride_cs": "i64", "stride_cl": "i32",
           "stride_ch": "i32", "scale": "fp32", "S": "i32", "CHUNK": "i32"}
    consts = {"KH": KH, "G": G, "d": d, "BLOCK_G": 16, "BLOCK_L": 32, "BLOCK_D": d, "IEEE": dtype == "fp32"}
    pro = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "qw_ptr": f"*{dtype}",
           "kw_ptr": f"*{dtype}", "inv_ptr": "*fp32", "pos_ptr": "*i64", "slots_ptr": "*i64", "qo_ptr": f"*{dtype}",
           "kc_ptr": f"*{dtype}", "vc_ptr": f"*{dtype}", "stride_cs": "i64", "stride_cl": "i32", "stride_ch": "i32",
           "eps": "fp32", "att": "fp32"}
    pconsts = {"H": KH * G, "KH": KH, "d": d, "BLOCK_HALF": triton.next_power_of_2(d // 2)}
    return [kernel_spec(gqa_split_kernel, sig, consts, free=("IEEE",)),
            kernel_spec(qk_norm_rope_kernel, pro, pconsts, static=("qw_ptr", "kw_ptr", "inv_ptr")),
            *splitk_specs(dtype)]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    k, v = cache
    gqa_decode_attention(cfg, weights, f"model.layers.{op.layer}.self_attn", inputs[op.inputs[0]], step, k, v,
                         out=outputs[op.outputs[0]])


GQA_VARIANT = register(Variant(Manifest(
    name="triton-gqa-decode",
    description="GQA decode attention: q/k norms, RoPE and the cache write in one Triton kernel, then the "
                "attention split over the cache length (the G query heads of a kv head share each key/value "
                "tile, online fp32 softmax) and a fixed-order merge; the q/k/v/o projections stay torch",
    replaces=(ATTN_GQA,),
    scope=Scope(families=("qwen3_moe",), dtypes=("float32", "float16", "bfloat16"), devices=("cpu", "cuda"),
                batch=(1, 256), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/gqa.py", "megadecode/backends/fused/kernels/splitk.py", "megadecode/reference/attention.py",
             "megadecode/backends/fused/kernels/common.py"),
    uses_triton=True, graph_capturable=True, kernels=audit_specs),
    _run, kernel=gqa_split_kernel))
