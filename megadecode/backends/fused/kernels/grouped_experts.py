"""Grouped routed experts for any batch, without host syncs (issue 5: "a grouped path for larger batches").

    out[t] = sum_a w[t, a] * down_e (act(gate_e x_t, up_e x_t)),   e = ids[t, a]

Same legend, weights and activations as backends/fused/kernels/fused_experts.py (float or MXFP4 weights decoded in
registers, fp32 math). The difference: the T*A (token, expert) pairs are grouped by expert first, so each
selected expert's weights are read once per step however many tokens picked it. The small-batch kernel
reads them once per pair, which is right at batch <= 16 (the picks are mostly distinct) and wrong at
batch 64 (K3: 1024 picks of 896 experts) or for a hot expert.

Bookkeeping on the device, sync-free (capturable): `order` = the pairs sorted by expert (a stable sort of
the flat ids), `offs[e] .. offs[e+1]` = expert e's run in `order` (searchsorted of 0..E in the sorted ids).
Three launches:
  1. `grouped_up_kernel`, grid (E, cdiv(I, BLOCK_I)): program (e, i-tile) walks expert e's pairs BLOCK_M
     (16) at a time; per chunk it streams the gate and up rows of its i-tile over D through tensor cores,
     weights on the MMA's M side and the chunk's tokens on its N side ("swap AB": one token pads 16
     columns, not 64 rows), h[p, i] = act(gate_e[i] . x_t, up_e[i] . x_t). Experts nobody picked exit after
     two loads; one with more than BLOCK_M pairs re-reads its tile per chunk (from L2).
  2. `grouped_down_kernel`, grid (E, cdiv(D, BLOCK_N)): y[p, n] = down_e[n, :] . h[p, :] for e's pairs.
  3. `combine_kernel`, grid (T, cdiv(D, BLOCK_C)): out[t, n] = sum_{a = 0..A-1, in order} w[t, a] y[t*A+a, n]
     (pairs with a negative id left out).
With grouped=False the same kernels give each pair its own programs (grid rows T*A, no sort: the
small-batch layout of backends/fused/kernels/fused_experts.py on tensor cores).
Numerics: fp32 accumulation. Float weights: bf16/fp16 MMAs; fp32 activations are split into hi + lo
parts of the weight dtype (two MMAs, ~16 bits of mantissa for bf16); fp32 weights use IEEE fp32 dots.
MXFP4, two paths (the launcher picks; `mx_prep_kernel` first scales each token's activations by a power of
two into fp16's range, in one launch, and the products split them into fp16 hi + lo parts):
  exact  per 32-weight block the nibbles are decoded to fp16 with integer ops (exact, times 2**-14), two
         small MMAs per block, the block's fp32 sum scaled by its e8m0 scale. Any scale byte. (With SiLU-GLU
         it also needs |h| < 65504.)
  fast   (FAST; SiTU-GLU, every e8m0 byte in FAST_SCALES, checked once per weight tensor) chunks of BLOCK_D /
         BLOCK_K weights: inline PTX decodes 4 packed bytes into 8 fp16 weights with the block scale folded in
         (exact in that scale range; plain Triton ops under the interpreter), activations and h as fp16 planes
         prepared once (even hi, even lo, odd hi, odd lo), four MMAs per chunk. Measured on the H200 at
         ~26-30% of the HBM floor against ~8-20% for the exact path (docs/evidence/experts-paths-h200.md).
Known limit (both MXFP4 paths): h, the gate/up output, enters the down products as fp16 hi + lo parts with no
per-token scale (its row max is spread over the up kernel's programs). Where |h| is small its parts are fp16
subnormals with a fixed absolute precision (fast: h * 128 is stored, ~5e-10 absolute; exact: ~3e-8), so a token
whose h is all tiny loses relative precision: a token scaled by 1e-3 in tests came out at 3e-4 (fast) and 4e-2
(exact) relative error on its own output, against 1e-6 for ordinary magnitudes.
Deterministic (no atomics; each pair's values come from one program).

Memory paths: weights static; x, ids, order, offs, router weights, h and y are produced within the step and
read with plain coherent loads (the static audit in tests/test_grouped_experts.py checks all three kernels).
Contract for ids: 0 <= ids < E (the router's), or -1: a pair to skip (expert parallelism, megadecode/parallel: the
expert is another rank's); a skipped pair is in no expert's run, and the combine leaves it out (its y row is never
written or read). `check_ids=True` verifies on the host (debug, syncs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....contract import Manifest, Scope, Variant, float_experts, kernel_spec, register
from ....plan import EXPERTS
from ....quant.mxfp4 import BLOCK as MX_BLOCK
from . import fused_experts as fe
from . import tuning
from .common import e8m0_to_f32, mma, run_of, tanh_f32
from .fused_experts import ACTS, MAX_TOKENS, WDTYPES, check_problem, shape_key

KERNEL = "grouped-experts"
MAX_BATCH = 4096  # a sanity bound for the launcher (T * A pairs are indexed in int32)
DEFAULT_BLOCKS = {
    "BLOCK_M": 16,    # pairs per MMA tile (the MMA's N side; 16 is its minimum)
    "BLOCK_I": 64,    # stage 1: gate (and up) rows per program (the MMA's M side)
    "BLOCK_D": 128,   # stage 1: reduction chunk over D (float weights, MXFP4 fast; the exact MXFP4 path: 32)
    "BLOCK_N": 64,    # stage 2: output rows per program
    "BLOCK_K": 128,   # stage 2: reduction chunk over I (as BLOCK_D)
    "num_warps": 4,
    "num_stages": 3,
}
BLOCK_C = 256  # combine: output columns per program


@triton.jit
def _e2m1_lo_h(b):
    """Low nibbles of bytes b (int32) as fp16 e2m1 values times 2**-14 (see fused_experts._e2m1_lo), with no
    conversion instruction: integer ops and a bitcast."""
    return (((b & 8) << 12) | ((b & 7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_hi_h(b):
    return (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True)


# e2m1 nibbles -> fp16, times an fp16 scale, four bytes (eight weights) per instruction sequence. Per 32-bit
# register of four packed bytes: prmt spreads bytes 0,1 (then 2,3) into the low bytes of two 16-bit halves;
# the low nibble's sign goes to bit 15 and its exponent and mantissa bits to bits 11..9 (an fp16 equal to
# 2**-14 times the e2m1 value, exact, the 0.5 code being an fp16 subnormal), likewise the high nibble; one
# packed fp16 multiply applies the scale (pre-multiplied by 2**14). Exact when the e8m0 scale byte is in
# FAST_SCALES (then every product is an fp16 normal or subnormal number). Inline PTX on the GPU; under the
# CPU interpreter the kernels compute the same values with plain Triton ops (USE_ASM=False).
_MX_DECODE_ASM = tl.constexpr("""{
.reg .b32 t0, t1, a, c;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 c, t0, 12;
and.b32 c, c, 0x80008000;
or.b32 a, a, c;
mul.rn.f16x2 $0, a, $5;
shl.b32 a, t1, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 c, t1, 12;
and.b32 c, c, 0x80008000;
or.b32 a, a, c;
mul.rn.f16x2 $1, a, $6;
shl.b32 a, t0, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 c, t0, 8;
and.b32 c, c, 0x80008000;
or.b32 a, a, c;
mul.rn.f16x2 $2, a, $5;
shl.b32 a, t1, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 c, t1, 8;
and.b32 c, c, 0x80008000;
or.b32 a, a, c;
mul.rn.f16x2 $3, a, $6;
}""")
FAST_SCALES = (104, 128)  # e8m0 bytes for which the fp16 decode-and-scale is exact
H_SCALE = tl.constexpr(128.0)  # the fast path stores h * 128 in its fp16 planes (SiTU-GLU: |h| <= 100)


@triton.jit
def _mx_decode_fast(b, s16):
    """(low-nibble weights, high-nibble weights) as fp16 = e2m1 * s16 * 2**-14, from packed bytes b (uint8)
    and the per-byte scale s16 (fp16, same shape)."""
    return tl.inline_asm_elementwise(_MX_DECODE_ASM, "=r,=r,=r,=r,r,r,r", [b, s16],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


@triton.jit
def _tc_dot(w_ptr, s_ptr, w_off, s_off, rows, row_ok, stride_wr, stride_sr, v_ptr, v_rows, m_ok, PS,
            K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
            MXFP4: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr = False, USE_ASM: tl.constexpr = True):
    """[BLOCK_R, BLOCK_M] fp32: W[rows, :K] . v[m, :K] for one expert's matrix at w_ptr + w_off and the
    BLOCK_M activation rows at v_ptr + v_rows[m] (masked by m_ok), on tensor cores (weights as the MMA's
    M side, tokens as its N side: "swap AB", so a handful of tokens pads 16 columns, not 64 rows).
    MXFP4: per 32-weight block, the low and high nibbles decoded to fp16 (times 2**-14, exact) multiply the
    even and odd activations (fp16), and the block's fp32 sum is scaled by its e8m0 scale: exact weights,
    activations rounded to fp16 (the launcher scales x into range; SPLIT keeps ~22 bits). FAST (MXFP4 only): v_ptr is the base of
    four fp16 planes (even hi, even lo, odd hi, odd lo; PS elements apart, rows of K/2 at v_rows), prepared
    once per launch instead of converted in the loop; the weights' decode is the inline PTX (USE_ASM) or the
    same arithmetic in plain Triton."""
    acc = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
    if MXFP4 and FAST:
        HALF: tl.constexpr = BLOCK_K // 2
        NB: tl.constexpr = BLOCK_K // 32
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + tl.arange(0, HALF)
            b = tl.load(w_ptr + w_off + rows[:, None] * stride_wr + j[None, :], mask=row_ok[:, None], other=0,
                        eviction_policy="evict_first")
            sb = k0 // 32 + tl.arange(0, NB)
            sc = tl.load(s_ptr + s_off + rows[:, None] * stride_sr + sb[None, :], mask=row_ok[:, None], other=113,
                         eviction_policy="evict_first").to(tl.int32)
            s16 = ((sc - 98) << 10).to(tl.uint16).to(tl.float16, bitcast=True)  # 2**(s - 113): scale * 2**14
            s16 = tl.reshape(tl.broadcast_to(s16[:, :, None], (BLOCK_R, NB, 16)), (BLOCK_R, HALF))
            if USE_ASM:
                we, wo = _mx_decode_fast(b, s16)
            else:  # the same values without inline PTX (the CPU interpreter)
                bi = b.to(tl.int32)
                we = _e2m1_lo_h(bi) * s16
                wo = _e2m1_hi_h(bi) * s16
            # activations as fp16 planes [even hi, even lo, odd hi, odd lo], each [rows, K/2], PS apart
            v = v_ptr + v_rows[None, :] + j[:, None]
            acc = tl.dot(we, tl.load(v, mask=m_ok[None, :], other=0.0), acc)
            acc = tl.dot(we, tl.load(v + PS, mask=m_ok[None, :], other=0.0), acc)
            acc = tl.dot(wo, tl.load(v + 2 * PS, mask=m_ok[None, :], other=0.0), acc)
            acc = tl.dot(wo, tl.load(v + 3 * PS, mask=m_ok[None, :], other=0.0), acc)
    elif MXFP4:
        for k0 in range(0, K, 32):
            j = k0 // 2 + tl.arange(0, 16)
            b = tl.load(w_ptr + w_off + rows[:, None] * stride_wr + j[None, :], mask=row_ok[:, None], other=0,
                        eviction_policy="evict_first").to(tl.int32)
            sc = tl.load(s_ptr + s_off + rows * stride_sr + k0 // 32, mask=row_ok, other=127,
                         eviction_policy="evict_first").to(tl.int32)
            ke = k0 + 2 * tl.arange(0, 16)
            ve = tl.load(v_ptr + v_rows[None, :] + ke[:, None], mask=m_ok[None, :], other=0.0)
            vo = tl.load(v_ptr + v_rows[None, :] + ke[:, None] + 1, mask=m_ok[None, :], other=0.0)
            part = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
            part = mma(_e2m1_lo_h(b), ve, part, SPLIT)
            part = mma(_e2m1_hi_h(b), vo, part, SPLIT)
            acc += part * e8m0_to_f32(sc)[:, None]
        acc = acc * 16384.0  # undo the decoders' 2**-14
    else:
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(w_ptr + w_off + rows[:, None] * stride_wr + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0, eviction_policy="evict_first")
            v = tl.load(v_ptr + v_rows[None, :] + k[:, None], mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            acc = mma(w, v, acc, SPLIT)
    return acc


@triton.jit
def grouped_up_kernel(x_ptr, ids_ptr, order_ptr, offs_ptr, gu_ptr, gus_ptr, h_ptr, xs_ptr, stride_x, stride_gu_e,
                      stride_gu_r, stride_gus_e, stride_gus_r, ps_x, ps_h, D: tl.constexpr, I: tl.constexpr, A: tl.constexpr,
                      ACT: tl.constexpr, MXFP4: tl.constexpr, GROUPED: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, FAST: tl.constexpr = False,
                      USE_ASM: tl.constexpr = True):
    """Program (e or pair, i-tile): for each pair p of its run, h[p, i] = act(gate_e[i] . x_t, up_e[i] . x_t)."""
    e, start, end = run_of(tl.program_id(0), ids_ptr, offs_ptr, GROUPED)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < I
    w_off = e.to(tl.int64) * stride_gu_e
    s_off = e.to(tl.int64) * stride_gus_e
    m0 = start
    while m0 < end:  # a while loop: the interpreter cannot take a range() over loaded bounds
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        if GROUPED:
            p = tl.load(order_ptr + m, mask=m_ok, other=0)
        else:
            p = m
        if FAST:
            x_rows = (p // A).to(tl.int64) * (D // 2)  # row of the x planes
        else:
            x_rows = (p // A).to(tl.int64) * stride_x
        g = _tc_dot(gu_ptr, gus_ptr, w_off, s_off, i, i_ok, stride_gu_r, stride_gus_r, x_ptr, x_rows, m_ok, ps_x,
                    D, BLOCK_M, BLOCK_I, BLOCK_D, MXFP4, SPLIT, FAST, USE_ASM)
        u = _tc_dot(gu_ptr, gus_ptr, w_off, s_off, I + i, i_ok, stride_gu_r, stride_gus_r, x_ptr, x_rows, m_ok,
                    ps_x, D, BLOCK_M, BLOCK_I, BLOCK_D, MXFP4, SPLIT, FAST, USE_ASM)
        if MXFP4:  # undo the per-token power-of-two scaling that kept x inside fp16's range (mx_prep_kernel)
            xs = tl.load(xs_ptr + p // A, mask=m_ok, other=1.0)
            g = g * xs[None, :]
            u = u * xs[None, :]
        sig = 1.0 / (1.0 + tl.exp(-g))
        if ACT == 0:  # SiLU-GLU
            h = g * sig * u
        else:  # SiTU-GLU: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)
            h = 4.0 * tanh_f32(g * 0.25) * sig * (25.0 * tanh_f32(u * 0.04))
        hm = i_ok[:, None] & m_ok[None, :]
        if FAST:  # h as the fp16 planes the down kernel reads: plane 2 * (i % 2) (+1 for the lo part)
            hp = h_ptr + (2 * (i % 2)).to(tl.int64)[:, None] * ps_h + p.to(tl.int64)[None, :] * (I // 2) \
                + (i // 2)[:, None]
            h = h * H_SCALE  # |SiTU-GLU| <= 100: times 128 stays in fp16's range and keeps the lo parts normal
            hh = h.to(tl.float16)
            tl.store(hp, hh, mask=hm)
            tl.store(hp + ps_h, (h - hh.to(tl.float32)).to(tl.float16), mask=hm)
        else:
            tl.store(h_ptr + p.to(tl.int64)[None, :] * I + i[:, None], h, mask=hm)
        m0 += BLOCK_M


@triton.jit
def grouped_down_kernel(h_ptr, ids_ptr, order_ptr, offs_ptr, dn_ptr, dns_ptr, y_ptr, stride_dn_e, stride_dn_r,
                        stride_dns_e, stride_dns_r, ps_h, D: tl.constexpr, I: tl.constexpr, MXFP4: tl.constexpr,
                        GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        FAST: tl.constexpr = False, USE_ASM: tl.constexpr = True):
    """Program (e or pair, n-tile): for each pair p of its run, y[p, n] = down_e[n, :] . h[p, :]."""
    e, start, end = run_of(tl.program_id(0), ids_ptr, offs_ptr, GROUPED)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < D
    w_off = e.to(tl.int64) * stride_dn_e
    s_off = e.to(tl.int64) * stride_dns_e
    m0 = start
    while m0 < end:
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        if GROUPED:
            p = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)
        else:
            p = m.to(tl.int64)
        h_rows = p * (I // 2) if FAST else p * I
        y = _tc_dot(dn_ptr, dns_ptr, w_off, s_off, n, n_ok, stride_dn_r, stride_dns_r, h_ptr, h_rows, m_ok, ps_h,
                    I, BLOCK_M, BLOCK_N, BLOCK_K, MXFP4, True, FAST, USE_ASM)
        if FAST:
            y = y * (1.0 / H_SCALE)
        tl.store(y_ptr + p[None, :] * D + n[:, None], y, mask=n_ok[:, None] & m_ok[None, :])
        m0 += BLOCK_M


@triton.jit
def mx_prep_kernel(x_ptr, xin_ptr, xs_ptr, stride_x, ps_x, D: tl.constexpr, FAST: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Program t: the activations of token t prepared for the MXFP4 products, in one launch. fp16 holds
    |x| < 65504 and loses bits below 6.1e-5 (subnormals, where the lo parts of the hi + lo split live), so
    row t is divided by the power of two xs[t] that brings its max |x| into [8192, 16384), built from the
    exponent bits of the max (exact; no log/exp). Per token, so a token's result does not depend on the others
    in the batch. FAST: writes the four fp16 planes of the fast loop (even hi, even lo, odd hi, odd lo; rows of
    D/2, planes ps_x apart); else the scaled row in fp32. A NaN or inf stays in its element (and so reaches
    the output)."""
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * stride_x
    amax = tl.zeros((), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.max(tl.abs(tl.load(row + d, mask=d < D, other=0.0).to(tl.float32)), axis=0))
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax in [2**(e-127), 2**(e-126))
    k = tl.minimum(tl.maximum(e, 14), 255) - 13  # xs = 2**(k - 127), k in [1, 242]
    tl.store(xs_ptr + t, (k << 23).to(tl.float32, bitcast=True))
    inv = ((254 - k) << 23).to(tl.float32, bitcast=True)  # 1 / xs, exact
    if FAST:
        HALF: tl.constexpr = D // 2
        for j0 in range(0, HALF, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < HALF
            xe = tl.load(row + 2 * j, mask=ok, other=0.0).to(tl.float32) * inv
            xo = tl.load(row + 2 * j + 1, mask=ok, other=0.0).to(tl.float32) * inv
            xeh = xe.to(tl.float16)
            xoh = xo.to(tl.float16)
            dst = xin_ptr + t * HALF + j
            tl.store(dst, xeh, mask=ok)
            tl.store(dst + ps_x, (xe - xeh.to(tl.float32)).to(tl.float16), mask=ok)
            tl.store(dst + 2 * ps_x, xoh, mask=ok)
            tl.store(dst + 3 * ps_x, (xo - xoh.to(tl.float32)).to(tl.float16), mask=ok)
    else:
        for d0 in range(0, D, BLOCK):
            d = d0 + tl.arange(0, BLOCK)
            v = tl.load(row + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(xin_ptr + t * D + d, v * inv, mask=d < D)


@triton.jit
def combine_kernel(y_ptr, ids_ptr, wts_ptr, out_ptr, stride_out, D: tl.constexpr, A: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """Program (t, n-tile): out[t, n] = sum_{a = 0..A-1, in order, ids[t, a] >= 0} w[t, a] * y[t*A + a, n]."""
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_ok = n < D
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for a in range(A):
        p = (t * A + a).to(tl.int64)
        live = tl.load(ids_ptr + p) >= 0  # a skipped pair's y row was never written
        acc += tl.load(wts_ptr + p) * tl.load(y_ptr + p * D + n, mask=n_ok & live, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---- launcher -----------------------------------------------------------------------------------------
_SCALES_CHECKED: dict[int, tuple] = {}  # id(scale tensor) -> (weakref to it, all in FAST_SCALES)


def fast_scales(*scales: torch.Tensor) -> bool:
    """True when every e8m0 byte of these (static) scale tensors lies in FAST_SCALES, so the fp16
    decode-and-scale path is exact. Checked once per tensor object (a host sync: the first call must come
    before a CUDA graph capture, as the executors' warm-up runs do; during a capture an unchecked tensor
    takes the exact path)."""
    import weakref

    lo, hi = FAST_SCALES
    for t in scales:
        hit = _SCALES_CHECKED.get(id(t))
        if hit is None or hit[0]() is not t:
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            hit = (weakref.ref(t), bool(((t >= lo) & (t <= hi)).all()))
            _SCALES_CHECKED[id(t)] = hit
        if not hit[1]:
            return False
    return True


def group_pairs(ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int32 [T*A]: pair indices sorted by expert, stable; offs int32 [E+1]: expert e's pairs are
    order[offs[e]:offs[e+1]]). Device ops only, no host sync."""
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(E + 1, device=ids.device, dtype=flat.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    return order.to(torch.int32), offs


def tuned_blocks(device: torch.device, key: str, T: int) -> dict | None:
    return tuning.lookup(KERNEL, torch.cuda.get_device_name(device), key, T) if device.type == "cuda" else None


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down, *,
                    act: str = "silu", out: torch.Tensor | None = None, check_ids: bool = False,
                    blocks: dict | None = None, grouped: bool | None = None) -> torch.Tensor:
    """Routed experts for any batch (T <= MAX_BATCH), arguments as kernels.fused_experts.fused_experts.
    grouped: True sorts the pairs by expert on the device (each selected expert read once per step), False
    gives each pair its own programs (no sort; an expert picked twice is read twice); None: grouped above
    MAX_TOKENS (16) tokens. Allocates its scratch (h [T*A, I], y [T*A, D], fp32) per call: under a CUDA
    graph they come from the graph's pool. `blocks`: overrides of DEFAULT_BLOCKS; None: the tuned config
    when one exists."""
    pb = check_problem(x, ids, weights, gate_up, down, act, out, MAX_BATCH, check_ids)
    T, D, A, E, I, mx, out = pb.T, pb.D, pb.A, pb.E, pb.I, pb.mx, pb.out
    gu, gus, dn, dns = pb.gu, pb.gus, pb.dn, pb.dns
    if T == 0:
        return out
    if grouped is None:
        grouped = T > MAX_TOKENS
    if blocks is None:
        wdtype = "mxfp4" if mx else WDTYPES[gu.dtype]
        blocks = tuned_blocks(x.device, shape_key(D, I, A, wdtype, act) + f",grouped={int(grouped)}", T)
    b = {**DEFAULT_BLOCKS, **(blocks or {})}
    bm = max(16, triton.next_power_of_2(b["BLOCK_M"]))
    bi = max(16, min(b["BLOCK_I"], triton.next_power_of_2(I)))
    bd = max(16, min(b["BLOCK_D"], triton.next_power_of_2(D)))
    bn = max(16, min(b["BLOCK_N"], triton.next_power_of_2(D)))
    bk = max(16, min(b["BLOCK_K"], triton.next_power_of_2(I)))
    if grouped:
        order, offs = group_pairs(ids, E)
        rows = E
    else:
        order = offs = ids  # unused pointers
        rows = T * A
    y = torch.empty(T * A, D, dtype=torch.float32, device=x.device)
    gus_, dns_ = (gus, dns) if mx else (gu, dn)  # unused scale pointers: any valid tensor
    split = mx or (x.dtype == torch.float32 and gu.dtype != torch.float32)
    # fast: SiTU-GLU only, whose |h| <= 100 fits the fp16 planes of h (SiLU-GLU's h is unbounded)
    fast = mx and act == "situ" and fast_scales(gus, dns)
    if fast and (bd % MX_BLOCK or bk % MX_BLOCK or D % bd or I % bk):
        fast = False  # the fast MXFP4 loop takes whole chunks of a multiple of 32
    xs = y  # unused unless MXFP4
    if mx:  # activations scaled per token into fp16's range, as fp16 planes (fast) or fp32 (mx_prep_kernel)
        xs = torch.empty(T, dtype=torch.float32, device=x.device)
        if fast:
            xin = torch.empty(4, T, D // 2, dtype=torch.float16, device=x.device)
            h = torch.empty(4, T * A, I // 2, dtype=torch.float16, device=x.device)
            ps_x, ps_h = T * (D // 2), T * A * (I // 2)
        else:
            xin = torch.empty(T, D, dtype=torch.float32, device=x.device)
            h = torch.empty(T * A, I, dtype=torch.float32, device=x.device)
            ps_x = ps_h = 0
        mx_prep_kernel[(T,)](x, xin, xs, x.stride(0), ps_x, D=D, FAST=fast,
                             BLOCK=min(1024, triton.next_power_of_2(D)))
    else:
        xin, ps_x, ps_h = x, 0, 0
        h = torch.empty(T * A, I, dtype=torch.float32, device=x.device)
    kw = {"num_warps": b["num_warps"], "num_stages": b["num_stages"]}
    grouped_up_kernel[(rows, triton.cdiv(I, bi))](
        xin, ids, order, offs, gu, gus_, h, xs, xin.stride(0) if not fast else 0, gu.stride(0), gu.stride(1),
        gus_.stride(0) if mx else 0, gus_.stride(1) if mx else 0, ps_x, ps_h, D=D, I=I, A=A, ACT=ACTS[act], MXFP4=mx,
        GROUPED=grouped, SPLIT=split, BLOCK_M=bm, BLOCK_I=bi, BLOCK_D=bd, FAST=fast, USE_ASM=x.is_cuda, **kw)
    grouped_down_kernel[(rows, triton.cdiv(D, bn))](
        h, ids, order, offs, dn, dns_, y, dn.stride(0), dn.stride(1), dns_.stride(0) if mx else 0,
        dns_.stride(1) if mx else 0, ps_h, D=D, I=I, MXFP4=mx, GROUPED=grouped, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        FAST=fast, USE_ASM=x.is_cuda, **kw)
    combine_kernel[(T, triton.cdiv(D, BLOCK_C))](y, ids, weights, out, out.stride(0), D=D, A=A, BLOCK_C=BLOCK_C)
    return out


def routed_experts(x, ids, weights, gate_up, down, *, act: str = "silu", out=None, blocks=None) -> torch.Tensor:
    """The Triton routed experts at any batch, the path picked by what measured fastest on the H200
    (bench/experts_paths.py; docs/evidence/experts-paths-h200.md): the tensor-core kernels (per pair at
    <= 16 tokens, grouped by expert above) for float weights and for MXFP4 weights on the GPU whose scales
    allow the fast decode (fast_scales); other MXFP4 weights (the exact per-block decode, and the CPU) take
    the small-batch FMA kernels (backends/fused/kernels/fused_experts.py) at <= 16 tokens. Sync-free either way (graph
    capturable; fast_scales syncs once per scale tensor, in the executors' warm-up before capture)."""
    mx = not isinstance(gate_up, torch.Tensor)
    if mx and x.shape[0] <= MAX_TOKENS:
        gus = gate_up[1] if isinstance(gate_up, tuple) else gate_up.scales
        dns = down[1] if isinstance(down, tuple) else down.scales
        if not (x.is_cuda and fast_scales(gus, dns)):
            return fe.fused_experts(x, ids, weights, gate_up, down, act=act, out=out, blocks=blocks)  # module lookup
    return grouped_experts(x, ids, weights, gate_up, down, act=act, out=out, blocks=blocks)


def tuning_key(D: int, I: int, A: int, wdtype: str, act: str, T: int) -> str:
    """The tuning-file key grouped_experts looks up at batch T with grouped=None (`megadecode tune`)."""
    return shape_key(D, I, A, wdtype, act) + f",grouped={int(T > MAX_TOKENS)}"


def launch(x, ids, w, gu, dn, act, out, blocks):
    """The tuner's entry point: one call with explicit blocks (per pair at <= 16 tokens, grouped above)."""
    return grouped_experts(x, ids, w, gu, dn, act=act, out=out, blocks=blocks)


# ---- static audit description -------------------------------------------------------------------------
def audit_specs(dtype: str = "bf16", mxfp4: bool = False, act: str = "silu", D: int = 3584, I: int = 3072,
                A: int = 16, grouped: bool = True, fast: bool = False) -> list:
    """KernelSpecs of the three kernels (and the MXFP4 activation prep) at one path: `grouped` (sorted by expert)
    or per pair, float or `mxfp4` weights, `fast` (the MXFP4 inline-PTX decode) or exact. Path constexprs:
    MXFP4, GROUPED, FAST, ACT; SPLIT and USE_ASM are the dtype's and the device's choice."""
    w = s = "*u8" if mxfp4 else f"*{dtype}"
    b = DEFAULT_BLOCKS
    split = dtype == "fp32" and mxfp4
    strides = {"stride_gu_e": "i32", "stride_gu_r": "i32", "stride_gus_e": "i32", "stride_gus_r": "i32"}
    up_sig = {"x_ptr": "*fp16" if fast else f"*{dtype}", "ids_ptr": "*i64", "order_ptr": "*i32",
              "offs_ptr": "*i32", "gu_ptr": w, "gus_ptr": s, "h_ptr": "*fp16" if fast else "*fp32",
              "xs_ptr": "*fp32", "stride_x": "i32", **strides, "ps_x": "i32", "ps_h": "i32"}
    up_c = {"D": D, "I": I, "A": A, "ACT": ACTS[act], "MXFP4": mxfp4, "GROUPED": grouped, "SPLIT": split,
            "BLOCK_M": b["BLOCK_M"], "BLOCK_I": b["BLOCK_I"], "BLOCK_D": b["BLOCK_D"], "FAST": fast, "USE_ASM": True}
    dn_sig = {"h_ptr": "*fp16" if fast else "*fp32", "ids_ptr": "*i64", "order_ptr": "*i32", "offs_ptr": "*i32",
              "dn_ptr": w, "dns_ptr": s, "y_ptr": "*fp32", "stride_dn_e": "i32", "stride_dn_r": "i32",
              "stride_dns_e": "i32", "stride_dns_r": "i32", "ps_h": "i32"}
    dn_c = {"D": D, "I": I, "MXFP4": mxfp4, "GROUPED": grouped, "BLOCK_M": b["BLOCK_M"], "BLOCK_N": b["BLOCK_N"],
            "BLOCK_K": b["BLOCK_K"], "FAST": fast, "USE_ASM": True}
    cb_sig = {"y_ptr": "*fp32", "ids_ptr": "*i64", "wts_ptr": "*fp32", "out_ptr": f"*{dtype}", "stride_out": "i32"}
    cb_c = {"D": D, "A": A, "BLOCK_C": BLOCK_C}
    specs = [kernel_spec(grouped_up_kernel, up_sig, up_c, static=("gu_ptr", "gus_ptr"),
                         path=("MXFP4", "GROUPED", "FAST", "ACT")),
             kernel_spec(grouped_down_kernel, dn_sig, dn_c, static=("dn_ptr", "dns_ptr"),
                         path=("MXFP4", "GROUPED", "FAST")),
             kernel_spec(combine_kernel, cb_sig, cb_c)]
    if mxfp4:
        pr_sig = {"x_ptr": f"*{dtype}", "xin_ptr": "*fp16" if fast else "*fp32", "xs_ptr": "*fp32",
                  "stride_x": "i32", "ps_x": "i32"}
        pr_c = {"D": D, "FAST": fast, "BLOCK": 1024}
        specs.append(kernel_spec(mx_prep_kernel, pr_sig, pr_c))
    return specs


def all_paths(dtype: str = "bf16", mxfp4: bool = False, act: str = "silu", **dims) -> list:
    """Every path grouped_experts can take for these weights: per pair (<= 16 tokens) and grouped by expert, and
    for MXFP4 the exact and the fast decode (the fast one needs SiTU-GLU and in-range scales)."""
    fasts = (False, True) if mxfp4 and act == "situ" else (False,)
    return [s for grouped in (False, True) for fast in fasts
            for s in audit_specs(dtype, mxfp4, act, grouped=grouped, fast=fast, **dims)]


# ---- the harness variant ----------------------------------------------------------------------------
def _run(op, inputs, weights, outputs, cfg, step, cache=None):
    x, ids, wts = (inputs[n] for n in op.inputs)
    grouped_experts(x.contiguous(), ids.contiguous(), wts.float().contiguous(), weights[op.weights[0]],
                    weights[op.weights[1]], act="silu", out=outputs[op.outputs[0]])


GROUPED_EXPERTS_VARIANT = register(Variant(Manifest(
    name="triton-grouped-experts",
    description="routed experts at any batch in three Triton kernels on tensor cores (weights on the MMA's M "
                "side, 16 tokens on its N side): per (pair, tile) at <= 16 tokens; above, pairs sorted by "
                "expert on the device (no host sync) and (expert, tile) programs that read each selected expert "
                "once for all its pairs; a fixed-order weighted combine; fp32 accumulation",
    replaces=(EXPERTS,),
    scope=Scope(families=("qwen3_moe", "deepseek_v3"), dtypes=("float32", "float16", "bfloat16"),
                devices=("cpu", "cuda"), batch=(1, 256), arch="sm_90", dims=float_experts),
    sources=("megadecode/backends/fused/kernels/grouped_experts.py", "megadecode/backends/fused/kernels/fused_experts.py",
             "megadecode/backends/fused/kernels/common.py"), uses_triton=True,
    graph_capturable=True, kernels=lambda: all_paths("bf16", False, "silu", D=2048, I=768, A=8)),
    _run, kernel=grouped_up_kernel))
