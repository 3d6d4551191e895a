"""The megakernel in CuTe DSL: one persistent launch walks a decode step's instruction queues (mega/isa.py).

Each CTA (NT threads) runs its queue in order. For every instruction: thread 0 spins on the counters it waits on
(`ld.acquire.gpu`, bounded: on a timeout it records the instruction, counter and value in `err`, sets the abort
flag that every spinner also polls, and the launch drains), then a block barrier; the opcode's body; a block
barrier; thread 0 signals (`fence.acq_rel.gpu`, then `atom.add.release.gpu`). Activations produced inside the
launch (the fp32 and int32 arenas, the KV cache) are read with plain coherent `ld.global` after the acquire;
static weights are read with the same plain loads (no non-coherent path at all in this version). Opcode
semantics: mega/pyvm.py, which this kernel is diffed against.

Weights and caches are bf16; activations fp32. Dot products: each warp takes rows, each lane 8 consecutive
elements at a time (16-byte loads), TB tokens per pass, fp32 accumulation, shuffle reductions.
Requires every reduction length (K, d, C, I) to be a multiple of 8 (`lower.check_kernel_dims`).
"""

from __future__ import annotations

import functools
import os
import tempfile

ARCH = "sm_90a"  # the H200; every compile names it (--gpu-arch), whatever imported cutlass first
os.environ.setdefault("CUTE_DSL_ARCH", ARCH)

import cuda.bindings.driver as cuda_drv  # noqa: E402
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from .isa import (
    F_GREEDY,
    F_INTERLEAVED,
    F_NORM,
    F_RENORM,
    F_RESID,
    F_SHARED,
    F_SIGMOID,
    F_WRITE_NORMED,
    HEADER,
    OPCODES,
    OPS,
    ROW,
)

NT = 256  # threads per CTA
NW = NT // 32
TB = 4  # tokens (or expert pairs) per pass of a dot-product loop
CH = 64  # cache positions scored per attention chunk
SMEM_F = 12288  # fp32 words of shared memory per CTA (48 KiB)
SMEM_I = 2048  # int32 words (8 KiB)
SMEM_BYTES = 4 * (SMEM_F + SMEM_I)
ROW_S = SMEM_I - 64  # the current instruction's row; SMEM_I - 1: its waits were satisfied
NEG_INF = float("-inf")

ARG = {name: {a: HEADER + i for i, a in enumerate(args)} for name, (_, args) in OPS.items()}


