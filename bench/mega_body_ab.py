"""The megakernel's opcode bodies (backends/mega/cute/) against alternatives, by launch time on the GPU, as
bench/mega_sync_ab.py measures the loop: each variant is a build of the kernel with module-level names swapped for
one compile (the shipped source holds no switch), first diffed against pyvm (validate.mega_gpu.diff_program on
--check-preset at --check-batch (1 and 3), delayed launches included), then timed on --preset in interleaved rounds
(mega_sync_ab.timed). Medians to --out as JSON.

    git show ae62ae9:megadecode/backends/mega/cute/moe.py > /tmp/moe_before.py
    python bench/mega_body_ab.py --bodies-from /tmp/moe_before.py --variants shipped,bodies,up_r4,down_u16 \
        --preset qwen3-30b-a3b --batch 1,8 --out $OUT/mega-body-ab.json
    python bench/mega_body_ab.py --audit --variants up_r4,down_u16   # no GPU: the static audit of each

A variant is a list of (module, name, replacement) swaps (`_swaps`); `shipped` is the kernel as it is. Variants:
- `bodies`: bf16 EXPERT_UP's and EXPERT_DOWN's row bodies (`expert_up_rows`, `expert_down_rows`) of another
  cute/moe.py (--bodies-from, e.g. an earlier commit's, read with `git show`): a body change measured against the
  one it replaced, in the same call.
- `up_r4`: EXPERT_UP's one-pair path with 4 rows a warp and one chunk of each in flight (cute/moe.py's RU_UP = 4,
  WU_UP = 1; shipped: 2 rows, 2 chunks).
- `down_u16`: EXPERT_DOWN's flat bf16 units of 16 rows (RU_DN = 16; shipped: 8).
- `up_w4`: EXPERT_UP's one-pair path with 4 chunks of each of its rows in flight a lane (WU_UP = 4: 8 KiB a warp).
- `down_w3`: EXPERT_DOWN's flat bf16 units with 3 chunks of each of their rows in flight a lane (WU_DN = 3: 12 KiB a
  warp; at qwen3-30b-a3b's I = 768 a unit's whole rows in one round).
- `attn_early`: an ATTN_GQA instruction issues the loads of its split's first chunk (the positions before the
  token's own: written by earlier launches) right after its wait, beside q's and k's loads, and folds them after
  the norms, RoPE and the cache write; the shipped body loads the chunk after those (cute/attention.py
  gqa_chunk), a dependent trip of 32 KB on every instruction's path. The token's own position, where the split
  holds it, stays in the chunk loop (its row is written by the instruction itself). Measured at 6f6d217 on an H100:
  5147 against 4786 us at batch 1 (bench/results/mega-body-ab-attn-early-nvidia-h100.json): not landed.
- `tc_warps`: F_TC MATVEC / GLU past 8 tokens with a row group's token groups dealt to its warps (each over the
  whole K, no k-slice partials), the rows outer: the shipped tc_rows passes over every row once per 8 tokens.
  Measured at 6f6d217 on an H100 (its form moved into cute/dense.py, against the passes): 26954 against 25125 us at
  batch 17, 42270 against 42770 at 64 (bench/results/mega-body-ab-tc-warps-nvidia-h100.json): not landed.
- `attn_warp`: ATTN_GQA's chunks through shared memory (cp.async, two buffers of 32 positions, the next one's
  copies in flight while this one computes) with a warp a q head: one barrier a chunk where gqa_chunk has three and
  waits for its next loads after its arithmetic (at qwen3-30b-a3b batch 64 the instruction's chunks are 96 of its
  104 us: `docs/evidence/qwen3-30b-a3b-timeline-b64-h100.txt`). Two-CTA build 128 registers, ring build 168, audit
  clean, on the CPU:

      python bench/mega_body_ab.py --variants shipped,attn_warp --batch 1,17,64 --check-batch 1,3,17

- `merge_one`: MERGE of a single split (S == 1: qwen3-30b-a3b's heads from batch 45 on 264 CTAs, Builder.splits;
  the tiny check preset's at 33 on 16) as acc / sum, a thread its elements in one trip, no barrier (the same bits
  as the shipped body's general path there, which runs three barriers and its maxima's trip first); at batch 64 the
  phase is 2048 of them, 8 a CTA, 1.9 us each. Two-CTA build 128 registers, ring build 168, audit clean, on the
  CPU:

      python bench/mega_body_ab.py --variants shipped,merge_one --batch 64 --check-batch 33,3

- `tables_match`: ROUTE's tables with each pick's rank by match.any within its warp and the warps' counts, where
  the shipped loop compares every pair of picks (the tables' instruction: 19.6 us a layer at qwen3-30b-a3b batch
  64, on one CTA). Its two-CTA build takes 239 registers (see TABLES_NEW); under `capped`, 128:

      python bench/mega_body_ab.py --variants shipped,capped,capped+tables_match --batch 64,17 --check-batch 17,33
- `capped`: the two-CTA build compiled for two CTAs an SM (min_blocks_per_mp = 2: ptxas holds it to 128
  registers) rather than left to ptxas's choice; joined with a body variant that the choice takes to ~240
  (`capped+tables_match`) it makes that variant measurable, and `shipped,capped` says what the cap costs.
- `tc_hi`, `group_hi` (diagnostics, never to land): the tensor-core step (dense.py tc_step) with each k half's mma
  against the input's high bf16 half only, in MATVEC / GLU past batch 1 (`tc_hi`) or in F_GROUP's experts
  (`group_hi`): half the mma and none of the low half's conversions, the same loads. Their pyvm checks may fail
  (the input rounded to bf16; the A/B times every variant and records each check's result); their times say how
  much of those phases is the step's arithmetic rather than its loads:

      python bench/mega_body_ab.py --variants shipped,tc_hi,group_hi --batch 17,64,8 --check-batch 17

- `wna`, `group_wna`: the tensor-core step's weight loads not allocating in L1 (base.ld4w, the K3 experts' load),
  in MATVEC / GLU past batch 1 and the F_GROUP experts (`wna`) or the experts only (`group_wna`): the streamed
  rows then leave L1 to the inputs every warp of the CTA reads again:

      python bench/mega_body_ab.py --variants shipped,wna,group_wna --batch 64,17 --check-batch 17

- `group_cp`, `group_ring`: the F_GROUP experts' weights copied (cp.async) a few steps ahead into each warp's share
  of the working memory (`group_cp`: 3 EXPERT_UP stages; its two-CTA build is 228 registers uncapped, so measure it
  as `capped+group_cp` beside `capped`) or of the weight ring (`group_ring`: 10 stages; the ring build only, so
  with `--ring-all`):

      python bench/mega_body_ab.py --variants shipped,capped,capped+group_cp --batch 64,17 --check-batch 17,33
      python bench/mega_body_ab.py --ring-all --variants shipped,group_ring --batch 64,17 --check-batch 17,33

- `mv_ring`: F_TC MATVEC / GLU's k slices (dense.py tc_rows) streamed the same way through the ring (19 steps
  ahead, GLU 9); the ring build only; joins with group_ring:

      python bench/mega_body_ab.py --ring-all --variants shipped,group_ring,mv_ring,group_ring+mv_ring --batch 64,17,8

- `mv_cp`: mv_ring's copies into each warp's 4 KiB of the working memory (MATVEC 3 steps ahead, GLU 1), so the
  two-CTA build (the executor's past batch 1) runs them; joins with group_cp:

      python bench/mega_body_ab.py --variants shipped,capped,capped+mv_cp,capped+group_cp+mv_cp --batch 64,17,8

  `mv_cp0`: the same with each step's input loaded at the step, not held a step ahead (under the cap mv_cp's held
  input goes to local memory and back every step).

- `raw_wna`: the CUDA-core bodies' weight loads (batch 1's MATVEC / GLU rows outside the ring, the one-pair
  experts, EXPERT_DOWN's flat units, K3's MXFP4 rows) not allocating in L1, as `group_wna` keeps the F_GROUP
  experts' (with `capped`: 5.6% faster at batch 64): the inputs the CTA's warps share keep L1:

      python bench/mega_body_ab.py --variants shipped,raw_wna --batch 1,8,17 --check-batch 1,3,17

- `kv_wna`: ATTN_GQA's cache rows (gqa_loads: the keys' 16-byte and the values' 8-byte loads) not allocating in
  L1: each chunk's rows are read once an instruction, beside q and the scores every thread of the CTA reads again.
  The cache is written in the launch (the token's own row, by the instruction that reads it), so these stay
  plain coherent loads (`ld.global`, after the wait's acquire), only their L1 allocation changes:

      python bench/mega_body_ab.py --variants shipped,kv_wna --batch 1,17,64 --check-batch 1,3,17

- (`up_flat`, a routed batch-1 EXPERT_UP item's units dealt flat across the pairs it straddles, measured here at
  0ce3026 on an H100: 4862 against 4925 us, is cute/moe.py's `up_routed_rows` since.)
Variants join with `+` (`up_w4+down_w3`: both swaps in one build). The ring build (one CTA an SM, 8 compute warps)
keeps half the two-CTA build's loads in flight in these phases, which the deeper variants would give back; measured
at 97c28fe on the H200, they do not pay (docs/megakernel.md, "The abort flag polled every 32 polls"). The A/B builds
the ring build (compile_launcher's default), which batch 1 runs.
Each variant's build should pass the static audit (`--audit`) before it is timed.

Measured before (docs/megakernel.md, "The one-pair expert bodies"): at 8ac6cae the units this file then swapped
in (EXPERT_DOWN's flat units of 4 / 8 rows where the body took 2; EXPERT_UP's one-pair path with 2 rows a warp where
it took 1; `git show 8ac6cae:bench/mega_body_ab.py`), bench/results/mega-body-ab-nvidia-h200.json; the two that
paid are cute/moe.py's since. At 1e8d862 (bench/results/mega-body-ab-b1-64-nvidia-h200.json): `up_r4` and
`down_u16` slower at every batch, `down_flat8` 11% faster at batch 64 (cute/moe.py's FLAT_PAIRS since). Before
that, the MXFP4 bodies' conversions (`git show cacde6b:bench/mega_frag_ab.py`).
"""

