"""Constants and device helpers shared by the megakernel's opcode bodies. Global memory is reached by address
(the arenas' bases and the tensor table's entries are Int64), so one body serves every buffer of its kind."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint32

from ...cute_device import (  # noqa: F401  (the generic helpers, re-exported for the bodies)
    _g, from_bits, ldf, ldi, ldi64, ldu8, sigmoid, silu, situ, sti, stf, warp_argmax, warp_max, warp_sum,
)
from ...cute_frag import frag_block, frag_dec, frag_scale, lds4, mma  # noqa: F401  (re-exported for the bodies)
from ....quant.mxfp4_frag import MAG_AT, MAG_MASK, RECORD, SIGN_AT, SIGN_MASK, WBYTES  # noqa: F401
from ..isa import F_STAGE as F_STAGE_BIT, HEADER, OPS, PASS, ROW, TLW, W_STAGE
from ..limits import BODY_I, NT, RING_PAGE, RING_SLOTS, SMEM_F, SMEM_I

NW = NT // 32
TB = PASS  # tokens (or expert pairs) per pass of a dot-product loop
CH = 64  # cache positions scored per attention chunk
RING_BYTES = RING_SLOTS * RING_PAGE
SMEM_BYTES = 4 * (SMEM_F + SMEM_I)  # the working memory; the ring build adds the ring, its mbarriers and alignment
SMEM_RING_BYTES = SMEM_BYTES + RING_BYTES + 8 * RING_SLOTS + 128
ROW_S = SMEM_I - 64  # the current instruction's row; SMEM_I - 1: its waits were satisfied
NEXT_S = BODY_I  # the next instruction's row, copied (cp.async) while the current one runs; a body's int words
# are [0, BODY_I) (limits.py)
IDX_S = SMEM_I - 24  # the current instruction's index
TL_S = SMEM_I - 4  # 2 int words: the timeline buffer's address in timeline builds (0 otherwise), for `mark`
FLAG_S = SMEM_I - 8  # an int word a body shares over its CTA (ROUTE: its batch-1 path taken)
ERR_S = SMEM_I - 20  # 2 int words: the error buffer's address (the weight ring's timeouts report through it)
# The weight ring's int words (RING_S + k): k = 3 pages freed (consumed: their slots may be refilled), 4 the current
# instruction's first page, 5 the ring's shared address, 6 its mbarriers' shared address, 7 the launch's spin limit
RING_S = SMEM_I - 72
LOADER = NT  # the ring build's loader warp (threads NT .. NT + 31, beside the NW compute warps): its lane 0 issues
# the ring's copies
NTL = NT + 32  # threads the ring build launches a CTA


def block_threads(ring: bool) -> int:
    """Threads a CTA of the build launches: the compute warps, and the ring's loader warp."""
    return NTL if ring else NT


def block_smem(ring: bool) -> int:
    """Shared memory bytes a CTA of the build takes."""
    return SMEM_RING_BYTES if ring else SMEM_BYTES
NEG_INF = float("-inf")

ARG = {name: {a: HEADER + i for i, a in enumerate(args)} for name, (_, args) in OPS.items()}


@cute.jit
def cta_sync():
    """A block barrier of the NW compute warps (named barrier 1, NT threads): the loader warp never joins one."""
    cute.arch.inline_ptx("bar.sync 1, {$r0};", read_only_args=[Int32(NT)])


@cute.jit
def mark(smi: cute.Tensor, idx: Int32, k: Constexpr):
    """In a timeline build, stamp mark k (0..3) of instruction idx with the globaltimer (ns): the calling thread's
    progress through its body, for `MegaRuntime.timeline_rows`' "marks". A no-op otherwise. One thread calls it."""
    lo = Int64(smi[TL_S]) & Int64(0xFFFFFFFF)
    base = (Int64(smi[TL_S + 1]) << Int64(32)) | lo
    if base != Int64(0):
        t = cute.make_tensor(_g(base + Int64(TLW * idx + 4 + k) * 8, Int64, 8), cute.make_layout(1))
        t[0] = Int64(cute.arch.globaltimer())


