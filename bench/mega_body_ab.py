"""The megakernel's opcode bodies (backends/mega/cute/) against alternatives, by launch time on the GPU, as
bench/mega_sync_ab.py measures the loop: each variant is a build of the kernel with module-level functions swapped
for one compile (the shipped source holds no switch), first diffed against pyvm (validate.mega_gpu.diff_program on
--check-preset at batch 1 and 3, delayed launches included), then timed on --preset in interleaved rounds
(mega_sync_ab.timed). Medians to --out as JSON.

    python bench/mega_body_ab.py --preset qwen3-30b-a3b --batch 1,8 --variants shipped,down_u4,down_u8,up_r2 \\
        --out $OUT/mega-body-ab.json
    python bench/mega_body_ab.py --audit --variants down_u4,down_u8,up_r2   # no GPU: the static audit of each

A variant is a list of (module, name, replacement) swaps (`_swaps`); `shipped` is the kernel as it is. Variants:
- `down_u4`, `down_u8`: bf16 EXPERT_DOWN's flat path (at most 2 pairs an expert on average: batch 1-8 of
  qwen3-30b-a3b) with units of (pair, 4 / 8 adjacent rows) where the shipped body takes (pair, 2 rows): each of a
  lane's 8-column chunks loads its 4 / 8 rows together, and the pair's h chunk is read once for all of them.
  What it tests (docs/megakernel.md: EXPERT_DOWN at batch 8 moves 162 MB in 72.8 us a layer, 2.2 TB/s): a
  2-row unit reads as many bytes of h (fp32, from L2) as of weights, and a warp takes its units one after the
  other. The sums are the shipped ones bit for bit: each lane's chunks in the same k order, each row's chunk
  products added as `rows_mac` adds them. Other cases (MXFP4, more pairs an expert) run the shipped body.
- `up_r2`: bf16 EXPERT_UP's one-pair path (F_PAIR1: batch 1-8) with two rows a warp at once (gate and up of rows
  r and r + NW), each 8-column chunk of the pair's x loaded once for both: the shipped path loads x (fp32, 8 KB at
  qwen3-30b-a3b's 2048) once a row, as many bytes as the row's gate and up weights (EXPERT_UP at batch 1: 20.7 us
  a layer for 50 MB, 2.4 TB/s). The same sums bit for bit.
Each variant's build passes the static audit (`--audit`) with 128 registers and the shipped kernel's spills.

Measured before (docs/megakernel.md, "K3's MXFP4 experts on the tensor cores"): at 918ac56 EXPERT_UP staged
against the per-warp conversion and two or three records a trip (bench/results/mega-frag-ab-nvidia-h200.json); at
3c9504e EXPERT_DOWN's per-warp conversion with two records a trip and per-block scales
(bench/results/mega-frag-ab-down-nvidia-h200.json), none faster; their bodies are in git (`git show
cacde6b:bench/mega_frag_ab.py`, this file's name then).
"""

from megadecode.backends.mega.runtime import compile_launcher
from mega_sync_ab import ab_parser, ab_variants, run_ab, swapped  # bench/: options, swaps, checks, timing

VARIANTS = ("shipped", "down_u4", "down_u8", "up_r2")


