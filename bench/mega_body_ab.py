"""The megakernel's opcode bodies (backends/mega/cute/) against alternatives, by launch time on the GPU, as
bench/mega_sync_ab.py measures the loop: each variant is a build of the kernel with module-level names swapped for
one compile (the shipped source holds no switch), first diffed against pyvm (validate.mega_gpu.diff_program on
--check-preset at --check-batch (1 and 3), delayed launches included), then timed on --preset in interleaved rounds
(mega_sync_ab.timed). Medians to --out as JSON.

    git show ae62ae9:megadecode/backends/mega/cute/moe.py > /tmp/moe_before.py
    python bench/mega_body_ab.py --bodies-from /tmp/moe_before.py --variants shipped,bodies,up_r4,down_u16 \
        --preset qwen3-30b-a3b --batch 1,8 --out $OUT/mega-body-ab.json
    python bench/mega_body_ab.py --variants shipped,route1 --check-batch 1,3 --preset qwen3-30b-a3b --batch 1
    python bench/mega_body_ab.py --audit --variants route1   # no GPU: the static audit of each

A variant is a list of (module, name, replacement) swaps (`_swaps`); `shipped` is the kernel as it is. Variants:
- `bodies`: bf16 EXPERT_UP's and EXPERT_DOWN's row bodies (`expert_up_rows`, `expert_down_rows`) of another
  cute/moe.py (--bodies-from, e.g. an earlier commit's, read with `git show`): a body change measured against the
  one it replaced, in the same call.
- `up_r4`: EXPERT_UP's one-pair path with 4 rows a warp and one chunk of each in flight (cute/moe.py's RU_UP = 4,
  WU_UP = 1; shipped: 2 rows, 2 chunks).
- `down_u16`: EXPERT_DOWN's flat bf16 units of 16 rows (RU_DN = 16; shipped: 8).
- `route1`: ROUTE at batch 1 with softmax scores (qwen3-moe), E <= 256 experts and A <= 32 picks: the picks by
  rank, not one warp argmax a pick. Every thread takes an expert and counts the experts ahead of it (larger, or
  equal at a lower index: the order the shipped picks take, so the same ids in the same slots); the slots' weights
  summed in slot order as before (the same bits), the tables of the batch-1 path from the picks in registers instead
  of reloading them from global memory. Why: ROUTE is one instruction on one CTA while the GPU waits, 9.7 us a
  layer at qwen3-30b-a3b batch 1 on the H200 at d581af0 (its marks: scores 3.3 us, 8 picks 2.7, weights 1.9,
  tables 1.0), 0.47 ms of the 4.54 ms step.
Each variant's build should pass the static audit (`--audit`) before it is timed.

Measured before (docs/megakernel.md, "The one-pair expert bodies"): at 8ac6cae the units this file then swapped
in (EXPERT_DOWN's flat units of 4 / 8 rows where the body took 2; EXPERT_UP's one-pair path with 2 rows a warp where
it took 1; `git show 8ac6cae:bench/mega_body_ab.py`), bench/results/mega-body-ab-nvidia-h200.json; the two that
paid are cute/moe.py's since. Before that, the MXFP4 bodies' conversions (`git show cacde6b:bench/mega_frag_ab.py`).
"""

from __future__ import annotations

from megadecode.backends.mega.runtime import compile_launcher
from mega_sync_ab import ab_parser, ab_variants, module_from_file, run_ab, swapped  # bench/: options, swaps, timing

VARIANTS = ("shipped", "bodies", "up_r4", "down_u16", "route1")
BODIES_FROM = None  # --bodies-from: the cute/moe.py whose row bodies the `bodies` variant builds


def _bodies_module():
    """--bodies-from loaded as a module of the cute package (its relative imports resolve as the shipped file's)."""
    return module_from_file("megadecode.backends.mega.cute._moe_from", BODIES_FROM, "--bodies-from", "a cute/moe.py")


def _swaps(name: str) -> list[tuple[object, str, object]]:
    """The variant's swaps (none for `shipped`)."""
    from megadecode.backends.mega.cute import moe as M

    if name == "shipped":
        return []
    if name == "bodies":
        B = _bodies_module()
        return [(M, "expert_up_rows", B.expert_up_rows), (M, "expert_down_rows", B.expert_down_rows)]
    if name == "up_r4":
        return [(M, "RU_UP", 4), (M, "WU_UP", 1)]
    if name == "down_u16":
        return [(M, "RU_DN", 16)]
    if name == "route1":
        from megadecode.backends.mega import cute_kernel as K

        bodies = tuple((n, _route1_body() if n == "ROUTE" else f) for n, f in K.BODIES)
        return [(K, "BODIES", bodies)]
    raise ValueError(f"unknown variant {name!r}")


