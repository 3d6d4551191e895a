"""GQA decode attention (norms, RoPE, the cache write and one split of the cache) and the MLA opcodes."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64

from ..isa import F_INTERLEAVED, F_KV_READ, F_KV_WRITE, F_NOPE
from ..limits import MLA_HB
from .base import (
    cta_sync,
    ARG,
    _g,
    CH,
    NEG_INF,
    NT,
    NW,
    SMEM_F,
    arg,
    argf,
    args,
    dot8,
    fa,
    ia,
    ld4bf,
    ld8,
    ld8raw,
    ldf,
    ldi,
    mark,
    rope_index,
    rope_pair,
    sm8,
    softmax_chunk,
    stf,
    warp_sum,
)


@cute.jit
def value_chunk(sm: cute.Tensor, tid: Int32, vbase: Int64, vstride: Int64, n: Int32, W: Int32, NH: Int32,
                SC: Constexpr, ACC: Constexpr, AL: Constexpr, PT: Constexpr):
    """ACC[h, :W] = ACC[h, :W] * AL[h] + sum over the chunk's n positions p of SC[h, p] * V[p, :W] for the NH heads
    (NH <= 16) sharing the value rows V[p] (bf16 at vbase + p * vstride bytes). A task owns 4 columns of 4 heads:
    each value is loaded once per 4 heads as a 4-wide vector. When the (column group, head group) tasks leave
    threads idle, each task is split into PS slices of the positions (p = slice, slice + PS, ...), whose sums go to
    shared memory at PT (PS x NH x W words, which must fit below SMEM_F) and are added in slice order after a
    barrier: fixed slices and a fixed order, so the result does not depend on timing. Why: GQA at d = 128 and 8 q
    heads a KV head has 64 tasks, so without slices 64 of the 256 threads walk all 64 positions, a chain of 16
    rounds of 4 loads (qwen3-30b-a3b at batch 1: 22 us an instruction, 1.4 ms of a 6.0 ms step on the H200)."""
    CG = W // 4
    NHG = (NH + 3) // 4
    T = CG * NHG
    PS = cutlass.max(cutlass.min(cutlass.min(NT // T, 8), (SMEM_F - PT) // (NH * W)), 1)
    acc = cute.make_rmem_tensor(16, Float32)
    vr = cute.make_rmem_tensor(4, Float32)
    for task in cutlass.range(tid, T * PS, NT):
        ps, rest = task // T, task % T
        cg, hg = rest % CG, rest // CG
        for i in cutlass.range_constexpr(16):
            acc[i] = Float32(0.0)
        for p in cutlass.range(ps, n, PS, unroll=4):
            vr.store(ld4bf(vbase + Int64(p) * vstride + Int64(cg * 8)))
            for hq in cutlass.range_constexpr(4):
                wgt = sm[SC + (hg * 4 + hq) * CH + p]  # rows past NH: unused values, never stored
                for i in cutlass.range_constexpr(4):
                    acc[hq * 4 + i] += wgt * vr[i]
        for hq in cutlass.range_constexpr(4):
            hh = hg * 4 + hq
            if hh < NH:
                for i in cutlass.range_constexpr(4):
                    e = hh * W + cg * 4 + i
                    if PS == 1:
                        sm[ACC + e] = sm[ACC + e] * sm[AL + hh] + acc[hq * 4 + i]
                    else:
                        sm[PT + ps * NH * W + e] = acc[hq * 4 + i]
    if PS > 1:  # uniform over the CTA: every thread reaches the barrier
        cta_sync()
        for e in cutlass.range(tid, NH * W, NT):
            tot = Float32(0.0)
            for q in cutlass.range(PS):
                tot += sm[PT + q * NH * W + e]
            sm[ACC + e] = sm[ACC + e] * sm[AL + e // W] + tot


def split_bounds(s: Int32, S: Int32, pos: Int32):
    """Positions [lo, hi) of split s of S over a cache of pos + 1 positions (GQA and MLA attention alike)."""
    Lq = pos + 1
    return s * Lq // S, (s + 1) * Lq // S


@cute.jit
def init_stats(sm: cute.Tensor, tid: Int32, M: Constexpr, L: Constexpr, NH: Int32):
    """The online softmax's state for NH heads: running max -inf, running sum 0."""
    for g in cutlass.range(tid, NH, NT):
        sm[M + g] = Float32(NEG_INF)
        sm[L + g] = Float32(0.0)