from __future__ import annotations

from megadecode.backends.mega.runtime import compile_launcher
from mega_sync_ab import (  # bench/: options, swaps, timing
    ab_parser, ab_variants, edited_module, module_from_file, run_ab, swapped)

VARIANTS = ("shipped", "bodies", "up_r4", "down_u16", "up_w4", "down_w3", "attn_early", "tc_warps", "tc_hi",
            "group_hi", "attn_warp", "merge_one",
            "tables_match", "capped", "wna", "group_wna", "group_cp", "group_ring", "mv_ring", "mv_cp",
            "mv_cp0", "raw_wna", "kv_wna")
BODIES_FROM = None  # --bodies-from: the cute/moe.py whose row bodies the `bodies` variant builds


def _bodies_module():
    """--bodies-from loaded as a module of the cute package (its relative imports resolve as the shipped file's)."""
    return module_from_file("megadecode.backends.mega.cute._moe_from", BODIES_FROM, "--bodies-from", "a cute/moe.py")


def _bodies_swap(ops: dict) -> list[tuple[object, str, object]]:
    """The swap of cute_kernel.BODIES with the opcodes in `ops` (name -> body) replaced, the rest as shipped."""
    from megadecode.backends.mega import cute_kernel as K

    return [(K, "BODIES", tuple((n, ops.get(n, f)) for n, f in K.BODIES))]


def _swaps(name: str) -> list[tuple[object, str, object]]:
    """The variant's swaps (none for `shipped`)."""
    from megadecode.backends.mega.cute import moe as M

    if "+" in name:
        return [s for part in name.split("+") for s in _swaps(part)]
    if name == "shipped":
        return []
    if name == "bodies":
        B = _bodies_module()
        return [(M, "expert_up_rows", B.expert_up_rows), (M, "expert_down_rows", B.expert_down_rows)]
    if name == "up_r4":
        return [(M, "RU_UP", 4), (M, "WU_UP", 1)]
    if name == "down_u16":
        return [(M, "RU_DN", 16)]
    if name == "up_w4":
        return [(M, "WU_UP", 4)]
    if name == "down_w3":
        return [(M, "WU_DN", 3)]
    if name == "attn_early":
        return _bodies_swap({"ATTN_GQA": _attn_early_module().op_attn_gqa})
    if name == "tc_warps":
        mod = _tc_warps_module()
        return _bodies_swap({"MATVEC": mod.op_matvec, "GLU": mod.op_glu})
    if name == "attn_warp":
        return _bodies_swap({"ATTN_GQA": _attn_warp_module().op_attn_gqa})
    if name == "merge_one":
        return _bodies_swap({"MERGE": _merge_one_module().op_merge})
    if name == "capped":
        from megadecode.backends.mega import cute_kernel as K

        return [(K, "launch", _capped_launch())]
    if name == "tables_match":
        from megadecode.backends.mega.cute import moe

        return [(moe, "route_tables", _tables_match_module().route_tables)]
    if name in ("tc_hi", "group_hi"):
        from megadecode.backends.mega.cute import dense, moe

        return [(dense if name == "tc_hi" else moe, "tc_step", _hi_module().tc_step)]
    if name == "mv_ring":
        from megadecode.backends.mega.cute import dense

        return [(dense, "op_rows", _mv_ring_module().op_rows)]
    if name in ("mv_cp", "mv_cp0"):
        from megadecode.backends.mega.cute import dense

        return [(dense, "op_rows", _mv_cp_module(prefetch_x=name == "mv_cp").op_rows)]
    if name in ("group_cp", "group_ring"):
        mod = _group_cp_module() if name == "group_cp" else _group_ring_module()
        return _bodies_swap({"EXPERT_UP": mod.op_expert_up, "EXPERT_DOWN": mod.op_expert_down})
    if name in ("wna", "group_wna"):
        from megadecode.backends.mega.cute import dense, moe

        step = _wna_module().tc_step
        return ([(dense, "tc_step", step)] if name == "wna" else []) + [(moe, "tc_step", step)]
    if name == "raw_wna":
        from megadecode.backends.mega.cute import base, dense, moe

        ld = _raw_wna_module().ld8raw
        return [(dense, "ld8raw", ld), (moe, "ld8raw", ld), (moe, "ld4u32", base.ld4w)]
    if name == "kv_wna":
        from megadecode.backends.mega.cute import attention

        mod = _raw_wna_module()
        return [(attention, "ld8raw", mod.ld8raw), (attention, "ld4raw", mod.ld4raw)]
    raise ValueError(f"unknown variant {name!r}")


