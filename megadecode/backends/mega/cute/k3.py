"""Kimi K3's own opcodes: ATTN_RES (a layer's input as a softmax mix of the AttnRes blocks' sums) and KDA_STEP
(one decode step of Kimi Delta Attention for one (sequence, head)). Semantics: `run` in ops/attn_res.py and
ops/kda_step.py. Everything these bodies read was produced earlier in the launch (the arenas, the KDA caches) or is a
static weight; all of it through plain coherent loads."""

from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, cute

from .base import (
    cta_sync,
    ARG,
    NEG_INF,
    NT,
    NW,
    arg,
    argf,
    args,
    dot8,
    fa,
    ia,
    ld8,
    ldf,
    ldi,
    sigmoid,
    silu,
    stf,
    tensors,
    warp_sum,
)


@cute.jit
def op_attn_res(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                tid: Int32):
    """Columns [c0, c1) of sequence b's mix: every source row s (src_off + (s * B + b) * D) scores
    rms(src_s) * norm_w . query_w (one warp per source), softmax over the sources, weighted sum of the columns."""
    warp, lane = tid // 32, tid % 32
    A_ = "ATTN_RES"
    src_off, nsrc, B, D = args(smi, A_, "src_off nsrc B D")
    qw, nw = tensors(wtab, smi, A_, "query_w norm_w")
    eps = argf(smi, ARG[A_]["eps_bits"])
    out_off, b, c0, c1 = args(smi, A_, "out_off b c0 c1")
    LG = 0  # the sources' logits, then their softmax weights
    for s in cutlass.range(warp, nsrc, NW):
        row = src_off + (s * B + b) * D
        ss = Float32(0.0)
        dq = Float32(0.0)
        # 8 columns per lane and load, 4 such loads unrolled (kernel_check: D a multiple of 8, rows 16-byte aligned);
        # was one column per lane and load, each waited on in turn: 224 L2 round trips per source at D = 7168
        for k in cutlass.range(lane * 8, D, 256, unroll=4):
            x = ld8(Float32, fa(fb, row + k))
            ss += dot8(x, x)
            dq += dot8(x * ld8(BFloat16, nw + Int64(k) * 2), ld8(BFloat16, qw + Int64(k) * 2))
        ss = warp_sum(ss)
        dq = warp_sum(dq)
        if lane == 0:
            sm[LG + s] = dq * cute.math.rsqrt(ss / Float32(D) + eps)
    cta_sync()
    if tid == 0:
        mx = Float32(NEG_INF)
        for s in cutlass.range(nsrc):
            mx = cute.arch.fmax(mx, sm[LG + s])
        tot = Float32(0.0)
        for s in cutlass.range(nsrc):
            ev = cute.math.exp(sm[LG + s] - mx)
            sm[LG + s] = ev
            tot += ev
        for s in cutlass.range(nsrc):
            sm[LG + s] = sm[LG + s] / tot
    cta_sync()
    for c in cutlass.range(c0 + tid, c1, NT):
        acc = Float32(0.0)
        for s in cutlass.range(nsrc, unroll=4):  # 4 sources' loads in flight, not one L2 trip each
            acc += sm[LG + s] * ldf(Float32, fa(fb, src_off + (s * B + b) * D + c))
        stf(Float32, fa(fb, out_off + b * D + c), acc)


@cute.jit
def softplus(x: Float32) -> Float32:
    """torch's softplus with threshold 20: x above it, else log(1 + exp(x))."""
    y = x
    if x <= Float32(20.0):
        y = cute.math.log1p(cute.math.exp(x))
    return y


SR = 8  # KDA_STEP: rows of the recurrent state a thread loads together (one column, every parts-th row)


def state_row(i0: Int32, u: int, parts: Int32, K: Int32) -> Int32:
    """Row u of a group of SR state rows from i0 (stride parts); past the last row, row K - 1 (loaded, not used)."""
    i = i0 + u * parts
    return cutlass.min(i, K - 1)


