"""Routing for the whole batch (ROUTE) and the routed experts (EXPERT_UP, EXPERT_DOWN)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint32

from ..isa import (F_FRAG, F_GROUP, F_MXFP4, F_PAIR1, F_PICKS, F_RENORM, F_ROUTE, F_SHARED, F_SIGMOID, F_SITU,
                   F_STORE, F_TABLES, FRAG_DOWN, FRAG_TILE, GROUP_MAX_E, GROUP_N, GROUP_TILE, TC_K)
from .base import (
    cta_sync,
    ARG,
    RECORD,
    WBYTES,
    FLAG_S,
    NEG_INF,
    NT,
    NW,
    SMEM_F,
    TB,
    arg,
    argf,
    args,
    dot8,
    e2m1x8,
    f16x2_split,
    f32_bits,
    fa,
    frag_block,
    from_bits,
    ia,
    ld4u32,
    ld4w,
    ld8,
    ld8raw,
    ldf,
    ldi,
    lds4,
    ldu8,
    mark,
    mx_scale,
    silu,
    situ,
    stf,
    sti,
    sts1,
    warp_argmax,
    warp_max,
    warp_sum,
)
from .dense import tc_step


@cute.jit
def sig_score(lg: Float32) -> Float32:
    """ROUTE's sigmoid score of a logit (one expression for the scores pass and the picked weights: the same bits)."""
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-lg))


SC_E = 4  # ROUTE's sigmoid scores: experts a thread takes per pass (E = 896 over 256 threads: one pass)


@cute.jit
def block_excl_scan(v: Int32, tid: Int32, smi: cute.Tensor, base: Int32):
    """(sum of v over the threads before this one, sum over all NT threads); NW int words at smi[base] as scratch,
    free again on return. Every thread of the CTA must call it."""
    warp, lane = tid // 32, tid % 32
    inc = v
    for i in cutlass.range_constexpr(5):
        o = cute.arch.shuffle_sync_up(inc, offset=1 << i)
        if lane >= (1 << i):
            inc = inc + o
    if lane == 31:
        smi[base + warp] = inc
    cta_sync()
    before, total = Int32(0), Int32(0)
    for w in cutlass.range_constexpr(NW):
        x = smi[base + w]
        total += x
        if w < warp:
            before += x
    cta_sync()
    return before + inc - v, total


# route_one's shared int words: slot -> expert (RS), pair -> expert (RT); a pick a lane, so 32 each
RS, RT = 0, 32


@cute.jit
def route_one(fb: Int64, ib: Int64, sm: cute.Tensor, smi: cute.Tensor, tid: Int32, idx: Int32, A_: Constexpr,
              write: Int32, marks: Constexpr):
    """One token's routing with softmax scores (E <= NT experts, A <= 32 picks): ROUTE at batch 1, and EXPERT_UP
    under F_ROUTE. Leaves smi[RT + p] = the expert of pair p (pairs in ascending expert order, as ROUTE's tables
    hold them) for the CTA; with `write`, also ROUTE's outputs: ids, wts and the tables. The picks by rank, not one
    warp argmax a pick: thread e counts the experts ahead of expert e (a larger probability, or an equal one at a
    lower index), which is the order the argmax picks take, so the same ids in the same slots; NaN scores (then
    all of them) pick experts 0 .. A - 1, as a stable sort of NaN does (pyvm). The probabilities are ROUTE's
    expressions and the picks' sum is taken in slot order, as its lane 0 adds them: the same bits. Why: ROUTE at
    qwen3-30b-a3b batch 1 took 9.7 us of one CTA a layer on the H200 (docs/megakernel.md; its marks: scores 3.3 us, 8
    argmax picks 2.7, weights 1.9, tables 1.0). Its arguments are read here from the row of opcode A_ (ROUTE's, or
    EXPERT_UP's copy of them): passed in from an EXPERT_UP body they stayed live across it, and ptxas then gave the
    kernel 244 registers a thread (one CTA an SM) where it gives 128."""
    warp, lane = tid // 32, tid % 32
    logits_off, E, A = args(smi, A_, "logits_off E A")
    if warp == 0:
        mx = Float32(NEG_INF)
        for e in cutlass.range(lane, E, 32, unroll=4):
            lv = ldf(Float32, fa(fb, logits_off + e))
            sm[e] = lv
            mx = cute.arch.fmax(mx, lv)
        mx = warp_max(mx)
        tot = Float32(0.0)
        for e in cutlass.range(lane, E, 32, unroll=4):
            tot += cute.math.exp(sm[e] - mx)
        tot = warp_sum(tot)
        for e in cutlass.range(lane, E, 32, unroll=4):
            sm[e] = cute.math.exp(sm[e] - mx) / tot
    if tid < 32:
        smi[RS + tid] = E  # no pick yet
    cta_sync()
    if cutlass.const_expr(marks):
        if tid == 0:
            mark(smi, idx, 0)  # timeline builds: the scores
    if tid < E:
        v = sm[tid]
        rank = Int32(0)
        for j in cutlass.range(E, unroll=8):
            u = sm[j]
            if u > v or (u == v and j < tid):
                rank += 1
        if v == v and rank < A:
            smi[RS + rank] = tid
    cta_sync()
    if cutlass.const_expr(marks):
        if tid == 0:
            mark(smi, idx, 1)  # the picks
    if warp == 0:
        pe = E
        wv = Float32(0.0)
        if lane < A:
            pe = smi[RS + lane]
            if smi[RS] == E:  # no pick (NaN scores): experts 0 .. A - 1
                pe = lane
            wv = sm[pe]
        tot = Float32(0.0)
        for a in cutlass.range(A):
            tot += cute.arch.shuffle_sync(wv, a)
        if (arg(smi, 3) & F_RENORM) != 0:
            wv = wv / tot
        pos = Int32(0)  # the pick's pair: the picks of lower id before it
        for k in cutlass.range(A):
            if cute.arch.shuffle_sync(pe, k) < pe:
                pos += 1
        if lane < A:
            smi[RT + pos] = pe
            if write != 0:
                ids_off, wts_off, nuniq_off, uniq_off = args(smi, A_, "ids_off wts_off nuniq_off uniq_off")
                pstart_off, qst_off, ptok_off = args(smi, A_, "pstart_off qst_off ptok_off")
                pslot_off, pairof_off = args(smi, A_, "pslot_off pairof_off")
                sti(ia(ib, ids_off + lane), pe)
                stf(Float32, fa(fb, wts_off + lane), wv * argf(smi, ARG[A_]["scale_bits"]))
                sti(ia(ib, uniq_off + pos), pe)
                sti(ia(ib, pstart_off + pos), pos)
                sti(ia(ib, qst_off + pos), pos)
                sti(ia(ib, pairof_off + lane), pos)
                sti(ia(ib, ptok_off + pos), Int32(0))
                sti(ia(ib, pslot_off + pos), lane)
        if lane == 0 and write != 0:
            sti(ia(ib, arg(smi, ARG[A_]["pstart_off"]) + A), A)
            sti(ia(ib, arg(smi, ARG[A_]["qst_off"]) + A), A)
            sti(ia(ib, arg(smi, ARG[A_]["nuniq_off"])), A)
        if cutlass.const_expr(marks):
            if tid == 0:
                mark(smi, idx, 2)  # the weights
    cta_sync()
    if cutlass.const_expr(marks):
        if tid == 0:
            mark(smi, idx, 3)  # the tables


@cute.jit
def op_route(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
             tid: Int32):
    """One token with softmax scores (a qwen3-moe batch-1 step, where the lowering keeps a ROUTE phase): route_one;
    else every token's scores, picks and weights, then the tables (route_batch)."""
    A_ = "ROUTE"
    E, A, B = args(smi, A_, "E A B")
    if B == 1 and (arg(smi, 3) & F_SIGMOID) == 0 and arg(smi, ARG[A_]["n_group"]) <= 1 and E <= NT and A <= 32:
        route_one(fb, ib, sm, smi, tid, idx, "ROUTE", Int32(1), True)
    else:
        route_batch(pb, idx, fb, ib, wtab, ptab, sm, smi, tid)