# tc_warps: cute/dense.py's tc_rows (F_TC, batch >= 2) with a row group's token groups dealt to its warps past 8
# tokens, each over the whole K (no k slices, no partials through shared memory), the rows outer and the token
# groups inner: the warps of a row group read the same rows about together (the repeats from L1 / L2) where the
# shipped loop makes a pass over every row per 8 tokens. Up to 8 tokens: the shipped k slices. Its tc_rows is
# appended to the module, so the module's op_matvec and op_glu trace it.
TC_WARPS_TAIL = '''


@cute.jit
def tc_rows(w0: Int64, w1: Int64, K: Int32, r0: Int32, r1: Int32, B: Int32, warp: Int32, lane: Int32, gaddr: Int64,
            fb: Int64, x_off: Int32, x2_off: Int32, x_stride: Int32, norm, has_x2, sm: cute.Tensor, flags: Int32,
            out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32, add1: Int32, RS: Constexpr,
            glu: Constexpr):
    """The shipped tc_rows up to 8 tokens; past them, a round's row group rg is taken by its ks warps, warp sl
    the token groups sl, sl + ks, ... over the whole K, storing its own sums."""
    ntg = (B + 7) // 8
    if ntg == 1:
        tc_rows_ks(w0, w1, K, r0, r1, B, warp, lane, gaddr, fb, x_off, x2_off, x_stride, norm, has_x2, sm, flags,
                   out_off, out_stride, out_col, add0, add1, RS, glu)
    else:
        tc_rows_tg(w0, w1, K, r0, r1, B, warp, lane, gaddr, fb, x_off, x2_off, x_stride, norm, has_x2, sm, flags,
                   out_off, out_stride, out_col, add0, add1, RS, glu)


@cute.jit
def tc_rows_tg(w0: Int64, w1: Int64, K: Int32, r0: Int32, r1: Int32, B: Int32, warp: Int32, lane: Int32,
               gaddr: Int64, fb: Int64, x_off: Int32, x2_off: Int32, x_stride: Int32, norm, has_x2, sm: cute.Tensor,
               flags: Int32, out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32, add1: Int32,
               RS: Constexpr, glu: Constexpr):
    g, t = lane // 4, lane % 4
    nrg = (r1 - r0 + 15) // 16
    nsteps = K // TC_K
    ntg = (B + 7) // 8
    acc = cute.make_rmem_tensor(8, Float32)
    UC = TC_UC
    if cutlass.const_expr(glu):
        UC = TC_UC // 2
    smain = nsteps - nsteps % UC
    for rb0 in cutlass.range(0, nrg, NW):
        nr = cutlass.min(NW, nrg - rb0)
        ks = NW // nr
        rg, sl = rb0 + warp % nr, warp // nr
        ra = r0 + rg * 16 + g
        rowa = Int64(cutlass.min(ra, r1 - 1)) * Int64(K) * 2
        rowb = Int64(cutlass.min(ra + 8, r1 - 1)) * Int64(K) * 2
        ntw = ntg
        if sl >= ks:  # the warps past nr * ks idle (a second store of a residual row would add it twice)
            ntw = 0
        for tg in cutlass.range(sl, ntw, ks):
            t0 = tg * 8
            msk = Uint32(0xFFFFFFFF)
            if t0 + g >= B:
                msk = Uint32(0)
            tok = cutlass.min(t0 + g, B - 1)
            xrow = fa(fb, x_off + tok * x_stride)
            x2row = fa(fb, x2_off + tok * x_stride)
            for i in cutlass.range_constexpr(8):
                acc[i] = Float32(0.0)
            for s in cutlass.range(0, smain, UC):
                tc_step(acc, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s * TC_K, t, xrow, x2row, gaddr, norm,
                        has_x2, msk, UC, glu)
            for s in cutlass.range(smain, nsteps):
                tc_step(acc, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s * TC_K, t, xrow, x2row, gaddr, norm,
                        has_x2, msk, 1, glu)
            for h in cutlass.range_constexpr(2):
                for j in cutlass.range_constexpr(2):
                    row, tk = ra + 8 * h, t0 + 2 * t + j
                    if row < r1 and tk < B:
                        store_one(acc[2 * h + j], acc[4 + 2 * h + j], row, tk, sm, fb, flags, norm, out_off,
                                  out_stride, out_col, add0, add1, RS, glu)
'''


def _tc_warps_module():
    """The shipped cute/dense.py with tc_rows renamed tc_rows_ks and TC_WARPS_TAIL's tc_rows appended."""
    from megadecode.backends.mega.cute import dense

    return edited_module("megadecode.backends.mega.cute._tc_warps", dense,
                         [("@cute.jit\ndef tc_rows(", "@cute.jit\ndef tc_rows_ks(")], "tc_warps", TC_WARPS_TAIL)


# merge_one: MERGE of one split (S == 1: qwen3-30b-a3b from batch 45 on 264 CTAs, Builder.splits) as o = acc /
# sum, each thread its elements in one trip, no barrier; the shipped body's three barriers and its loads of the
# splits' maxima and sums first give the same bits there (exp(0) = 1, 0 + acc = acc). At batch 64 the phase is 2048
# such instructions, 8 a CTA, 1.9 us each (docs/evidence/qwen3-30b-a3b-timeline-b64-h100.txt).
MERGE_ONE_FROM = "    MS, WS = SMEM_F - 128, SMEM_F - 64  # S <= 64 (Builder.splits)\n"
MERGE_ONE_TO = "\n\n@cute.jit\ndef op_sample("
MERGE_ONE_FAST = """    if S == 1 and wuv < 0:  # uniform: a thread its elements, no barrier
        den1 = ldf(Float32, fa(fb, base + 1))
        for dd in cutlass.range(tid, d, NT):
            o1 = ldf(Float32, fa(fb, base + 2 + dd)) / den1
            if gate_off >= 0:
                o1 = o1 * sigmoid(ldf(Float32, fa(fb, gate_off + b * out_stride + h * dv + dd)))
            stf(Float32, fa(fb, obase + dd), o1)
    else:
"""


def _merge_one_module():
    """The shipped cute/dense.py whose op_merge takes one split without barriers."""
    from megadecode.backends.mega.cute import dense

    from pathlib import Path

    src = Path(dense.__file__).read_text()
    i = src.index(MERGE_ONE_FROM)
    j = src.index(MERGE_ONE_TO, i)
    general = src[i:j]
    indented = "".join("    " + ln if ln.strip() else ln for ln in general.splitlines(keepends=True))
    return edited_module("megadecode.backends.mega.cute._merge_one", dense,
                         [(general, MERGE_ONE_FAST + indented)], "merge_one")


# tables_match: ROUTE's tables (route_tables) with each pick's rank among the earlier picks of its expert found by
# match.any within its warp, each warp's count of each expert in shared memory, and a running count over rounds of NT
# picks; the shipped loop has each pick compare all n picks (n = 512 at batch 64: 1024 compares a thread; the tables'
# instruction 19.6 us a layer at qwen3-30b-a3b batch 64 on one CTA,
# docs/evidence/qwen3-30b-a3b-timeline-b64-h100.txt). The same ranks and counts (pyvm's tables, exactly: checked
# against the all-pairs definition by a throwaway Python model of the rounds, warps and lanes, not kept: 200 random
# cases up to n = 1024 and E = 896). Shared words: the ids at 0 .. n, the ranks at n .. 2n (as shipped), the warps'
# counts at 2n .. 2n + NW E. NOT READY: the two-CTA build compiles to 239 registers (one CTA an SM) on the CPU, the
# ring build to its 168. Bisected without finding the cause: the loop of rounds with a barrier, match.any,
# lanemask_lt, the ids' float-to-int conversion, each alone beside the shipped loop, stay at 128; the first half of
# the new loop (the zeroing, the ids, the match and the warps' counts) with the shipped rank loop after it already
# takes 239, with any one of those removed too, and with every loop unroll=1.
TABLES_AT = """    for j in cutlass.range(tid, n, NT):
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
"""
TABLES_NEW = """    warp, lane = tid // 32, tid % 32
    WC = 2 * n  # float words: each warp's count of each expert in the round (NW x E)
    for r0 in cutlass.range(0, n, NT):  # rounds of NT picks, the same on every thread
        for e in cutlass.range(tid, NW * E, NT):
            sm[WC + e] = Float32(0.0)
        cta_sync()
        j = r0 + tid
        pe = -1 - lane  # past n: a value no pick and no other lane holds
        if j < n:
            pe = Int32(sm[j])
        grp = cute.arch.match_sync(Uint32(0xFFFFFFFF), pe)  # the warp's lanes with this pick's expert
        lt = grp & cute.arch.lanemask_lt()
        if j < n and lt == Uint32(0):  # the group's first lane: the warp's count
            sm[WC + warp * E + pe] = Float32(cute.arch.popc(grp))
        cta_sync()
        rank, last = Int32(0), Int32(0)
        if j < n:
            before, after = Int32(0), Int32(0)
            for w in cutlass.range_constexpr(NW):
                c = Int32(sm[WC + w * E + pe])
                if w < warp:
                    before += c
                if w > warp:
                    after += c
            rank = smi[CNT + pe] + before + Int32(cute.arch.popc(lt))
            sm[RK + j] = Float32(rank)
            if (grp & cute.arch.lanemask_gt()) == Uint32(0) and after == 0:
                last = Int32(1)  # the expert's last pick of the round: it raises the running count
        cta_sync()  # every pick of the round has read the running counts
        if last == 1:
            smi[CNT + pe] = rank + 1
    cta_sync()
"""