def _route1_body():
    """The `route1` variant's ROUTE body: the rank picks at batch 1 (softmax, E <= NT, A <= 32), else the shipped
    op_route."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from megadecode.backends.mega.cute import moe as M
    from megadecode.backends.mega.cute.base import (ARG, FLAG_S, NEG_INF, NT, arg, argf, args, fa, ia, ldf, mark, stf,
                                                    sti, warp_max, warp_sum)
    from megadecode.backends.mega.isa import F_RENORM, F_SIGMOID

    @cute.jit
    def route_one_softmax(fb, ib, sm: cute.Tensor, smi: cute.Tensor, tid: Int32, idx: Int32, E: Int32, A: Int32):
        warp, lane = tid // 32, tid % 32
        A_ = "ROUTE"
        flags = arg(smi, 3)
        logits_off = arg(smi, ARG[A_]["logits_off"])
        scale = argf(smi, ARG[A_]["scale_bits"])
        ids_off, wts_off = args(smi, A_, "ids_off wts_off")
        nuniq_off, uniq_off, pstart_off = args(smi, A_, "nuniq_off uniq_off pstart_off")
        ptok_off, pslot_off, pairof_off = args(smi, A_, "ptok_off pslot_off pairof_off")
        qst_off = arg(smi, ARG[A_]["qst_off"])
        if warp == 0:  # the probabilities into sm[0:E]: op_route's expressions, so the same bits
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
            smi[tid] = E  # slot -> expert; E: no pick (NaN scores)
        cute.arch.sync_threads()
        if tid == 0:
            mark(smi, idx, 0)
        if tid < E:  # expert tid's rank: the experts ahead of it (larger, or equal at a lower index); NaN: none
            v = sm[tid]
            rank = Int32(0)
            for j in cutlass.range(E, unroll=8):
                u = sm[j]
                if u > v or (u == v and j < tid):
                    rank += 1
            if v == v and rank < A:
                smi[rank] = tid
        cute.arch.sync_threads()
        if tid == 0:
            mark(smi, idx, 1)
        if warp == 0:
            pe = E
            wv = Float32(0.0)
            if lane < A:
                pe = smi[lane]
                sti(ia(ib, ids_off + lane), pe)
                wv = sm[cutlass.min(pe, E - 1)]  # no pick: expert E - 1's score, as op_route takes
            tot = Float32(0.0)
            for a in cutlass.range(A):  # the slots' sum in slot order, as op_route's lane 0 adds them
                tot += cute.arch.shuffle_sync(wv, a)
            if (flags & F_RENORM) != 0:
                wv = wv / tot
            if lane < A:
                stf(Float32, fa(fb, wts_off + lane), wv * scale)
            if tid == 0:
                mark(smi, idx, 2)
            pos, dup = Int32(0), Int32(0)  # op_route's batch-1 tables, the picks from registers
            for k in cutlass.range(A):
                ov = cute.arch.shuffle_sync(pe, k)
                if ov < pe:
                    pos += 1
                if ov == pe and k != lane:
                    dup = 1
            if cute.arch.vote_all_sync(dup == 0):
                if lane < A:
                    sti(ia(ib, uniq_off + pos), pe)
                    sti(ia(ib, pstart_off + pos), pos)
                    sti(ia(ib, qst_off + pos), pos)
                    sti(ia(ib, pairof_off + lane), pos)
                    sti(ia(ib, ptok_off + pos), Int32(0))
                    sti(ia(ib, pslot_off + pos), lane)
                if lane == 0:
                    sti(ia(ib, pstart_off + A), A)
                    sti(ia(ib, qst_off + A), A)
                    sti(ia(ib, nuniq_off), A)
                    smi[FLAG_S] = Int32(1)
            elif lane == 0:
                smi[FLAG_S] = Int32(0)
        cute.arch.sync_threads()
        if tid == 0:
            mark(smi, idx, 3)
        if smi[FLAG_S] == 0:  # repeated ids (no picks: NaN scores): the general tables, as op_route
            M.route_tables(ib, sm, smi, tid, E, A, Int32(1), A, ids_off, nuniq_off, uniq_off, pstart_off, qst_off,
                           ptok_off, pslot_off, pairof_off, idx)

    @cute.jit
    def op_route_route1(pb, idx: Int32, fb, ib, wtab: cute.Tensor, ptab: cute.Tensor, sm: cute.Tensor,
                        smi: cute.Tensor, tid: Int32):
        E, A, B = args(smi, "ROUTE", "E A B")
        G = arg(smi, ARG["ROUTE"]["n_group"])
        if B == 1 and (arg(smi, 3) & F_SIGMOID) == 0 and G <= 1 and E <= NT and A <= 32:
            route_one_softmax(fb, ib, sm, smi, tid, idx, E, A)
        else:
            M.op_route(pb, idx, fb, ib, wtab, ptab, sm, smi, tid)

    return op_route_route1


def build(name: str, device):
    """The variant's launcher; `shipped`: None, the runtimes' own (loaded from the disk cache where an earlier
    compile of these sources left it: a compile less a call)."""
    if name == "shipped":
        return None
    with swapped(_swaps(name)):
        return compile_launcher(device, cache=False)


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
    args = ap.parse_args(argv)
    global BODIES_FROM
    BODIES_FROM = args.bodies_from
    names = ab_variants(ap, args, VARIANTS)
    if args.audit:
        reports = {n: audit(n) for n in names}
        for n, r in reports.items():
            print(f"{n}: audit {'passed' if r.passed else 'FAILED'} ({len(r.rules_checked)} rules)")
            if not r.passed:
                print(r.to_markdown())
        return 0 if all(r.passed for r in reports.values()) else 1
    out = run_ab(names, build, args.check_preset, args.preset, args.batch, args.context, args.rounds, args.out,
                 args.check_batch)
    ok = all(not c["failures"] for c in out["checks"])
    print(f"wrote {args.out}; every variant {'passes' if ok else 'does NOT pass'} its check")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