@cute.jit
def fold_chunk(sm: cute.Tensor, tid: Int32, vbase: Int64, vstride: Int64, n: Int32, W: Int32, NH: Int32,
               SC: Constexpr, M: Constexpr, L: Constexpr, AL: Constexpr, ACC: Constexpr, PT: Constexpr):
    """A chunk's scores (at SC, written by every thread) folded into the online softmax and the value accumulators
    of NH heads: softmax_chunk, then value_chunk over the chunk's n value rows from vbase (its position slices'
    sums at PT), a barrier around each."""
    cta_sync()
    softmax_chunk(sm, tid, SC, M, L, AL, NH)
    cta_sync()
    value_chunk(sm, tid, vbase, vstride, n, W, NH, SC, ACC, AL, PT)
    cta_sync()


@cute.jit
def store_partial(sm: cute.Tensor, tid: Int32, part: Int32, hb: Int32, s: Int32, S: Int32, NH: Int32, W: Int32,
                  M: Constexpr, L: Constexpr, ACC: Constexpr, fb: Int64):
    """Split s's partial of heads hb .. hb + NH - 1 to the fp32 partials at `part` (per head and split: max, sum,
    then W accumulators), for MERGE."""
    for e in cutlass.range(tid, NH * (W + 2), NT):
        g, j = e // (W + 2), e % (W + 2)
        v = sm[M + g]
        if j == 1:
            v = sm[L + g]
        if j >= 2:
            v = sm[ACC + g * W + j - 2]
        stf(Float32, fa(fb, part + ((hb + g) * S + s) * (W + 2) + j), v)


@cute.jit
def ld4raw(addr: Int64):
    """4 consecutive bf16 (8-byte aligned) as they are: converted where they are used."""
    return cute.make_tensor(_g(addr, BFloat16, 8), cute.make_layout(4)).load()


@cute.jit
def fold_lanes(v: list, lane: Int32, offsets: Constexpr) -> list:
    """Sums of the values v (a power-of-2 count) over the lanes that differ in the bits of `offsets` (each a power
    of 2), spread over those lanes: each step halves the list, the lane with the step's bit set keeping the upper
    half (so after steps o1, o2, ... a lane's value k is the sum of original value k + sum of half_i * bit_i).
    One shuffle per value kept, not one per value and lane as a warp_sum per value would take. The lanes' sums
    are added in a fixed tree, so the result does not depend on timing."""
    for o in cutlass.range_constexpr(len(offsets)):
        off = offsets[o]
        half = len(v) // 2
        up = (lane & off) != 0
        nv = []
        for k in cutlass.range_constexpr(half):
            send = Float32(cutlass.select_(up, v[k], v[k + half]))
            keep = Float32(cutlass.select_(up, v[k + half], v[k]))
            nv.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
        v = nv
    return v


@cute.jit
def gqa_chunk(sm: cute.Tensor, tid: Int32, kc: Int64, vc: Int64, rowb: Int64, rstride: Int64, c0: Int32, n: Int32,
              d: Int32, G: Int32, scale: Float32, Q: Constexpr, SC: Constexpr, M: Constexpr, L: Constexpr,
              AL: Constexpr, ACC: Constexpr):
    """One chunk of n <= CH cache positions from c0 folded into the online softmax of G <= 16 q heads of one KV
    head (d <= 128, a multiple of 8): the chunk's keys and values are loaded at once at the top (gqa_loads), then
    used from registers (gqa_fold). Why: with value_chunk and a score loop of two 128-dim dots a thread, each step's
    loads issue after the last one's arithmetic, ~12 dependent memory trips an instruction (20 us an instruction at
    qwen3-30b-a3b batch 1 on the H200)."""
    kq, vq = gqa_loads(tid, kc, vc, rowb, rstride, c0, n, d)
    gqa_fold(sm, tid, kq, vq, n, d, G, scale, Q, SC, M, L, AL, ACC)