def _tables_match_module():
    """The shipped cute/moe.py whose route_tables ranks the picks with match.any."""
    from megadecode.backends.mega.cute import moe

    return edited_module("megadecode.backends.mega.cute._tables_match", moe, [(TABLES_AT, TABLES_NEW)],
                         "tables_match")


# capped: the two-CTA build compiled for two CTAs an SM (nvvm.minctasm 2: ptxas holds it to 128 registers, spilling
# where a body needs more) instead of left to ptxas's choice, which is 128 today but jumps to ~240 (one CTA an SM)
# on small body changes (tables_match; attn_warp with the next chunk in registers). On the CPU the shipped kernel
# capped is 128 registers with 184 bytes of spill stores against 96 uncapped, and tables_match capped the same 184.
# The carveout is stated (50% of the SM's shared memory: two CTAs' 112 KiB) because the DSL otherwise asks the
# device for it, which a compile without a GPU cannot.
CAPPED_CARVEOUT = 50


def _capped_launch():
    """cute_kernel.launch with min_blocks_per_mp = 2 on the two-CTA build (the ring build as shipped)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from megadecode.backends.mega import cute_kernel as K

    def launch(prog, qstart, qorder, ctr, f32, i32, wtab, ptab, err, max_spin, tl, timeline, delay_ns, num_ctas,
               stream, ring):
        kern = K.mega_kernel(prog, qstart, qorder, ctr, f32, i32, wtab, ptab, err, max_spin, tl, timeline, delay_ns,
                             ring)
        if cutlass.const_expr(ring):
            kern.launch(grid=(num_ctas, 1, 1), block=(K.block_threads(ring), 1, 1), stream=stream)
        else:
            kern.launch(grid=(num_ctas, 1, 1), block=(K.block_threads(ring), 1, 1), stream=stream,
                        min_blocks_per_mp=2, preferred_smem_carveout=CAPPED_CARVEOUT)

    # the shipped launcher's parameter types, as objects (annotations in this module are strings, which the DSL
    # would evaluate in its globals)
    launch.__annotations__ = {
        **{n: cute.Tensor for n in ("prog", "qstart", "qorder", "ctr", "f32", "i32", "wtab", "ptab", "err", "tl")},
        **{n: Int32 for n in ("max_spin", "timeline", "delay_ns", "num_ctas")},
        "stream": K.cuda_drv.CUstream, "ring": cutlass.Constexpr}
    return cute.jit(launch)


# tc_hi / group_hi (diagnostic, not for landing): cute/dense.py's tc_step against the input's high bf16 half only,
# the low half's mma left out (and with it, once the compiler drops the unused half, its conversions)
HI_AT = "            for p in (hi, lo):  # each half twice: against hi, then lo\n"


def _hi_module():
    """The shipped cute/dense.py whose tc_step runs each k half's mma against hi alone."""
    from megadecode.backends.mega.cute import dense

    return edited_module("megadecode.backends.mega.cute._tc_hi", dense,
                         [(HI_AT, "            for p in (hi,):  # the diagnostic: hi alone\n")], "tc_hi")


# wna / group_wna: cute/dense.py's tc_step with its weight loads not allocating in L1 (base.ld4w, as the K3
# fragment-order experts load theirs), so the rows streaming through a step do not take L1 from the inputs the
# CTA's warps read again (Nsight Compute at batch 64: the bf16 experts' loops hold 46% of the stall samples, 84-90%
# of them waiting on loads; L1 hit rate 44%). wna in MATVEC / GLU past batch 1 and the F_GROUP experts, group_wna
# in the experts only
WNA_AT = [("    ld4u32,\n", "    ld4u32,\n    ld4w,\n")] + [
    (f"{ind}{v}.append(ld4u32({r} + Int64(k) * 2))\n", f"{ind}{v}.append(ld4w({r} + Int64(k) * 2))\n")
    for ind, v, r in (("        ", "wa", "ra"), ("        ", "wb", "rb"), ("            ", "wua", "ua"),
                      ("            ", "wub", "ub"))]


def _wna_module():
    """The shipped cute/dense.py whose tc_step loads its weights with base.ld4w."""
    from megadecode.backends.mega.cute import dense

    return edited_module("megadecode.backends.mega.cute._wna", dense, WNA_AT, "wna")


# raw_wna: the CUDA-core bodies' weight loads not allocating in L1, as group_wna's experts': base.ld8raw's 16
# bytes through base.ld4w's load in dense.py (MATVEC / GLU's row_sums: batch 1 and the rows F_STAGE leaves to
# global loads) and moe.py (the one-pair EXPERT_UP rows, EXPERT_DOWN's flat units), and moe.py's ld4u32 (K3's
# MXFP4 rows) as ld4w. Every use of those two names in those modules is a static weight's row; the inputs (x, h)
# keep ld8 and L1, which the CTA's warps share
RAW_WNA_TAIL = '''


@cute.jit
def ld8raw(dtype: Constexpr, addr: Int64):
    """8 consecutive 16-bit elements (16-byte aligned) as they are, loaded without allocating in L1 (ld4w)."""
    w = ld4w(addr)
    t = cute.make_rmem_tensor(4, Uint32)
    for i in cutlass.range_constexpr(4):
        t[i] = w[i]
    return cute.recast_tensor(t, dtype).load()


@cute.jit
def ld4raw(addr: Int64):
    """4 consecutive bf16 (8-byte aligned) as they are, loaded without allocating in L1."""
    w = cute.arch.inline_ptx("ld.global.L1::no_allocate.v2.u32 { {$w0}, {$w1} }, [{$r0}];",
                             write_only_types=[Uint32, Uint32], read_only_args=[addr])
    t = cute.make_rmem_tensor(2, Uint32)
    for i in cutlass.range_constexpr(2):
        t[i] = w[i]
    return cute.recast_tensor(t, BFloat16).load()
'''


def _raw_wna_module():
    """cute/base.py with ld8raw loading through ld4w, and ld4raw (attention.py's 8-byte load) loading alike."""
    from megadecode.backends.mega.cute import base

    return edited_module("megadecode.backends.mega.cute._raw_wna", base, [], "raw_wna", tail=RAW_WNA_TAIL)