@cute.jit
def e8m0(s: Uint32) -> Float32:
    """An MXFP4 block scale byte as fp32 2**(s - 127), exactly (s = 0: the subnormal 2**-127; 255: NaN)."""
    bits = s << 23
    if s == Uint32(0):
        bits = Uint32(0x00400000)
    if s == Uint32(255):
        bits = Uint32(0x7FC00000)
    return from_bits(bits)


# e2m1x8: per pair of nibbles (j, j + 4) the left shifts (negative: right) that take the magnitude bits 4j..4j+2 to
# 9..11 and the sign bit 4j+3 to 15 (nibble j + 4's to 25..27 and 31, the high fp16 half), and the masks after them
E2M1X8_SHIFTS = tuple((9 - 4 * j, 12 - 4 * j) for j in range(4))
E2M1X8_MAG, E2M1X8_SIGN = 0x0E000E00, 0x80008000


@cute.jit
def h2f(h: Uint32):
    """The two fp16 halves of h (low, high) as fp32, exactly."""
    return cute.arch.inline_ptx("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, {$r0}; cvt.f32.f16 {$w0}, lo; "
                                "cvt.f32.f16 {$w1}, hi; }", write_only_types=[Float32, Float32], read_only_args=[h])


@cute.jit
def bf16x2_split(x0: Float32, x1: Float32):
    """x0 and x1 as bf16 pairs hi + lo (words, x0 in the low halves, as bf16x2 packs them): hi the values rounded to
    bf16 (nearest even), lo their remainders x - hi (exact in fp32) rounded to bf16 alike, so hi + lo is within
    2**-16 of x relatively (isa.tc_input). A product summed over both pairs then barely depends on where x falls
    against a bf16 rounding boundary."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 h, e0, e1; .reg .f32 f0, f1; cvt.rn.bf16x2.f32 h, {$r1}, {$r0}; shl.b32 e0, h, 16; "
        "and.b32 e1, h, 0xFFFF0000; mov.b32 f0, e0; mov.b32 f1, e1; sub.rn.f32 f0, {$r0}, f0; "
        "sub.rn.f32 f1, {$r1}, f1; "
        "cvt.rn.bf16x2.f32 {$w1}, f1, f0; mov.b32 {$w0}, h; }",
        write_only_types=[Uint32, Uint32], read_only_args=[x0, x1])


@cute.jit
def f16x2_split(x0: Float32, x1: Float32):
    """x0 and x1 (scaled so that fp16 holds them: moe.stage_row) as fp16 pairs hi + lo (words, x0 in the low
    halves): hi rounded to nearest even, lo the remainder x - hi (exact in fp32) rounded alike, ~22 bits in all."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 h; .reg .b16 a, b; .reg .f32 f0, f1; cvt.rn.f16x2.f32 h, {$r1}, {$r0}; mov.b32 {a, b}, h; "
        "cvt.f32.f16 f0, a; cvt.f32.f16 f1, b; sub.rn.f32 f0, {$r0}, f0; sub.rn.f32 f1, {$r1}, f1; "
        "cvt.rn.f16x2.f32 {$w1}, f1, f0; mov.b32 {$w0}, h; }",
        write_only_types=[Uint32, Uint32], read_only_args=[x0, x1])


@cute.jit
def ld4w(addr: Int64):
    """16 bytes of fragment-order records (static) as 4 words: a plain, coherent load that does not allocate in L1,
    so a stream of weights read once does not evict the activations the bodies read again."""
    return cute.arch.inline_ptx("ld.global.L1::no_allocate.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[addr])


@cute.jit
def sts1(addr: Int32, v: Uint32):
    """One word into shared memory at byte address addr."""
    cute.arch.inline_ptx("st.shared.u32 [{$r0}], {$r1};", read_only_args=[addr, v])


@cute.jit
def f32_bits(x: Float32) -> Int32:
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Int32], read_only_args=[x])