@cute.jit
def op_kda_step(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor,
                tid: Int32):
    """KDA for sequence b, head h (head dim K, value dim K): the short causal conv of the q/k/v channels over the
    slot's conv state (shifted, the new input appended, rounded to the cache dtype), SiLU; q and k L2-normalized
    (q also by K^-1/2); per-channel decay exp(-exp(A_log[h]) * softplus(f + dt_bias)); the delta rule on the
    slot's fp32 state S [K, K]: S <- S * decay[:, None], S <- S + k (beta (v - k S)); o = q S; gated RMSNorm.
    The state is read twice (decay and k S; then the update and q S), each element by the same thread, and
    written once. Shared memory: 6K + max(NT, K) + 4 words (kernel_check.check_program)."""
    warp, lane = tid // 32, tid % 32
    A_ = "KDA_STEP"
    qkv_off, f_off, gate_off, beta_off = args(smi, A_, "qkv_off f_off gate_off beta_off")
    conv_w, = tensors(wtab, smi, A_, "conv_w")
    conv_state, rec = tensors(ptab, smi, A_, "conv_state rec_state")
    a_log, dt_bias, onorm = tensors(wtab, smi, A_, "a_log dt_bias onorm_w")
    out_off, b, h, H = args(smi, A_, "out_off b h H")
    K, W = args(smi, A_, "K W")
    eps = argf(smi, ARG[A_]["eps_bits"])
    slot = ldi(ia(ib, arg(smi, ARG[A_]["slot_off"]) + b))
    HK = H * K
    parts = cutlass.max(1, NT // K)  # threads per state column (each takes every parts-th row)
    MX, DC = 0, 3 * K  # the conv outputs q, k, v; the per-row decay
    PP = 4 * K  # per (part, column) partial sums: parts * K <= max(NT, K) words
    DL = PP + cutlass.max(NT, K)  # beta (v - k S) per column
    O = DL + K  # q S per column
    SC = O + K  # scalars: q scale, k scale, beta, output rstd
    # 1. the short conv over [state, input] for the 3K channels, the state shifted in place
    for c in cutlass.range(tid, 3 * K, NT):
        j, i = c // K, c % K
        ch = j * HK + h * K + i
        raw = ldf(Float32, fa(fb, qkv_off + b * 3 * HK + ch))
        st = conv_state + (Int64(slot) * Int64(3 * HK) + Int64(ch)) * Int64(W - 1) * 2
        cw = conv_w + Int64(ch) * Int64(W) * 2
        acc = Float32(0.0)
        for w in cutlass.range(W - 1):
            cur = ldf(BFloat16, st + Int64(w) * 2)  # read before the write below moves the next one down
            acc += cur * ldf(BFloat16, cw + Int64(w) * 2)
            if w > 0:
                stf(BFloat16, st + Int64(w - 1) * 2, cur)
        acc += raw * ldf(BFloat16, cw + Int64(W - 1) * 2)
        if W > 1:
            stf(BFloat16, st + Int64(W - 2) * 2, raw)
        sm[MX + c] = silu(acc)
    # the gates, from the arena's low-rank halves and the static biases
    for i in cutlass.range(tid, K, NT):
        fv = ldf(Float32, fa(fb, f_off + b * HK + h * K + i)) + ldf(BFloat16, dt_bias + Int64(h * K + i) * 2)
        g = -cute.math.exp(ldf(BFloat16, a_log + Int64(h) * 2)) * softplus(fv)
        sm[DC + i] = cute.math.exp(g)
    cta_sync()
    if warp < 2:  # warp 0: q's norm, warp 1: k's
        ss = Float32(0.0)
        for i in cutlass.range(lane, K, 32):
            x = sm[MX + warp * K + i]
            ss += x * x
        ss = warp_sum(ss)
        if lane == 0:
            sc = Float32(1.0) / cute.math.sqrt(ss + Float32(1e-6))
            if warp == 0:
                sc = sc / cute.math.sqrt(Float32(K))
            sm[SC + warp] = sc
    if tid == 64:
        sm[SC + 2] = sigmoid(ldf(Float32, fa(fb, beta_off + b * H + h)))
    cta_sync()
    for i in cutlass.range(tid, 2 * K, NT):
        sm[MX + i] = sm[MX + i] * sm[SC + i // K]
    cta_sync()
    # 2. k S on the decayed state, per column, in parts
    S = rec + Int64(slot * H + h) * Int64(K) * Int64(K) * 4
    for jj in cutlass.range(tid, parts * K, NT):
        part, j = jj // K, jj % K
        acc = Float32(0.0)
        for i0 in cutlass.range(part, K, parts * SR):  # SR rows' loads in flight (was one L2 / HBM trip per row)
            sv = []
            for u in cutlass.range_constexpr(SR):  # a row past K reads row i0 again and is not used
                sv.append(ldf(Float32, S + (Int64(state_row(i0, u, parts, K)) * Int64(K) + Int64(j)) * 4))
            for u in cutlass.range_constexpr(SR):
                i = i0 + u * parts
                if i < K:
                    acc += sm[MX + K + i] * sm[DC + i] * sv[u]
        sm[PP + jj] = acc
    cta_sync()
    beta = sm[SC + 2]
    for j in cutlass.range(tid, K, NT):
        ks = Float32(0.0)
        for part in cutlass.range(parts):
            ks += sm[PP + part * K + j]
        sm[DL + j] = (sm[MX + 2 * K + j] - ks) * beta
    cta_sync()
    # 3. the update, written once, and q S
    for jj in cutlass.range(tid, parts * K, NT):
        part, j = jj // K, jj % K
        dl = sm[DL + j]
        acc = Float32(0.0)
        for i0 in cutlass.range(part, K, parts * SR):  # SR rows loaded before any is stored
            sv = []
            for u in cutlass.range_constexpr(SR):
                sv.append(ldf(Float32, S + (Int64(state_row(i0, u, parts, K)) * Int64(K) + Int64(j)) * 4))
            for u in cutlass.range_constexpr(SR):
                i = i0 + u * parts
                if i < K:
                    s = sv[u] * sm[DC + i] + sm[MX + K + i] * dl
                    stf(Float32, S + (Int64(i) * Int64(K) + Int64(j)) * 4, s)
                    acc += sm[MX + i] * s
        sm[PP + jj] = acc
    cta_sync()
    for j in cutlass.range(tid, K, NT):
        o = Float32(0.0)
        for part in cutlass.range(parts):
            o += sm[PP + part * K + j]
        sm[O + j] = o
    cta_sync()
    # 4. gated RMSNorm of o
    if warp == 0:
        ss = Float32(0.0)
        for j in cutlass.range(lane, K, 32):
            ss += sm[O + j] * sm[O + j]
        ss = warp_sum(ss)
        if lane == 0:
            sm[SC + 3] = cute.math.rsqrt(ss / Float32(K) + eps)
    cta_sync()
    for j in cutlass.range(tid, K, NT):
        e = b * HK + h * K + j
        o = sm[O + j] * sm[SC + 3] * ldf(BFloat16, onorm + Int64(j) * 2) * sigmoid(ldf(Float32, fa(fb, gate_off + e)))
        stf(Float32, fa(fb, out_off + e), o)