# A lane's copies of one tensor-core step (and its copy groups' commit / wait) and the step's arithmetic from them,
# shared by group_cp's and mv_ring's tails (each module imports row_copy16, lds4u, bf16x2_split and mma)
COPY_STEP_SRC = '''@cute.jit
def gc_commit():
    cute.arch.inline_ptx("cp.async.commit_group;")


@cute.jit
def gc_wait(n: Constexpr):
    """Wait until at most n of this thread's newest copy groups are in flight."""
    cute.arch.inline_ptx(f"cp.async.wait_group {n};")


@cute.jit
def gc_drain():
    cute.arch.inline_ptx("cp.async.wait_all;")


@cute.jit
def gc_issue(slot: Int32, ra: Int64, rb: Int64, ua: Int64, ub: Int64, k: Int32, glu: Constexpr):
    """This lane's copies of one step (its 16 bytes at k of rows g, g + 8 and GLU's up rows) into its slots of a
    stage: 512 bytes apart, lane-major, so the warp's reads back are conflict-free."""
    row_copy16(slot, ra + Int64(k) * 2)
    row_copy16(slot + 512, rb + Int64(k) * 2)
    if cutlass.const_expr(glu):
        row_copy16(slot + 1024, ua + Int64(k) * 2)
        row_copy16(slot + 1536, ub + Int64(k) * 2)


@cute.jit
def gc_step(acc: cute.Tensor, slot: Int32, xv, msk: Uint32, glu: Constexpr):
    """tc_step's arithmetic for one step whose weights are in this lane's slots and whose input is xv (8 fp32):
    the same mma in the same order, so the same sums."""
    wa = lds4u(slot)
    wb = lds4u(slot + 512)
    wua, wub = wa, wb
    if cutlass.const_expr(glu):
        wua = lds4u(slot + 1024)
        wub = lds4u(slot + 1536)
    hi, lo = [], []
    for i in cutlass.range_constexpr(4):
        ph, pl = bf16x2_split(xv[2 * i], xv[2 * i + 1])
        hi.append(ph & msk)
        lo.append(pl & msk)
    for h in cutlass.range_constexpr(2):
        for p in (hi, lo):
            c = mma("bf16", wa[2 * h], wb[2 * h], wa[2 * h + 1], wb[2 * h + 1], p[2 * h], p[2 * h + 1],
                    acc[0], acc[1], acc[2], acc[3])
            for i in cutlass.range_constexpr(4):
                acc[i] = c[i]
            if cutlass.const_expr(glu):
                c = mma("bf16", wua[2 * h], wub[2 * h], wua[2 * h + 1], wub[2 * h + 1], p[2 * h], p[2 * h + 1],
                        acc[4], acc[5], acc[6], acc[7])
                for i in cutlass.range_constexpr(4):
                    acc[4 + i] = c[i]
'''


# group_cp: the F_GROUP experts' units (cute/moe.py group_units) with the weights copied (cp.async) into each
# warp's share of the working memory a few steps ahead of the step that multiplies them, rather than loaded into
# registers two steps at a time and waited for: Nsight Compute at batch 64 (qwen3-30b-a3b, H100) has the two loops
# at 46% of the stall samples, 84-90% of them waiting on the weights' loads, each warp's 4 KB in flight draining to
# nothing before the next are asked for. op_expert_up / op_expert_down pass the working memory to the group bodies
GROUP_CP_AT = [("        expert_up_group(fb, ib, wtab, smi, tid)\n",
                "        expert_up_group(fb, ib, wtab, smi, tid, sm)\n"),
               ("        expert_down_group(fb, ib, wtab, smi, tid)\n",
                "        expert_down_group(fb, ib, wtab, smi, tid, sm)\n"),
               ("    ld4w,\n", "    ld4w,\n    lds4u,\n    mma,\n    row_copy16,\n    bf16x2_split,\n")]
GROUP_CP_TAIL = '''

GC_WB = 4 * SMEM_F // NW  # bytes of the working memory a warp's copies take (6 KiB)


''' + COPY_STEP_SRC + '''

@cute.jit
def group_units_cp(fb: Int64, ib: Int64, smi: cute.Tensor, sm: cute.Tensor, tid: Int32, A_: Constexpr, w0: Int64,
                   I: Int32, K: Int32, R: Int32, x_off: Int32, ptok_off: Int32, out_off: Int32, use_situ):
    """group_units with each unit's weights streamed through this warp's GC_WB bytes of the working memory: NS
    stages of one step each (EXPERT_UP 2 KB: 3, EXPERT_DOWN 1 KB: 6), every lane copying (cp.async, static
    weights) the 16-byte pieces it multiplies, NS - 1 steps ahead of the step it computes, so a warp keeps
    NS - 1 steps of weights requested without holding them in registers; the input (produced in this launch:
    coherent loads) one step ahead in registers. The same mma in the same order as group_units: the same bits."""
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
    erows = R
    STG = 1024
    if cutlass.const_expr(glu):
        erows = 2 * I
        STG = 2048
    NS = GC_WB // STG
    nsteps = K // TC_K
    wbase = Int32(sm.iterator.toint()) + warp * GC_WB + lane * 16
    acc = cute.make_rmem_tensor(8, Float32)
    xr = cute.make_rmem_tensor(8, Float32)
    for unit in cutlass.range(lo + warp, hi, NW):
        P = unit // nt
        r = (unit - P * nt) * GROUP_TILE
        e, p0, pn = group_pass(smi, nuniq, P)
        msk = Uint32(0xFFFFFFFF)
        if g >= pn:
            msk = Uint32(0)
        src = p0 + cutlass.min(g, pn - 1)
        if cutlass.const_expr(glu):
            src = ldi(ia(ib, ptok_off + src))
        xrow = fa(fb, x_off + src * K)
        ra = w0 + (Int64(e) * Int64(erows) + Int64(r + g)) * rowb
        rb = ra + Int64(8) * rowb
        ua = ra + Int64(I) * rowb
        ub = rb + Int64(I) * rowb
        for i in cutlass.range_constexpr(8):
            acc[i] = Float32(0.0)
        for j in cutlass.range_constexpr(NS - 1):  # the first NS - 1 steps' copies, a group each
            if j < nsteps:
                gc_issue(wbase + j * STG, ra, rb, ua, ub, j * TC_K + 8 * t, glu)
            gc_commit()
        xr.store(ld8(Float32, xrow + Int64(8 * t) * 4))
        for s in cutlass.range(nsteps):
            jn = s + NS - 1
            if jn < nsteps:  # the copies NS - 1 steps ahead, into the stage step s - 1 read
                gc_issue(wbase + (jn % NS) * STG, ra, rb, ua, ub, jn * TC_K + 8 * t, glu)
            gc_commit()
            xv = xr.load()
            if s + 1 < nsteps:
                xr.store(ld8(Float32, xrow + Int64((s + 1) * TC_K + 8 * t) * 4))
            gc_wait(NS - 1)  # step s's copies landed
            gc_step(acc, wbase + (s % NS) * STG, xv, msk, glu)
        for h in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(2):
                if 2 * t + j < pn:
                    v = acc[2 * h + j]
                    if cutlass.const_expr(glu):
                        up = acc[4 + 2 * h + j]
                        gs = v
                        v = silu(gs) * up
                        if use_situ:
                            v = situ(gs, up)
                    stf(Float32, fa(fb, out_off + (p0 + 2 * t + j) * R + r + g + 8 * h), v)
    gc_drain()


@cute.jit
def expert_up_group(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32, sm: cute.Tensor):
    """EXPERT_UP under F_GROUP (bf16), its weights through the warps' copy stages (group_units_cp)."""
    A_ = "EXPERT_UP"
    I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
    group_units_cp(fb, ib, smi, sm, tid, A_, wtab[arg(smi, ARG[A_]["gu"])], I, D, I, x_off,
                   arg(smi, ARG[A_]["ptok_off"]), h_off, (arg(smi, 3) & F_SITU) != 0)


@cute.jit
def expert_down_group(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32, sm: cute.Tensor):
    """EXPERT_DOWN under F_GROUP (bf16), its weights through the warps' copy stages (group_units_cp)."""
    A_ = "EXPERT_DOWN"
    I, D, h_off, y_off = args(smi, A_, "I D h_off y_off")
    group_units_cp(fb, ib, smi, sm, tid, A_, wtab[arg(smi, ARG[A_]["dn"])], I, I, D, h_off, Int32(-1), y_off, False)
'''


def _group_cp_module():
    """The shipped cute/moe.py with the F_GROUP bodies of GROUP_CP_TAIL (defined after, so they are the ones the
    module's op_expert_up / op_expert_down trace)."""
    from megadecode.backends.mega.cute import moe

    return edited_module("megadecode.backends.mega.cute._group_cp", moe, GROUP_CP_AT, "group_cp", GROUP_CP_TAIL)