@cute.jit
def gqa_loads(tid: Int32, kc: Int64, vc: Int64, rowb: Int64, rstride: Int64, c0: Int32, n: Int32, d: Int32):
    """A chunk's keys and values (positions c0 .. c0 + n - 1 of one KV head, d <= 128) as gqa_fold takes them, all
    in flight together (32 KB at d = 128: 16 B of keys and 8 x 8 B of values a thread). Keys: 4 threads a
    position, each 8-dim pieces qd, qd + 4, ...; values: a thread 4 dims of 8 positions (slice ps: ps, ps + 8,
    ...). Positions past n read position n - 1 (clamped: every load is valid and unconditional, so all are issued
    before any use)."""
    warp, lane = tid // 32, tid % 32
    # keys: position kp, dims kd + 32u (u = 0..3), clamped to the last 8 (rows shorter than 128: unused pieces)
    kp, qd = tid // 4, tid % 4
    krow = kc + rowb + Int64(c0 + cutlass.min(kp, n - 1)) * rstride
    kq = []
    for u in cutlass.range_constexpr(4):
        kq.append(ld8raw(BFloat16, krow + Int64(cutlass.min(qd * 8 + 32 * u, d - 8)) * 2))
    # values: dims cg * 4 .. + 4 (cg = 4 * warp + lane // 8), positions ps + 8 j (ps = lane % 8)
    ps, cg = lane % 8, warp * 4 + lane // 8
    vcol = Int64(cutlass.min(cg * 4, d - 4)) * 2
    vq = []
    for j in cutlass.range_constexpr(8):
        vq.append(ld4raw(vc + rowb + Int64(c0 + cutlass.min(ps + 8 * j, n - 1)) * rstride + vcol))
    return kq, vq