def _down_units(RU: int):
    """bf16 EXPERT_DOWN's flat path in units of (pair, RU adjacent rows); every other case the shipped body."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64

    from megadecode.backends.mega.cute import moe as M
    from megadecode.backends.mega.cute.base import ARG, NW, arg, args, dot8, fa, ia, ld8, ld8raw, ldi, stf
    from megadecode.backends.mega.cute.base import warp_sum
    from megadecode.backends.mega.isa import F_MXFP4

    shipped = M.expert_down_rows

    @cute.jit
    def expert_down_rows_units(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
        A_ = "EXPERT_DOWN"
        flags = arg(smi, 3)
        nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
        pstart_off = arg(smi, ARG[A_]["pstart_off"])
        npairs = ldi(ia(ib, pstart_off + nuniq))
        if (flags & F_MXFP4) != 0 or npairs > 2 * nuniq:
            shipped(fb, ib, wtab, smi, tid)
        else:
            warp, lane = tid // 32, tid % 32
            dn = wtab[arg(smi, ARG[A_]["dn"])]
            I, D, h_off, y_off, out_off = args(smi, A_, "I D h_off y_off out_off")
            r0, r1, B, A = args(smi, A_, "r0 r1 B A")
            uniq_off, wts_off, pairof_off, shared_off = args(smi, A_, "uniq_off wts_off pairof_off shared_off")
            rowb = Int64(I) * 2
            M.pair_experts(ib, smi, tid, nuniq, uniq_off, pstart_off)  # smi[p]: pair p's expert
            acc = cute.make_rmem_tensor(RU, Float32)
            gpu = (r1 - r0 + RU - 1) // RU  # units per pair
            for g in cutlass.range(warp, npairs * gpu, NW):
                p = g // gpu
                r = r0 + (g % gpu) * RU
                for q in cutlass.range_constexpr(RU):
                    acc[q] = Float32(0.0)
                w = dn + Int64(smi[p]) * Int64(D) * rowb
                rows = [w + Int64(cutlass.min(r + q, r1 - 1)) * rowb for q in range(RU)]  # past r1: not stored
                hrow = fa(fb, h_off + p * I)
                for k in cutlass.range(lane * 8, I, 256):
                    wq = [ld8raw(BFloat16, rows[q] + Int64(k) * 2) for q in range(RU)]
                    xv = ld8(Float32, hrow + Int64(k) * 4)
                    for q in cutlass.range_constexpr(RU):
                        acc[q] += dot8(wq[q].to(Float32), xv)
                for q in cutlass.range_constexpr(RU):
                    s = warp_sum(acc[q])
                    if lane == 0 and r + q < r1:
                        stf(Float32, fa(fb, y_off + p * D + r + q), s)
            cute.arch.sync_threads()
            M.combine_rows(fb, ib, flags, tid, y_off, out_off, D, r0, r1, B, A, wts_off, pairof_off, shared_off)

    return [(M, "expert_down_rows", expert_down_rows_units)]


def _up_rows2(WU: int = 2):
    """bf16 EXPERT_UP's one-pair path (F_PAIR1, a decode step's common case) with two rows a warp at once (r and
    r + NW, gate and up of each): a chunk of the pair's x is loaded once for both, WU chunks of the four rows in
    flight a lane (the shipped loop: one row, WU1 = 4 chunks of its gate and up). Every other case (MXFP4, passes of
    several pairs) the shipped body; the sums bit for bit the shipped ones (chunks in k order, rows_mac's products)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64

    from megadecode.backends.mega.cute import moe as M
    from megadecode.backends.mega.cute.base import ARG, NT, NW, arg, args, dot8, fa, ia, ld8, ld8raw, ldi, silu
    from megadecode.backends.mega.cute.base import situ, stf, warp_sum
    from megadecode.backends.mega.isa import F_MXFP4, F_PAIR1, F_SITU

    shipped = M.expert_up_rows

    @cute.jit
    def pair_rows(acc: cute.Tensor, gbase: Int64, rowb: Int64, I: Int32, ra: Int32, rb: Int32, D: Int32,
                  xa: Int64, lane: Int32):
        """acc[0..3]: this lane's sums of gate ra, up ra, gate rb, up rb against x (fp32 at xa)."""
        rows = [gbase + Int64(ra) * rowb, gbase + Int64(ra + I) * rowb, gbase + Int64(rb) * rowb,
                gbase + Int64(rb + I) * rowb]
        kmain = D - D % (256 * WU)
        for k0 in cutlass.range(lane * 8, kmain, 256 * WU):
            wq = [[ld8raw(BFloat16, rows[j] + Int64(k0 + u * 256) * 2) for j in range(4)] for u in range(WU)]
            for u in cutlass.range_constexpr(WU):
                xv = ld8(Float32, xa + Int64(k0 + u * 256) * 4)
                for j in cutlass.range_constexpr(4):
                    acc[j] += dot8(wq[u][j].to(Float32), xv)
        for k in cutlass.range(kmain + lane * 8, D, 256):
            wq = [ld8raw(BFloat16, rows[j] + Int64(k) * 2) for j in range(4)]
            xv = ld8(Float32, xa + Int64(k) * 4)
            for j in cutlass.range_constexpr(4):
                acc[j] += dot8(wq[j].to(Float32), xv)

    @cute.jit
    def expert_up_rows2(fb: Int64, ib: Int64, wtab: cute.Tensor, smi: cute.Tensor, tid: Int32):
        A_ = "EXPERT_UP"
        flags = arg(smi, 3)
        if (flags & F_MXFP4) != 0 or (flags & F_PAIR1) == 0:
            shipped(fb, ib, wtab, smi, tid)
        else:
            warp, lane = tid // 32, tid % 32
            use_situ = (flags & F_SITU) != 0
            gu = wtab[arg(smi, ARG[A_]["gu"])]
            I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
            w, W = args(smi, A_, "w W")
            nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
            uniq_off, pstart_off, ptok_off = args(smi, A_, "uniq_off pstart_off ptok_off")
            for u in cutlass.range(tid, nuniq + 1, NT):  # the pair prefix (F_PAIR1: one pair a pass)
                smi[u] = ldi(ia(ib, pstart_off + u))
            cute.arch.sync_threads()
            N = Int64(smi[nuniq]) * Int64(I)
            lo = Int64(w) * N // Int64(W)
            hi = Int64(w + 1) * N // Int64(W)
            rowb = Int64(D) * 2
            acc = cute.make_rmem_tensor(4, Float32)
            for u in cutlass.range(nuniq):  # the experts whose passes meet [lo, hi): a scan (the shipped body
                # bisects; nuniq <= E is small against the rows)
                e = ldi(ia(ib, uniq_off + u))
                for q in cutlass.range(smi[u], smi[u + 1]):
                    r0 = Int32(cutlass.max(lo - Int64(q) * Int64(I), Int64(0)))
                    r1 = Int32(cutlass.min(hi - Int64(q) * Int64(I), Int64(I)))
                    if r0 < r1:
                        xa = fa(fb, x_off + ldi(ia(ib, ptok_off + q)) * D)
                        gbase = gu + Int64(e) * Int64(2 * I) * rowb
                        for r in cutlass.range(r0 + warp, r1, 2 * NW):
                            rb = cutlass.min(r + NW, r1 - 1)  # past r1: computed, not stored
                            for j in cutlass.range_constexpr(4):
                                acc[j] = Float32(0.0)
                            pair_rows(acc, gbase, rowb, I, r, rb, D, xa, lane)
                            for h in cutlass.range_constexpr(2):
                                g = warp_sum(acc[2 * h])
                                up = warp_sum(acc[2 * h + 1])
                                if lane == 0 and r + h * NW < r1:
                                    hv = silu(g) * up
                                    if use_situ:
                                        hv = situ(g, up)
                                    stf(Float32, fa(fb, h_off + q * I + r + h * NW), hv)

    return [(M, "expert_up_rows", expert_up_rows2)]


def _swaps(name: str) -> list[tuple[object, str, object]]:
    """The variant's swaps (none for `shipped`)."""
    if name == "shipped":
        return []
    if name in ("down_u4", "down_u8"):
        return _down_units(int(name[-1]))
    if name == "up_r2":
        return _up_rows2()
    raise ValueError(f"unknown variant {name!r}")


def build(name: str, device):
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
    args = ap.parse_args(argv)
    names = ab_variants(ap, args, VARIANTS)
    if args.audit:
        reports = {n: audit(n) for n in names}
        for n, r in reports.items():
            print(f"{n}: audit {'passed' if r.passed else 'FAILED'} ({len(r.rules_checked)} rules)")
            if not r.passed:
                print(r.to_markdown())
        return 0 if all(r.passed for r in reports.values()) else 1
    out = run_ab(names, build, args.check_preset, args.preset, args.batch, args.context, args.rounds, args.out)
    ok = all(not c["failures"] for c in out["checks"])
    print(f"wrote {args.out}; every variant {'passes' if ok else 'does NOT pass'} its check")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