@cute.jit
def e2m1x8(word: Uint32, wr: cute.Tensor):
    """The 8 e2m1 codes of one packed MXFP4 word (nibble j: element j) times 2**-14, exactly, into wr: nibbles j and
    j + 4 become the two fp16 halves of one register (magnitude bits e1 e0 m to 11..9, the sign to 15, with the same
    two shifts for both halves), which is the e2m1 value times 2**-14 (fp16's subnormals carry e = 0), then each
    half is converted. 4 operations per weight with the multiply, where an fp32 subnormal decode takes 8: the block
    scale (and the 2**14) is applied once to a block's sum instead (`mx_scale`)."""
    for j in cutlass.range_constexpr(4):
        sm, ss = E2M1X8_SHIFTS[j]
        mag = (word << Uint32(sm)) if cutlass.const_expr(sm >= 0) else (word >> Uint32(-sm))
        sgn = (word << Uint32(ss)) if cutlass.const_expr(ss > 0) else word
        lo, hi = h2f((mag & Uint32(E2M1X8_MAG)) | (sgn & Uint32(E2M1X8_SIGN)))
        wr[j] = lo
        wr[j + 4] = hi


@cute.jit
def mx_scale(s: Float32, sc: Uint32) -> Float32:
    """A block's sum of e2m1x8 weights times inputs, times 2**14 and its e8m0 scale byte: both powers of two, so
    exact where no overflow or underflow."""
    return s * Float32(16384.0) * e8m0(sc)


@cute.jit
def ld4u32(addr: Int64):
    """4 consecutive 32-bit words (16-byte aligned) in one load: an MXFP4 block of 32 weights (mx8_word each)."""
    return cute.make_tensor(_g(addr, Uint32, 16), cute.make_layout(4)).load()


@cute.jit
def ld8(dtype: Constexpr, addr: Int64):
    """8 consecutive elements (16-byte aligned for 16-bit types, 32-byte for fp32) as fp32."""
    return cute.make_tensor(_g(addr, dtype, 16), cute.make_layout(8)).load().to(Float32)


@cute.jit
def st8f(addr: Int64, v):
    """Store 8 fp32 values (a TensorSSA of 8) to 8 consecutive fp32 elements (16-byte aligned)."""
    cute.make_tensor(_g(addr, Float32, 16), cute.make_layout(8)).store(v)


@cute.jit
def ld8raw(dtype: Constexpr, addr: Int64):
    """8 consecutive 16-bit elements (16-byte aligned) as they are: a load whose conversion waits for its use."""
    return cute.make_tensor(_g(addr, dtype, 16), cute.make_layout(8)).load()


@cute.jit
def ld4bf(addr: Int64):
    """4 consecutive bf16 (8-byte aligned) as fp32."""
    return cute.make_tensor(_g(addr, BFloat16, 8), cute.make_layout(4)).load().to(Float32)


@cute.jit
def sm8(sm: cute.Tensor, i: Int32):
    return cute.make_tensor(sm.iterator + i, cute.make_layout(8)).load()


@cute.jit
def dot8(a, b) -> Float32:
    return (a * b).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


@cute.jit
def hash32(seed: Uint32, b: Uint32, v: Uint32) -> Uint32:
    x = seed * Uint32(0x9E3779B1) + b * Uint32(0x85EBCA77) + v * Uint32(0xC2B2AE3D)
    x = x ^ (x >> 16)
    x = x * Uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * Uint32(0x846CA68B)
    return x ^ (x >> 16)


@cute.jit
def row_copy16(dst: Int32, src: Int64):
    """Start an asynchronous copy of 16 bytes of the instruction stream (static: cp.async reads only what the
    audit proves static) from global src into shared dst (both 16-byte aligned), through L2 (.cg)."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[dst, src])


@cute.jit
def row_copies_landed():
    """Wait until this thread's cp.async copies have landed (their bytes are then visible to this thread)."""
    cute.arch.inline_ptx("cp.async.wait_all;")


@cute.jit
def arg(smi: cute.Tensor, j: Constexpr) -> Int32:
    """Word j of the current instruction (copied into shared memory while thread 0 waits)."""
    return smi[ROW_S + j]


def args(smi: cute.Tensor, op: str, names: str) -> tuple:
    """The named words of the current instruction of opcode `op` (isa.OPS' argument names, space-separated), in order."""
    return tuple(arg(smi, ARG[op][n]) for n in names.split())


def tensors(tab: cute.Tensor, smi: cute.Tensor, op: str, names: str) -> tuple:
    """The base addresses of the named tensor arguments (words that index an address table: wtab or ptab)."""
    return tuple(tab[a] for a in args(smi, op, names))