@cute.jit
def route_batch(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
                smi: cute.Tensor, tid: Int32):
    warp, lane = tid // 32, tid % 32
    A_ = "ROUTE"
    flags = arg(smi, 3)
    logits_off, E, A, B = args(smi, A_, "logits_off E A B")
    bias_w, G, TG = args(smi, A_, "bias_w n_group topk_group")
    scale = argf(smi, ARG[A_]["scale_bits"])
    ids_off, wts_off = args(smi, A_, "ids_off wts_off")
    sigmoid = (flags & F_SIGMOID) != 0
    # a warp's token region: softmax, the probabilities (SCW) and the choice values (CHW, -inf once picked or
    # masked) apart; sigmoid, the choice values (score + bias) alone, a pick's score recomputed from its logit (the
    # same expression on the same value: the same bits). Why: with both, a region of 2 E + 32 words left room for 6
    # tokens a round at K3's 896 experts, so batch 8 took two rounds of scores and picks (k3-mini: ROUTE 47 us a
    # layer at batch 8, 29 at batch 1, on the H200)
    region = 2 * E + 32
    if sigmoid:
        region = E + 32
    nwu = cutlass.min(NW, SMEM_F // region)  # warps with room for their token's scores
    SCW = warp * region  # the warp's token's probabilities (softmax)
    CHW = SCW + E  # the choice values
    if sigmoid:
        CHW = SCW
    PK = CHW + E  # the picked weights
    T0, T1 = Int32(0), B  # the tokens whose scores, picks and weights this instruction makes (F_PICKS: [t0, t1))
    if (flags & F_PICKS) != 0:
        T0, T1 = args(smi, A_, "t0 t1")
    if (flags & F_TABLES) == 0:  # F_TABLES: the picks are in ids already (the F_PICKS phase before)
        for t0 in cutlass.range(T0, T1, nwu):  # rounds of up to nwu tokens: a score region and a warp each
            nr = cutlass.min(nwu, T1 - t0)
            if sigmoid:  # the round's sigmoid scores by every thread of the CTA, not the token's warp alone
                # A thread takes up to SC_E experts a pass: their bias values loaded once for the round's tokens, then
                # the logits of 2 tokens at a time, every load of a group issued before any is used. Why: a thread per
                # (token, expert) item loads each item's logit, tensor-table entry and bias one after the other
                # (3 dependent global loads an item): ~1.5 us an item, 10.4 us a layer at k3-mini batch 1 and 44.7 at
                # batch 8 (the kernel's marks on the H200). The same operations per score, so the same values.
                bias_base = fa(fb, logits_off)  # a valid address when there is no bias (its loads are not used)
                if bias_w >= 0:
                    bias_base = wtab[bias_w]
                for e0 in cutlass.range(tid, E, NT * SC_E):
                    es = [cutlass.min(e0 + NT * u, E - 1) for u in range(SC_E)]  # past E: expert E - 1, not stored
                    bv = [ldf(Float32, bias_base + Int64(es[u]) * 4) for u in range(SC_E)]
                    for r0 in cutlass.range(0, nr, 2):
                        rr = [r0, cutlass.min(r0 + 1, nr - 1)]  # past the round: its last token again, not stored
                        lg = [[ldf(Float32, fa(fb, logits_off + (t0 + rr[h]) * E + es[u])) for u in range(SC_E)]
                              for h in range(2)]
                        for h in cutlass.range_constexpr(2):
                            for u in cutlass.range_constexpr(SC_E):
                                if e0 + NT * u < E and r0 + h < nr:
                                    ch = sig_score(lg[h][u])
                                    if bias_w >= 0:
                                        ch = ch + bv[u]
                                    sm[rr[h] * region + es[u]] = ch  # the token's CHW
                cta_sync()
            if warp < nr:
                t = t0 + warp
                lrow = logits_off + t * E
                if not sigmoid:  # softmax: the token's warp (a max and a sum over its row). The row is loaded once,
                    # into the warp's score words (each lane reads back only its own), not in each of the 3 passes
                    # (3 dependent trips: ROUTE's scores 3.6 us a layer at qwen3-30b-a3b batch 1 on the H200)
                    mx = Float32(NEG_INF)
                    for e in cutlass.range(lane, E, 32, unroll=4):
                        lv = ldf(Float32, fa(fb, lrow + e))
                        sm[SCW + e] = lv
                        mx = cute.arch.fmax(mx, lv)
                    mx = warp_max(mx)
                    tot = Float32(0.0)
                    for e in cutlass.range(lane, E, 32, unroll=4):
                        tot += cute.math.exp(sm[SCW + e] - mx)
                    tot = warp_sum(tot)
                    for e in cutlass.range(lane, E, 32, unroll=4):
                        pv = cute.math.exp(sm[SCW + e] - mx) / tot
                        sm[SCW + e] = pv
                        sm[CHW + e] = pv
                cute.arch.sync_warp()
                if tid == 0:
                    mark(smi, idx, 0)  # timeline builds: thread 0's token's scores done
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
                    # 4 candidates' shared-memory loads issued together, then compared in order (one load, its
                    # compare, the next load would make ~28 dependent trips per lane per pick at E = 896, 16 picks per
                    # token; an unrolled range keeps a bounds branch after every load). Past E: expert E - 1 read, never
                    # picked
                    for e0 in cutlass.range(lane, E, 128):
                        vs = []
                        for u in cutlass.range_constexpr(4):
                            vs.append(sm[CHW + cutlass.min(e0 + 32 * u, E - 1)])
                        for u in cutlass.range_constexpr(4):
                            if e0 + 32 * u < E and vs[u] > bv:
                                bv = vs[u]
                                bi = e0 + 32 * u
                    bv, bi = warp_argmax(bv, bi)
                    if bi == E:  # no ordered value left (NaN scores): the lowest-index NaN not yet picked, so the ids
                        # stay experts (id E would send EXPERT_UP past the expert tensors); every score NaN then picks
                        # experts 0 .. A - 1 as pyvm's stable sort does
                        ni = Int32(E)
                        for e in cutlass.range(lane, E, 32):
                            v = sm[CHW + e]
                            if v != v and ni == E:
                                ni = e
                        for k in cutlass.range_constexpr(5):
                            ni = cutlass.min(ni, cute.arch.shuffle_sync_bfly(ni, offset=1 << k))
                        bi = cutlass.min(ni, E - 1)
                    if lane == 0:
                        sti(ia(ib, ids_off + t * A + a), bi)
                        pe = bi
                        if sigmoid:
                            sm[PK + a] = Float32(pe)  # the pick's id, its score computed after the picks
                        else:
                            sm[PK + a] = sm[SCW + pe]
                        sm[CHW + bi] = Float32(NEG_INF)
                    cute.arch.sync_warp()
                if sigmoid:  # the picks' scores from their logits, a lane each: one trip for all A, not one a pick
                    for a in cutlass.range(lane, A, 32):
                        sm[PK + a] = sig_score(ldf(Float32, fa(fb, lrow + Int32(sm[PK + a]))))
                    cute.arch.sync_warp()
                if tid == 0:
                    mark(smi, idx, 1)  # its A picks done
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
            cta_sync()  # the round's regions are free again
    if tid == 0:
        mark(smi, idx, 2)  # every token's picks and weights (the warps' last token)
    if (flags & F_PICKS) == 0:  # F_PICKS: the tables are the next phase's (F_TABLES)
        route_table_part(ib, sm, smi, tid, idx, A, B, E, ids_off)


@cute.jit
def route_table_part(ib: Int64, sm: cute.Tensor, smi: cute.Tensor, tid: Int32, idx: Int32, A: Int32, B: Int32,
                     E: Int32, ids_off: Int32):
    """ROUTE's tables from the B tokens' picks in ids (the single-token fast path, else route_tables)."""
    A_ = "ROUTE"
    warp, lane = tid // 32, tid % 32
    # the (token, slot) pairs grouped by expert, experts ascending, pairs in (token, slot) order
    nuniq_off, uniq_off, pstart_off = args(smi, A_, "nuniq_off uniq_off pstart_off")
    ptok_off, pslot_off, pairof_off = args(smi, A_, "ptok_off pslot_off pairof_off")
    qst_off = arg(smi, ARG[A_]["qst_off"])
    n = B * A
    # one token (a batch-1 step) whose picks are distinct experts, as top-k picks are (checked: a pick with no
    # ordered or NaN score left repeats expert E - 1): warp 0 writes the tables at once, a lane a pick, its place
    # being the number of picks of lower id; every expert holds one pair and one pass. The same tables as the
    # general path below (experts ascending), without its zeroing of E counts, its 3 block scans and 4 CTA barriers
    # (ROUTE's marks at qwen3-30b-a3b batch 1 on the H200 for the general path: counts and table 3.0 us, pair lists
    # 1.5 of its 11.3)
    fast = Int32(0)
    if B == 1 and n <= 32:  # uniform over the CTA
        if warp == 0:
            pe = E
            if lane < n:
                pe = ldi(ia(ib, ids_off + lane))
            pos, dup = Int32(0), Int32(0)
            for k in cutlass.range(n):
                v = cute.arch.shuffle_sync(pe, k)
                if v < pe:
                    pos += 1
                if v == pe and k != lane:
                    dup = 1
            if cute.arch.vote_all_sync(dup == 0):
                if lane < n:
                    sti(ia(ib, uniq_off + pos), pe)
                    sti(ia(ib, pstart_off + pos), pos)
                    sti(ia(ib, qst_off + pos), pos)
                    sti(ia(ib, pairof_off + lane), pos)
                    sti(ia(ib, ptok_off + pos), Int32(0))
                    sti(ia(ib, pslot_off + pos), lane)
                if lane == 0:
                    sti(ia(ib, pstart_off + n), n)
                    sti(ia(ib, qst_off + n), n)
                    sti(ia(ib, nuniq_off), n)
                    smi[FLAG_S] = Int32(1)
            elif lane == 0:
                smi[FLAG_S] = Int32(0)
        cta_sync()
        fast = smi[FLAG_S]
        if tid == 0:
            mark(smi, idx, 3)
    if fast == 0:
        route_tables(ib, sm, smi, tid, E, A, B, n, ids_off, nuniq_off, uniq_off, pstart_off, qst_off, ptok_off,
                     pslot_off, pairof_off, idx)


@cute.jit
def route_tables(ib: Int64, sm: cute.Tensor, smi: cute.Tensor, tid: Int32, E: Int32, A: Int32, B: Int32, n: Int32,
                 ids_off: Int32, nuniq_off: Int32, uniq_off: Int32, pstart_off: Int32, qst_off: Int32,
                 ptok_off: Int32, pslot_off: Int32, pairof_off: Int32, idx: Int32):
    """ROUTE's tables from the picks in ids: the (token, slot) pairs grouped by expert, experts ascending, pairs in
    (token, slot) order; each expert's pair and pass prefix."""
    CNT, START = 0, E  # int words 0 .. 2E (below BODY_I, where the instruction rows start)
    RK = n  # float words n .. 2n: each pick's rank among the earlier picks of its expert (kernel_check: 2n fit)
    for j in cutlass.range(tid, n, NT):  # the picked ids, as exact small floats in the (now free) score space
        sm[j] = Float32(ldi(ia(ib, ids_off + j)))
    for e in cutlass.range(tid, E, NT):
        smi[CNT + e] = Int32(0)
    cta_sync()
    # a thread per pick: its rank among the earlier picks of the same expert, and the expert's count written by its
    # last pick (exactly one pick per selected expert has no later one). Not a thread per expert scanning all n
    # picks for its count and again for its pair list, E / NT experts a thread: that is 3.5 x 2 x 128 compares a
    # thread at k3-mini batch 8 (ROUTE's marks put such counts and pair lists at 9.4 + 22.0 us of its 98 us on the
    # H200). The same lists: pairs of an expert in pick order
    for j in cutlass.range(tid, n, NT):
        pe = sm[j]
        rank, later = Int32(0), Int32(0)
        for k in cutlass.range(n, unroll=8):
            if sm[k] == pe:
                if k < j:
                    rank += 1
                if k > j:
                    later += 1
        sm[RK + j] = Float32(rank)
        if later == 0:
            smi[CNT + Int32(pe)] = rank + 1
    cta_sync()
    # every thread a run of consecutive experts: its counts of selected experts, pairs and passes, scanned over the
    # CTA for where its run starts (one thread walking all E experts takes ~10 us at E = 896)
    per = (E + NT - 1) // NT
    e0 = cutlass.min(E, tid * per)
    e1 = cutlass.min(E, e0 + per)
    nu, npairs, nq = Int32(0), Int32(0), Int32(0)
    for e in cutlass.range(e0, e1):
        c = smi[CNT + e]
        if c > 0:
            nu += 1
            npairs += c
            nq += (c + TB - 1) // TB
    SCAN = 2 * E  # 3 x NW int words after CNT and START (kernel_check keeps them below the row)
    u, tu = block_excl_scan(nu, tid, smi, SCAN)
    start, tp = block_excl_scan(npairs, tid, smi, SCAN + NW)
    q, tq = block_excl_scan(nq, tid, smi, SCAN + 2 * NW)
    for e in cutlass.range(e0, e1):
        c = smi[CNT + e]
        if c > 0:
            sti(ia(ib, uniq_off + u), e)
            sti(ia(ib, pstart_off + u), start)
            sti(ia(ib, qst_off + u), q)
            smi[START + e] = start
            start += c
            q += (c + TB - 1) // TB
            u += 1
    if tid == 0:
        sti(ia(ib, pstart_off + tu), tp)
        sti(ia(ib, qst_off + tu), tq)
        sti(ia(ib, nuniq_off), tu)
    cta_sync()
    if tid == 0:
        mark(smi, idx, 3)  # the counts, scans and expert table; the pair lists follow
    for j in cutlass.range(tid, n, NT):  # each pick's place in its expert's pair list
        p = smi[START + Int32(sm[j])] + Int32(sm[RK + j])
        sti(ia(ib, pairof_off + j), p)
        sti(ia(ib, ptok_off + p), j // A)
        sti(ia(ib, pslot_off + p), j % A)


# rows a warp streams at once in a single-pair MXFP4 pass (up_mx_rows1: gate and up each; down_mx_rows1); the
# accumulators hold TB. EXPERT_UP at 4 rows took the kernel to 192 registers (1 CTA per SM)
RW_UP, RW_DN = 2, 4
assert max(RW_UP, RW_DN) <= TB
# bf16 rows a unit of the one-pair paths: EXPERT_DOWN's flat (pair, RU_DN adjacent rows) units; EXPERT_UP's RU_UP
# rows a warp (r, r + NW, ...) with WU_UP chunks of their gate and up rows in flight a lane. Each loads a chunk of the
# pair's fp32 activation once for all its rows: with one row a load the activation bytes equal the weight bytes
# (the sizes as measured on the H200: docs/megakernel.md, "The one-pair expert bodies")
RU_DN, RU_UP, WU_UP = 8, 2, 2
# EXPERT_DOWN's flat bf16 units: WU_DN chunks of 256 columns of the unit's rows in flight a lane (1: one chunk)
WU_DN = 1
# bf16 EXPERT_DOWN takes the flat units up to this many pairs an expert on average. Measured on the H200
# (qwen3-30b-a3b, bench/mega_body_ab.py): with (pair, 8 row) units the flat path is 58.8 against the loop's 66.3 ms
# a step at batch 64 (4.1 pairs an expert), no slower at 1-16; with (pair, 2 row) units it lost at batch 64
FLAT_PAIRS = 8


@cute.jit
def up_rows_multi(acc: cute.Tensor, gbase: Int64, rowb: Int64, I: Int32, r: Int32, r1: Int32, D: Int32, xa: Int64,
                  lane: Int32):
    """acc[2 i], acc[2 i + 1] += this lane's products of gate and up row r + i NW (i < RU_UP; a row past r1 reads
    row r1 - 1) of one expert's bf16 [2 I, D] block at gbase with x (fp32 at xa) (up_rows_at)."""
    ris = [Int64(cutlass.min(r + i * NW, r1 - 1)) for i in range(RU_UP)]
    up_rows_at(acc, [gbase + (ris[j // 2] + Int64(I * (j % 2))) * rowb for j in range(2 * RU_UP)], D, xa, lane)


@cute.jit
def up_rows_at(acc: cute.Tensor, rows: list, D: Int32, xa: Int64, lane: Int32):
    """acc[j] += this lane's products of bf16 row rows[j] (addresses: gate, up, gate, ... RU_UP pairs) with x (fp32
    at xa): WU_UP chunks of 256 columns of all the rows in flight, each chunk of x loaded once for them; the lane's
    chunks in k order."""
    kmain = D - D % (256 * WU_UP)
    for k0 in cutlass.range(lane * 8, kmain, 256 * WU_UP):
        wq = [[ld8raw(BFloat16, rows[j] + Int64(k0 + u * 256) * 2) for j in range(2 * RU_UP)] for u in range(WU_UP)]
        for u in cutlass.range_constexpr(WU_UP):
            xv = ld8(Float32, xa + Int64(k0 + u * 256) * 4)
            for j in cutlass.range_constexpr(2 * RU_UP):
                acc[j] += dot8(wq[u][j].to(Float32), xv)
    for k in cutlass.range(kmain + lane * 8, D, 256):
        wq = [ld8raw(BFloat16, rows[j] + Int64(k) * 2) for j in range(2 * RU_UP)]
        xv = ld8(Float32, xa + Int64(k) * 4)
        for j in cutlass.range_constexpr(2 * RU_UP):
            acc[j] += dot8(wq[j].to(Float32), xv)


@cute.jit
def up_mx_rows1(gu: Int64, gus: Int64, gbase: Int64, rb: Int32, r1: Int32, I: Int32, rowb: Int64, D: Int32,
                x0: Int32, fb: Int64, lane: Int32, accg: cute.Tensor, accu: cute.Tensor, wr: cute.Tensor):
    """Gate and up MXFP4 rows rb, rb + NW, ... (RW_UP of them; a row past r1 reads row r1 - 1, not stored) of one
    expert (rows from gbase) against one pair's x (from element x0). Per lane and iteration every row's block of 32
    weights is loaded before the first is used, and each 8 values of x once for all the rows: a loop that waits for
    one row's block at a time is bound by latency, not bytes (218 us an instruction in an H200 timeline)."""
    for k in cutlass.range(lane * 32, D, 1024):
        gq, uq, gsc, usc = [], [], [], []
        for i in cutlass.range_constexpr(RW_UP):
            g = gbase + Int64(cutlass.min(rb + i * NW, r1 - 1))
            gq.append(ld4u32(gu + g * rowb + Int64(k // 2)))
            uq.append(ld4u32(gu + (g + Int64(I)) * rowb + Int64(k // 2)))
            gsc.append(ldu8(gus + g * Int64(D // 32) + Int64(k // 32)))
            usc.append(ldu8(gus + (g + Int64(I)) * Int64(D // 32) + Int64(k // 32)))
        pg, pu = [], []  # each row's block sums, scaled once per block (mx_scale)
        for s8 in cutlass.range_constexpr(4):
            xv = ld8(Float32, fa(fb, x0 + k + 8 * s8))
            for i in cutlass.range_constexpr(RW_UP):
                e2m1x8(gq[i][s8], wr)
                g = dot8(wr.load(), xv)
                e2m1x8(uq[i][s8], wr)
                u = dot8(wr.load(), xv)
                if cutlass.const_expr(s8 == 0):
                    pg.append(g)
                    pu.append(u)
                else:
                    pg[i] = pg[i] + g
                    pu[i] = pu[i] + u
        for i in cutlass.range_constexpr(RW_UP):
            accg[i] += mx_scale(pg[i], gsc[i])
            accu[i] += mx_scale(pu[i], usc[i])


@cute.jit
def down_mx_rows1(dn: Int64, dns: Int64, dbase: Int64, rb: Int32, r1: Int32, rowb: Int64, I: Int32, fb: Int64,
                  h0: Int32, lane: Int32, acc: cute.Tensor, wr: cute.Tensor):
    """Down MXFP4 rows rb, rb + 1, ... (RW_DN of them; a row past r1 reads row r1 - 1, not stored) of one expert
    (rows from dbase) against one pair's h (from element h0), every row's block loaded before the first is used."""
    for k in cutlass.range(lane * 32, I, 1024):
        wq, sc = [], []
        for i in cutlass.range_constexpr(RW_DN):
            w = dbase + Int64(cutlass.min(rb + i, r1 - 1))
            wq.append(ld4u32(dn + w * rowb + Int64(k // 2)))
            sc.append(ldu8(dns + w * Int64(I // 32) + Int64(k // 32)))
        ps = []  # each row's block sum, scaled once per block (mx_scale)
        for s8 in cutlass.range_constexpr(4):
            hv = ld8(Float32, fa(fb, h0 + k + 8 * s8))
            for i in cutlass.range_constexpr(RW_DN):
                e2m1x8(wq[i][s8], wr)
                d = dot8(wr.load(), hv)
                if cutlass.const_expr(s8 == 0):
                    ps.append(d)
                else:
                    ps[i] = ps[i] + d
        for i in cutlass.range_constexpr(RW_DN):
            acc[i] += mx_scale(ps[i], sc[i])


# ---- fragment-order MXFP4 experts on the tensor cores (F_FRAG) -------------------------------------------------
# A CTA stages a pair's activation row once in shared memory (stage_row: scaled by a power of two, split into fp16
# hi + lo planes, ~22 bits of the fp32 value); a warp takes a unit, two 16-row tiles (EXPERT_UP: a gate tile and its
# up tile; EXPERT_DOWN: two adjacent row tiles) against that row, over every record of the reduction
# (quant/mxfp4_frag.py). Per record a lane loads its 4 A-fragment words of each tile and its rows' scales (ld4w),
# and for each of the 8 scale blocks its 8 consecutive activations of each plane from shared memory, which both
# tiles multiply (mma.sync m16n8k16, 2 k-steps a block, 2 planes). Every lane of a group loads the same activations,
# so every column of B is the pair's row and column 0 of C (lanes with c = 0) holds the sums. Why: the CUDA-core
# bodies decode ~4.5 integer operations a weight and are issue-bound at 1.1-1.4 TB/s on the H200, where the fused
# executor's tensor-core experts (backends/fused/kernels/cute_experts.py, the same records) stream 3.2.


@cute.jit
def frag_tiles(ra: Int64, rb: Int64, ntl: Constexpr, nsc: Int32, sbase: Int32, K: Int32, lane: Int32,
               acc: cute.Tensor):
    """acc[0..3] (the tile at ra) and, with ntl = 2, acc[4..7] (the tile at rb): this lane's sums C[g, 2c..2c+1],
    C[g + 8, 2c..2c+1] of the tiles' nsc records (RECORD bytes apart) against the activation row staged in shared
    memory at byte sbase as fp16 hi / lo planes (stage_row; K values a plane), the block scales applied; times the
    row's 2**(14 - kk) (stage_row's return) they are the dot products."""
    c = lane % 4
    g = lane // 4
    for i in cutlass.range_constexpr(8):
        acc[i] = Float32(0.0)
    for sc in cutlass.range(nsc):
        off = Int64(sc) * Int64(RECORD)
        ws, ss = [], []
        for t in cutlass.range_constexpr(ntl):
            base = (ra if t == 0 else rb) + off
            ws.append([ld4w(base + Int64(512 * q) + Int64(16) * Int64(lane)) for q in range(4)])
            ss.append(ld4w(base + Int64(WBYTES) + Int64(16) * Int64(g)))
        for q in cutlass.range_constexpr(4):
            for b in cutlass.range_constexpr(2):
                at = sbase + 2 * (256 * sc + 64 * q + 32 * b + 8 * c)  # this lane's 8 fp16 of the block
                hv = lds4(at)
                lv = lds4(at + 2 * K)
                hi = [hv[0], hv[1], hv[2], hv[3]]
                lo = [lv[0], lv[1], lv[2], lv[3]]
                for t in cutlass.range_constexpr(ntl):
                    frag_block(acc, t, ws[t][q][2 * b:2 * b + 2], ss[t], 2 * q + b, hi, lo)


@cute.jit
def stage_row(xrow: Int64, K: Int32, sbase: Int32, tid: Int32) -> Float32:
    """The fp32 row at xrow (K values, produced in this launch: coherent loads, after the instruction's wait) into
    shared memory at byte sbase as fp16 hi (bytes [0, 2K)) and lo ([2K, 4K)) planes of the row times 2**kk, kk
    putting the row's largest magnitude in [2**14, 2**15) (so fp16 holds every scaled value, and the record decode's
    2**-14 (frag_dec) and the scale come off the sums as one factor; kk = 0 for an all-zero or non-finite row, whose
    NaN / inf carry through); the 8 words after the planes hold the warps' maxima. Returns 2**(14 - kk). The
    whole CTA calls it; it starts and ends with a block barrier (the planes' earlier readers are done; the new
    planes are written)."""
    red = sbase + 4 * K
    cta_sync()
    m = Float32(0.0)
    for k in cutlass.range(tid * 8, K, NT * 8):
        v = ld8(Float32, xrow + Int64(k) * 4)
        for j in cutlass.range_constexpr(8):
            m = cute.arch.fmax(m, cute.arch.fmax(v[j], -v[j]))
    m = warp_max(m)
    if tid % 32 == 0:
        sts1(red + (tid // 32) * 4, Uint32(f32_bits(m)))
    cta_sync()
    mm = Float32(0.0)
    for w in cutlass.range_constexpr(NW // 4):
        q = lds4(red + 16 * w)
        for j in cutlass.range_constexpr(4):
            mm = cute.arch.fmax(mm, from_bits(q[j]))
    ex = (f32_bits(mm) >> 23) & 255
    kk = Int32(0)
    if ex > 0 and ex < 255:
        kk = cutlass.min(Int32(141) - ex, Int32(127))
    up_s = from_bits(Uint32((kk + 127) << 23))
    for i in cutlass.range(tid, K // 8, NT):
        v = ld8(Float32, xrow + Int64(8 * i) * 4)
        for j in cutlass.range_constexpr(4):
            h, l_ = f16x2_split(v[2 * j] * up_s, v[2 * j + 1] * up_s)
            sts1(sbase + 16 * i + 4 * j, h)
            sts1(sbase + 2 * K + 16 * i + 4 * j, l_)
    cta_sync()
    return from_bits(Uint32((141 - kk) << 23))


@cute.jit
def pair_experts(ib: Int64, smi: cute.Tensor, tid: Int32, nuniq: Int32, uniq_off: Int32, pstart_off: Int32):
    """smi[p] = the expert of pair p (ROUTE's grouping, produced in this launch: coherent loads), then a block
    barrier."""
    for u in cutlass.range(tid, nuniq, NT):
        e = ldi(ia(ib, uniq_off + u))
        for p in cutlass.range(ldi(ia(ib, pstart_off + u)), ldi(ia(ib, pstart_off + u + 1))):
            smi[p] = e
    cta_sync()


@cute.jit
def expert_up_frag(fb: Int64, ib: Int64, wtab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """EXPERT_UP under F_FRAG: units (pair, gate tile) of N = pairs x I / 16, this item's share [w N / W,
    (w + 1) N / W) (isa.up_chunks with unit FRAG_TILE, which pyvm runs). Pair by pair (an item's units touch one
    or two), the CTA stages the pair's x once in shared memory as fp16 hi / lo planes (stage_row), then its warps
    take the pair's units a unit a warp, reading B there: the conversion is done once a CTA, not once a warp and
    unit (on the H200 -3% / -7% of k3-mini's batch 1 / 8 launch, bench/mega_body_ab.py, named mega_frag_ab.py
    then)."""
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_UP"
    use_situ = (arg(smi, 3) & F_SITU) != 0
    gu = wtab[arg(smi, ARG[A_]["gu"])]
    I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
    w, W = args(smi, A_, "w W")
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off, ptok_off = args(smi, A_, "uniq_off pstart_off ptok_off")
    pair_experts(ib, smi, tid, nuniq, uniq_off, pstart_off)
    npairs = ldi(ia(ib, pstart_off + nuniq))
    nt = I // FRAG_TILE  # gate tiles an expert (its up tiles follow)
    nsc = D // 256
    N = npairs * nt
    lo = Int32(Int64(w) * Int64(N) // Int64(W))
    hi = Int32(Int64(w + 1) * Int64(N) // Int64(W))
    sbase = Int32(sm.iterator.toint())  # the planes: 4 D bytes, then 8 words (kernel_check: D + 8 <= SMEM_F)
    acc = cute.make_rmem_tensor(8, Float32)
    c, g = lane % 4, lane // 4
    if lo < hi:
        for p in cutlass.range(lo // nt, (hi - 1) // nt + 1):
            xrow = fa(fb, x_off + ldi(ia(ib, ptok_off + p)) * D)
            fs = stage_row(xrow, D, sbase, tid)
            ra = gu + Int64(smi[p]) * Int64(2 * nt) * Int64(nsc) * Int64(RECORD)
            for unit in cutlass.range(cutlass.max(lo, p * nt) + warp, cutlass.min(hi, (p + 1) * nt), NW):
                rt = unit % nt
                rg = ra + Int64(rt) * Int64(nsc) * Int64(RECORD)
                frag_tiles(rg, rg + Int64(nt) * Int64(nsc) * Int64(RECORD), 2, nsc, sbase, D, lane, acc)
                if c == 0:
                    for i in cutlass.range_constexpr(2):
                        gv = acc[2 * i] * fs
                        uv = acc[4 + 2 * i] * fs
                        hv = silu(gv) * uv
                        if use_situ:
                            hv = situ(gv, uv)
                        stf(Float32, fa(fb, h_off + p * I + rt * FRAG_TILE + g + 8 * i), hv)


@cute.jit
def expert_down_frag(fb: Int64, ib: Int64, wtab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """EXPERT_DOWN under F_FRAG: units (pair, FRAG_DOWN rows: two adjacent 16-row tiles) of N = pairs x D / 32,
    this item's share [w N / W, (w + 1) N / W) pair-major (isa.up_chunks with unit FRAG_DOWN over the pair prefix,
    which pyvm runs); y[p, rows] alone, the weighted sum being the next phase's COMBINE. As EXPERT_UP: the CTA stages
    each pair's h row once in shared memory as fp16 hi / lo planes (stage_row) and its warps take the pair's units,
    a unit a warp, both tiles against the one B. Row tiles of every pair an item, the form before this one, had
    each warp scale and convert its pair's row for every 16-row tile it took, at 1.5 TB/s on the H200 (k3-mini
    batch 8, where EXPERT_UP's staged items stream at 3.4)."""
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_DOWN"
    dn = wtab[arg(smi, ARG[A_]["dn"])]
    I, D, h_off, y_off = args(smi, A_, "I D h_off y_off")
    w, W = args(smi, A_, "w W")
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off = args(smi, A_, "uniq_off pstart_off")
    pair_experts(ib, smi, tid, nuniq, uniq_off, pstart_off)
    npairs = ldi(ia(ib, pstart_off + nuniq))
    ntd = D // FRAG_TILE  # row tiles an expert
    nu = D // FRAG_DOWN  # units a pair
    nsc = I // 256
    N = npairs * nu
    lo = Int32(Int64(w) * Int64(N) // Int64(W))
    hi = Int32(Int64(w + 1) * Int64(N) // Int64(W))
    sbase = Int32(sm.iterator.toint())  # the planes: 4 I bytes, then 8 words (kernel_check: I + 8 <= SMEM_F)
    acc = cute.make_rmem_tensor(8, Float32)
    c, g = lane % 4, lane // 4
    tile = Int64(nsc) * Int64(RECORD)
    if lo < hi:
        for p in cutlass.range(lo // nu, (hi - 1) // nu + 1):
            xrow = fa(fb, h_off + p * I)
            fs = stage_row(xrow, I, sbase, tid)
            ra = dn + Int64(smi[p]) * Int64(ntd) * tile
            for unit in cutlass.range(cutlass.max(lo, p * nu) + warp, cutlass.min(hi, (p + 1) * nu), NW):
                rt = 2 * (unit % nu)  # the unit's first row tile
                rg = ra + Int64(rt) * tile
                frag_tiles(rg, rg + tile, 2, nsc, sbase, I, lane, acc)
                if c == 0:
                    for t in cutlass.range_constexpr(2):
                        for i in cutlass.range_constexpr(2):
                            stf(Float32, fa(fb, y_off + p * D + (rt + t) * FRAG_TILE + g + 8 * i),
                                acc[4 * t + 2 * i] * fs)


# F_GROUP's shared int words (group_tables; ops/expert_up.py GROUP_WORDS sizes them): the pass prefix, ROUTE's
# pstart and the experts, GROUP_MAX_E + 1 words each, then the scan's scratch
GP, GS, GU = 0, GROUP_MAX_E + 1, 2 * (GROUP_MAX_E + 1)
GX = 3 * (GROUP_MAX_E + 1)
GUC_UP = 2  # F_GROUP's tensor-core steps whose weight loads are issued together: EXPERT_UP (gate and up rows)
GUC_DN = 4  # and EXPERT_DOWN, 128 B of weights a lane either way


@cute.jit
def group_tables(ib: Int64, smi: cute.Tensor, tid: Int32, nuniq: Int32, uniq_off: Int32, pstart_off: Int32):
    """F_GROUP's tables in shared int words from ROUTE's grouping (produced in this launch: coherent loads), a
    thread an expert in rounds of NT (nuniq <= GROUP_MAX_E, ops/expert_up.py check_group): GS + u pstart, GU + u
    the expert, GP + u the pass prefix, expert u holding ceil(pairs / GROUP_N) passes (isa.group_prefix); returns
    the passes. Every thread of the CTA calls it (two barriers a round, one more)."""
    total = Int32(0)
    for c0 in cutlass.range(0, nuniq, NT):  # the same rounds on every thread
        u = c0 + tid
        c = Int32(0)
        if u < nuniq:
            ps = ldi(ia(ib, pstart_off + u))
            pe = ldi(ia(ib, pstart_off + u + 1))
            smi[GS + u] = ps
            smi[GU + u] = ldi(ia(ib, uniq_off + u))
            if u == nuniq - 1:
                smi[GS + nuniq] = pe
            c = (pe - ps + GROUP_N - 1) // GROUP_N
        before, tot = block_excl_scan(c, tid, smi, GX)
        if u < nuniq:
            smi[GP + u] = total + before
        total += tot
    if tid == 0:
        smi[GP + nuniq] = total
    cta_sync()
    return total


@cute.jit
def group_pass(smi: cute.Tensor, nuniq: Int32, P: Int32):
    """Pass P under F_GROUP: (its expert, its first pair, its pairs), the expert the last u with GP[u] <= P."""
    u0, ua = Int32(0), nuniq
    for _ in cutlass.range_constexpr(10):  # nuniq <= GROUP_MAX_E = 512
        if ua - u0 > 1:
            mid = (u0 + ua) // 2
            if smi[GP + mid] <= P:
                u0 = mid
            else:
                ua = mid
    p0 = smi[GS + u0] + (P - smi[GP + u0]) * GROUP_N
    return smi[GU + u0], p0, cutlass.min(smi[GS + u0 + 1] - p0, GROUP_N)


@cute.jit
def group_units(fb: Int64, ib: Int64, smi: cute.Tensor, tid: Int32, A_: Constexpr, w0: Int64, I: Int32, K: Int32,
                R: Int32, x_off: Int32, ptok_off: Int32, out_off: Int32, use_situ):
    """The units of an F_GROUP item (group_tables built): (pass, 16-row tile) of N = passes x R / 16, its share [w N
    / W, (w + 1) N / W) (isa.up_chunks with unit GROUP_TILE over isa.group_prefix, which pyvm runs), a unit a warp:
    the expert's 16 rows of K (EXPERT_UP: its gate rows and the up rows I below them, SwiGLU / SiTU-GLU'd;
    EXPERT_DOWN: its down rows) against the pass's up to GROUP_N pairs on the tensor cores (dense.py tc_step: the
    mma's M the rows, its N the pairs, column g the input row of pair p0 + g, zeroed past the pass), so each weight
    is read once for GROUP_N of its pairs. The input rows are x's at the pairs' tokens (EXPERT_UP, `ptok`) or h's at
    the pairs (EXPERT_DOWN), both produced in this launch (coherent loads); out[pair, R] takes the rows. Lane
    (g, t) stores rows g and g + 8 of pairs 2t and 2t + 1."""
    glu = A_ == "EXPERT_UP"
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    nt = R // GROUP_TILE
    w, W = args(smi, A_, "w W")
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off = args(smi, A_, "uniq_off pstart_off")
    N = group_tables(ib, smi, tid, nuniq, uniq_off, pstart_off) * nt
    lo = Int32(Int64(w) * Int64(N) // Int64(W))
    hi = Int32(Int64(w + 1) * Int64(N) // Int64(W))
    rowb = Int64(K) * 2
    erows = R  # weight rows an expert: EXPERT_UP's gate and up rows, EXPERT_DOWN's output rows
    UC = GUC_DN
    if cutlass.const_expr(glu):
        erows = 2 * I
        UC = GUC_UP
    nsteps = K // TC_K
    smain = nsteps - nsteps % UC
    acc = cute.make_rmem_tensor(8, Float32)
    for unit in cutlass.range(lo + warp, hi, NW):
        P = unit // nt
        r = (unit - P * nt) * GROUP_TILE
        e, p0, pn = group_pass(smi, nuniq, P)
        msk = Uint32(0xFFFFFFFF)
        if g >= pn:
            msk = Uint32(0)  # the B operand's column g is past the pass: zeros (a valid row loaded)
        src = p0 + cutlass.min(g, pn - 1)  # the pair's input row: its own (h), or its token's (x)
        if cutlass.const_expr(glu):
            src = ldi(ia(ib, ptok_off + src))
        xrow = fa(fb, x_off + src * K)
        ra = w0 + (Int64(e) * Int64(erows) + Int64(r + g)) * rowb
        rb = ra + Int64(8) * rowb
        ua = ra + Int64(I) * rowb  # EXPERT_UP's up rows (glu only)
        ub = rb + Int64(I) * rowb
        for i in cutlass.range_constexpr(8):
            acc[i] = Float32(0.0)
        for s in cutlass.range(0, smain, UC):
            tc_step(acc, ra, rb, ua, ub, s * TC_K, t, xrow, xrow, xrow, False, False, msk, UC, glu)
        for s in cutlass.range(smain, nsteps):
            tc_step(acc, ra, rb, ua, ub, s * TC_K, t, xrow, xrow, xrow, False, False, msk, 1, glu)
        for h in cutlass.range_constexpr(2):  # rows g, g + 8
            for j in cutlass.range_constexpr(2):  # pairs 2t, 2t + 1
                if 2 * t + j < pn:
                    v = acc[2 * h + j]
                    if cutlass.const_expr(glu):
                        up = acc[4 + 2 * h + j]
                        gs = v
                        v = silu(gs) * up
                        if use_situ:
                            v = situ(gs, up)
                    stf(Float32, fa(fb, out_off + (p0 + 2 * t + j) * R + r + g + 8 * h), v)


@cute.jit
def expert_up_group(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """EXPERT_UP under F_GROUP (bf16): h[pair] = glu(gate_up[e] . x[token]) for the item's units (group_units)."""
    A_ = "EXPERT_UP"
    I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
    group_units(fb, ib, smi, tid, A_, wtab[arg(smi, ARG[A_]["gu"])], I, D, I, x_off, arg(smi, ARG[A_]["ptok_off"]),
                h_off, (arg(smi, 3) & F_SITU) != 0)


@cute.jit
def expert_down_group(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """EXPERT_DOWN under F_GROUP (bf16): y[pair] = down[e] . h[pair] for the item's units (group_units), pair-major;
    the weighted sum is the next phase's COMBINE."""
    A_ = "EXPERT_DOWN"
    I, D, h_off, y_off = args(smi, A_, "I D h_off y_off")
    group_units(fb, ib, smi, tid, A_, wtab[arg(smi, ARG[A_]["dn"])], I, I, D, h_off, Int32(-1), y_off, False)


@cute.jit
def op_expert_up(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                 tid: Int32):
    """Gate and up rows of each selected expert against its tokens, GLU'd into h. Weights bf16 [E, 2I, D], or
    MXFP4 (F_MXFP4): packed bytes [E, 2I, D/2] (`gu`) and e8m0 scales [E, 2I, D/32] (`gus`), decoded in registers.
    This item's share: units [w * N / W, (w + 1) * N / W) of N = qst[nuniq] * I, a unit being one row of one of an
    expert's passes over TB of its pairs (isa.up_chunks, which pyvm runs): every item streams and decodes the same
    number of rows to within one, however the pairs fall on the experts. F_FRAG: MXFP4 records on the tensor
    cores, whole 16-row tiles (expert_up_frag)."""
    if (arg(smi, 3) & F_FRAG) != 0:
        expert_up_frag(fb, ib, wtab, sm, smi, tid)
    elif (arg(smi, 3) & F_GROUP) != 0:
        expert_up_group(fb, ib, wtab, smi, tid)
    elif (arg(smi, 3) & F_ROUTE) != 0:
        expert_up_routed(fb, ib, wtab, sm, smi, tid, idx)
    else:
        expert_up_rows(fb, ib, wtab, smi, tid)


@cute.jit
def expert_up_routed(fb: Int64, ib: Int64, wtab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor, tid: Int32,
                     idx: Int32):
    """EXPERT_UP under F_ROUTE (one token, bf16 experts one pair a pass): the item routes the token itself
    (route_one; item 0 also writes ROUTE's outputs, which EXPERT_DOWN reads after this phase), then takes its share
    of the A pairs' rows as expert_up_rows' one-pair path does (pass p is pair p, its rows units p * I + r), the
    experts from shared memory: no ROUTE phase before it and no table read back from global memory."""
    A_ = "EXPERT_UP"
    write = Int32(0)
    if arg(smi, ARG[A_]["w"]) == 0:
        write = Int32(1)
    route_one(fb, ib, sm, smi, tid, idx, A_, write, False)
    up_routed_rows(fb, wtab, smi, tid)


@cute.jit
def up_routed_rows(fb: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """A routed EXPERT_UP item's rows from global memory: expert_up_rows' one-pair path over the experts route_one
    left in shared memory. The item's units [lo, hi) (unit u: row u % I of pair u // I) are dealt to the warps as one
    flat range, across the boundary of the two pairs an item may straddle, each row's address its own expert's:
    walked pair by pair, an item of 47 units split 10 + 37 took 1 + 3 passes of RU_UP x NW rows where 47 flat take 3,
    and the phase waits for its slowest item (qwen3-30b-a3b batch 1, 8 pairs over 132 items: 4 items took 4 passes;
    H100 launch median 4862 against 4925 us, bench/mega_body_ab.py). The same sums in the same order."""
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_UP"
    use_situ = (arg(smi, 3) & F_SITU) != 0  # the row's words read after the routing (route_one: registers)
    gu = wtab[arg(smi, ARG[A_]["gu"])]
    I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
    w, W, A = args(smi, A_, "w W A")
    N = Int64(A) * Int64(I)
    lo = Int64(w) * N // Int64(W)
    n = Int32(Int64(w + 1) * N // Int64(W) - lo)
    rowb = Int64(D) * 2
    xa = fa(fb, x_off)  # the one token's x
    accm = cute.make_rmem_tensor(2 * RU_UP, Float32)
    for j0 in cutlass.range(warp, n, RU_UP * NW):
        for j in cutlass.range_constexpr(2 * RU_UP):
            accm[j] = Float32(0.0)
        rows = []
        for h in cutlass.range_constexpr(RU_UP):  # unit lo + j0 + h NW; past n, the last unit again (not stored)
            u = lo + Int64(cutlass.min(j0 + h * NW, n - 1))
            p = Int32(u // Int64(I))
            g = gu + (Int64(smi[RT + p]) * Int64(2 * I) + (u - Int64(p) * Int64(I))) * rowb
            rows += [g, g + Int64(I) * rowb]  # gate, up
        up_rows_at(accm, rows, D, xa, lane)
        for h in cutlass.range_constexpr(RU_UP):
            g = warp_sum(accm[2 * h])
            up = warp_sum(accm[2 * h + 1])
            if lane == 0 and j0 + h * NW < n:
                hv = silu(g) * up
                if use_situ:
                    hv = situ(g, up)
                stf(Float32, fa(fb, h_off + Int32(lo) + j0 + h * NW), hv)


@cute.jit
def expert_up_rows(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """EXPERT_UP on the CUDA cores (bf16 experts, and MXFP4 in the checkpoint's order)."""
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_UP"
    flags = arg(smi, 3)
    mx = (flags & F_MXFP4) != 0
    use_situ = (flags & F_SITU) != 0
    gu = wtab[arg(smi, ARG[A_]["gu"])]
    gus = gu
    if mx:
        gus = wtab[arg(smi, ARG[A_]["gus"])]
    I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
    w, W = args(smi, A_, "w W")
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off, ptok_off = args(smi, A_, "uniq_off pstart_off ptok_off")
    # the pass prefix (isa.up_passes): bf16 ROUTE's qst, PASS pairs a pass; MXFP4 and F_PAIR1 its pair prefix
    # pstart, one pair a pass, so that every pass takes a single-pair loop (passes of 2-4 pairs take 2.3-3.6x as
    # long on the H200; bf16 at qwen3-30b-a3b batch 8, 1.8-2.0x: isa.up_passes)
    pre_off = arg(smi, ARG[A_]["qst_off"])
    PP = Int32(TB)
    if mx or (flags & F_PAIR1) != 0:
        pre_off = pstart_off
        PP = Int32(1)
    for u in cutlass.range(tid, nuniq + 1, NT):  # ROUTE's prefix (produced in this launch: coherent loads)
        smi[u] = ldi(ia(ib, pre_off + u))
    cta_sync()
    N = Int64(smi[nuniq]) * Int64(I)
    lo = Int64(w) * N // Int64(W)
    hi = Int64(w + 1) * N // Int64(W)
    # the experts holding units lo and hi - 1: the last u with qst[u] * I <= unit (qst strictly increases)
    u0, ua = Int32(0), nuniq
    u1, ub = Int32(0), nuniq
    for _ in cutlass.range_constexpr(11):  # nuniq <= 1024
        if ua - u0 > 1:
            mid = (u0 + ua) // 2
            if Int64(smi[mid]) * Int64(I) <= lo:
                u0 = mid
            else:
                ua = mid
        if ub - u1 > 1:
            mid = (u1 + ub) // 2
            if Int64(smi[mid]) * Int64(I) <= hi - 1:
                u1 = mid
            else:
                ub = mid
    if lo >= hi:
        u1 = u0 - 1  # an empty share
    rowb = Int64(D) * 2  # bytes per weight row (MXFP4: D / 2 packed, D / 32 scales)
    if mx:
        rowb = Int64(D // 2)
    # no L2 prefetch of the share's rows before the loops: such prefetches only queue ahead of the loads that need
    # the same bytes (launches with / without them on the H200, median of 20: qwen3-30b-a3b batch 1 / 8 / 64
    # 5345 / 5115, 17515 / 15475, 73344 / 67688 us, k3-mini 3224 / 3145, 10203 / 9213, 72423 / 68257)
    accg = cute.make_rmem_tensor(TB, Float32)
    accu = cute.make_rmem_tensor(TB, Float32)
    wg = cute.make_rmem_tensor(8, Float32)
    xrow = cute.make_rmem_tensor(TB, Int32)
    accm = cute.make_rmem_tensor(2 * RU_UP, Float32)
    for u in cutlass.range(u0, u1 + 1):
        e = ldi(ia(ib, uniq_off + u))
        ps, pe = ldi(ia(ib, pstart_off + u)), ldi(ia(ib, pstart_off + u + 1))
        for q in cutlass.range(smi[u], smi[u + 1]):
            r0 = Int32(cutlass.max(lo - Int64(q) * Int64(I), Int64(0)))
            r1 = Int32(cutlass.min(hi - Int64(q) * Int64(I), Int64(I)))
            p0 = ps + (q - smi[u]) * PP
            pn = cutlass.min(pe - p0, PP)  # this pass's pairs
            if mx:  # one pair (isa.up_passes): RW_UP rows at once
                x0 = x_off + ldi(ia(ib, ptok_off + p0)) * D
                for rb in cutlass.range(r0 + warp, r1, NW * RW_UP):
                    for i in cutlass.range_constexpr(RW_UP):
                        accg[i] = Float32(0.0)
                        accu[i] = Float32(0.0)
                    up_mx_rows1(gu, gus, Int64(e) * Int64(2 * I), rb, r1, I, rowb, D, x0, fb, lane, accg, accu, wg)
                    for i in cutlass.range_constexpr(RW_UP):
                        g = warp_sum(accg[i])
                        up = warp_sum(accu[i])
                        if lane == 0 and rb + i * NW < r1:
                            hv = silu(g) * up
                            if use_situ:
                                hv = situ(g, up)
                            stf(Float32, fa(fb, h_off + p0 * I + rb + i * NW), hv)
            elif pn == 1:  # bf16, one pair (a decode step's common case): RU_UP rows a warp (up_rows_multi)
                xa = fa(fb, x_off + ldi(ia(ib, ptok_off + p0)) * D)
                gbase = gu + Int64(e) * Int64(2 * I) * rowb
                for r in cutlass.range(r0 + warp, r1, RU_UP * NW):
                    for j in cutlass.range_constexpr(2 * RU_UP):
                        accm[j] = Float32(0.0)
                    up_rows_multi(accm, gbase, rowb, I, r, r1, D, xa, lane)
                    for h in cutlass.range_constexpr(RU_UP):
                        g = warp_sum(accm[2 * h])
                        up = warp_sum(accm[2 * h + 1])
                        if lane == 0 and r + h * NW < r1:
                            hv = silu(g) * up
                            if use_situ:
                                hv = situ(g, up)
                            stf(Float32, fa(fb, h_off + p0 * I + r + h * NW), hv)
            else:
                for r in cutlass.range(r0 + warp, r1, NW):
                    for j in cutlass.range_constexpr(TB):
                        accg[j] = Float32(0.0)
                        accu[j] = Float32(0.0)
                    gidx = Int64(e) * Int64(2 * I) + Int64(r)
                    uidx = gidx + Int64(I)
                    for j in cutlass.range_constexpr(TB):  # each pair's row of x, once per row, not per chunk
                        xrow[j] = x_off
                        if j < pn:
                            xrow[j] = x_off + ldi(ia(ib, ptok_off + p0 + j)) * D
                    for k in cutlass.range(lane * 8, D, 256, unroll=4):  # bf16 (MXFP4 took the branch above)
                        gv = ld8(BFloat16, gu + gidx * rowb + Int64(k) * 2)
                        uv = ld8(BFloat16, gu + uidx * rowb + Int64(k) * 2)
                        for j in cutlass.range_constexpr(TB):
                            if j < pn:
                                xv = ld8(Float32, fa(fb, xrow[j] + k))
                                accg[j] += dot8(gv, xv)
                                accu[j] += dot8(uv, xv)
                    for j in cutlass.range_constexpr(TB):
                        g = warp_sum(accg[j])
                        up = warp_sum(accu[j])
                        if lane == 0 and j < pn:
                            hv = silu(g) * up
                            if use_situ:
                                hv = situ(g, up)
                            stf(Float32, fa(fb, h_off + (p0 + j) * I + r), hv)


@cute.jit
def op_expert_down(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                   tid: Int32):
    """Down rows [r0, r1) of every selected expert against its pairs' h, then each token's weighted sum of its
    experts' rows (plus the shared experts' output with F_SHARED) added to `out`, or stored with F_STORE. Weights
    bf16 [E, D, I] or MXFP4 (packed [E, D, I/2] `dn`, scales [E, D, I/32] `dns`). F_FRAG: MXFP4 records on the
    tensor cores, pair-major, y alone (expert_down_frag; the sum is COMBINE's)."""
    if (arg(smi, 3) & F_FRAG) != 0:
        expert_down_frag(fb, ib, wtab, sm, smi, tid)
    elif (arg(smi, 3) & F_GROUP) != 0:
        expert_down_group(fb, ib, wtab, smi, tid)
    else:
        expert_down_rows(fb, ib, wtab, smi, tid)


@cute.jit
def expert_down_rows(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
    """EXPERT_DOWN on the CUDA cores (bf16 experts, and MXFP4 in the checkpoint's order), the combine fused."""
    warp, lane = tid // 32, tid % 32
    A_ = "EXPERT_DOWN"
    flags = arg(smi, 3)
    mx = (flags & F_MXFP4) != 0
    dn = wtab[arg(smi, ARG[A_]["dn"])]
    dns = dn
    if mx:
        dns = wtab[arg(smi, ARG[A_]["dns"])]
    I, D, h_off, y_off, out_off = args(smi, A_, "I D h_off y_off out_off")
    r0, r1, B, A = args(smi, A_, "r0 r1 B A")
    nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
    uniq_off, pstart_off = args(smi, A_, "uniq_off pstart_off")
    wts_off, pairof_off, shared_off = args(smi, A_, "wts_off pairof_off shared_off")
    rowb = Int64(I) * 2
    if mx:
        rowb = Int64(I // 2)
    acc = cute.make_rmem_tensor(TB, Float32)
    wr = cute.make_rmem_tensor(8, Float32)
    accr = cute.make_rmem_tensor(RU_DN, Float32)
    npairs = ldi(ia(ib, pstart_off + nuniq))
    # flat: every pair on its own, the (pair, rows) units of all selected experts dealt to the warps at once. MXFP4
    # always; bf16 up to FLAT_PAIRS pairs an expert on average (an expert's second pair reads its rows again, from
    # L2), past that the bf16 loop below (expert after expert, each row read once for up to TB of its pairs)
    flat = mx or npairs <= FLAT_PAIRS * nuniq
    if flat:
        for u in cutlass.range(tid, nuniq, NT):  # pair -> expert, in shared memory (pairs grouped by expert)
            e = ldi(ia(ib, uniq_off + u))
            for p in cutlass.range(ldi(ia(ib, pstart_off + u)), ldi(ia(ib, pstart_off + u + 1))):
                smi[p] = e
        cta_sync()
    if flat and not mx:
        # bf16: units of (pair, RU_DN adjacent rows). A lane's 8-column chunk of the pair's h (fp32, as many bytes as
        # two bf16 rows' chunks) is loaded once for the unit's RU_DN rows, whose chunks are in flight together; rows
        # past r1 are loaded (clamped to r1 - 1) and not stored. Each lane adds its chunks in k order, as the loop
        # below does, so the same sums
        gpu = (r1 - r0 + RU_DN - 1) // RU_DN  # units per pair
        for g in cutlass.range(warp, npairs * gpu, NW):
            p = g // gpu
            r = r0 + (g % gpu) * RU_DN
            for q in cutlass.range_constexpr(RU_DN):
                accr[q] = Float32(0.0)
            w0 = dn + Int64(smi[p]) * Int64(D) * rowb
            rows = [w0 + Int64(cutlass.min(r + q, r1 - 1)) * rowb for q in range(RU_DN)]
            hrow = fa(fb, h_off + p * I)
            kmain = Int32(0)
            if cutlass.const_expr(WU_DN > 1):  # WU_DN chunks a row at once, then the columns past their multiple
                kmain = I - I % (256 * WU_DN)
                for k0 in cutlass.range(lane * 8, kmain, 256 * WU_DN):
                    wqs = [[ld8raw(BFloat16, rows[q] + Int64(k0 + u * 256) * 2) for q in range(RU_DN)]
                           for u in range(WU_DN)]
                    for u in cutlass.range_constexpr(WU_DN):
                        hv = ld8(Float32, hrow + Int64(k0 + u * 256) * 4)
                        for q in cutlass.range_constexpr(RU_DN):
                            accr[q] += dot8(wqs[u][q].to(Float32), hv)
            for k in cutlass.range(kmain + lane * 8, I, 256):
                wq = [ld8raw(BFloat16, rows[q] + Int64(k) * 2) for q in range(RU_DN)]
                hv = ld8(Float32, hrow + Int64(k) * 4)
                for q in cutlass.range_constexpr(RU_DN):
                    accr[q] += dot8(wq[q].to(Float32), hv)
            for q in cutlass.range_constexpr(RU_DN):
                s = warp_sum(accr[q])
                if lane == 0 and r + q < r1:
                    stf(Float32, fa(fb, y_off + p * D + r + q), s)
    if mx:
        # MXFP4: the units are (pair, group of RW_DN consecutive rows), over every pair of every selected expert at
        # once, dealt to the warps; each group's RW_DN rows are loaded together and its pair's h once for them. A
        # row serving several pairs is read again (L1 / L2). Not expert after expert, its rows over the 8 warps:
        # with ~14 rows an instruction (1-2 rows per warp) that makes 16 experts x 3 dependent round trips in a row
        # at batch 1 (150 us an instruction, 2.3 GB/s per CTA, in an H200 timeline)
        gpp = (r1 - r0 + RW_DN - 1) // RW_DN  # groups per pair
        for g in cutlass.range(warp, npairs * gpp, NW):
            p = g // gpp
            rb = r0 + (g % gpp) * RW_DN
            for i in cutlass.range_constexpr(RW_DN):
                acc[i] = Float32(0.0)
            down_mx_rows1(dn, dns, Int64(smi[p]) * Int64(D), rb, r1, rowb, I, fb, h_off + p * I, lane, acc, wr)
            for i in cutlass.range_constexpr(RW_DN):
                s = warp_sum(acc[i])
                if lane == 0 and rb + i < r1:
                    stf(Float32, fa(fb, y_off + p * D + rb + i), s)
    for u in cutlass.range(nuniq):
        e = ldi(ia(ib, uniq_off + u))
        ps, pe = ldi(ia(ib, pstart_off + u)), ldi(ia(ib, pstart_off + u + 1))
        if flat:
            pe = ps  # done above: no passes for the bf16 loop below
        for p0 in cutlass.range(ps, pe, TB):
            for r in cutlass.range(r0 + warp, r1, NW):
                for j in cutlass.range_constexpr(TB):
                    acc[j] = Float32(0.0)
                widx = Int64(e) * Int64(D) + Int64(r)
                for k in cutlass.range(lane * 8, I, 256, unroll=4):  # bf16 (MXFP4 took the branch above)
                    wv = ld8(BFloat16, dn + widx * rowb + Int64(k) * 2)
                    for j in cutlass.range_constexpr(TB):
                        if p0 + j < pe:
                            acc[j] += dot8(wv, ld8(Float32, fa(fb, h_off + (p0 + j) * I + k)))
                for j in cutlass.range_constexpr(TB):
                    s = warp_sum(acc[j])
                    if lane == 0 and p0 + j < pe:
                        stf(Float32, fa(fb, y_off + (p0 + j) * D + r), s)
    cta_sync()
    combine_rows(fb, ib, flags, tid, y_off, out_off, D, r0, r1, B, A, wts_off, pairof_off, shared_off)


@cute.jit
def combine_rows(fb: Int64, ib: Int64, flags: Int32, tid: Int32, y_off: Int32, out_off: Int32, D: Int32, r0: Int32,
                 r1: Int32, B: Int32, A: Int32, wts_off: Int32, pairof_off: Int32, shared_off: Int32):
    """out[t, r] (+)= sum_a wts[t, a] * y[pairof[t, a], r] (+ shared[t, r]) for rows [r0, r1), t < B, a thread an
    element, slots in order (pyvm's ops/combine.combine). y, the weights and the pair table were produced in this
    launch: coherent loads, after the instruction's wait (COMBINE) or the block barrier after the products
    (EXPERT_DOWN's own)."""
    rows = r1 - r0
    store = (flags & F_STORE) != 0
    for e in cutlass.range(tid, B * rows, NT):
        t, r = e // rows, r0 + e % rows
        o = fa(fb, out_off + t * D + r)
        v = Float32(0.0)
        if not store:
            v = ldf(Float32, o)
        for a in cutlass.range(A):
            p = ldi(ia(ib, pairof_off + t * A + a))
            v += ldf(Float32, fa(fb, wts_off + t * A + a)) * ldf(Float32, fa(fb, y_off + p * D + r))
        if (flags & F_SHARED) != 0:
            v += ldf(Float32, fa(fb, shared_off + t * D + r))
        stf(Float32, o, v)


@cute.jit
def op_combine(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
               smi: cute.Tensor, tid: Int32):
    """COMBINE: each token's weighted sum of its experts' rows [r0, r1) (plus the shared experts' output with
    F_SHARED) added to `out`, or stored with F_STORE (combine_rows)."""
    A_ = "COMBINE"
    y_off, out_off, D, r0, r1 = args(smi, A_, "y_off out_off D r0 r1")
    B, A, wts_off, pairof_off, shared_off = args(smi, A_, "B A wts_off pairof_off shared_off")
    combine_rows(fb, ib, arg(smi, 3), tid, y_off, out_off, D, r0, r1, B, A, wts_off, pairof_off, shared_off)
