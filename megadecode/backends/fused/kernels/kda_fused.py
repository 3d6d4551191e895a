"""A KDA decode step in three launches: the input projections as one, the per-head work as one, o_proj as one.

reference/kda.py's decode step runs ~60 kernels a layer at batch 1 on the H200 (bench/profile_step.py,
k3-mini: 295 us for a 157 us floor): six projections of x (q, k, v, f_a, g_a, b), then a chain of elementwise
ops (short conv, SiLU, l2norm, the forget gate's low-rank f_b and softplus, beta's sigmoid, the recurrence, the
output gate's low-rank g_b, the gated RMSNorm) that each read and write a few KB, then o_proj. Here:
  1. proj = x [q_proj; k_proj; v_proj; f_a_proj; g_a_proj; b_proj]^T   backends/fused/kernels/linear.py, one pass over the six
     weights when they lie one after another in memory (backends/fused/kernels/packed.py: the fused executor packs them at
     build; otherwise they are concatenated per call), rounded to the model dtype as each F.linear is.
  2. kda_fused_kernel, program (sequence b, head h), on the head's K channels:
       q, k, v = SiLU(conv_W(conv_state[slot], proj's q/k/v)), rounded to the model dtype; the conv state shifts
       q, k = l2norm(q) K^-1/2, l2norm(k)
       g    = -exp(A_log[h]) softplus(round(f_b[h] f_a) + dt_bias[h])     beta = round(sigmoid(b[h]))
       S    = exp(g) S;  S += k (x) beta (v - k^T S);  o = q^T S           the whole [K, V] state in registers
       y    = rmsnorm(round(o)) o_norm sigmoid(round(g_b[h] g_a))          rounded to the model dtype
  3. out = y o_proj^T                                                      backends/fused/kernels/linear.py
Both projections take packed.project's path: backends/fused/kernels/linear.py up to 16 tokens (one pass over the weights),
cuBLAS above (the Triton projection reads the weights once per 16 tokens).
The same arithmetic as the reference, op for op (fp32 inside, the reference's roundings to the model dtype kept);
sums run in another order. Prefill keeps the reference (a sequence's tokens are a recurrence).

Memory paths: the program reads its own slot's conv and recurrent state and writes them back (slots are distinct
per step, so no program reads what another writes; a barrier orders the conv state's loads before its shifted
stores, which other threads of the program make); proj and the states come from earlier launches (plain loads);
the conv, gate and norm weights are static.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, kernel_spec, register
from ....plan import ATTN_KDA
from ....reference.kda import kda_attention
from .packed import project, rows_view

# backends/fused/kernels/linear.py blocks for the two projections, from bench/linear_paths.py on the H200 (k3-mini
# shapes): the 37216 x 7168 input projection 122 us at batch 1 and 8 (95% of the HBM floor; cuBLAS on the six
# weights apart ~158 us), o_proj 43 us (cuBLAS 47)
IN_BLOCKS = {"BLOCK_N": 32, "BLOCK_K": 256, "num_stages": 4}
OUT_BLOCKS = {"BLOCK_K": 256, "num_stages": 4}
# Above 16 tokens triton-kda-decode runs the op: on the H200 (bench/profile_step.py, k3-mini) this kernel, one
# program per (sequence, head) holding the whole [K, V] state, takes 62 us a layer at batch 8 (where
# triton-kda-decode's recurrence kernel alone takes 28 us) and 446 us at batch 64, 1.8 TB/s over the states'
# 806 MB. At batch 8 the ~55 launches it replaces cost more than the difference; at 64 the difference is ~4x
# larger. triton-kda-decode is not measured at batch 64, nor either between 8 and 64.
MAX_BATCH = 16
PROJ = ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "g_a_proj", "b_proj")


def in_names(prefix: str) -> list[str]:
    """The six input projections' weight names of the KDA layer at `prefix`, in proj's column order."""
    return [f"{prefix}.{n}.weight" for n in PROJ]


@triton.jit
def _conv_head(prow, conv_ptr, conv_w_ptr, slot, c, ok, C: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """SiLU(causal conv over the slot's last W-1 inputs of channels c and proj's new one), rounded to proj's dtype;
    the shifted window is stored back to the conv state after a barrier (other threads loaded the old one)."""
    j = tl.arange(0, BLOCK_W)[None, :]
    new = tl.load(prow + c, mask=ok, other=0.0)
    st = conv_ptr + (slot * C + c)[:, None] * (W - 1) + j
    old = tl.load(st, mask=ok[:, None] & (j < W - 1), other=0.0)
    win = tl.where(j == W - 1, new[:, None], old)
    cw = tl.load(conv_w_ptr + c[:, None] * W + j, mask=ok[:, None] & (j < W), other=0.0).to(tl.float32)
    acc = tl.sum(win.to(tl.float32) * cw, axis=1)
    y = acc / (1.0 + tl.exp(-acc))
    tl.debug_barrier()
    tl.store(st - 1, win.to(conv_ptr.dtype.element_ty), mask=ok[:, None] & (j >= 1) & (j < W))
    return y.to(prow.dtype.element_ty).to(tl.float32)


@triton.jit
def _low_rank(prow, r_off, w_ptr, rows, ok, R: tl.constexpr, BLOCK_R: tl.constexpr):
    """sum_r W[rows, r] proj[r_off + r] in fp32, rounded to proj's dtype (an F.linear's output)."""
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        rok = rr < R
        a = tl.load(prow + r_off + rr, mask=rok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * R + rr[None, :], mask=ok[:, None] & rok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
    return acc.to(prow.dtype.element_ty).to(tl.float32)


@triton.jit
def kda_fused_kernel(proj_ptr, conv_ptr, conv_w_ptr, fb_ptr, dt_ptr, alog_ptr, gb_ptr, onorm_ptr, s_ptr, y_ptr,
                     rows_ptr, stride_proj, stride_y, eps, H: tl.constexpr, K: tl.constexpr, RF: tl.constexpr,
                     RG: tl.constexpr, W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_R: tl.constexpr):
    """Program (b, h): the head's conv, gates and recurrence for sequence b (slot rows[b]), y[b, h*K:(h+1)*K]."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(rows_ptr + b).to(tl.int64)
    HK: tl.constexpr = H * K
    C: tl.constexpr = 3 * HK
    kk = tl.arange(0, BLOCK_K)
    ok = kk < K
    ch = h * K + kk  # the head's channels within q (k: + HK, v: + 2 HK)
    prow = proj_ptr + b.to(tl.int64) * stride_proj
    q = _conv_head(prow, conv_ptr, conv_w_ptr, slot, ch, ok, C, W, BLOCK_W)
    k = _conv_head(prow, conv_ptr, conv_w_ptr, slot, HK + ch, ok, C, W, BLOCK_W)
    v = _conv_head(prow, conv_ptr, conv_w_ptr, slot, 2 * HK + ch, ok, C, W, BLOCK_W)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * (1.0 / tl.sqrt(K * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    graw = _low_rank(prow, C, fb_ptr, ch, ok, RF, BLOCK_R) + tl.load(dt_ptr + ch, mask=ok, other=0.0).to(tl.float32)
    soft = tl.where(graw > 20.0, graw, tl.log(1.0 + tl.exp(tl.minimum(graw, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * soft
    braw = tl.load(prow + C + RF + RG + h).to(tl.float32)
    beta = (1.0 / (1.0 + tl.exp(-braw))).to(proj_ptr.dtype.element_ty).to(tl.float32)
    sp = s_ptr + ((slot * H + h) * K + kk[:, None]) * K + kk[None, :]
    m = ok[:, None] & ok[None, :]
    S = tl.load(sp, mask=m, other=0.0) * tl.exp(g)[:, None]
    read = tl.sum(k[:, None] * S, axis=0)
    S = S + k[:, None] * ((v - read) * beta)[None, :]
    tl.store(sp, S, mask=m)
    o = tl.sum(q[:, None] * S, axis=0).to(y_ptr.dtype.element_ty).to(tl.float32)  # [V], V = K
    gate = _low_rank(prow, C + RF, gb_ptr, ch, ok, RG, BLOCK_R)
    ms = tl.sum(o * o, axis=0) / K
    y = o * (1.0 / tl.sqrt(ms + eps))
    y = y * tl.load(onorm_ptr + kk, mask=ok, other=0.0).to(tl.float32) * (1.0 / (1.0 + tl.exp(-gate)))
    tl.store(y_ptr + b.to(tl.int64) * stride_y + ch, y.to(y_ptr.dtype.element_ty), mask=ok)


def kda_decode(cfg, w: dict, prefix: str, x: torch.Tensor, step, conv_state: torch.Tensor, rec_state: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """reference/kda.py kda_attention on a decode step (one token per sequence): x [N, D] -> [N, D] (into `out`
    when given). Prefill: the reference."""
    if step.segments is not None:
        y = kda_attention(cfg, w, prefix, x, step, conv_state, rec_state)
        return y if out is None else out.copy_(y)
    N, H, K, W = x.shape[0], cfg.linear_num_heads, cfg.linear_head_dim, cfg.conv_kernel
    f = f"{prefix}.forget_gate"
    fb, gb = w[f"{f}.f_b_proj.weight"], w[f"{prefix}.g_b_proj.weight"]
    RF, RG = fb.shape[1], gb.shape[1]
    C = 3 * H * K
    if conv_state.shape[1:] != (C, W - 1) or not conv_state.is_contiguous() or rec_state.dtype != torch.float32 \
            or not rec_state.is_contiguous() or rec_state.shape[1:] != (H, K, K):
        raise ValueError(f"kda_decode: conv state [S, {C}, {W - 1}] and contiguous fp32 recurrent state "
                         f"[S, {H}, {K}, {K}] expected, got {tuple(conv_state.shape)} and {tuple(rec_state.shape)} "
                         f"{rec_state.dtype}")
    if out is None:
        out = torch.empty(N, x.shape[1], dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    x = x.contiguous()
    proj = project(x, rows_view([w[n] for n in in_names(prefix)]), blocks=IN_BLOCKS)
    rows = step.slots.contiguous()  # with contiguous_slots: 0..N-1 (no arange launch for it)
    y = torch.empty(N, H * K, dtype=x.dtype, device=x.device)
    conv_w = w[f"{prefix}.conv1d.weight"]
    kda_fused_kernel[(N, H)](proj, conv_state, conv_w.contiguous(), fb.contiguous(), w[f"{f}.dt_bias"].contiguous(),
                             w[f"{f}.A_log"].contiguous(), gb.contiguous(), w[f"{prefix}.o_norm.weight"], rec_state,
                             y, rows, proj.stride(0), y.stride(0), float(cfg.rms_norm_eps), H=H, K=K, RF=RF, RG=RG,
                             W=W, BLOCK_K=triton.next_power_of_2(K), BLOCK_W=triton.next_power_of_2(W),
                             BLOCK_R=min(32, triton.next_power_of_2(max(RF, RG))), num_warps=8)
    return project(y, w[f"{prefix}.o_proj.weight"], out=out, blocks=OUT_BLOCKS)


def audit_specs(H: int = 96, K: int = 128, R: int = 128, W: int = 4, dtype: str = "bf16") -> list:
    from .linear import audit_specs as linear_specs

    sig = {"proj_ptr": f"*{dtype}", "conv_ptr": f"*{dtype}", "conv_w_ptr": f"*{dtype}", "fb_ptr": f"*{dtype}",
           "dt_ptr": f"*{dtype}", "alog_ptr": f"*{dtype}", "gb_ptr": f"*{dtype}", "onorm_ptr": f"*{dtype}",
           "s_ptr": "*fp32", "y_ptr": f"*{dtype}", "rows_ptr": "*i64", "stride_proj": "i32", "stride_y": "i32",
           "eps": "fp32"}
    consts = {"H": H, "K": K, "RF": R, "RG": R, "W": W, "BLOCK_K": triton.next_power_of_2(K),
              "BLOCK_W": triton.next_power_of_2(W), "BLOCK_R": 32}
    return [kernel_spec(kda_fused_kernel, sig, consts,
                        static=("conv_w_ptr", "fb_ptr", "dt_ptr", "alog_ptr", "gb_ptr", "onorm_ptr")),
            *linear_specs(dtype, norm=False, K=7168, N=3 * H * K + 2 * R + H, x_dtype=dtype, partials=False),
            *linear_specs(dtype, norm=False, K=H * K, N=7168, x_dtype=dtype, partials=False)]


def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    conv_state, rec_state = cache
    kda_decode(cfg, weights, f"model.layers.{op.layer}.self_attn", inputs[op.inputs[0]], step, conv_state,
               rec_state, out=outputs[op.outputs[0]])


KDA_FUSED_VARIANT = register(Variant(Manifest(
    name="triton-kda-fused",
    description="KDA decode attention in three launches: the six input projections as one tensor-core "
                "projection, one kernel per (sequence, head) for the short conv, l2norm, both low-rank gates, the "
                "delta-rule recurrence and the gated RMSNorm, and o_proj; prefill stays the reference",
    replaces=(ATTN_KDA,),
    scope=Scope(families=("kimi_linear", "kimi_k3"), dtypes=("float32", "float16", "bfloat16"),
                devices=("cpu", "cuda"), batch=(1, MAX_BATCH), arch="sm_90"),
    sources=("megadecode/backends/fused/kernels/kda_fused.py", "megadecode/backends/fused/kernels/packed.py", "megadecode/backends/fused/kernels/linear.py",
             "megadecode/backends/fused/kernels/common.py",
             "megadecode/reference/kda.py"), uses_triton=True, graph_capturable=True,
    kernels=audit_specs),
    _run, kernel=kda_fused_kernel))