@cute.jit
def argf(smi: cute.Tensor, j: Constexpr) -> Float32:
    """Word j of the current instruction, as the fp32 whose bits it holds."""
    return from_bits(Uint32(smi[ROW_S + j]))


@cute.jit
def fa(fb: Int64, e) -> Int64:
    """Address of fp32 arena element e."""
    return fb + Int64(e) * 4


@cute.jit
def ia(ib: Int64, e) -> Int64:
    """Address of int32 arena element e."""
    return ib + Int64(e) * 4


@cute.jit
def rope_pair(a: Float32, b: Float32, pos: Int32, inv: Float32, att: Float32):
    f = Float32(pos) * inv
    cs = cute.math.cos(f) * att
    sn = cute.math.sin(f) * att
    return a * cs - b * sn, b * cs + a * sn


@cute.jit
def rope_index(i: Int32, half: Int32, interleaved: cutlass.Boolean):
    """(first, second) element of rotation pair i: (2i, 2i + 1) interleaved, else (i, i + half)."""
    a, b = i, i + half
    if interleaved:
        a, b = 2 * i, 2 * i + 1
    return a, b


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


# ---- the weight ring ----------------------------------------------------------------------------------------
# RING_SLOTS pages of RING_PAGE bytes of shared memory a CTA. The pages of the CTA's staged instructions (isa.F_STAGE:
# each one's static bytes, words 10..12, cut into RING_PAGE pieces) are numbered in queue order, page n in slot
# n % RING_SLOTS, completing phase n // RING_SLOTS of that slot's mbarrier. The loader warp's lane 0 walks the queue's
# staged instructions (row word W_STAGE) and issues their pages with cp.async.bulk (the copy engine: static weights
# only, which the audit proves per copy, as it does the non-coherent loads) as far ahead as free slots allow; it never
# waits on a counter, so the weights of later instructions stream while the compute warps wait and compute. The
# compute warps wait on a page's mbarrier (bounded), read it with shared loads, and free pages in order: a block
# barrier of the compute warps after the reads, then thread 0's release store of the pages freed, which the loader
# acquires before it refills a slot.


@cute.jit
def nap(max_ns: Int32, a: Int32, b: Int32, c: Int32):
    """Sleep a pseudo-random 0..max_ns ns (the debug build's delays that shake out ordering bugs)."""
    ns = hash32(Uint32(a), Uint32(b), Uint32(c)) % Uint32(max_ns)
    cute.arch.inline_ptx("nanosleep.u32 {$r0};", read_only_args=[Int32(ns)])