# group_ring: group_cp's copies into the weight ring's memory (160 KiB, idle past batch 1: only batch-1 MATVEC is
# staged, Program.stageable) rather than the working memory: 20 KiB a warp, EXPERT_UP 10 stages, EXPERT_DOWN 20, so
# a warp keeps ~18 KB of weights requested where group_cp keeps 4. The ring build only (one CTA an SM, 8 compute
# warps): run with --ring-all, which times every variant's ring build at every batch
GROUP_RING_AT = [("    NW,\n", "    NW,\n    RING_PAGE,\n    RING_S,\n    RING_SLOTS,\n")]
GROUP_RING_EDITS = [("GC_WB = 4 * SMEM_F // NW  # bytes of the working memory a warp's copies take (6 KiB)\n",
                     "GC_WB = RING_SLOTS * RING_PAGE // NW  # bytes of the ring a warp's copies take (20 KiB)\n"),
                    ("    wbase = Int32(sm.iterator.toint()) + warp * GC_WB + lane * 16\n",
                     "    wbase = smi[RING_S + 5] + warp * GC_WB + lane * 16  # the ring's shared address\n")]


def _group_ring_module():
    """group_cp's module with its stages in the weight ring (GROUP_RING_EDITS of GROUP_CP_TAIL)."""
    from megadecode.backends.mega.cute import moe

    tail = GROUP_CP_TAIL
    for old, new in GROUP_RING_EDITS:
        if tail.count(old) != 1:
            raise SystemExit("group_ring: GROUP_CP_TAIL changed; the variant's edit point is not unique")
        tail = tail.replace(old, new)
    return edited_module("megadecode.backends.mega.cute._group_ring", moe, GROUP_CP_AT + GROUP_RING_AT, "group_ring",
                         tail)


# mv_ring: F_TC MATVEC / GLU (cute/dense.py tc_rows, 2 tokens and more) with each k slice's weights copied
# (cp.async) into the warp's 20 KiB of the weight ring up to 19 steps ahead (GLU 9), the input one step ahead in
# registers, the same mma in the same order as tc_step (the same bits). The ring build only (--ring-all); op_rows is
# swapped (its tc_rows call passes the ring's address), so it joins with group_ring: `group_ring+mv_ring`
MV_RING_AT = [
    ("            out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32, add1: Int32, RS: Constexpr,\n"
     "            glu: Constexpr):\n    \"\"\"Rows [r0, r1) against the batch on the tensor cores",
     "            out_off: Int32, out_stride: Int32, out_col: Int32, add0: Int32, add1: Int32, RS: Constexpr,\n"
     "            ring: Int32, glu: Constexpr):\n    \"\"\"Rows [r0, r1) against the batch on the tensor cores"),
    ("                out_off, out_stride, out_col, add0, add1, RS, glu)\n    else:\n",
     "                out_off, out_stride, out_col, add0, add1, RS, smi[RING_S + 5], glu)\n    else:\n"),
    ("""                smain = s1 - (s1 - s0) % UC
                for s in cutlass.range(s0, smain, UC):
                    tc_step(acc, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s * TC_K, t, xrow, x2row, gaddr, norm,
                            has_x2, msk, UC, glu)
                for s in cutlass.range(smain, s1):  # the slice's last steps, one at a time
                    tc_step(acc, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s * TC_K, t, xrow, x2row, gaddr, norm,
                            has_x2, msk, 1, glu)
""",
     "                cp_steps(acc, ring + warp * MV_WB + lane * 16, w0 + rowa, w0 + rowb, w1 + rowa, w1 + rowb, s0,\n"
     "                         s1, t, xrow, x2row, gaddr, norm, has_x2, msk, glu)\n"),
    ("    RING_SLOTS,\n", "    RING_SLOTS,\n    row_copy16,\n")]
MV_RING_TAIL = '''


''' + COPY_STEP_SRC + '''

MV_WB = RING_SLOTS * RING_PAGE // NW  # bytes of the ring a warp's copies take (20 KiB)


@cute.jit
def cp_steps(acc: cute.Tensor, wbase: Int32, ra: Int64, rb: Int64, ua: Int64, ub: Int64, s0: Int32, s1: Int32,
             t: Int32, xrow: Int64, x2row: Int64, gaddr: Int64, norm, has_x2, msk: Uint32, glu: Constexpr):
    """tc_step's steps s0 .. s1 - 1, in order, with the weights copied NS - 1 steps ahead into this lane's slots of
    NS one-step stages at wbase (each lane reads back only its own copies: no warp barrier) and x one step ahead
    in registers; x2 and the norm weight loaded at the step, before its copies are waited for."""
    STG = 1024
    if cutlass.const_expr(glu):
        STG = 2048
    NS = MV_WB // STG
    xr = cute.make_rmem_tensor(8, Float32)
    for j in cutlass.range_constexpr(NS - 1):
        if s0 + j < s1:
            gc_issue(wbase + j * STG, ra, rb, ua, ub, (s0 + j) * TC_K + 8 * t, glu)
        gc_commit()
    if s0 < s1:
        xr.store(ld8(Float32, xrow + Int64(s0 * TC_K + 8 * t) * 4))
    for s in cutlass.range(s0, s1):
        jn = s + NS - 1
        if jn < s1:
            gc_issue(wbase + ((jn - s0) % NS) * STG, ra, rb, ua, ub, jn * TC_K + 8 * t, glu)
        gc_commit()
        k = s * TC_K + 8 * t
        xv = xr.load()
        if s + 1 < s1:
            xr.store(ld8(Float32, xrow + Int64(k + TC_K) * 4))
        if has_x2:
            xv = xv + ld8(Float32, x2row + Int64(k) * 4)
        if norm:
            xv = xv * ld8(BFloat16, gaddr + Int64(k) * 2)
        gc_wait(NS - 1)
        gc_step(acc, wbase + ((s - s0) % NS) * STG, xv, msk, glu)
    gc_drain()
'''


def _mv_ring_module():
    """The shipped cute/dense.py whose tc_rows streams its slices' weights through the ring (MV_RING_TAIL)."""
    from megadecode.backends.mega.cute import dense

    return edited_module("megadecode.backends.mega.cute._mv_ring", dense, MV_RING_AT, "mv_ring", MV_RING_TAIL)


# mv_cp: mv_ring's copies into the working memory instead of the ring, so the two-CTA build (the executor's past
# batch 1) runs them: each warp's 4 KiB from byte MV_CP_AT (past tc_rows' k-slice partials, words 0 .. 2048, and
# before the norm's rstd words at the end), MATVEC 4 one-step stages (3 steps ahead of the one multiplied) and
# GLU 2, against the shipped loop's two steps loaded, then waited for. Nsight Compute at batch 64 has MATVEC's
# step loop waiting on its loads (long scoreboard 47% of its samples); q/k/v and o_proj are 145 us of a batch-64
# layer for 38 MB of rows
MV_CP_AT = 8192  # bytes of the working memory before the stages: tc_rows' partials (2048 words)
MV_CP_EDITS = [
    ("                out_off, out_stride, out_col, add0, add1, RS, smi[RING_S + 5], glu)\n    else:\n",
     "                out_off, out_stride, out_col, add0, add1, RS, Int32(sm.iterator.toint()) + MV_CP_AT, glu)\n"
     "    else:\n")]
MV_CP_TAIL_EDITS = [
    ("MV_WB = RING_SLOTS * RING_PAGE // NW  # bytes of the ring a warp's copies take (20 KiB)\n",
     "MV_WB = 4096  # bytes of the working memory a warp's copies take\nMV_CP_AT = %d\n" % MV_CP_AT)]
# mv_cp0: mv_cp with the step's input loaded at the step rather than one step ahead: under the two-CTA build's 128
# registers mv_cp's held input (8 fp32) is stored to local memory and read back in every iteration (its SASS), so
# mv_cp0 tells whether that round trip or the exposed input load costs more
MV_CP0_EDITS = [
    ("    xr = cute.make_rmem_tensor(8, Float32)\n", ""),
    ("    if s0 < s1:\n        xr.store(ld8(Float32, xrow + Int64(s0 * TC_K + 8 * t) * 4))\n", ""),
    ("        xv = xr.load()\n        if s + 1 < s1:\n            xr.store(ld8(Float32, xrow + Int64(k + TC_K) * 4))\n",
     "        xv = ld8(Float32, xrow + Int64(k) * 4)\n")]