def _g(addr, dtype, align):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def ldf(dtype: Constexpr, addr: Int64) -> Float32:
    return Float32(cute.make_tensor(_g(addr, dtype, dtype.width // 8), cute.make_layout(1))[0])


@cute.jit
def ldi(addr: Int64) -> Int32:
    return cute.make_tensor(_g(addr, Int32, 4), cute.make_layout(1))[0]


@cute.jit
def ldi64(addr: Int64) -> Int64:
    return cute.make_tensor(_g(addr, Int64, 8), cute.make_layout(1))[0]


@cute.jit
def stf(dtype: Constexpr, addr: Int64, v: Float32):
    t = cute.make_tensor(_g(addr, dtype, dtype.width // 8), cute.make_layout(1))
    t[0] = dtype(v)


@cute.jit
def sti(addr: Int64, v: Int32):
    t = cute.make_tensor(_g(addr, Int32, 4), cute.make_layout(1))
    t[0] = v


@cute.jit
def ld8(dtype: Constexpr, addr: Int64):
    """8 consecutive elements (16-byte aligned for 16-bit types, 32-byte for fp32) as fp32."""
    return cute.make_tensor(_g(addr, dtype, 16), cute.make_layout(8)).load().to(Float32)


@cute.jit
def sm8(sm: cute.Tensor, i: Int32):
    return cute.make_tensor(sm.iterator + i, cute.make_layout(8)).load()


@cute.jit
def dot8(a, b) -> Float32:
    return (a * b).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


@cute.jit
def prefetch_l2(base: Int64, nbytes: Int64, first: Int32, stride: Int32):
    """prefetch.global.L2 of every 128-byte line of [base, base + nbytes), lines first, first + stride, ..."""
    lines = Int32((nbytes + 127) // 128)
    for line in cutlass.range(first, lines, stride):
        cute.arch.inline_ptx("prefetch.global.L2 [{$r0}];", read_only_args=[base + Int64(line) * 128])


@cute.jit
def prefetch_row(prog: cute.Tensor, taddr: cute.Tensor, idx: Int32, first: Int32, stride: Int32):
    """Prefetch the static bytes instruction idx declares (header words 10..12) into L2."""
    t = prog[idx, 10]
    if t >= 0:
        prefetch_l2(taddr[t] + Int64(prog[idx, 11]) * 16, Int64(prog[idx, 12]) * 16, first, stride)


@cute.jit
def warp_sum(v: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << i)
    return v


@cute.jit
def warp_max(v: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1 << i))
    return v


@cute.jit
def warp_argmax(v: Float32, i: Int32):
    """(max value, lowest index holding it) over the warp."""
    for k in cutlass.range_constexpr(5):
        ov = cute.arch.shuffle_sync_bfly(v, offset=1 << k)
        oi = cute.arch.shuffle_sync_bfly(i, offset=1 << k)
        if ov > v or (ov == v and oi < i):
            v = ov
            i = oi
    return v, i


@cute.jit
def silu(x: Float32) -> Float32:
    return x / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def hash32(seed: Uint32, b: Uint32, v: Uint32) -> Uint32:
    x = seed * Uint32(0x9E3779B1) + b * Uint32(0x85EBCA77) + v * Uint32(0xC2B2AE3D)
    x = x ^ (x >> 16)
    x = x * Uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * Uint32(0x846CA68B)
    return x ^ (x >> 16)


@cute.jit
def arg(smi: cute.Tensor, j: Constexpr) -> Int32:
    """Word j of the current instruction (copied into shared memory while thread 0 waits)."""
    return smi[ROW_S + j]


@cute.jit
def argf(pb: Int64, idx: Int32, j: Constexpr) -> Float32:
    """Argument word j of instruction idx, as the fp32 whose bits it holds."""
    return ldf(Float32, pb + Int64(idx * ROW + j) * 4)


@cute.jit
def fa(fb: Int64, e) -> Int64:
    """Address of fp32 arena element e."""
    return fb + Int64(e) * 4


@cute.jit
def ia(ib: Int64, e) -> Int64:
    """Address of int32 arena element e."""
    return ib + Int64(e) * 4


# ---- dense rows: MATVEC and GLU ------------------------------------------------------------------------------
@cute.jit
def op_rows(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
            tid: Int32, glu: Constexpr):
    warp, lane = tid // 32, tid % 32
    op = "GLU" if glu else "MATVEC"
    flags = arg(smi, 3)
    K, x_off, x_stride = arg(smi, ARG[op]["K"]), arg(smi, ARG[op]["x_off"]), arg(smi, ARG[op]["x_stride"])
    out_off, out_stride, out_col = arg(smi, ARG[op]["out_off"]), arg(smi, ARG[op]["out_stride"]), arg(smi, ARG[op]["out_col"])
    r0, r1, B, norm_w = arg(smi, ARG[op]["r0"]), arg(smi, ARG[op]["r1"]), arg(smi, ARG[op]["B"]), arg(smi, ARG[op]["norm_w"])
    eps = argf(pb, idx, ARG[op]["eps_bits"])
    w0 = taddr[arg(smi, ARG[op]["wg" if glu else "w"])]
    w1 = w0
    if cutlass.const_expr(glu):
        w1 = taddr[arg(smi, ARG[op]["wu"])]
    norm = (flags & F_NORM) != 0
    gaddr = w0
    if norm:
        gaddr = taddr[norm_w]
    RS = SMEM_F - 64  # rstd per token
    if norm:
        for t in cutlass.range(warp, B, NW):
            ss = Float32(0.0)
            for k in cutlass.range(lane * 8, K, 256):
                xv = ld8(Float32, fa(fb, x_off + t * x_stride + k))
                ss += dot8(xv, xv)
            ss = warp_sum(ss)
            if lane == 0:
                sm[RS + t] = cute.math.rsqrt(ss / Float32(K) + eps)
        cute.arch.sync_threads()
    acc = cute.make_rmem_tensor(TB, Float32)
    acu = cute.make_rmem_tensor(TB, Float32)
    for t0 in cutlass.range(0, B, TB):
        for r in cutlass.range(r0 + warp, r1, NW):
            for j in cutlass.range_constexpr(TB):
                acc[j] = Float32(0.0)
                acu[j] = Float32(0.0)
            wrow = w0 + Int64(r) * Int64(K) * 2
            urow = w1 + Int64(r) * Int64(K) * 2
            for k in cutlass.range(lane * 8, K, 256, unroll=4):
                wv = ld8(BFloat16, wrow + Int64(k) * 2)
                uv = wv
                if cutlass.const_expr(glu):
                    uv = ld8(BFloat16, urow + Int64(k) * 2)
                gv = wv
                if norm:
                    gv = ld8(BFloat16, gaddr + Int64(k) * 2)
                for j in cutlass.range_constexpr(TB):
                    if t0 + j < B:
                        xv = ld8(Float32, fa(fb, x_off + (t0 + j) * x_stride + k))
                        if norm:
                            xv = xv * gv * sm[RS + t0 + j]
                        acc[j] += dot8(wv, xv)
                        if cutlass.const_expr(glu):
                            acu[j] += dot8(uv, xv)
            for j in cutlass.range_constexpr(TB):
                s = warp_sum(acc[j])
                if cutlass.const_expr(glu):
                    s = silu(s) * warp_sum(acu[j])
                if lane == 0 and t0 + j < B:
                    o = fa(fb, out_off + (t0 + j) * out_stride + out_col + r)
                    if (flags & F_RESID) != 0:
                        s += ldf(Float32, o)
                    stf(Float32, o, s)
    if cutlass.const_expr(not glu):
        if (flags & F_WRITE_NORMED) != 0 and r0 == 0:
            normed_off = arg(smi, ARG[op]["normed_off"])
            for t in cutlass.range(B):
                for k in cutlass.range(tid, K, NT):
                    v = ldf(Float32, fa(fb, x_off + t * x_stride + k)) * sm[RS + t] * ldf(BFloat16, gaddr + Int64(k) * 2)
                    stf(Float32, fa(fb, normed_off + t * K + k), v)


@cute.jit
def op_embed(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    w, tok_off, out_off = taddr[arg(smi, ARG["EMBED"]["w"])], arg(smi, ARG["EMBED"]["tok_off"]), arg(smi, ARG["EMBED"]["out_off"])
    D, B, c0, c1 = arg(smi, ARG["EMBED"]["D"]), arg(smi, ARG["EMBED"]["B"]), arg(smi, ARG["EMBED"]["c0"]), arg(smi, ARG["EMBED"]["c1"])
    for t in cutlass.range(B):
        tok = ldi(ia(ib, tok_off + t))
        for col in cutlass.range(c0 + tid, c1, NT):
            stf(Float32, fa(fb, out_off + t * D + col), ldf(BFloat16, w + (Int64(tok) * Int64(D) + Int64(col)) * 2))


# ---- attention ---------------------------------------------------------------------------------------------
@cute.jit
def rope_pair(a: Float32, b: Float32, pos: Int32, inv: Float32, att: Float32):
    f = Float32(pos) * inv
    cs = cute.math.cos(f) * att
    sn = cute.math.sin(f) * att
    return a * cs - b * sn, b * cs + a * sn


@cute.jit
def softmax_chunk(sm: cute.Tensor, tid: Int32, SC: Constexpr, M: Constexpr, L: Constexpr, AL: Constexpr, G: Int32):
    """Per row g < G of the chunk's scores SC[g * CH + p]: update the running max M[g] and sum L[g], turn the
    scores into exp(score - max), and leave the rescale factor of the old accumulator in AL[g]."""
    warp, lane = tid // 32, tid % 32
    for g in cutlass.range(warp, G, NW):
        s0 = sm[SC + g * CH + lane]
        s1 = sm[SC + g * CH + 32 + lane]
        cm = warp_max(cute.arch.fmax(s0, s1))
        m_old = sm[M + g]
        m_new = cute.arch.fmax(m_old, cm)
        p0 = cute.math.exp(s0 - m_new)
        p1 = cute.math.exp(s1 - m_new)
        sm[SC + g * CH + lane] = p0
        sm[SC + g * CH + 32 + lane] = p1
        tot = warp_sum(p0 + p1)
        if lane == 0:
            alpha = cute.math.exp(m_old - m_new)
            sm[AL + g] = alpha
            sm[L + g] = sm[L + g] * alpha + tot
            sm[M + g] = m_new


@cute.jit
def op_attn_gqa(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                tid: Int32):
    warp, lane = tid // 32, tid % 32
    A = "ATTN_GQA"
    kc, vc = taddr[arg(smi, ARG[A]["kc"])], taddr[arg(smi, ARG[A]["vc"])]
    qkv_off, qkv_stride = arg(smi, ARG[A]["qkv_off"]), arg(smi, ARG[A]["qkv_stride"])
    qn, kn = taddr[arg(smi, ARG[A]["qn_w"])], taddr[arg(smi, ARG[A]["kn_w"])]
    b, h, s, S, H, KH, d = (arg(smi, ARG[A][n]) for n in ("b", "h", "s", "S", "H", "KH", "d"))
    part_off, Lmax = arg(smi, ARG[A]["part_off"]), arg(smi, ARG[A]["Lmax"])
    scale, eps, att = argf(pb, idx, ARG[A]["scale_bits"]), argf(pb, idx, ARG[A]["eps_bits"]), argf(pb, idx, ARG[A]["att_bits"])
    inv = taddr[arg(smi, ARG[A]["rope_w"])]
    pos = ldi(ia(ib, arg(smi, ARG[A]["pos_off"]) + b))
    slot = ldi(ia(ib, arg(smi, ARG[A]["slot_off"]) + b))
    G = H // KH
    half = d // 2
    Q, SC, ACC = 0, 2048, 3072
    M, L, AL, TMP = 5120, 5136, 5152, 5168
    base = qkv_off + b * qkv_stride
    for g in cutlass.range(warp, G, NW):  # q heads: RMSNorm
        qrow = base + (h * G + g) * d
        ss = Float32(0.0)
        for dd in cutlass.range(lane, d, 32):
            x = ldf(Float32, fa(fb, qrow + dd))
            ss += x * x
        rs = cute.math.rsqrt(warp_sum(ss) / Float32(d) + eps)
        for dd in cutlass.range(lane, d, 32):
            sm[Q + g * d + dd] = ldf(Float32, fa(fb, qrow + dd)) * rs * ldf(BFloat16, qn + Int64(dd) * 2)
    if warp == 0:  # the k row's rstd
        krow = base + (H + h) * d
        ss = Float32(0.0)
        for dd in cutlass.range(lane, d, 32):
            x = ldf(Float32, fa(fb, krow + dd))
            ss += x * x
        ss = warp_sum(ss)
        if lane == 0:
            sm[TMP] = cute.math.rsqrt(ss / Float32(d) + eps)
    cute.arch.sync_threads()
    for e in cutlass.range(tid, G * half, NT):  # q heads: RoPE (pairs i, i + d/2)
        g, i = e // half, e % half
        x0, x1 = rope_pair(sm[Q + g * d + i], sm[Q + g * d + i + half], pos, ldf(Float32, inv + Int64(i) * 4),
                           att)
        sm[Q + g * d + i] = x0
        sm[Q + g * d + i + half] = x1
    if s == S - 1:  # this split holds the token's own position: write its key and value
        krow = base + (H + h) * d
        vrow = base + (H + KH + h) * d
        crow = ((Int64(slot) * Int64(Lmax) + Int64(pos)) * Int64(KH) + Int64(h)) * Int64(d)
        rs = sm[TMP]
        for i in cutlass.range(tid, half, NT):
            k0 = ldf(Float32, fa(fb, krow + i)) * rs * ldf(BFloat16, kn + Int64(i) * 2)
            k1 = ldf(Float32, fa(fb, krow + i + half)) * rs * ldf(BFloat16, kn + Int64(i + half) * 2)
            k0, k1 = rope_pair(k0, k1, pos, ldf(Float32, inv + Int64(i) * 4), att)
            stf(BFloat16, kc + (crow + Int64(i)) * 2, k0)
            stf(BFloat16, kc + (crow + Int64(i + half)) * 2, k1)
        for dd in cutlass.range(tid, d, NT):
            stf(BFloat16, vc + (crow + Int64(dd)) * 2, ldf(Float32, fa(fb, vrow + dd)))
    for g in cutlass.range(tid, G, NT):
        sm[M + g] = Float32(NEG_INF)
        sm[L + g] = Float32(0.0)
    for e in cutlass.range(tid, G * d, NT):
        sm[ACC + e] = Float32(0.0)
    cute.arch.sync_threads()
    Lq = pos + 1
    lo = s * Lq // S
    hi = (s + 1) * Lq // S
    for c0 in cutlass.range(lo, hi, CH):
        n = cutlass.min(CH, hi - c0)
        for e in cutlass.range(tid, G * CH, NT):
            g, p = e // CH, e % CH
            sc = Float32(NEG_INF)
            if p < n:
                krow = kc + ((Int64(slot) * Int64(Lmax) + Int64(c0 + p)) * Int64(KH) + Int64(h)) * Int64(d) * 2
                sc = Float32(0.0)
                for dd in cutlass.range(0, d, 8):
                    sc += dot8(ld8(BFloat16, krow + Int64(dd) * 2), sm8(sm, Q + g * d + dd))
                sc = sc * scale
            sm[SC + e] = sc
        cute.arch.sync_threads()
        softmax_chunk(sm, tid, SC, M, L, AL, G)
        cute.arch.sync_threads()
        for e in cutlass.range(tid, G * d, NT):
            g, dd = e // d, e % d
            a = sm[ACC + e] * sm[AL + g]
            for p in cutlass.range(n):
                vrow = ((Int64(slot) * Int64(Lmax) + Int64(c0 + p)) * Int64(KH) + Int64(h)) * Int64(d)
                a += sm[SC + g * CH + p] * ldf(BFloat16, vc + (vrow + Int64(dd)) * 2)
            sm[ACC + e] = a
        cute.arch.sync_threads()
    for e in cutlass.range(tid, G * (d + 2), NT):
        g, j = e // (d + 2), e % (d + 2)
        v = sm[M + g]
        if j == 1:
            v = sm[L + g]
        if j >= 2:
            v = sm[ACC + g * d + j - 2]
        stf(Float32, fa(fb, part_off + ((b * H + h * G + g) * S + s) * (d + 2) + j), v)


@cute.jit
def op_merge(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    warp, lane = tid // 32, tid % 32
    A = "MERGE"
    part_off, out_off, out_stride = arg(smi, ARG[A]["part_off"]), arg(smi, ARG[A]["out_off"]), arg(smi, ARG[A]["out_stride"])
    b, h, S, H, d, wuv, dv, P = (arg(smi, ARG[A][n]) for n in ("b", "h", "S", "H", "d", "wuv", "dv", "P"))
    base = part_off + (b * H + h) * S * (d + 2)
    mx = Float32(NEG_INF)
    for s in cutlass.range(S):
        mx = cute.arch.fmax(mx, ldf(Float32, fa(fb, base + s * (d + 2))))
    den = Float32(0.0)
    for s in cutlass.range(S):
        den += cute.math.exp(ldf(Float32, fa(fb, base + s * (d + 2))) - mx) * ldf(Float32, fa(fb, base + s * (d + 2) + 1))
    for dd in cutlass.range(tid, d, NT):
        num = Float32(0.0)
        for s in cutlass.range(S):
            num += cute.math.exp(ldf(Float32, fa(fb, base + s * (d + 2))) - mx) * \
                ldf(Float32, fa(fb, base + s * (d + 2) + 2 + dd))
        o = num / den
        if wuv < 0:
            stf(Float32, fa(fb, out_off + b * out_stride + h * dv + dd), o)
        else:
            sm[dd] = o
    if wuv >= 0:  # MLA: the head's value up-projection W_UV [dv, C] on the merged latent
        cute.arch.sync_threads()
        w = taddr[wuv]
        for v in cutlass.range(warp, dv, NW):
            wrow = w + Int64(h * (P + dv) + P + v) * Int64(d) * 2
            acc = Float32(0.0)
            for k in cutlass.range(lane * 8, d, 256):
                acc += dot8(ld8(BFloat16, wrow + Int64(k) * 2), sm8(sm, k))
            acc = warp_sum(acc)
            if lane == 0:
                stf(Float32, fa(fb, out_off + b * out_stride + h * dv + v), acc)


# ---- routing and experts -----------------------------------------------------------------------------------
@cute.jit
def op_route(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    warp, lane = tid // 32, tid % 32
    A_ = "ROUTE"
    flags = arg(smi, 3)
    logits_off, E, A, B = arg(smi, ARG[A_]["logits_off"]), arg(smi, ARG[A_]["E"]), arg(smi, ARG[A_]["A"]), arg(smi, ARG[A_]["B"])
    bias_w, G, TG = arg(smi, ARG[A_]["bias_w"]), arg(smi, ARG[A_]["n_group"]), arg(smi, ARG[A_]["topk_group"])
    scale = argf(pb, idx, ARG[A_]["scale_bits"])
    ids_off, wts_off = arg(smi, ARG[A_]["ids_off"]), arg(smi, ARG[A_]["wts_off"])
    sigmoid = (flags & F_SIGMOID) != 0
    nwu = cutlass.min(NW, SMEM_F // (2 * E + 32))  # warps with room for their token's scores
    region = 2 * E + 32
    if warp < nwu:
        SCW = warp * region  # the token's weights (probabilities or sigmoid scores)
        CHW = SCW + E  # the choice values (-inf once picked or masked)
        PK = CHW + E  # the picked weights
        for t in cutlass.range(warp, B, nwu):
            lrow = logits_off + t * E
            if sigmoid:
                for e in cutlass.range(lane, E, 32):
                    sv = Float32(1.0) / (Float32(1.0) + cute.math.exp(-ldf(Float32, fa(fb, lrow + e))))
                    sm[SCW + e] = sv
                    ch = sv
                    if bias_w >= 0:
                        ch = sv + ldf(Float32, taddr[bias_w] + Int64(e) * 4)
                    sm[CHW + e] = ch
            else:
                mx = Float32(NEG_INF)
                for e in cutlass.range(lane, E, 32):
                    mx = cute.arch.fmax(mx, ldf(Float32, fa(fb, lrow + e)))
                mx = warp_max(mx)
                tot = Float32(0.0)
                for e in cutlass.range(lane, E, 32):
                    tot += cute.math.exp(ldf(Float32, fa(fb, lrow + e)) - mx)
                tot = warp_sum(tot)
                for e in cutlass.range(lane, E, 32):
                    pv = cute.math.exp(ldf(Float32, fa(fb, lrow + e)) - mx) / tot
                    sm[SCW + e] = pv
                    sm[CHW + e] = pv
            cute.arch.sync_warp()
            if G > 1:  # expert groups: keep the topk_group groups with the best top-2 sums
                gs = E // G
                gsc = Float32(NEG_INF)
                if lane < G:
                    b1, b2 = Float32(NEG_INF), Float32(NEG_INF)
                    for e in cutlass.range(lane * gs, (lane + 1) * gs):
                        v = sm[CHW + e]
                        if v > b1:
                            b2 = b1
                            b1 = v
                        elif v > b2:
                            b2 = v
                    gsc = b1 + b2
                keep = Int32(0)
                for _ in cutlass.range(TG):
                    bv, bi = warp_argmax(gsc, lane)
                    if lane == bi:
                        keep = Int32(1)
                        gsc = Float32(NEG_INF)
                sm[PK + lane] = Float32(keep)  # every lane: its group's flag (shuffles need all 32 lanes)
                cute.arch.sync_warp()
                for e in cutlass.range(lane, E, 32):
                    if sm[PK + e // gs] == Float32(0.0):
                        sm[CHW + e] = Float32(NEG_INF)
                cute.arch.sync_warp()
            for a in cutlass.range(A):
                bv, bi = Float32(NEG_INF), Int32(E)
                for e in cutlass.range(lane, E, 32):
                    v = sm[CHW + e]
                    if v > bv:
                        bv = v
                        bi = e
                bv, bi = warp_argmax(bv, bi)
                if lane == 0:
                    sti(ia(ib, ids_off + t * A + a), bi)
                    sm[PK + a] = sm[SCW + bi]
                    sm[CHW + bi] = Float32(NEG_INF)
                cute.arch.sync_warp()
            if lane == 0:
                tot = Float32(0.0)
                for a in cutlass.range(A):
                    tot += sm[PK + a]
                if sigmoid:
                    tot = tot + Float32(1e-20)
                for a in cutlass.range(A):
                    v = sm[PK + a]
                    if (flags & F_RENORM) != 0:
                        v = v / tot
                    stf(Float32, fa(fb, wts_off + t * A + a), v * scale)
            cute.arch.sync_warp()
    cute.arch.sync_threads()
    # the (token, slot) pairs grouped by expert, experts ascending, pairs in (token, slot) order
    nuniq_off, uniq_off, pstart_off = arg(smi, ARG[A_]["nuniq_off"]), arg(smi, ARG[A_]["uniq_off"]), arg(smi, ARG[A_]["pstart_off"])
    ptok_off, pslot_off, pairof_off = arg(smi, ARG[A_]["ptok_off"]), arg(smi, ARG[A_]["pslot_off"]), arg(smi, ARG[A_]["pairof_off"])
    n = B * A
    CNT, START, IDS = 0, E, 2 * E
    for j in cutlass.range(tid, n, NT):
        smi[IDS + j] = ldi(ia(ib, ids_off + j))
    cute.arch.sync_threads()
    for e in cutlass.range(tid, E, NT):
        cnt = Int32(0)
        for j in cutlass.range(n):
            if smi[IDS + j] == e:
                cnt += 1
        smi[CNT + e] = cnt
    cute.arch.sync_threads()
    if tid == 0:
        u, start = Int32(0), Int32(0)
        for e in cutlass.range(E):
            if smi[CNT + e] > 0:
                sti(ia(ib, uniq_off + u), e)
                sti(ia(ib, pstart_off + u), start)
                smi[START + e] = start
                start += smi[CNT + e]
                u += 1
        sti(ia(ib, pstart_off + u), start)
        sti(ia(ib, nuniq_off), u)
    cute.arch.sync_threads()
    for e in cutlass.range(tid, E, NT):
        if smi[CNT + e] > 0:
            p = smi[START + e]
            for j in cutlass.range(n):
                if smi[IDS + j] == e:
                    sti(ia(ib, pairof_off + j), p)
                    sti(ia(ib, ptok_off + p), j // A)
                    sti(ia(ib, pslot_off + p), j % A)
                    p += 1


@cute.jit
def op_expert_up(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                 tid: Int32):
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_UP"
    gu = taddr[arg(smi, ARG[A_]["gu"])]
    I, D, x_off, h_off, rows = arg(smi, ARG[A_]["I"]), arg(smi, ARG[A_]["D"]), arg(smi, ARG[A_]["x_off"]), arg(smi, ARG[A_]["h_off"]), arg(smi, ARG[A_]["rows"])
    w, W = arg(smi, ARG[A_]["w"]), arg(smi, ARG[A_]["W"])
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off, ptok_off = arg(smi, ARG[A_]["uniq_off"]), arg(smi, ARG[A_]["pstart_off"]), arg(smi, ARG[A_]["ptok_off"])
    tiles = (I + rows - 1) // rows
    N = nuniq * tiles
    accg = cute.make_rmem_tensor(TB, Float32)
    accu = cute.make_rmem_tensor(TB, Float32)
    for item in cutlass.range(w * N // W, (w + 1) * N // W):  # all items' rows into L2 first (known after ROUTE)
        u, tile = item // tiles, item % tiles
        e = ldi(ia(ib, uniq_off + u))
        r0 = tile * rows
        r1 = cutlass.min(I, r0 + rows)
        for half in cutlass.range_constexpr(2):
            first = (Int64(e) * Int64(2 * I) + Int64(half * I + r0)) * Int64(D) * 2
            prefetch_l2(gu + first, Int64(r1 - r0) * Int64(D) * 2, tid, NT)
    for item in cutlass.range(w * N // W, (w + 1) * N // W):
        u, tile = item // tiles, item % tiles
        e = ldi(ia(ib, uniq_off + u))
        ps, pe = ldi(ia(ib, pstart_off + u)), ldi(ia(ib, pstart_off + u + 1))
        r0 = tile * rows
        r1 = cutlass.min(I, r0 + rows)
        for p0 in cutlass.range(ps, pe, TB):
            for r in cutlass.range(r0 + warp, r1, NW):
                for j in cutlass.range_constexpr(TB):
                    accg[j] = Float32(0.0)
                    accu[j] = Float32(0.0)
                grow = gu + (Int64(e) * Int64(2 * I) + Int64(r)) * Int64(D) * 2
                urow = gu + (Int64(e) * Int64(2 * I) + Int64(I + r)) * Int64(D) * 2
                for k in cutlass.range(lane * 8, D, 256, unroll=4):
                    gv = ld8(BFloat16, grow + Int64(k) * 2)
                    uv = ld8(BFloat16, urow + Int64(k) * 2)
                    for j in cutlass.range_constexpr(TB):
                        if p0 + j < pe:
                            t = ldi(ia(ib, ptok_off + p0 + j))
                            xv = ld8(Float32, fa(fb, x_off + t * D + k))
                            accg[j] += dot8(gv, xv)
                            accu[j] += dot8(uv, xv)
                for j in cutlass.range_constexpr(TB):
                    g = warp_sum(accg[j])
                    up = warp_sum(accu[j])
                    if lane == 0 and p0 + j < pe:
                        stf(Float32, fa(fb, h_off + (p0 + j) * I + r), silu(g) * up)


@cute.jit
def op_expert_down(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                   tid: Int32):
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_DOWN"
    flags = arg(smi, 3)
    dn = taddr[arg(smi, ARG[A_]["dn"])]
    I, D, h_off, y_off, out_off = arg(smi, ARG[A_]["I"]), arg(smi, ARG[A_]["D"]), arg(smi, ARG[A_]["h_off"]), arg(smi, ARG[A_]["y_off"]), arg(smi, ARG[A_]["out_off"])
    r0, r1, B, A = arg(smi, ARG[A_]["r0"]), arg(smi, ARG[A_]["r1"]), arg(smi, ARG[A_]["B"]), arg(smi, ARG[A_]["A"])
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off = arg(smi, ARG[A_]["uniq_off"]), arg(smi, ARG[A_]["pstart_off"])
    wts_off, pairof_off, shared_off = arg(smi, ARG[A_]["wts_off"]), arg(smi, ARG[A_]["pairof_off"]), arg(smi, ARG[A_]["shared_off"])
    acc = cute.make_rmem_tensor(TB, Float32)
    for u in cutlass.range(nuniq):  # every selected expert's rows into L2 first
        e = ldi(ia(ib, uniq_off + u))
        prefetch_l2(dn + (Int64(e) * Int64(D) + Int64(r0)) * Int64(I) * 2, Int64(r1 - r0) * Int64(I) * 2, tid, NT)
    for u in cutlass.range(nuniq):
        e = ldi(ia(ib, uniq_off + u))
        ps, pe = ldi(ia(ib, pstart_off + u)), ldi(ia(ib, pstart_off + u + 1))
        for p0 in cutlass.range(ps, pe, TB):
            for r in cutlass.range(r0 + warp, r1, NW):
                for j in cutlass.range_constexpr(TB):
                    acc[j] = Float32(0.0)
                wrow = dn + (Int64(e) * Int64(D) + Int64(r)) * Int64(I) * 2
                for k in cutlass.range(lane * 8, I, 256, unroll=4):
                    wv = ld8(BFloat16, wrow + Int64(k) * 2)
                    for j in cutlass.range_constexpr(TB):
                        if p0 + j < pe:
                            acc[j] += dot8(wv, ld8(Float32, fa(fb, h_off + (p0 + j) * I + k)))
                for j in cutlass.range_constexpr(TB):
                    s = warp_sum(acc[j])
                    if lane == 0 and p0 + j < pe:
                        stf(Float32, fa(fb, y_off + (p0 + j) * D + r), s)
    cute.arch.sync_threads()
    rows = r1 - r0
    for e in cutlass.range(tid, B * rows, NT):
        t, r = e // rows, r0 + e % rows
        o = fa(fb, out_off + t * D + r)
        v = ldf(Float32, o)
        for a in cutlass.range(A):
            p = ldi(ia(ib, pairof_off + t * A + a))
            v += ldf(Float32, fa(fb, wts_off + t * A + a)) * ldf(Float32, fa(fb, y_off + p * D + r))
        if (flags & F_SHARED) != 0:
            v += ldf(Float32, fa(fb, shared_off + t * D + r))
        stf(Float32, o, v)


@cute.jit
def op_sample(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
              tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    A_ = "SAMPLE"
    flags = arg(smi, 3)
    logits_off, V, b = arg(smi, ARG[A_]["logits_off"]), arg(smi, ARG[A_]["V"]), arg(smi, ARG[A_]["b"])
    inv_t = argf(pb, idx, ARG[A_]["inv_temp_bits"])
    seed = ldi(ia(ib, arg(smi, ARG[A_]["seed_off"])))
    greedy = (flags & F_GREEDY) != 0
    base = logits_off + b * V
    mx, bv, bi = Float32(NEG_INF), Float32(NEG_INF), Int32(V)
    for v in cutlass.range(tid, V, NT):
        lg = ldf(Float32, fa(fb, base + v))
        mx = cute.arch.fmax(mx, lg)
        sc = lg
        if not greedy:
            hv = hash32(Uint32(seed), Uint32(b), Uint32(v))
            uu = (Float32(hv >> 8) + Float32(0.5)) / Float32(16777216.0)
            sc = lg * inv_t - cute.math.log(-cute.math.log(uu))
        if sc > bv:
            bv = sc
            bi = v
    sm[tid] = mx
    sm[NT + tid] = bv
    smi[tid] = bi
    cute.arch.sync_threads()
    if tid == 0:
        for k in cutlass.range(1, NT):
            sm[0] = cute.arch.fmax(sm[0], sm[k])
            if sm[NT + k] > sm[NT] or (sm[NT + k] == sm[NT] and smi[k] < smi[0]):
                sm[NT] = sm[NT + k]
                smi[0] = smi[k]
    cute.arch.sync_threads()
    gmax = sm[0]
    tot = Float32(0.0)
    for v in cutlass.range(tid, V, NT):
        tot += cute.math.exp(ldf(Float32, fa(fb, base + v)) - gmax)
    cute.arch.sync_threads()
    sm[2 * NT + tid] = tot
    cute.arch.sync_threads()
    if tid == 0:
        s = Float32(0.0)
        for k in cutlass.range(NT):
            s += sm[2 * NT + k]
        tok = smi[0]
        sti(ia(ib, arg(smi, ARG[A_]["tok_out_off"]) + b), tok)
        stf(Float32, fa(fb, arg(smi, ARG[A_]["lp_out_off"]) + b), ldf(Float32, fa(fb, base + tok)) - gmax - cute.math.log(s))


# ---- MLA ----------------------------------------------------------------------------------------------------
@cute.jit
def rope_index(i: Int32, half: Int32, interleaved: cutlass.Boolean):
    """(first, second) element of rotation pair i: (2i, 2i + 1) interleaved, else (i, i + half)."""
    a, b = i, i + half
    if interleaved:
        a, b = 2 * i, 2 * i + 1
    return a, b


@cute.jit
def op_mla_kv(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
              tid: Int32):
    warp, lane = tid // 32, tid % 32
    A_ = "MLA_KV"
    flags = arg(smi, 3)
    cache = taddr[arg(smi, ARG[A_]["cache"])]
    kva_off, kva_stride, norm_w = arg(smi, ARG[A_]["kva_off"]), arg(smi, ARG[A_]["kva_stride"]), taddr[arg(smi, ARG[A_]["norm_w"])]
    C, R, b, Lmax = arg(smi, ARG[A_]["C"]), arg(smi, ARG[A_]["R"]), arg(smi, ARG[A_]["b"]), arg(smi, ARG[A_]["Lmax"])
    eps, att, inv = argf(pb, idx, ARG[A_]["eps_bits"]), argf(pb, idx, ARG[A_]["att_bits"]), taddr[arg(smi, ARG[A_]["rope_w"])]
    pos = ldi(ia(ib, arg(smi, ARG[A_]["pos_off"]) + b))
    slot = ldi(ia(ib, arg(smi, ARG[A_]["slot_off"]) + b))
    row = kva_off + b * kva_stride
    if warp == 0:
        ss = Float32(0.0)
        for k in cutlass.range(lane, C, 32):
            x = ldf(Float32, fa(fb, row + k))
            ss += x * x
        ss = warp_sum(ss)
        if lane == 0:
            sm[0] = cute.math.rsqrt(ss / Float32(C) + eps)
    cute.arch.sync_threads()
    rs = sm[0]
    crow = (Int64(slot) * Int64(Lmax) + Int64(pos)) * Int64(C + R)
    for k in cutlass.range(tid, C, NT):
        stf(BFloat16, cache + (crow + Int64(k)) * 2,
            ldf(Float32, fa(fb, row + k)) * rs * ldf(BFloat16, norm_w + Int64(k) * 2))
    half = R // 2
    for i in cutlass.range(tid, half, NT):
        ja, jb = rope_index(i, half, (flags & F_INTERLEAVED) != 0)
        x0, x1 = rope_pair(ldf(Float32, fa(fb, row + C + ja)), ldf(Float32, fa(fb, row + C + jb)), pos,
                           ldf(Float32, inv + Int64(i) * 4), att)
        stf(BFloat16, cache + (crow + Int64(C + ja)) * 2, x0)
        stf(BFloat16, cache + (crow + Int64(C + jb)) * 2, x1)


@cute.jit
def op_mla_q(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    A_ = "MLA_Q"
    flags = arg(smi, 3)
    wkv = taddr[arg(smi, ARG[A_]["wkv"])]
    qb_off, qb_stride, qlat_off, qpe_off = arg(smi, ARG[A_]["qb_off"]), arg(smi, ARG[A_]["qb_stride"]), arg(smi, ARG[A_]["qlat_off"]), \
        arg(smi, ARG[A_]["qpe_off"])
    b, h, H, P, R, C, V = (arg(smi, ARG[A_][n]) for n in ("b", "h", "H", "P", "R", "C", "V"))
    att, inv = argf(pb, idx, ARG[A_]["att_bits"]), taddr[arg(smi, ARG[A_]["rope_w"])]
    pos = ldi(ia(ib, arg(smi, ARG[A_]["pos_off"]) + b))
    q = qb_off + b * qb_stride + h * (P + R)
    for p in cutlass.range(tid, P, NT):
        sm[p] = ldf(Float32, fa(fb, q + p))
    cute.arch.sync_threads()
    for cc in cutlass.range(tid, C, NT):
        acc = Float32(0.0)
        for p in cutlass.range(P):
            acc += sm[p] * ldf(BFloat16, wkv + (Int64(h * (P + V) + p) * Int64(C) + Int64(cc)) * 2)
        stf(Float32, fa(fb, qlat_off + (b * H + h) * C + cc), acc)
    half = R // 2
    for i in cutlass.range(tid, half, NT):
        ja, jb = rope_index(i, half, (flags & F_INTERLEAVED) != 0)
        x0, x1 = rope_pair(ldf(Float32, fa(fb, q + P + ja)), ldf(Float32, fa(fb, q + P + jb)), pos,
                           ldf(Float32, inv + Int64(i) * 4), att)
        stf(Float32, fa(fb, qpe_off + (b * H + h) * R + ja), x0)
        stf(Float32, fa(fb, qpe_off + (b * H + h) * R + jb), x1)


@cute.jit
def op_mla_attn(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    A_ = "MLA_ATTN"
    cache = taddr[arg(smi, ARG[A_]["cache"])]
    qlat_off, qpe_off, part_off = arg(smi, ARG[A_]["qlat_off"]), arg(smi, ARG[A_]["qpe_off"]), arg(smi, ARG[A_]["part_off"])
    b, h0, HB, s, S, H, C, R, Lmax = (arg(smi, ARG[A_][n]) for n in ("b", "h0", "HB", "s", "S", "H", "C", "R", "Lmax"))
    scale = argf(pb, idx, ARG[A_]["scale_bits"])
    pos = ldi(ia(ib, arg(smi, ARG[A_]["pos_off"]) + b))
    slot = ldi(ia(ib, arg(smi, ARG[A_]["slot_off"]) + b))
    QL, QP, SC, ACC = 0, 4096, 4608, 5120
    M, L, AL = 9216, 9232, 9248
    for e in cutlass.range(tid, HB * C, NT):
        hh, cc = e // C, e % C
        sm[QL + e] = ldf(Float32, fa(fb, qlat_off + (b * H + h0 + hh) * C + cc))
        sm[ACC + e] = Float32(0.0)
    for e in cutlass.range(tid, HB * R, NT):
        hh, r = e // R, e % R
        sm[QP + e] = ldf(Float32, fa(fb, qpe_off + (b * H + h0 + hh) * R + r))
    for g in cutlass.range(tid, HB, NT):
        sm[M + g] = Float32(NEG_INF)
        sm[L + g] = Float32(0.0)
    cute.arch.sync_threads()
    Lq = pos + 1
    lo = s * Lq // S
    hi = (s + 1) * Lq // S
    for c0 in cutlass.range(lo, hi, CH):
        n = cutlass.min(CH, hi - c0)
        for e in cutlass.range(tid, HB * CH, NT):
            hh, p = e // CH, e % CH
            sc = Float32(NEG_INF)
            if p < n:
                row = cache + (Int64(slot) * Int64(Lmax) + Int64(c0 + p)) * Int64(C + R) * 2
                sc = Float32(0.0)
                for k in cutlass.range(0, C, 8):
                    sc += dot8(ld8(BFloat16, row + Int64(k) * 2), sm8(sm, QL + hh * C + k))
                for k in cutlass.range(0, R, 8):
                    sc += dot8(ld8(BFloat16, row + Int64(C + k) * 2), sm8(sm, QP + hh * R + k))
                sc = sc * scale
            sm[SC + e] = sc
        cute.arch.sync_threads()
        softmax_chunk(sm, tid, SC, M, L, AL, HB)
        cute.arch.sync_threads()
        for e in cutlass.range(tid, HB * C, NT):
            hh, cc = e // C, e % C
            a = sm[ACC + e] * sm[AL + hh]
            for p in cutlass.range(n):
                row = (Int64(slot) * Int64(Lmax) + Int64(c0 + p)) * Int64(C + R)
                a += sm[SC + hh * CH + p] * ldf(BFloat16, cache + (row + Int64(cc)) * 2)
            sm[ACC + e] = a
        cute.arch.sync_threads()
    for e in cutlass.range(tid, HB * (C + 2), NT):
        hh, j = e // (C + 2), e % (C + 2)
        v = sm[M + hh]
        if j == 1:
            v = sm[L + hh]
        if j >= 2:
            v = sm[ACC + hh * C + j - 2]
        stf(Float32, fa(fb, part_off + ((b * H + h0 + hh) * S + s) * (C + 2) + j), v)


@cute.jit
def op_matvec(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
              tid: Int32):
    op_rows(pb, idx, fb, ib, taddr, sm, smi, tid, False)


@cute.jit
def op_glu(pb: Int64, idx: Int32, fb: Int64, ib: Int64, taddr: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
           tid: Int32):
    op_rows(pb, idx, fb, ib, taddr, sm, smi, tid, True)


# Each opcode's body (the same arguments for all); the persistent loop dispatches on the row's opcode.
BODIES = (("MATVEC", op_matvec), ("GLU", op_glu), ("EMBED", op_embed), ("ATTN_GQA", op_attn_gqa),
          ("MERGE", op_merge), ("ROUTE", op_route), ("EXPERT_UP", op_expert_up), ("EXPERT_DOWN", op_expert_down),
          ("SAMPLE", op_sample), ("MLA_KV", op_mla_kv), ("MLA_Q", op_mla_q), ("MLA_ATTN", op_mla_attn))


# ---- the persistent loop ------------------------------------------------------------------------------------
PLANT = ""  # a deliberate ordering mistake, compiled only by compile_for(plant=...) for the audit's own tests
PLANTS = ("relaxed_signal", "weak_wait")


@cute.jit
def wait_load(p) -> Int32:
    if cutlass.const_expr(PLANT == "weak_wait"):
        return cute.arch.load(p, Int32, sem="relaxed", scope="gpu")
    return cute.arch.load(p, Int32, sem="acquire", scope="gpu")


@cute.jit
def wait_counter(ctr: cute.Tensor, err: cute.Tensor, c_idx: Int32, need: Int32, per: Int32, epoch: Int32,
                 max_spin: Int32, instr: Int32):
    """Thread 0: spin (acquire) until counter c_idx reached this launch's target; on a timeout record it."""
    ok = Int32(1)
    if c_idx >= 0:
        target = (epoch - 1) * per + need
        p = (ctr.iterator + c_idx).llvm_ptr
        v = wait_load(p)
        spins = Int32(0)
        aborted = Int32(0)
        while (v - target) < 0 and spins < max_spin and aborted == 0:
            v = wait_load(p)
            aborted = cute.arch.load(err.iterator.llvm_ptr, Int32, sem="relaxed", scope="gpu")
            spins += 1
        if (v - target) < 0:
            ok = Int32(0)
            if aborted == 0:
                old = cute.arch.atomic_cas(err.iterator.llvm_ptr, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
                if old == 0:
                    err[1] = instr
                    err[2] = c_idx
                    err[3] = v
                    err[4] = target
    return ok


@cute.jit
def nap(max_ns: Int32, a: Int32, b: Int32, c: Int32):
    """Sleep a pseudo-random 0..max_ns ns (the debug build's delays that shake out ordering bugs)."""
    ns = hash32(Uint32(a), Uint32(b), Uint32(c)) % Uint32(max_ns)
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(ns)])


@cute.kernel
def mega_kernel(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor, f32: cute.Tensor,
                i32: cute.Tensor, taddr: cute.Tensor, err: cute.Tensor, max_spin: Int32, tl: cute.Tensor,
                timeline: Int32, delay_ns: Int32):
    """`timeline` != 0: thread 0 records per instruction [wait start, work start, end (globaltimer ns), SM] in tl.
    `delay_ns` > 0: thread 0 sleeps a random 0..delay_ns before the instruction's stores and after its signal."""
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    alloc = SmemAllocator()
    sm = alloc.allocate_tensor(Float32, cute.make_layout(SMEM_F), 16)
    smi = alloc.allocate_tensor(Int32, cute.make_layout(SMEM_I), 16)
    pb = prog.iterator.toint()
    fb = f32.iterator.toint()
    ib = i32.iterator.toint()
    # the launch number (written before the launch): read with acquire like every other read of the counters
    epoch = cute.arch.load(ctr.iterator.llvm_ptr, Int32, sem="acquire", scope="gpu")
    for qi in cutlass.range(qstart[bid], qstart[bid + 1]):
        idx = qorder[qi]
        if tid >= 32 and tid < 32 + ROW:  # warp 1 fetches the row while thread 0 waits
            smi[ROW_S + tid - 32] = prog[idx, tid - 32]
        if tid >= 64:  # warps 2.. stream the static weights into L2 before the wait: the next instruction's
            # (this one's were requested while the previous one ran; the first of the queue's now)
            if qi == qstart[bid]:
                prefetch_row(prog, taddr, idx, tid - 64, NT - 64)
            if qi + 1 < qstart[bid + 1]:
                prefetch_row(prog, taddr, qorder[qi + 1], tid - 64, NT - 64)
        t_wait = Int64(0)
        if tid == 0:
            t_wait = cute.arch.globaltimer()
            ok = wait_counter(ctr, err, prog[idx, 4], prog[idx, 5], prog[idx, 6], epoch, max_spin, idx)
            if ok == 1:
                ok = wait_counter(ctr, err, prog[idx, 7], prog[idx, 8], prog[idx, 9], epoch, max_spin, idx)
            smi[SMEM_I - 1] = ok
            cute.arch.fence_acq_rel_gpu()
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4 + 1)
        cute.arch.sync_threads()
        t_start = Int64(0)
        if tid == 0:
            t_start = cute.arch.globaltimer()
        if smi[SMEM_I - 1] == 1:
            op = prog[idx, 0]
            for k in cutlass.range_constexpr(len(BODIES)):
                if op == OPCODES[BODIES[k][0]]:
                    BODIES[k][1](pb, idx, fb, ib, taddr, sm, smi, tid)
            cute.arch.sync_threads()
            sig = prog[idx, 2]
            if tid == 0 and sig >= 0:
                if cutlass.const_expr(PLANT != "relaxed_signal"):
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="release", scope="gpu")
                else:
                    cute.arch.atomic_add((ctr.iterator + sig).llvm_ptr, Int32(1), sem="relaxed", scope="gpu")
        if tid == 0:
            if timeline != 0:
                tl[4 * idx] = t_wait
                tl[4 * idx + 1] = t_start
                tl[4 * idx + 2] = cute.arch.globaltimer()
                tl[4 * idx + 3] = Int64(cute.arch.smid())
            if delay_ns > 0:
                nap(delay_ns, idx, epoch, bid * 4 + 2)
        cute.arch.sync_threads()


@cute.jit
def launch(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor, f32: cute.Tensor,
           i32: cute.Tensor, taddr: cute.Tensor, err: cute.Tensor, max_spin: Int32, tl: cute.Tensor,
           timeline: Int32, delay_ns: Int32, num_ctas: Int32, stream: cuda_drv.CUstream):
    mega_kernel(prog, qstart, qorder, ctr, f32, i32, taddr, err, max_spin, tl, timeline, delay_ns).launch(
        grid=(num_ctas, 1, 1), block=(NT, 1, 1), stream=stream)


def current_stream_arg():
    """The current torch CUDA stream as the launcher's stream argument (so a step can be graph-captured)."""
    import torch

    return cuda_drv.CUstream(torch.cuda.current_stream().cuda_stream)


@functools.lru_cache(maxsize=4)
def compile_for(plant: str = ""):
    """cute.compile the launcher with fake tensors: no GPU needed. The PTX is in `.__ptx__` (what the static audit
    and the occupancy calculation read; the dump goes to a temporary directory). `plant`: one of PLANTS, a
    deliberate ordering mistake the audit must catch (never launched)."""
    global PLANT
    from cutlass.cute.runtime import make_fake_compact_tensor as fk

    if plant not in ("",) + PLANTS:
        raise ValueError(f"unknown plant {plant!r}; plants: {PLANTS}")
    args = (fk(Int32, (64, ROW)), fk(Int32, (9,)), fk(Int32, (64,)), fk(Int32, (64,)),
            fk(Float32, (4096,), assumed_align=16), fk(Int32, (1024,), assumed_align=16), fk(Int64, (16,)),
            fk(Int32, (8,)), Int32(1 << 20), fk(Int64, (256,)), Int32(0), Int32(0), Int32(8), cuda_drv.CUstream(0))
    dump = tempfile.mkdtemp(prefix="megadecode-cute-")
    PLANT = plant
    try:
        return cute.compile(launch, *args, options=f"--gpu-arch={ARCH} --keep-ptx --dump-dir={dump}", no_cache=True)
    finally:
        PLANT = ""