@cute.jit
def ld_acquire_shared(addr: Int32) -> Int32:
    return cute.arch.inline_ptx("ld.acquire.cta.shared.u32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[addr])


@cute.jit
def free_pages(smi: cute.Tensor, upto: Int32):
    """Thread 0, after a block barrier of the compute warps that follows every read of pages < upto: hand them to
    the loader (a release store it acquires)."""
    cute.arch.inline_ptx("st.release.cta.shared.u32 [{$r0}], {$r1};",
                         read_only_args=[Int32(smi.iterator.toint()) + (RING_S + 3) * 4, upto])


@cute.jit
def ring_init(smi: cute.Tensor, ring: Int32, mbar: Int32, err: Int64, max_spin: Int32):
    """Thread LOADER, once a launch, before the barrier of all threads: the slots' mbarriers (one arrival a phase:
    the loader's expect_tx) and the ring's words."""
    for k in cutlass.range_constexpr(RING_SLOTS):
        cute.arch.inline_ptx("mbarrier.init.shared::cta.b64 [{$r0}], 1;", read_only_args=[mbar + k * 8])
    cute.arch.mbarrier_init_fence()
    smi[RING_S + 3] = Int32(0)
    smi[RING_S + 4] = Int32(0)
    smi[RING_S + 5] = ring
    smi[RING_S + 6] = mbar
    smi[RING_S + 7] = max_spin
    smi[ERR_S] = Int32(err & Int64(0xFFFFFFFF))
    smi[ERR_S + 1] = Int32(err >> Int64(32))


@cute.jit
def ring_pages(nbytes: Int32) -> Int32:
    """The pages a staged instruction of nbytes static bytes takes."""
    return (nbytes + RING_PAGE - 1) // RING_PAGE


@cute.jit
def err_addr(smi: cute.Tensor) -> Int64:
    return (Int64(smi[ERR_S + 1]) << Int64(32)) | (Int64(smi[ERR_S]) & Int64(0xFFFFFFFF))


@cute.jit
def report_ring_timeout(smi: cute.Tensor, idx: Int32, what: Int32, page: Int32):
    """A ring wait past its limit, recorded as a counter's timeout is: err[2] = what (-2: a page that did not land,
    -3: the loader waiting for a free slot), err[3] the page; the abort flag raised (runtime.MegaRuntime.check)."""
    ea = err_addr(smi)
    old = cute.arch.atomic_cas(_g(ea, Int32, 4).llvm_ptr, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
    if old == 0:
        sti(ea + 4, idx)
        sti(ea + 8, what)
        sti(ea + 12, page)
        sti(ea + 16, Int32(0))


@cute.jit
def aborted(smi: cute.Tensor) -> Int32:
    """The launch's abort flag (err[0]): a wait somewhere timed out."""
    return cute.arch.load(_g(err_addr(smi), Int32, 4).llvm_ptr, Int32, sem="relaxed", scope="gpu")


@cute.jit
def staged_pages(smi: cute.Tensor) -> Int32:
    """The ring pages the current instruction (its row in shared memory) consumes: 0 unless F_STAGE (a MATVEC):
    its static bytes in pages."""
    npg = Int32(0)
    if (smi[ROW_S + 3] & F_STAGE_BIT) != 0:
        npg = ring_pages(smi[ROW_S + 12] * 16)
    return npg


# The loader keeps at most RING_INFLIGHT pages in flight: page n is issued once page n - RING_INFLIGHT landed. With
# every slot's copy in flight at once, 132 CTAs request a ring each (21 MiB, ~5-6 us of HBM) whenever a phase frees
# its pages, and the latency-bound loads of the phases that run meanwhile (attention's q and cache rows, the
# experts' rows) queue behind that burst; two pages (4 MiB GPU-wide) keep the stream near the HBM's rate with a
# shallow queue (qwen3-30b-a3b batch 1 on the H200, bench/mega_sync_ab.py: launch median 4236 against 4335 us).
RING_INFLIGHT = 2
assert 0 < RING_INFLIGHT <= RING_SLOTS


@cute.jit
def loader_gives_up(smi: cute.Tensor, spins: Int32, lim: Int32, j: Int32, n: Int32) -> Int32:
    """A loader's bounded wait after `spins` polls: 1 when it gives up, past `lim` (reported: -3, page n of
    instruction j) or once the launch aborted."""
    stop = Int32(0)
    if spins > lim:
        report_ring_timeout(smi, j, Int32(-3), n)
        stop = Int32(1)
    elif aborted(smi) != 0:
        stop = Int32(1)
    return stop


@cute.jit
def issue_page(smi: cute.Tensor, n: Int32, src: Int64, sz: Int32, lim: Int32, j: Int32, delay_ns: Int32,
               epoch: Int32, bid: Int32):
    """The loader: page n (sz bytes from src, static) into slot n % RING_SLOTS once the slot is free (pages freed
    acquired from the compute warps; sleeping between polls) and page n - RING_INFLIGHT landed (its slot's mbarrier,
    not yet refilled: n - RING_INFLIGHT > n - RING_SLOTS), both bounded by lim (then reported, -3); its mbarrier
    told to expect the bytes (the arrival), one bulk copy completing it. (n + 1, 0) when issued; (n, 1) when it gave
    up (a timeout, or the launch aborted)."""
    freed_at = Int32(smi.iterator.toint()) + (RING_S + 3) * 4
    spins = Int32(0)
    stop = Int32(0)
    while n - ld_acquire_shared(freed_at) >= RING_SLOTS and stop == 0:
        cute.arch.inline_ptx("nanosleep.u32 64;")
        spins += 1
        stop = loader_gives_up(smi, spins, lim, j, n)
    if cutlass.const_expr(RING_INFLIGHT < RING_SLOTS):
        if n >= RING_INFLIGHT and stop == 0:
            m = n - RING_INFLIGHT
            mb0 = smi[RING_S + 6] + (m % RING_SLOTS) * 8
            while page_landed(mb0, (m // RING_SLOTS) & 1) == 0 and stop == 0:
                spins += 1
                stop = loader_gives_up(smi, spins, lim, j, n)
    if stop == 0:
        if delay_ns > 0:
            nap(delay_ns, n, epoch, bid * 4 + 3)
        slot = n % RING_SLOTS
        mb = smi[RING_S + 6] + slot * 8
        cute.arch.inline_ptx("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{$r0}], {$r1};", read_only_args=[mb, sz])
        cute.arch.inline_ptx("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{$r0}], [{$r1}], "
                             "{$r2}, [{$r3}];", read_only_args=[smi[RING_S + 5] + slot * RING_PAGE, src, sz, mb])
        n += 1
    return n, stop


@cute.jit
def loader(pb: Int64, wtab: cute.Tensor, smi: cute.Tensor, first: Int32, delay_ns: Int32, epoch: Int32, bid: Int32):
    """The loader warp's lane 0: from the first staged instruction (`first`, -1: none) along the W_STAGE chain, every
    page in order (issue_page: a page waits for a free slot only). A MATVEC's pages are its static bytes (words
    10..12) cut into RING_PAGE pieces.
    The rows of the instruction stream are static: plain loads. Waits are bounded (64 x the spin limit) and give up
    when the launch aborted; then it waits (bounded) until its last pages landed, so that no copy writes the CTA's
    shared memory after its threads exit. The debug build (delay_ns > 0) sleeps a random while before each page."""
    lim = smi[RING_S + 7] * 64
    j = first
    n = Int32(0)
    stop = Int32(0)
    while j >= 0 and stop == 0:
        row = pb + Int64(j) * (ROW * 4)
        nb = ldi(row + 12 * 4) * 16  # a batch-1 MATVEC (Program.stageable)
        src = wtab[ldi(row + 10 * 4)] + Int64(ldi(row + 11 * 4)) * 16
        pg = Int32(0)
        while pg < ring_pages(nb) and stop == 0:
            n, stop = issue_page(smi, n, src + Int64(pg) * RING_PAGE,
                                 cutlass.min(Int32(RING_PAGE), nb - pg * RING_PAGE), lim, j, delay_ns, epoch, bid)
            pg += 1
        j = ldi(row + W_STAGE * 4)
    for q in cutlass.range(cutlass.max(n - RING_SLOTS, 0), n):
        page_wait(smi, q, Int32(-1))


@cute.jit
def page_landed(mbar: Int32, parity: Int32) -> Int32:
    """1 when the mbarrier at shared address mbar completed its phase of this parity (one try_wait: the hardware
    may suspend the thread a while before it answers 0)."""
    return cute.arch.inline_ptx("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{$r0}], {$r1}; "
                                "selp.b32 {$w0}, 1, 0, p; }", write_only_types=[Int32], read_only_args=[mbar, parity])


@cute.jit
def page_wait(smi: cute.Tensor, page: Int32, idx: Int32):
    """Wait until ring page `page` landed, bounded by the launch's spin limit, giving up once the launch aborted
    (a page its loader stopped before): past the limit the timeout is recorded (report_ring_timeout, -2) and the
    caller reads whatever the slot holds, in a launch reported failed."""
    mb = smi[RING_S + 6] + (page % RING_SLOTS) * 8
    par = (page // RING_SLOTS) & 1
    ok = page_landed(mb, par)
    spins = Int32(0)
    lim = smi[RING_S + 7]
    stop = Int32(0)
    while ok == 0 and spins < lim and stop == 0:
        ok = page_landed(mb, par)
        spins += 1
        if ok == 0:
            stop = aborted(smi)
    if ok == 0 and stop == 0:
        report_ring_timeout(smi, idx, Int32(-2), page)


@cute.jit
def lds4u(addr: Int32):
    """4 words of shared memory at a 16-byte aligned address, as they are (a page's 8 bf16)."""
    return cute.arch.inline_ptx("ld.shared.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[addr])