def _mv_cp_module(prefetch_x: bool = True):
    """mv_ring's module with its stages in the working memory (MV_CP_EDITS of MV_RING_AT, MV_CP_TAIL_EDITS of its
    tail); without `prefetch_x`, mv_cp0's (MV_CP0_EDITS: the input loaded at its step)."""
    from megadecode.backends.mega.cute import dense
    from megadecode.backends.mega.limits import SMEM_F

    if MV_CP_AT + 8 * 4096 > 4 * (SMEM_F - 128):  # the stages end before the rstd words (dense.RSTD_PART)
        raise SystemExit("mv_cp: the stages overlap the norm's words")
    edits = []
    for old, new in MV_RING_AT:
        for a, b in MV_CP_EDITS:
            if a in new:
                new = new.replace(a, b)
        edits.append((old, new))
    if sum(b in new for _, new in edits for _, b in MV_CP_EDITS) != len(MV_CP_EDITS):
        raise SystemExit("mv_cp: MV_RING_AT changed; the variant's edit point is not unique")
    tail = MV_RING_TAIL
    for old, new in MV_CP_TAIL_EDITS + ([] if prefetch_x else MV_CP0_EDITS):
        if tail.count(old) != 1:
            raise SystemExit("mv_cp: MV_RING_TAIL changed; the variant's edit point is not unique")
        tail = tail.replace(old, new)
    name = "mv_cp" if prefetch_x else "mv_cp0"
    return edited_module(f"megadecode.backends.mega.cute._{name}", dense, edits, name, tail)


# attn_warp: ATTN_GQA's chunks with a warp a q head. The shipped chunk (gqa_chunk) loads the chunk's keys and
# values into registers, then folds them with the 256 threads together: scores over 4 lanes a position, a barrier,
# softmax_chunk by warps, a barrier, values over 8 lanes a column group, a barrier (three, and the shuffles of
# fold_lanes), and the next chunk's loads wait for all of it. Here chunks of 32 positions are copied into shared
# memory with cp.async (coherent copies through L2, after the wait like every load of the body: no registers held),
# two buffers, the next chunk's copies issued before this one's wait; after a barrier each warp takes its q heads
# (warp, warp + NW) alone: a lane's score at its position over the whole row, the online softmax in registers
# (warp_max / warp_sum), the values as a lane's 4 columns over the chunk's positions, each position's weight
# shuffled from its lane. A barrier ends the chunk before its buffer is refilled. The partials (max, sum,
# accumulators) are stored from the warps' registers. Shared memory: q at words 0 .. G d, then two buffers of keys
# and values (32 rows each of 2 d + 16 bytes: 16 bytes of padding, so a warp's 16-byte reads of 8 rows meet no bank
# twice), 34 KiB at d = 128, below the working memory's last words. (Holding the next chunk in registers instead,
# as gqa_loads does, took the two-CTA build to 244 registers on the CPU.)
ATTN_WARP_AT = """    if not kv_only:
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
"""
ATTN_WARP_NEW = """    if not kv_only:
        cta_sync()  # q's RoPE and the cache write done
        if tid == 0:
            mark(smi, idx, 1)  # RoPE and the cache write (the last split) done
        attn_warps(sm, tid, kc, vc, rowb, rstride, lo, hi, d, G, scale, part_off, b * H + h * G, s, S, fb, Q)
        if tid == 0:
            mark(smi, idx, 2)  # the split's chunks folded (the partials stored by each warp)
"""
ATTN_WARP_TAIL = '''


AW_CH = 32  # positions a staged chunk (a lane's score each)
AW_K = 8192  # byte offset of the staged buffers in the working memory (after q: G d <= 2048 fp32 words)


@cute.jit
def aw_commit():
    cute.arch.inline_ptx("cp.async.commit_group;")


@cute.jit
def aw_wait_older():
    """Wait until every group of this thread's copies but the newest has landed."""
    cute.arch.inline_ptx("cp.async.wait_group 1;")


@cute.jit
def aw_lds2(addr: Int32):
    return cute.arch.inline_ptx("ld.shared.v2.u32 { {$w0}, {$w1} }, [{$r0}];", write_only_types=[Uint32, Uint32],
                                read_only_args=[addr])


@cute.jit
def bf_lo(w: Uint32) -> Float32:
    return from_bits(w << Uint32(16))


@cute.jit
def bf_hi(w: Uint32) -> Float32:
    return from_bits(w & Uint32(0xFFFF0000))


@cute.jit
def aw_issue(tid: Int32, kc: Int64, vc: Int64, rowb: Int64, rstride: Int64, c0: Int32, hi: Int32, d: Int32,
             buf: Int32, rowbytes: Int32):
    """Copies of positions c0 .. c0 + AW_CH - 1 (past hi: position hi - 1, never used) of the keys, then the
    values, into buf (AW_CH key rows, then AW_CH value rows, rowbytes apart), 16 bytes a copy."""
    PR = d // 8  # copies a row
    per = AW_CH * PR
    for q in cutlass.range(tid, 2 * per, NT):
        w, rest = q // per, q % per
        r, c = rest // PR, rest % PR
        src = kc
        if w == 1:
            src = vc
        pos = cutlass.min(c0 + r, hi - 1)
        # base.row_copy16: the cp.async the loop copies instruction rows with; through L2, coherent, after the wait
        row_copy16(buf + (w * AW_CH + r) * rowbytes + c * 16, src + rowb + Int64(pos) * rstride + Int64(c * 16))


@cute.jit
def attn_warps(sm: cute.Tensor, tid: Int32, kc: Int64, vc: Int64, rowb: Int64, rstride: Int64, lo: Int32, hi: Int32,
               d: Int32, G: Int32, scale: Float32, part: Int32, hb: Int32, s: Int32, S: Int32, fb: Int64,
               Q: Constexpr):
    """Positions [lo, hi) of one KV head folded into the online softmax of its G <= 2 NW q heads (q at Q, normed
    and roped), a warp a head, AW_CH positions a chunk through two shared buffers; the split's partials stored for
    MERGE."""
    warp, lane = tid // 32, tid % 32
    rowbytes = 2 * d + 16  # a staged row: its d bf16, then 16 bytes of padding
    bufbytes = 2 * AW_CH * rowbytes
    b0 = Int32(sm.iterator.toint()) + AW_K
    st = cute.make_rmem_tensor(12, Float32)  # per head of the warp (2): max, sum, the lane's 4 accumulators
    for gi in cutlass.range_constexpr(2):
        st[6 * gi] = Float32(NEG_INF)
        for i in cutlass.range_constexpr(5):
            st[6 * gi + 1 + i] = Float32(0.0)
    nch = (hi - lo + AW_CH - 1) // AW_CH
    if nch > 0:
        aw_issue(tid, kc, vc, rowb, rstride, lo, hi, d, b0, rowbytes)
    aw_commit()
    vcol = cutlass.min(lane * 4, d - 4) * 2  # lanes past d / 4 read the row's last 4 columns (never stored)
    for ci in cutlass.range(nch):
        c0 = lo + ci * AW_CH
        n = cutlass.min(AW_CH, hi - c0)
        if ci + 1 < nch:  # the next chunk's copies, into the other buffer (free: the last chunk's barrier)
            aw_issue(tid, kc, vc, rowb, rstride, c0 + AW_CH, hi, d, b0 + ((ci + 1) % 2) * bufbytes, rowbytes)
        aw_commit()
        aw_wait_older()  # this thread's copies of chunk ci landed
        cta_sync()  # and every thread's
        ks = b0 + (ci % 2) * bufbytes
        vs = ks + AW_CH * rowbytes
        for gi in cutlass.range_constexpr(2):
            g = warp + gi * NW
            if g < G:  # uniform over the warp
                sc = Float32(0.0)
                for pc in cutlass.range(d // 8, unroll=4):  # position lane against q, 8 dims a step
                    qv = sm8(sm, Q + g * d + pc * 8)
                    wk = lds4u(ks + lane * rowbytes + pc * 16)
                    for i in cutlass.range_constexpr(4):
                        sc += bf_lo(wk[i]) * qv[2 * i] + bf_hi(wk[i]) * qv[2 * i + 1]
                sc = sc * scale
                if lane >= n:
                    sc = Float32(NEG_INF)
                m_old = st[6 * gi]
                m_new = cute.arch.fmax(m_old, warp_max(sc))
                pw = cute.math.exp(sc - m_new)
                alpha = cute.math.exp(m_old - m_new)
                st[6 * gi] = m_new
                st[6 * gi + 1] = st[6 * gi + 1] * alpha + warp_sum(pw)
                a0 = st[6 * gi + 2] * alpha
                a1 = st[6 * gi + 3] * alpha
                a2 = st[6 * gi + 4] * alpha
                a3 = st[6 * gi + 5] * alpha
                for p in cutlass.range(n):
                    wgt = cute.arch.shuffle_sync(pw, p)
                    v = aw_lds2(vs + p * rowbytes + vcol)
                    a0 += wgt * bf_lo(v[0])
                    a1 += wgt * bf_hi(v[0])
                    a2 += wgt * bf_lo(v[1])
                    a3 += wgt * bf_hi(v[1])
                st[6 * gi + 2] = a0
                st[6 * gi + 3] = a1
                st[6 * gi + 4] = a2
                st[6 * gi + 5] = a3
        cta_sync()  # every warp's reads of the buffer done before it is refilled
    for gi in cutlass.range_constexpr(2):
        g = warp + gi * NW
        if g < G:
            row = part + ((hb + g) * S + s) * (d + 2)
            if lane == 0:
                stf(Float32, fa(fb, row), st[6 * gi])
                stf(Float32, fa(fb, row + 1), st[6 * gi + 1])
            if lane * 4 < d:
                for i in cutlass.range_constexpr(4):
                    stf(Float32, fa(fb, row + 2 + lane * 4 + i), st[6 * gi + 2 + i])
'''


