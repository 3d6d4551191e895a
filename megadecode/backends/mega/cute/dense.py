"""Rows of a weight against every token (MATVEC, GLU), EMBED, MERGE of split attention, SAMPLE."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint32

from ..isa import F_GREEDY, F_NORM, F_RESID, F_STAGE, F_TC, F_WRITE_NORMED, TC_K
from .base import (
    cta_sync,
    ARG,
    NEG_INF,
    NT,
    NW,
    RING_PAGE,
    RING_S,
    RING_SLOTS,
    SMEM_F,
    TB,
    arg,
    argf,
    args,
    bf16x2_split,
    dot8,
    fa,
    hash32,
    ia,
    ld4u32,
    ld8,
    ld8raw,
    ldf,
    ldi,
    mark,
    free_pages,
    page_wait,
    from_bits,
    lds4u,
    mma,
    sigmoid,
    silu,
    sm8,
    st8f,
    stf,
    sti,
    warp_sum,
)


@cute.jit
def rows_mac(acc: cute.Tensor, acu: cute.Tensor, wq: list, uq: list, k0: Int32, gaddr: Int64, xa: cute.Tensor,
             xb: cute.Tensor, t0: Int32, B: Int32, norm, has_x2, TT: Constexpr, glu: Constexpr):
    """Chunks of 8 columns at k0, k0 + 256, ... (one per entry of wq / uq: raw 16-bit loads of a warp's row(s)) against
    its tokens: the norm weight folded into the rows once for every token (rstd after the sum), then each token's
    x (+ x2) dotted with both rows (GLU: gate and up), chunk after chunk in k order. Every chunk's rows are used in
    the first token's block, so the loads stay ahead of the tokens' branches (the compiler sinks a load used only
    after them to its use, which leaves one chunk's loads in flight at a time)."""
    WU = len(wq)
    ws = []
    us = []
    for u in cutlass.range_constexpr(WU):
        wv = wq[u].to(Float32)
        uv = uq[u].to(Float32)
        if norm:
            gv = ld8(BFloat16, gaddr + Int64(k0 + u * 256) * 2)
            wv = wv * gv
            uv = uv * gv
        ws.append(wv)
        us.append(uv)
    for j in cutlass.range_constexpr(TT):
        if t0 + j < B:
            for u in cutlass.range_constexpr(WU):
                k = k0 + u * 256
                xv = ld8(Float32, xa[j] + Int64(k) * 4)
                if has_x2:
                    xv = xv + ld8(Float32, xb[j] + Int64(k) * 4)
                acc[j] += dot8(ws[u], xv)
                if cutlass.const_expr(glu):
                    acu[j] += dot8(us[u], xv)
                else:
                    acc[TT + j] += dot8(us[u], xv)


WU = 2  # chunks of 256 columns per warp whose weight loads are issued together, TT tokens per pass (row_sums)
WU1 = 4  # the same for one token (batch 1): the registers of the other tokens' sums and x hold the extra chunks


@cute.jit
def row_sums(acc: cute.Tensor, acu: cute.Tensor, w0: Int64, w1: Int64, r: Int32, r1: Int32, K: Int32, lane: Int32,
             gaddr: Int64, xa: cute.Tensor, xb: cute.Tensor, t0: Int32, B: Int32, norm, has_x2, TT: Constexpr,
             glu: Constexpr, NU: Constexpr):
    """row_sums_range over all K columns."""
    row_sums_range(acc, acu, w0, w1, r, r1, K, Int32(0), K, lane, gaddr, xa, xb, t0, B, norm, has_x2, TT, glu, NU)


@cute.jit
def row_sums_range(acc: cute.Tensor, acu: cute.Tensor, w0: Int64, w1: Int64, r: Int32, r1: Int32, K: Int32,
                   kb: Int32, ke: Int32, lane: Int32, gaddr: Int64, xa: cute.Tensor, xb: cute.Tensor, t0: Int32,
                   B: Int32, norm, has_x2, TT: Constexpr, glu: Constexpr, NU: Constexpr):
    """A warp's lane sums of row r (MATVEC: rows r and r + 1, the second clamped to r1 - 1 and not stored past it;
    GLU: gate and up rows r) against tokens t0 .. t0 + TT - 1, NU chunks of 256 columns per iteration with their
    weight loads issued together before the tokens' branches split the block: 2 x NU x 16 B per lane in flight.
    One chunk at a time (1 KB per warp) holds a CTA near 9 GB/s at ~1 us of latency (a fit to an H200 timeline).
    Chunks in k order, so the sums do not depend on NU; the columns past the last full group of NU chunks take the
    one-chunk loop."""
    wrow = w0 + Int64(r) * Int64(K) * 2
    urow = w1 + Int64(r) * Int64(K) * 2
    if cutlass.const_expr(not glu):
        urow = w0 + Int64(cutlass.min(r + 1, r1 - 1)) * Int64(K) * 2  # the pair's second row
    kmain = ke - (ke - kb) % (256 * NU)  # columns [kb, ke) (multiples of 8) of rows of K
    for k0 in cutlass.range(kb + lane * 8, kmain, 256 * NU):
        wq = []
        uq = []
        for u in cutlass.range_constexpr(NU):
            wq.append(ld8raw(BFloat16, wrow + Int64(k0 + u * 256) * 2))
            uq.append(ld8raw(BFloat16, urow + Int64(k0 + u * 256) * 2))  # GLU: up row; MATVEC: 2nd row
        rows_mac(acc, acu, wq, uq, k0, gaddr, xa, xb, t0, B, norm, has_x2, TT, glu)
    for k in cutlass.range(kmain + lane * 8, ke, 256, unroll=4):
        rows_mac(acc, acu, [ld8raw(BFloat16, wrow + Int64(k) * 2)], [ld8raw(BFloat16, urow + Int64(k) * 2)], k,
                 gaddr, xa, xb, t0, B, norm, has_x2, TT, glu)


@cute.jit
def store_rows(acc: cute.Tensor, acu: cute.Tensor, r: Int32, r1: Int32, t0: Int32, B: Int32, lane: Int32,
               sm: cute.Tensor, fb: Int64, flags: Int32, norm, out_off: Int32, out_stride: Int32, out_col: Int32,
               add0: Int32, add1: Int32, RS: Constexpr, TT: Constexpr, RP: Constexpr, glu: Constexpr):
    """The warp's sums of row r (and r + 1 for MATVEC) for tokens t0 .. t0 + TT - 1 reduced over the lanes and
    stored by lane 0: times rstd (a fused norm), GLU's silu(gate) * up, MATVEC's addends and residual."""
    for q in cutlass.range_constexpr(RP):
        rq = r + q
        for j in cutlass.range_constexpr(TT):
            s = warp_sum(acc[q * TT + j])  # every lane: a full-mask shuffle
            su = Float32(0.0)
            if cutlass.const_expr(glu):
                su = warp_sum(acu[j])
            if lane == 0 and t0 + j < B and rq < r1:
                store_one(s, su, rq, t0 + j, sm, fb, flags, norm, out_off, out_stride, out_col, add0, add1, RS, glu)


@cute.jit
def store_one(s: Float32, su: Float32, rq: Int32, tok: Int32, sm: cute.Tensor, fb: Int64, flags: Int32, norm,
              out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32, add1: Int32, RS: Constexpr,
              glu: Constexpr):
    """Row rq's sum s (GLU: gate s and up su) for token tok, finished and stored: times rstd (a fused norm), GLU's
    silu(gate) * up, MATVEC's addends and residual."""
    if norm:
        rs = sm[RS + tok]
        s = s * rs
        su = su * rs
    if cutlass.const_expr(glu):
        s = silu(s) * su
    col = tok * out_stride + out_col + rq
    o = fa(fb, out_off + col)
    if cutlass.const_expr(not glu):  # addends laid out like the output (kimi_k3's block sums)
        if add0 >= 0:
            s += ldf(Float32, fa(fb, add0 + col))
        if add1 >= 0:
            s += ldf(Float32, fa(fb, add1 + col))
    if (flags & F_RESID) != 0:
        s = ldf(Float32, o) + s
    stf(Float32, o, s)


@cute.jit
def tc_step(acc: cute.Tensor, ra: Int64, rb: Int64, ua: Int64, ub: Int64, kb: Int32, t: Int32, xrow: Int64,
            x2row: Int64, gaddr: Int64, norm, has_x2, msk: Uint32, UC: Constexpr, glu: Constexpr):
    """UC consecutive TC_K steps from kb of a warp's 16 rows (ra: row g's bytes, rb: row g + 8's; GLU's up rows
    ua / ub) against 8 tokens on the tensor cores. In step u lane (g, t) takes the 8 consecutive k at
    kb + 32u + 8t in one 16-byte load per row, for 2 mma.sync m16n8k16 whose k are mapped to physical k alike for
    the weights and the input (a sum over k does not depend on which mma holds which k): k + 0..3 are logical k
    2t, 2t + 1, 2t + 8, 2t + 9 of the first, k + 4..7 of the second. The weights' loads of the UC steps are issued
    first, then each step's input: x (+ x2) times the norm weight, split into bf16 pairs hi + lo (isa.tc_input:
    within 2**-16 of the fp32 input), zeroed past the batch (msk); each k half's mma runs against hi, then lo."""
    wa, wb, wua, wub = [], [], [], []
    for u in cutlass.range_constexpr(UC):
        k = kb + 32 * u + 8 * t
        wa.append(ld4u32(ra + Int64(k) * 2))
        wb.append(ld4u32(rb + Int64(k) * 2))
        if cutlass.const_expr(glu):
            wua.append(ld4u32(ua + Int64(k) * 2))
            wub.append(ld4u32(ub + Int64(k) * 2))
    for u in cutlass.range_constexpr(UC):
        k = kb + 32 * u + 8 * t
        xv = ld8(Float32, xrow + Int64(k) * 4)
        if has_x2:
            xv = xv + ld8(Float32, x2row + Int64(k) * 4)
        if norm:
            xv = xv * ld8(BFloat16, gaddr + Int64(k) * 2)
        hi, lo = [], []  # the input as bf16 pairs hi + lo (base.bf16x2_split), both zeroed past the batch
        for i in cutlass.range_constexpr(4):
            ph, pl = bf16x2_split(xv[2 * i], xv[2 * i + 1])
            hi.append(ph & msk)
            lo.append(pl & msk)
        for h in cutlass.range_constexpr(2):  # the step's two k halves: words 2h, 2h + 1 of each row's load
            for p in (hi, lo):  # each half twice: against hi, then lo
                c = mma("bf16", wa[u][2 * h], wb[u][2 * h], wa[u][2 * h + 1], wb[u][2 * h + 1], p[2 * h], p[2 * h + 1],
                        acc[0], acc[1], acc[2], acc[3])
                for i in cutlass.range_constexpr(4):
                    acc[i] = c[i]
                if cutlass.const_expr(glu):
                    c = mma("bf16", wua[u][2 * h], wub[u][2 * h], wua[u][2 * h + 1], wub[u][2 * h + 1], p[2 * h],
                            p[2 * h + 1], acc[4], acc[5], acc[6], acc[7])
                    for i in cutlass.range_constexpr(4):
                        acc[4 + i] = c[i]


TC_UC = 2  # MATVEC's TC_K steps whose weight loads are issued together (64 B a lane, 2 KB a warp); GLU half
# (gate and up rows: as many bytes). 4 at once took the kernel to 158-162 registers (1 CTA per SM)


@cute.jit
def tc_rows(w0: Int64, w1: Int64, K: Int32, r0: Int32, r1: Int32, B: Int32, warp: Int32, lane: Int32, gaddr: Int64,
            fb: Int64, x_off: Int32, x2_off: Int32, x_stride: Int32, norm, has_x2, sm: cute.Tensor, flags: Int32,
            out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32, add1: Int32, RS: Constexpr,
            glu: Constexpr):
    """Rows [r0, r1) against the batch on the tensor cores (F_TC): 8 tokens a pass (the mma's N), 16 rows a warp
    (its M), K in TC_K steps (tc_step). When a round's row groups leave warps free (an instruction of fewer than
    8 x 16 rows), each row group's steps are split over ks warps (k slices), whose sums meet in shared memory (words
    0 .. 2048) and are added in slice order: fixed slices and a fixed order, so the result does not depend on
    timing. Lane (g, t) ends with rows g and g + 8 of its group against tokens 2t and 2t + 1 and stores them."""
    g, t = lane // 4, lane % 4
    nrg = (r1 - r0 + 15) // 16
    nsteps = K // TC_K
    acc = cute.make_rmem_tensor(8, Float32)  # the mma sums: rows (gate) 0..3, GLU's up rows 4..7
    for t0 in cutlass.range(0, B, 8):
        msk = Uint32(0xFFFFFFFF)
        if t0 + g >= B:
            msk = Uint32(0)  # the B operand's column g is past the batch: zeros (a valid row loaded)
        tok = cutlass.min(t0 + g, B - 1)
        xrow = fa(fb, x_off + tok * x_stride)
        x2row = fa(fb, x2_off + tok * x_stride)
        for rb0 in cutlass.range(0, nrg, NW):  # rounds of up to NW row groups (every warp the same rounds)
            nr = cutlass.min(NW, nrg - rb0)
            ks = NW // nr  # k slices per row group
            rg, sl = rb0 + warp % nr, warp // nr
            for i in cutlass.range_constexpr(8):
                acc[i] = Float32(0.0)
            ra = r0 + rg * 16 + g
            if sl < ks:
                rowa = Int64(cutlass.min(ra, r1 - 1)) * Int64(K) * 2  # rows past r1 read row r1 - 1, not stored
                rowb = Int64(cutlass.min(ra + 8, r1 - 1)) * Int64(K) * 2
                s0, s1 = sl * nsteps // ks, (sl + 1) * nsteps // ks
                UC = TC_UC
                if cutlass.const_expr(glu):
                    UC = TC_UC // 2
                smain = s1 - (s1 - s0) % UC
                for s in cutlass.range(s0, smain, UC):
                    tc_step(acc, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s * TC_K, t, xrow, x2row, gaddr, norm,
                            has_x2, msk, UC, glu)
                for s in cutlass.range(smain, s1):  # the slice's last steps, one at a time
                    tc_step(acc, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s * TC_K, t, xrow, x2row, gaddr, norm,
                            has_x2, msk, 1, glu)
            if ks > 1:  # uniform over the CTA
                if sl < ks:
                    for i in cutlass.range_constexpr(8):
                        sm[((sl * nr + warp % nr) * 32 + lane) * 8 + i] = acc[i]
                cta_sync()
                if sl == 0:
                    for i in cutlass.range_constexpr(8):
                        tot = Float32(0.0)
                        for q in cutlass.range(ks):
                            tot += sm[((q * nr + warp % nr) * 32 + lane) * 8 + i]
                        acc[i] = tot
            if sl == 0:
                for h in cutlass.range_constexpr(2):  # rows g, g + 8
                    for j in cutlass.range_constexpr(2):  # tokens 2t, 2t + 1
                        row, tk = ra + 8 * h, t0 + 2 * t + j
                        if row < r1 and tk < B:
                            store_one(acc[2 * h + j], acc[4 + 2 * h + j], row, tk, sm, fb, flags, norm, out_off,
                                      out_stride, out_col, add0, add1, RS, glu)
            if ks > 1:
                cta_sync()  # the partials' words free again


RSTD = SMEM_F - 64  # shared fp32 words: each token's rstd (norm_rstd writes them, the stores read them)
RSTD_PART = RSTD - 64  # partial sums of squares per (token, slice)


@cute.jit
def norm_rstd(sm: cute.Tensor, fb: Int64, x_off: Int32, x2_off: Int32, x_stride: Int32, has_x2, K: Int32, B: Int32,
              eps: Float32, warp: Int32, lane: Int32, tid: Int32):
    """RMSNorm's rstd of each token's x (+ x2) into shared memory words RSTD + t (every thread of the CTA calls it:
    two barriers)."""
    RS, RSP = RSTD, RSTD_PART
    # S warps per token when the batch leaves warps free (batch 1: all 8 on the one row, each a slice of K; one
    # warp walking the whole row takes an L2 round trip per 256 elements: ~14 us at K = 7168);
    # fixed slices and a fixed-order sum, so the result does not depend on timing
    S = NW // cutlass.min(B, NW)
    sl = warp % S
    for t in cutlass.range(warp // S, B, NW // S):
        ss = Float32(0.0)
        for k in cutlass.range((sl * 32 + lane) * 8, K, S * 256, unroll=4):
            xv = ld8(Float32, fa(fb, x_off + t * x_stride + k))
            if has_x2:
                xv = xv + ld8(Float32, fa(fb, x2_off + t * x_stride + k))
            ss += dot8(xv, xv)
        ss = warp_sum(ss)
        if lane == 0:
            sm[RSP + t * S + sl] = ss
    cta_sync()
    for t in cutlass.range(tid, B, NT):
        tot = Float32(0.0)
        for q in cutlass.range(S):
            tot += sm[RSP + t * S + q]
        sm[RS + t] = cute.math.rsqrt(tot / Float32(K) + eps)
    cta_sync()


XS = 0  # staged_rows: the input x (+ x2), times the norm weight, in shared fp32 words [XS, XS + K)


@cute.jit
def stage_input(sm: cute.Tensor, fb: Int64, gaddr: Int64, x_off: Int32, x2_off: Int32, has_x2, norm, K: Int32,
                eps: Float32, warp: Int32, lane: Int32, tid: Int32):
    """staged_rows' prologue, every compute thread: the token's x (+ x2), times the norm weight when it norms, into
    shared words [XS, XS + K), 8 columns a thread a step (one trip for the whole row, instead of one a row pair's
    step); with the norm, the rstd from the same values, as norm_rstd takes it at batch 1 (thread t's sums over
    columns t * 8 + 2048 i, the warps' sums added in warp order): the same bits."""
    ss = Float32(0.0)
    for k in cutlass.range(tid * 8, K, NT * 8, unroll=2):
        xv = ld8(Float32, fa(fb, x_off + k))
        if has_x2:
            xv = xv + ld8(Float32, fa(fb, x2_off + k))
        if norm:
            ss += dot8(xv, xv)
            xv = xv * ld8(BFloat16, gaddr + Int64(k) * 2)
        cute.make_tensor(sm.iterator + XS + k, cute.make_layout(8)).store(xv)
    if norm:
        ss = warp_sum(ss)
        if lane == 0:
            sm[RSTD_PART + warp] = ss
        cta_sync()
        if tid == 0:
            tot = Float32(0.0)
            for q in cutlass.range_constexpr(NW):
                tot += sm[RSTD_PART + q]
            sm[RSTD] = cute.math.rsqrt(tot / Float32(K) + eps)
    cta_sync()


@cute.jit
def bf16x2_dot(w: Uint32, x0: Float32, x1: Float32, s0: Float32, s1: Float32):
    """s0 + w.lo * x0, s1 + w.hi * x1 for a word of two bf16 (the low half the first element): a bf16 is the high
    half of its fp32, so each converts with one shift or mask."""
    return (s0 + from_bits(w << Uint32(16)) * x0, s1 + from_bits(w & Uint32(0xFFFF0000)) * x1)


@cute.jit
def staged_rows(idx: Int32, smi: cute.Tensor, sm: cute.Tensor, fb: Int64, K: Int32, r0: Int32, r1: Int32,
                warp: Int32, lane: Int32, tid: Int32, gaddr: Int64, x_off: Int32, x2_off: Int32, norm, has_x2,
                eps: Float32, flags: Int32, out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32,
                add1: Int32):
    """A batch-1 MATVEC (F_STAGE) whose rows [r0, r1) come through the weight ring (cute/base.py): its static bytes,
    rows in order, are its pages from the instruction's first page (ring word 4): byte e of the rows at ring offset
    (first page's slot x RING_PAGE + e) mod RING_BYTES. The input first, into shared memory (stage_input). Then
    rounds of up to NW row pairs, each round's pages within half the ring (Program.stageable: a pair fits), so the
    next round's pages stream while this one computes: at a round's start thread 0 frees the pages before it (the
    loader refills them); each warp waits for the pages of its pair and sums it against the staged input, 8 columns
    a lane at k, k + 256, ... (even and odd columns in two sums, added at the end), then stores; a block barrier
    ends the round."""
    RP = 2
    acc1 = cute.make_rmem_tensor(RP, Float32)
    acu1 = cute.make_rmem_tensor(1, Float32)
    page0 = smi[RING_S + 4]
    ring = smi[RING_S + 5]
    if tid == 0:
        mark(smi, idx, 0)  # timeline builds: the staged body's start
    stage_input(sm, fb, gaddr, x_off, x2_off, has_x2, norm, K, eps, warp, lane, tid)
    npairs = (r1 - r0 + 1) // 2
    PB = 4 * K  # bytes of a row pair
    L = (r1 - r0) * K * 2
    H = RING_SLOTS // 2
    RB = Uint32(RING_SLOTS * RING_PAGE)
    base = (page0 % RING_SLOTS) * RING_PAGE
    q0 = Int32(0)
    it = Int32(0)
    while q0 < npairs:  # uniform over the CTA
        pa = q0 * PB // RING_PAGE  # the round's first page: every page before it was read by the rounds before
        q1 = cutlass.min(cutlass.min(q0 + NW, npairs), cutlass.max(q0 + 1, (pa + H) * RING_PAGE // PB))
        if tid == 0:
            free_pages(smi, page0 + pa)
        q = q0 + warp
        r = r0 + 2 * q
        if q < q1:
            e0 = q * PB
            e1 = cutlass.min(e0 + PB, L)
            for p in cutlass.range(e0 // RING_PAGE, (e1 - 1) // RING_PAGE + 1):
                page_wait(smi, page0 + p, idx)
            if tid == 0 and it == 0:
                mark(smi, idx, 1)  # thread 0's first pages landed (after the input)
            ea = (r - r0) * K * 2
            eb = ea  # a tile's odd last row: its pair's second row reads the first again, not stored
            if r + 1 < r1:
                eb = ea + K * 2
            oa = Uint32((base + ea + lane * 16) % (RING_SLOTS * RING_PAGE))  # this lane's ring offsets
            ob = Uint32((base + eb + lane * 16) % (RING_SLOTS * RING_PAGE))
            a0, a1, b0, b1 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
            for k in cutlass.range(lane * 8, K, 256, unroll=4):
                wa = lds4u(Int32(Uint32(ring) + oa))
                wb = lds4u(Int32(Uint32(ring) + ob))
                xv = sm8(sm, XS + k)
                for i in cutlass.range_constexpr(4):
                    a0, a1 = bf16x2_dot(wa[i], xv[2 * i], xv[2 * i + 1], a0, a1)
                    b0, b1 = bf16x2_dot(wb[i], xv[2 * i], xv[2 * i + 1], b0, b1)
                oa = cutlass.min(oa + Uint32(512), oa + Uint32(512) - RB)  # + 256 columns, wrapped at the ring's end
                ob = cutlass.min(ob + Uint32(512), ob + Uint32(512) - RB)
            acc1[0] = a0 + a1
            acc1[1] = b0 + b1
            if tid == 0 and it == 0:
                mark(smi, idx, 2)  # thread 0's first pair summed
            store_rows(acc1, acu1, r, r1, Int32(0), Int32(1), lane, sm, fb, flags, norm, out_off, out_stride,
                       out_col, add0, add1, RSTD, 1, RP, False)
        cta_sync()  # the round's pages read: the next round's start may free them
        q0 = q1
        it += 1
    if tid == 0:
        mark(smi, idx, 3)  # every round stored


@cute.jit
def op_rows(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
            tid: Int32, glu: Constexpr):
    warp, lane = tid // 32, tid % 32
    op = "GLU" if glu else "MATVEC"
    flags = arg(smi, 3)
    K, x_off, x_stride = arg(smi, ARG[op]["K"]), arg(smi, ARG[op]["x_off"]), arg(smi, ARG[op]["x_stride"])
    out_off, out_stride, out_col = arg(smi, ARG[op]["out_off"]), arg(smi, ARG[op]["out_stride"]), arg(smi, ARG[op]["out_col"])
    r0, r1, B, norm_w = arg(smi, ARG[op]["r0"]), arg(smi, ARG[op]["r1"]), arg(smi, ARG[op]["B"]), arg(smi, ARG[op]["norm_w"])
    eps = argf(smi, ARG[op]["eps_bits"])
    x2_off = arg(smi, ARG[op]["x2_off"])  # >= 0: the input is x + x2 (kimi_k3: the layer input + attention output)
    has_x2 = x2_off >= 0
    w0 = wtab[arg(smi, ARG[op]["wg" if glu else "w"])]
    w1 = w0
    if cutlass.const_expr(glu):
        w1 = wtab[arg(smi, ARG[op]["wu"])]
    norm = (flags & F_NORM) != 0
    gaddr = w0
    if norm:
        gaddr = wtab[norm_w]
    RS = RSTD  # each token's rstd (norm_rstd)
    # batch 1: the norm after the first rows' sums (below), whose weight loads then start with the body and fly
    # while x's sum of squares is taken (the rstd is applied at the store, the norm weight folded into the rows).
    # Measured on the H200 (qwen3-30b-a3b batch 1), against the norm first: q/k/v instructions 9.5 us against 10.0,
    # the router's 3.1 against 3.6, a layer 98.2 us against 101.6
    if norm and B != 1:
        norm_rstd(sm, fb, x_off, x2_off, x_stride, has_x2, K, B, eps, warp, lane, tid)
    if B == 1 and tid == 0:
        mark(smi, idx, 0)  # timeline builds, batch 1: the arguments read (the norm comes after mark 1; MARKS)
    add0, add1 = Int32(-1), Int32(-1)
    if cutlass.const_expr(not glu):
        add0, add1 = arg(smi, ARG[op]["add0_off"]), arg(smi, ARG[op]["add1_off"])
    # MATVEC: each warp takes two adjacent rows at once (RP = 2): every token's x load then serves 2 x 8 weights
    # instead of 8, which halves the L1 traffic of the activations per weight (at 4 tokens it capped the loop near
    # 3.3 TB/s of weights), and twice the weight loads are in flight per warp. The second row of a warp's pair at
    # the tile's end (odd tiles) reads row r again and is not stored. GLU keeps one row (two weights per row).
    RP = 1 if glu else 2
    TT = TB if glu else 2 * TB  # tokens per pass over the rows: MATVEC reads each weight once up to 8 tokens
    if B == 1 and (flags & F_STAGE) != 0:  # (Program.stageable: MATVEC only)
        if cutlass.const_expr(not glu):
            staged_rows(idx, smi, sm, fb, K, r0, r1, warp, lane, tid, gaddr, x_off, x2_off, norm, has_x2, eps, flags,
                        out_off, out_stride, out_col, add0, add1)
    elif B == 1:
        # one token (a batch-1 step, the headline case): WU1 chunks' weight loads in flight per warp, in the
        # registers the other tokens' sums and x take at TT tokens (a fit to an H200 timeline: ~10 GB/s per CTA with
        # 2 chunks in flight, bytes in flight per SM being the limit). Same k order per row, so the same sums
        acc1 = cute.make_rmem_tensor(RP, Float32)
        acu1 = cute.make_rmem_tensor(1, Float32)
        xa1 = cute.make_rmem_tensor(1, Int64)
        xb1 = cute.make_rmem_tensor(1, Int64)
        xa1[0] = fa(fb, x_off)
        xb1[0] = fa(fb, x2_off)
        nu = (r1 - r0 + RP - 1) // RP  # the warps' row units (MATVEC: pairs)
        ks = 1
        if nu < NW:  # fewer units than warps: each unit's columns split over ks warps, each slice >= 1024 columns
            ks = cutlass.min(NW // nu, cutlass.max(K // 1024, 1))
        if ks == 1:
            for it in cutlass.range((nu + NW - 1) // NW):  # rounds of NW units, the same count on every warp
                r = r0 + (it * NW + warp) * RP
                if r < r1:
                    for j in cutlass.range_constexpr(RP):
                        acc1[j] = Float32(0.0)
                    acu1[0] = Float32(0.0)
                    row_sums(acc1, acu1, w0, w1, r, r1, K, lane, gaddr, xa1, xb1, Int32(0), Int32(1), norm, has_x2,
                             1, glu, WU1)
                    if tid == 0 and it == 0:
                        mark(smi, idx, 1)  # thread 0's first row sums (its loads landed)
                if it == 0 and norm:  # uniform over the CTA: the norm once the first round's loads flew
                    norm_rstd(sm, fb, x_off, x2_off, x_stride, has_x2, K, B, eps, warp, lane, tid)
                if r < r1:
                    store_rows(acc1, acu1, r, r1, Int32(0), Int32(1), lane, sm, fb, flags, norm, out_off,
                               out_stride, out_col, add0, add1, RS, 1, RP, glu)
            if tid == 0:
                mark(smi, idx, 2)  # thread 0's rows summed and stored (no slices: marks 2 and 3 together)
                mark(smi, idx, 3)
        else:
            # k slices (an instruction of fewer rows than warps x RP, the builder's 8-row tiles at batch 1: twice
            # the CTAs on a phase, half the dependent trips per warp). Slice sl of unit u: columns
            # [sl K / ks, (sl + 1) K / ks) in multiples of 8; the slices' sums meet in shared memory words
            # 0 .. NW * (RP + 1) and are added in slice order: fixed slices and order, the result timing-free
            u, sl = warp % nu, warp // nu
            r = r0 + u * RP
            if sl < ks:  # uniform over the warp
                for j in cutlass.range_constexpr(RP):
                    acc1[j] = Float32(0.0)
                acu1[0] = Float32(0.0)
                kb, ke = (sl * (K // 8) // ks) * 8, ((sl + 1) * (K // 8) // ks) * 8
                row_sums_range(acc1, acu1, w0, w1, r, r1, K, kb, ke, lane, gaddr, xa1, xb1, Int32(0), Int32(1), norm,
                               has_x2, 1, glu, WU1)
                if tid == 0:
                    mark(smi, idx, 1)  # thread 0's slice summed
                for j in cutlass.range_constexpr(RP):
                    tot = warp_sum(acc1[j])
                    if lane == 0:
                        sm[(sl * nu + u) * (RP + 1) + j] = tot
                if cutlass.const_expr(glu):
                    tot = warp_sum(acu1[0])
                    if lane == 0:
                        sm[(sl * nu + u) * (RP + 1) + RP] = tot
            if norm:  # uniform over the CTA: the norm once the slices' loads flew
                norm_rstd(sm, fb, x_off, x2_off, x_stride, has_x2, K, B, eps, warp, lane, tid)
            cta_sync()
            if tid == 0:
                mark(smi, idx, 2)  # every slice summed
            if sl == 0 and lane == 0:
                for j in cutlass.range_constexpr(RP):
                    t = Float32(0.0)
                    tu = Float32(0.0)
                    for q in cutlass.range(ks):
                        t += sm[(q * nu + u) * (RP + 1) + j]
                        tu += sm[(q * nu + u) * (RP + 1) + RP]
                    if r + j < r1:
                        store_one(t, tu, r + j, Int32(0), sm, fb, flags, norm, out_off, out_stride, out_col, add0,
                                  add1, RS, glu)
            if tid == 0:
                mark(smi, idx, 3)  # its unit's rows stored
            cta_sync()  # the slices' words (NW x (RP + 1), below RSTD_PART) free again
    elif (flags & F_TC) != 0:  # 2 tokens and more, bf16 rows, K % TC_K == 0 (Builder.tc): the tensor cores
        tc_rows(w0, w1, K, r0, r1, B, warp, lane, gaddr, fb, x_off, x2_off, x_stride, norm, has_x2, sm, flags,
                out_off, out_stride, out_col, add0, add1, RS, glu)
    else:
        acc = cute.make_rmem_tensor(TT * RP, Float32)
        acu = cute.make_rmem_tensor(TT, Float32)
        xa = cute.make_rmem_tensor(TT, Int64)  # each token's row of x (and of x2): 64-bit bases, once per tile
        xb = cute.make_rmem_tensor(TT, Int64)
        for t0 in cutlass.range(0, B, TT):
            for j in cutlass.range_constexpr(TT):
                xa[j] = fa(fb, x_off + (t0 + j) * x_stride)
                xb[j] = fa(fb, x2_off + (t0 + j) * x_stride)
            for r in cutlass.range(r0 + warp * RP, r1, NW * RP):
                for j in cutlass.range_constexpr(TT * RP):
                    acc[j] = Float32(0.0)
                for j in cutlass.range_constexpr(TT):
                    acu[j] = Float32(0.0)
                row_sums(acc, acu, w0, w1, r, r1, K, lane, gaddr, xa, xb, t0, B, norm, has_x2, TT, glu, WU)
                store_rows(acc, acu, r, r1, t0, B, lane, sm, fb, flags, norm, out_off, out_stride, out_col, add0,
                           add1, RS, TT, RP, glu)
    if cutlass.const_expr(not glu):
        if (flags & F_WRITE_NORMED) != 0 and r0 == 0:
            # the normed rows for the experts, 8 columns a thread a unit, NV units' loads issued before any store
            # (an element a thread, a token after another, takes 21 us of the router's phase at qwen3-30b-a3b batch
            # 8 against its other instructions' 10 on the H200). The same operations per element
            normed_off = arg(smi, ARG[op]["normed_off"])
            K8 = K // 8
            NV = 4
            for u0 in cutlass.range(tid, B * K8, NT * NV):
                xs, gs = [], []
                for j in cutlass.range_constexpr(NV):
                    uj = cutlass.min(u0 + j * NT, B * K8 - 1)  # past the rows: the last unit again, not stored
                    t, k = uj // K8, (uj % K8) * 8
                    xv = ld8(Float32, fa(fb, x_off + t * x_stride + k))
                    if has_x2:
                        xv = xv + ld8(Float32, fa(fb, x2_off + t * x_stride + k))
                    xs.append(xv)
                    gs.append(ld8(BFloat16, gaddr + Int64(k) * 2))
                for j in cutlass.range_constexpr(NV):
                    uj = u0 + j * NT
                    if uj < B * K8:
                        t, k = uj // K8, (uj % K8) * 8
                        st8f(fa(fb, normed_off + t * K + k), xs[j] * sm[RS + t] * gs[j])


@cute.jit
def op_embed(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    w, tok_off, out_off = wtab[arg(smi, ARG["EMBED"]["w"])], arg(smi, ARG["EMBED"]["tok_off"]), arg(smi, ARG["EMBED"]["out_off"])
    D, B, c0, c1 = arg(smi, ARG["EMBED"]["D"]), arg(smi, ARG["EMBED"]["B"]), arg(smi, ARG["EMBED"]["c0"]), arg(smi, ARG["EMBED"]["c1"])
    for t in cutlass.range(B):
        tok = ldi(ia(ib, tok_off + t))
        for col in cutlass.range(c0 + tid, c1, NT):
            stf(Float32, fa(fb, out_off + t * D + col), ldf(BFloat16, w + (Int64(tok) * Int64(D) + Int64(col)) * 2))


@cute.jit
def op_merge(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    warp, lane = tid // 32, tid % 32
    A = "MERGE"
    part_off, out_off, out_stride = arg(smi, ARG[A]["part_off"]), arg(smi, ARG[A]["out_off"]), arg(smi, ARG[A]["out_stride"])
    b, h, S, H, d, wuv, dv, P = (arg(smi, ARG[A][n]) for n in ("b", "h", "S", "H", "d", "wuv", "dv", "P"))
    gate_off = arg(smi, ARG[A]["gate_off"])  # >= 0: kimi_k3's output gate, sigmoid per (head, value) element
    obase = out_off + b * out_stride + h * dv
    base = part_off + (b * H + h) * S * (d + 2)
    # each split's max and sum loaded once, by thread s (one trip), its weight exp(max_s - max) into shared memory;
    # then each element's S partials loaded 16 at a time. Every thread loading the S maxima twice and the sums, 8 at
    # a time, makes ~6 dependent trips at S = 16 (4.4 us an instruction at qwen3-30b-a3b batch 1 on the H200). The
    # same operations in the same order (max, then den and num summed over s ascending)
    MS, WS = SMEM_F - 128, SMEM_F - 64  # S <= 64 (Builder.splits)
    for s in cutlass.range(tid, S, NT):
        sm[MS + s] = ldf(Float32, fa(fb, base + s * (d + 2)))
        sm[WS + s] = ldf(Float32, fa(fb, base + s * (d + 2) + 1))
    cta_sync()
    mx = Float32(NEG_INF)
    for s in cutlass.range(S):
        mx = cute.arch.fmax(mx, sm[MS + s])
    den = Float32(0.0)
    for s in cutlass.range(S):
        den += cute.math.exp(sm[MS + s] - mx) * sm[WS + s]
    cta_sync()  # every thread has read the sums: their words take the weights
    for s in cutlass.range(tid, S, NT):
        sm[WS + s] = cute.math.exp(sm[MS + s] - mx)
    cta_sync()
    for dd in cutlass.range(tid, d, NT):
        num = Float32(0.0)
        for s in cutlass.range(S, unroll=16):
            num += sm[WS + s] * ldf(Float32, fa(fb, base + s * (d + 2) + 2 + dd))
        o = num / den
        if wuv < 0:
            if gate_off >= 0:
                o = o * sigmoid(ldf(Float32, fa(fb, gate_off + b * out_stride + h * dv + dd)))
            stf(Float32, fa(fb, obase + dd), o)
        else:
            sm[dd] = o
    if wuv >= 0:  # MLA: the head's value up-projection W_UV [dv, C] on the merged latent
        cta_sync()
        w = wtab[wuv]
        for v in cutlass.range(warp, dv, NW, unroll=2):  # two rows' loads in flight
            wrow = w + Int64(h * (P + dv) + P + v) * Int64(d) * 2
            acc = Float32(0.0)
            for k in cutlass.range(lane * 8, d, 256):
                acc += dot8(ld8(BFloat16, wrow + Int64(k) * 2), sm8(sm, k))
            acc = warp_sum(acc)
            if lane == 0:
                if gate_off >= 0:
                    acc = acc * sigmoid(ldf(Float32, fa(fb, gate_off + b * out_stride + h * dv + v)))
                stf(Float32, fa(fb, obase + v), acc)


@cute.jit
def op_sample(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
              tid: Int32):
    _warp, _lane = tid // 32, tid % 32
    A_ = "SAMPLE"
    flags = arg(smi, 3)
    logits_off, V, b = args(smi, A_, "logits_off V b")
    inv_t = argf(smi, ARG[A_]["inv_temp_bits"])
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
    cta_sync()
    if tid == 0:
        for k in cutlass.range(1, NT):
            sm[0] = cute.arch.fmax(sm[0], sm[k])
            if sm[NT + k] > sm[NT] or (sm[NT + k] == sm[NT] and smi[k] < smi[0]):
                sm[NT] = sm[NT + k]
                smi[0] = smi[k]
    cta_sync()
    gmax = sm[0]
    tot = Float32(0.0)
    for v in cutlass.range(tid, V, NT):
        tot += cute.math.exp(ldf(Float32, fa(fb, base + v)) - gmax)
    cta_sync()
    sm[2 * NT + tid] = tot
    cta_sync()
    if tid == 0:
        s = Float32(0.0)
        for k in cutlass.range(NT):
            s += sm[2 * NT + k]
        tok = smi[0]
        sti(ia(ib, arg(smi, ARG[A_]["tok_out_off"]) + b), tok)
        stf(Float32, fa(fb, arg(smi, ARG[A_]["lp_out_off"]) + b), ldf(Float32, fa(fb, base + tok)) - gmax - cute.math.log(s))


@cute.jit
def op_matvec(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
              smi: cute.Tensor, tid: Int32):
    op_rows(pb, idx, fb, ib, wtab, ptab, sm, smi, tid, False)


@cute.jit
def op_glu(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
           smi: cute.Tensor, tid: Int32):
    op_rows(pb, idx, fb, ib, wtab, ptab, sm, smi, tid, True)