@cute.jit
def gqa_fold(sm: cute.Tensor, tid: Int32, kq: list, vq: list, n: Int32, d: Int32, G: Int32, scale: Float32,
             Q: Constexpr, SC: Constexpr, M: Constexpr, L: Constexpr, AL: Constexpr, ACC: Constexpr):
    """gqa_loads' chunk of n positions folded into the online softmax of the G q heads at Q. Keys: each thread's
    pieces against every head's q (shared memory), the 4 partial sums of the 16 heads folded over those 4 lanes
    (fold_lanes); positions past n score -inf. Values: per group of 4 heads, a thread's 16 weighted sums folded
    over the 8 slices' lanes."""
    warp, lane = tid // 32, tid % 32
    kp, qd = tid // 4, tid % 4
    ps, cg = lane % 8, warp * 4 + lane // 8
    acc = cute.make_rmem_tensor(16, Float32)
    for i in cutlass.range_constexpr(16):
        acc[i] = Float32(0.0)
    for u in cutlass.range_constexpr(4):
        dd = qd * 8 + 32 * u
        if dd < d:
            kf = kq[u].to(Float32)
            for hg in cutlass.range_constexpr(4):
                if hg * 4 < G:  # uniform: rows past G are read (inside Q) and never stored
                    for hq in cutlass.range_constexpr(4):
                        acc[hg * 4 + hq] += dot8(kf, sm8(sm, Q + (hg * 4 + hq) * d + dd))
    sc = fold_lanes([acc[i] for i in range(16)], lane, (2, 1))  # heads 4 qd .. 4 qd + 3
    for k in cutlass.range_constexpr(4):
        g = qd * 4 + k
        if g < G:
            v = Float32(NEG_INF)
            if kp < n:
                v = sc[k] * scale
            sm[SC + g * CH + kp] = v
    cta_sync()
    softmax_chunk(sm, tid, SC, M, L, AL, G)
    cta_sync()
    for hg in cutlass.range((G + 3) // 4):
        for i in cutlass.range_constexpr(16):
            acc[i] = Float32(0.0)
        for j in cutlass.range_constexpr(8):
            vf = vq[j].to(Float32)
            for hq in cutlass.range_constexpr(4):
                wgt = sm[SC + (hg * 4 + hq) * CH + ps + 8 * j]  # 0 past n (exp(-inf)); rows past G unused
                for i in cutlass.range_constexpr(4):
                    acc[hq * 4 + i] += wgt * vf[i]
        o = fold_lanes([acc[i] for i in range(16)], lane, (4, 2, 1))
        g = hg * 4 + 2 * ((lane >> 2) & 1) + ((lane >> 1) & 1)  # the lane's head of the group (fold_lanes)
        if g < G and cg * 4 < d:
            for k in cutlass.range_constexpr(2):
                e = g * d + cg * 4 + 2 * (lane & 1) + k
                sm[ACC + e] = sm[ACC + e] * sm[AL + g] + o[k]
    cta_sync()


@cute.jit
def op_attn_gqa(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                tid: Int32):
    warp, lane = tid // 32, tid % 32
    A = "ATTN_GQA"
    kc, vc = ptab[arg(smi, ARG[A]["kc"])], ptab[arg(smi, ARG[A]["vc"])]
    qkv_off, qkv_stride = arg(smi, ARG[A]["qkv_off"]), arg(smi, ARG[A]["qkv_stride"])
    qn, kn = wtab[arg(smi, ARG[A]["qn_w"])], wtab[arg(smi, ARG[A]["kn_w"])]
    b, h, s, S, H, KH, d = (arg(smi, ARG[A][n]) for n in ("b", "h", "s", "S", "H", "KH", "d"))
    part_off, Lmax = arg(smi, ARG[A]["part_off"]), arg(smi, ARG[A]["Lmax"])
    scale, eps, att = argf(smi, ARG[A]["scale_bits"]), argf(smi, ARG[A]["eps_bits"]), argf(smi, ARG[A]["att_bits"])
    inv = wtab[arg(smi, ARG[A]["rope_w"])]
    pos = ldi(ia(ib, arg(smi, ARG[A]["pos_off"]) + b))
    slot = ldi(ia(ib, arg(smi, ARG[A]["slot_off"]) + b))
    G = H // KH
    half = d // 2
    Q, SC, ACC = 0, 2048, 3072
    M, L, AL, TMP = 5120, 5136, 5152, 5168
    flags = arg(smi, 3)
    kv_only = (flags & F_KV_WRITE) != 0  # a causal-rows program's write phase: the key and value, nothing else
    writes = kv_only or (s == S - 1 and (flags & F_KV_READ) == 0)
    base = qkv_off + b * qkv_stride
    rowb = (Int64(slot) * Int64(Lmax) * Int64(KH) + Int64(h)) * Int64(d) * 2  # position 0's row of this KV head
    rstride = Int64(KH) * Int64(d) * 2
    lo, hi = split_bounds(s, S, pos)
    # no L2 prefetch of the split's key and value rows before the q heads' norm: gqa_chunk loads them all at once
    # anyway (on the H200 without / with it, ATTN_GQA's phase at qwen3-30b-a3b batch 8 25.1 / 26.8 us, the launch
    # 13179 / 13485 us; batch 1 the same)
    NQ = G
    if kv_only:
        NQ = 0
    for g in cutlass.range(warp, NQ, NW):  # q heads: RMSNorm, each lane's elements and norm weights loaded together
        qrow = base + (h * G + g) * d
        ss = Float32(0.0)
        for dd in cutlass.range(lane, d, 32, unroll=4):
            x = ldf(Float32, fa(fb, qrow + dd))
            sm[Q + g * d + dd] = x * ldf(BFloat16, qn + Int64(dd) * 2)
            ss += x * x
        rs = cute.math.rsqrt(warp_sum(ss) / Float32(d) + eps)
        for dd in cutlass.range(lane, d, 32, unroll=4):  # the lane's own elements: no barrier needed
            sm[Q + g * d + dd] = sm[Q + g * d + dd] * rs
    if warp == 0:  # the k row's rstd
        krow = base + (H + h) * d
        ss = Float32(0.0)
        for dd in cutlass.range(lane, d, 32, unroll=4):
            x = ldf(Float32, fa(fb, krow + dd))
            ss += x * x
        ss = warp_sum(ss)
        if lane == 0:
            sm[TMP] = cute.math.rsqrt(ss / Float32(d) + eps)
    cta_sync()
    if tid == 0:
        mark(smi, idx, 0)  # timeline builds: the arguments, q's norm and k's rstd done
    for e in cutlass.range(tid, NQ * half, NT):  # q heads: RoPE (pairs i, i + d/2)
        g, i = e // half, e % half
        x0, x1 = rope_pair(sm[Q + g * d + i], sm[Q + g * d + i + half], pos, ldf(Float32, inv + Int64(i) * 4),
                           att)
        sm[Q + g * d + i] = x0
        sm[Q + g * d + i + half] = x1
    if writes:  # the split holding the token's own position (or the write phase): its key and value
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
    if not kv_only:
        init_stats(sm, tid, M, L, G)
        for e in cutlass.range(tid, G * d, NT):
            sm[ACC + e] = Float32(0.0)
        cta_sync()
        if tid == 0:
            mark(smi, idx, 1)  # RoPE, the cache write (the last split) and the softmax state done
        for c0 in cutlass.range(lo, hi, CH):
            gqa_chunk(sm, tid, kc, vc, rowb, rstride, c0, cutlass.min(CH, hi - c0), d, G, scale, Q, SC, M, L, AL,
                      ACC)
        if tid == 0:
            mark(smi, idx, 2)  # the split's chunks folded
        store_partial(sm, tid, part_off, b * H + h * G, s, S, G, d, M, L, ACC, fb)
        if tid == 0:
            mark(smi, idx, 3)  # thread 0's partials stored


@cute.jit
def op_mla_kv(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
              tid: Int32):
    warp, lane = tid // 32, tid % 32
    A_ = "MLA_KV"
    flags = arg(smi, 3)
    cache = ptab[arg(smi, ARG[A_]["cache"])]
    kva_off, kva_stride, norm_w = arg(smi, ARG[A_]["kva_off"]), arg(smi, ARG[A_]["kva_stride"]), wtab[arg(smi, ARG[A_]["norm_w"])]
    C, R, b, Lmax = args(smi, A_, "C R b Lmax")
    eps, att, inv = argf(smi, ARG[A_]["eps_bits"]), argf(smi, ARG[A_]["att_bits"]), wtab[arg(smi, ARG[A_]["rope_w"])]
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
    cta_sync()
    rs = sm[0]
    crow = (Int64(slot) * Int64(Lmax) + Int64(pos)) * Int64(C + R)
    for k in cutlass.range(tid, C, NT):
        stf(BFloat16, cache + (crow + Int64(k)) * 2,
            ldf(Float32, fa(fb, row + k)) * rs * ldf(BFloat16, norm_w + Int64(k) * 2))
    half = R // 2
    for i in cutlass.range(tid, half, NT):
        ja, jb = rope_index(i, half, (flags & F_INTERLEAVED) != 0)
        x0, x1 = ldf(Float32, fa(fb, row + C + ja)), ldf(Float32, fa(fb, row + C + jb))
        if (flags & F_NOPE) == 0:  # kimi_k3's NoPE MLA: the rope part is stored unrotated
            x0, x1 = rope_pair(x0, x1, pos, ldf(Float32, inv + Int64(i) * 4), att)
        stf(BFloat16, cache + (crow + Int64(C + ja)) * 2, x0)
        stf(BFloat16, cache + (crow + Int64(C + jb)) * 2, x1)


@cute.jit
def op_mla_q(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    A_ = "MLA_Q"
    flags = arg(smi, 3)
    wkv = wtab[arg(smi, ARG[A_]["wkv"])]
    qb_off, qb_stride, qlat_off, qpe_off = args(smi, A_, "qb_off qb_stride qlat_off qpe_off")
    b, h, H, P, R, C, V = args(smi, A_, "b h H P R C V")
    att, inv = argf(smi, ARG[A_]["att_bits"]), wtab[arg(smi, ARG[A_]["rope_w"])]
    pos = ldi(ia(ib, arg(smi, ARG[A_]["pos_off"]) + b))
    q = qb_off + b * qb_stride + h * (P + R)
    for p in cutlass.range(tid, P, NT):
        sm[p] = ldf(Float32, fa(fb, q + p))
    cta_sync()
    for cc in cutlass.range(tid, C, NT):
        acc = Float32(0.0)
        for p in cutlass.range(P, unroll=32):  # 32 loads in flight (8 make 16 dependent trips a column at P = 128)
            acc += sm[p] * ldf(BFloat16, wkv + (Int64(h * (P + V) + p) * Int64(C) + Int64(cc)) * 2)
        stf(Float32, fa(fb, qlat_off + (b * H + h) * C + cc), acc)
    half = R // 2
    for i in cutlass.range(tid, half, NT):
        ja, jb = rope_index(i, half, (flags & F_INTERLEAVED) != 0)
        x0, x1 = ldf(Float32, fa(fb, q + P + ja)), ldf(Float32, fa(fb, q + P + jb))
        if (flags & F_NOPE) == 0:
            x0, x1 = rope_pair(x0, x1, pos, ldf(Float32, inv + Int64(i) * 4), att)
        stf(Float32, fa(fb, qpe_off + (b * H + h) * R + ja), x0)
        stf(Float32, fa(fb, qpe_off + (b * H + h) * R + jb), x1)


assert NT % CH == 0 and (NT // CH) & (NT // CH - 1) == 0 and NT // CH <= 32  # MLA scores: lanes per position


@cute.jit
def op_mla_attn(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    A_ = "MLA_ATTN"
    cache = ptab[arg(smi, ARG[A_]["cache"])]
    qlat_off, qpe_off, part_off = args(smi, A_, "qlat_off qpe_off part_off")
    b, h0, HB, s, S, H, C, R, Lmax = args(smi, A_, "b h0 HB s S H C R Lmax")
    scale = argf(smi, ARG[A_]["scale_bits"])
    pos = ldi(ia(ib, arg(smi, ARG[A_]["pos_off"]) + b))
    slot = ldi(ia(ib, arg(smi, ARG[A_]["slot_off"]) + b))
    QL, QP, SC, ACC = 0, 4096, 4608, 5120
    M, L, AL = 9216, 9232, 9248
    PT = 9264  # value_chunk's position-slice sums (up to SMEM_F: 3024 words, so only when HB x C <= 1512)
    for e in cutlass.range(tid, HB * C, NT, unroll=8):  # 8 loads in flight (one makes 16 trips at HB x C = 4096)
        hh, cc = e // C, e % C
        sm[QL + e] = ldf(Float32, fa(fb, qlat_off + (b * H + h0 + hh) * C + cc))
        sm[ACC + e] = Float32(0.0)
    for e in cutlass.range(tid, HB * R, NT, unroll=2):
        hh, r = e // R, e % R
        sm[QP + e] = ldf(Float32, fa(fb, qpe_off + (b * H + h0 + hh) * R + r))
    init_stats(sm, tid, M, L, HB)
    cta_sync()
    lo, hi = split_bounds(s, S, pos)
    KS = NT // CH  # 4 threads a cached position, each 8-element chunks j, j + KS, ... of its row
    acc = cute.make_rmem_tensor(MLA_HB, Float32)
    for c0 in cutlass.range(lo, hi, CH):
        n = cutlass.min(CH, hi - c0)
        # a thread per (position, k slice) scores every head of the instruction: each chunk of the cached row is
        # loaded once for the HB heads (a thread per (head, position) loads the row once per head, each task's 72
        # chunks in 9 dependent trips of 8: 60.7 us an MLA_ATTN instruction at k3-mini batch 1 on the H200). The 4
        # slices' sums meet by two butterfly shuffles (a fixed order)
        p, j = tid // KS, tid % KS
        for hh in cutlass.range_constexpr(MLA_HB):
            acc[hh] = Float32(0.0)
        if p < n:
            row = cache + (Int64(slot) * Int64(Lmax) + Int64(c0 + p)) * Int64(C + R) * 2
            for k in cutlass.range(8 * j, C, 8 * KS, unroll=4):
                kv = ld8(BFloat16, row + Int64(k) * 2)
                for hh in cutlass.range_constexpr(MLA_HB):  # heads past HB: row HB - 1 again, never stored
                    acc[hh] += dot8(kv, sm8(sm, QL + cutlass.min(hh, HB - 1) * C + k))
            for k in cutlass.range(8 * j, R, 8 * KS, unroll=2):
                kv = ld8(BFloat16, row + Int64(C + k) * 2)
                for hh in cutlass.range_constexpr(MLA_HB):
                    acc[hh] += dot8(kv, sm8(sm, QP + cutlass.min(hh, HB - 1) * R + k))
        for hh in cutlass.range_constexpr(MLA_HB):
            v = acc[hh]
            for o in cutlass.range_constexpr(2):  # every lane: full-mask shuffles within the position's 4 lanes
                v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << o)
            if j == 0 and hh < HB:
                sc = Float32(NEG_INF)
                if p < n:
                    sc = v * scale
                sm[SC + hh * CH + p] = sc
        fold_chunk(sm, tid, cache + (Int64(slot) * Int64(Lmax) + Int64(c0)) * Int64(C + R) * 2, Int64(C + R) * 2, n,
                   C, HB, SC, M, L, AL, ACC, PT)
    store_partial(sm, tid, part_off, b * H + h0, s, S, HB, C, M, L, ACC, fb)