def _attn_warp_module():
    """The shipped cute/attention.py with ATTN_GQA's chunk loop and partials replaced by ATTN_WARP_TAIL's
    attn_warps, as a module of the cute package."""
    from megadecode.backends.mega.cute import attention

    return edited_module("megadecode.backends.mega.cute._attn_warp", attention,
                         [(ATTN_WARP_AT, ATTN_WARP_NEW),
                          ("from cutlass import BFloat16, Constexpr, Float32, Int32, Int64\n",
                           "from cutlass import BFloat16, Constexpr, Float32, Int32, Int64, Uint32\n"),
                          ("    fa,\n", "    fa,\n    from_bits,\n    lds4u,\n    row_copy16,\n    warp_max,\n")],
                         "attn_warp", ATTN_WARP_TAIL)


# attn_early: cute/attention.py's op_attn_gqa with its first chunk's loads moved up to the wait (edits of the
# shipped source, so the variant is today's body plus that move)
EARLY_AT = "    lo, hi = split_bounds(s, S, pos)\n"
EARLY_NEXT = "    # no L2 prefetch of the split's key and value rows"
EARLY_LOADS = """    pre = cutlass.min(CH, cutlass.min(hi, pos) - lo)  # the first chunk's positions written by earlier launches
    kq0, vq0 = gqa_loads(tid, kc, vc, rowb, rstride, lo, cutlass.max(pre, 1), d)
"""
EARLY_LOOP = """        for c0 in cutlass.range(lo, hi, CH):
            gqa_chunk(sm, tid, kc, vc, rowb, rstride, c0, cutlass.min(CH, hi - c0), d, G, scale, Q, SC, M, L, AL,
                      ACC)
"""
EARLY_FOLD = """        if pre > 0:
            gqa_fold(sm, tid, kq0, vq0, pre, d, G, scale, Q, SC, M, L, AL, ACC)
        for c0 in cutlass.range(lo + cutlass.max(pre, 0), hi, CH):
            gqa_chunk(sm, tid, kc, vc, rowb, rstride, c0, cutlass.min(CH, hi - c0), d, G, scale, Q, SC, M, L, AL,
                      ACC)
"""


def _attn_early_module():
    """The shipped cute/attention.py with EARLY_LOADS after the split's bounds and EARLY_FOLD for its chunk loop,
    as a module of the cute package."""
    from megadecode.backends.mega.cute import attention

    return edited_module("megadecode.backends.mega.cute._attn_early", attention,
                         [(EARLY_AT + EARLY_NEXT, EARLY_AT + EARLY_LOADS + EARLY_NEXT), (EARLY_LOOP, EARLY_FOLD)],
                         "attn_early")


def build(name: str, device, ring: bool = True):
    """The variant's launcher; `shipped`: None, the runtimes' own (loaded from the disk cache where an earlier
    compile of these sources left it: a compile less a call)."""
    if name == "shipped":
        return None
    with swapped(_swaps(name)):
        return compile_launcher(device, cache=False, ring=ring)


def build_ptx(name: str) -> str:
    """The variant's PTX compiled without a GPU (the CPU test of each variant's trace)."""
    from megadecode.backends.mega import cute_kernel as K

    with swapped(_swaps(name)):
        return K.compile_ptx_cubin().__ptx__


def audit(name: str):
    """The static ordering audit (validate/audit.py, every rule the shipped kernel is held to) of the variant's
    build, compiled without a GPU: a variant is timed only if it is as correct by construction as the kernel."""
    from megadecode.backends.mega.spec import MegaKernelSpec
    from megadecode.validate.audit import audit_spec

    class VariantSpec(MegaKernelSpec):
        def ptx(self) -> str:
            return build_ptx(name)

    return audit_spec(VariantSpec(), arch=90)


def main(argv=None) -> int:
    ap = ab_parser("qwen3-30b-a3b", "1,8", 15, ",".join(VARIANTS), "mega-body-ab.json")
    ap.add_argument("--check-preset", default="tiny-qwen3-moe",
                    help="the preset each variant is diffed against pyvm on (tiny-k3-frag for K3's bodies)")
    ap.add_argument("--audit", action="store_true", help="audit each variant statically (no GPU) and stop")
    ap.add_argument("--bodies-from", help="the cute/moe.py whose row bodies the `bodies` variant builds")
    ap.add_argument("--ring-all", action="store_true",
                    help="build, check and time the ring build (one CTA an SM) at every batch, not only at 1 "
                         "(group_ring needs it)")
    args = ap.parse_args(argv)
    global BODIES_FROM
    BODIES_FROM = args.bodies_from
    names = ab_variants(ap, args, VARIANTS, joins=True)
    if any({"group_ring", "mv_ring"} & set(n.split("+")) for n in names) and not (args.ring_all or args.audit):
        ap.error("group_ring and mv_ring stage into the weight ring, which only the ring build has: pass --ring-all")
    if args.ring_all:
        import mega_sync_ab

        mega_sync_ab.ring_build = lambda batch: True  # run_ab and timed ask it for every batch
    if args.audit:
        reports = {n: audit(n) for n in names}
        for n, r in reports.items():
            print(f"{n}: audit {'passed' if r.passed else 'FAILED'} ({len(r.rules_checked)} rules)")
            if not r.passed:
                print(r.to_markdown())
        return 0 if all(r.passed for r in reports.values()) else 1
    out = run_ab(names, build, args.check_preset, args.preset, args.batch, args.context, args.rounds, args.out,
                 args.check_batch, jobs=args.jobs, settings={"BODIES_FROM": args.bodies_from})
    ok = all(not c["failures"] for c in out["checks"])
    print(f"wrote {args.out}; every variant {'passes' if ok else 'does NOT pass'} its check")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
