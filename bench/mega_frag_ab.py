"""The megakernel's tensor-core expert bodies (F_FRAG, backends/mega/cute/moe.py) against alternatives, by launch time
on the GPU, as bench/mega_sync_ab.py measures the loop: each variant is a build of the kernel with module-level
functions swapped for one compile (the shipped source holds no switch), first diffed against pyvm
(validate.mega_gpu.diff_program on tiny-k3-frag at batch 1 and 3, delayed launches included), then timed on
k3-mini (experts in fragment order) in interleaved rounds (mega_sync_ab.timed). Medians to --out as JSON.

    python bench/mega_frag_ab.py --batch 1,8 --variants shipped,staged_up,hi_only --out $OUT/mega-frag-ab.json

Variants:
- `shipped`: each warp loads its pair's fp32 activations per 32-weight block and converts them (scale, fp16 hi +
  lo) for the tiles of its unit (two for EXPERT_UP, one for EXPERT_DOWN).
- `staged_up`: EXPERT_UP converts its pair's activation row once per CTA into shared memory (fp16 hi and lo
  planes, the row's scale), and its warps read B fragments there (two 16-byte shared loads a block): the
  conversion leaves the per-tile loop. EXPERT_DOWN as shipped.
- `scu2`: both bodies load two records of their tiles before using the first (the fused experts' `scu`), so a
  warp has twice the bytes in flight; `down_scu3`: EXPERT_DOWN three records, EXPERT_UP as shipped;
  `staged_scu2`: staged_up with two records a trip in both bodies.
- `hi_only`: both bodies multiply the hi plane alone (one mma a k-step, no remainder): the bound of what the
  conversion and the second plane cost, at fp16's 11 bits of the activations (its pyvm diff shows the error).
"""


import argparse

from megadecode.backends.mega.runtime import compile_launcher
from mega_sync_ab import run_ab, swapped  # bench/: the swaps' context, the checks and the interleaved timing

VARIANTS = ("shipped", "staged_up", "hi_only", "scu2", "staged_scu2", "down_scu3")


def _swaps(name: str) -> list[tuple[object, str, object]]:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Constexpr, Float32, Int32, Int64, Uint32

    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute import moe as M
    from megadecode.backends.mega.cute.base import (ARG, NT, NW, RECORD, WBYTES, arg, args, f16x2_split, f32_bits, fa,
                                                    frag_dec, frag_scale, from_bits, ia, ld4w, ld8, ldi, mma_f16,
                                                    silu, situ, stf, warp_max)
    from megadecode.backends.mega.isa import F_FRAG, F_SITU, FRAG_TILE

    if name == "shipped":
        return []

    if name == "hi_only":
        @cute.jit
        def frag_tiles_hi(ra: Int64, rb: Int64, ntl: Constexpr, nsc: Int32, xrow: Int64, up_s: Float32, lane: Int32,
                          acc: cute.Tensor):
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
                        xv = ld8(Float32, xrow + Int64(256 * sc + 64 * q + 32 * b + 8 * c) * 4)
                        hi = []
                        for i in cutlass.range_constexpr(4):
                            h, _ = f16x2_split(xv[2 * i] * up_s, xv[2 * i + 1] * up_s)
                            hi.append(h)
                        mb = 2 * q + b
                        for t in cutlass.range_constexpr(ntl):
                            p0, p1, p2, p3 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
                            for s2 in cutlass.range_constexpr(2):
                                w = ws[t][q][2 * b + s2]
                                p0, p1, p2, p3 = mma_f16(frag_dec(w, 0), frag_dec(w, 1), frag_dec(w, 2),
                                                         frag_dec(w, 3), hi[2 * s2], hi[2 * s2 + 1], p0, p1, p2, p3)
                            s_lo = frag_scale(ss[t][mb // 4], mb % 4)
                            s_hi = frag_scale(ss[t][2 + mb // 4], mb % 4)
                            acc[4 * t] += p0 * s_lo
                            acc[4 * t + 1] += p1 * s_lo
                            acc[4 * t + 2] += p2 * s_hi
                            acc[4 * t + 3] += p3 * s_hi

        return [(M, "frag_tiles", frag_tiles_hi)]

    # staged_up: EXPERT_UP's pair row staged once per CTA as fp16 hi (words [0, D/2)) and lo ([D/2, D)) planes

    scu_up, scu_down = {"scu2": (2, 2), "staged_scu2": (2, 2), "down_scu3": (1, 3)}.get(name, (1, 1))
    staged = name in ("staged_up", "staged_scu2")

    @cute.jit
    def lds4(addr: Int32):
        return cute.arch.inline_ptx("ld.shared.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                    write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[addr])

    @cute.jit
    def sts1(addr: Int32, v: Uint32):
        cute.arch.inline_ptx("st.shared.u32 [{$r0}], {$r1};", read_only_args=[addr, v])

    @cute.jit
    def stage_row(xrow: Int64, D: Int32, sbase: Int32, red: Int32, tid: Int32) -> Float32:
        """The row at xrow (D fp32, produced in the launch: coherent loads) into shared memory as fp16 hi / lo
        planes scaled by 2**kk (frag_row_scale's rule, the max over the CTA); returns 2**(14 - kk). Every thread
        calls it; a block barrier at the end."""
        m = Float32(0.0)
        for k in cutlass.range(tid * 8, D, NT * 8):
            v = ld8(Float32, xrow + Int64(k) * 4)
            for j in cutlass.range_constexpr(8):
                m = cute.arch.fmax(m, cute.arch.fmax(v[j], -v[j]))
        m = warp_max(m)
        if tid % 32 == 0:
            sts1(red + (tid // 32) * 4, Uint32(f32_bits(m)))
        cute.arch.sync_threads()
        mm = Float32(0.0)
        for w in cutlass.range_constexpr(NW):
            mm = cute.arch.fmax(mm, from_bits(lds4(red + (w // 4) * 16)[w % 4]))
        ex = (f32_bits(mm) >> 23) & 255
        kk = Int32(0)
        if ex > 0 and ex < 255:
            kk = cutlass.min(Int32(141) - ex, Int32(127))
        up_s = from_bits(Uint32((kk + 127) << 23))
        for i in cutlass.range(tid, D // 2, NT):
            v = cute.make_tensor(cute.make_ptr(Float32, xrow + Int64(8) * Int64(i), cute.AddressSpace.gmem,
                                               assumed_align=8), cute.make_layout(2)).load()
            h, lo = f16x2_split(v[0] * up_s, v[1] * up_s)
            sts1(sbase + 4 * i, h)
            sts1(sbase + 2 * D + 4 * i, lo)
        cute.arch.sync_threads()
        return from_bits(Uint32((141 - kk) << 23))

    @cute.jit
    def records(ra: Int64, rb: Int64, ntl: Constexpr, scu: Constexpr, sc0: Int32, xrow: Int64, up_s: Float32,
                sbase: Int32, D: Int32, from_smem: Constexpr, lane: Int32, acc: cute.Tensor):
        """Records [sc0, sc0 + scu) of the unit's ntl tiles, every record's words loaded before the first is
        used; B from the pair's fp32 row (converted per block) or, from_smem, from the staged planes."""
        c = lane % 4
        g = lane // 4
        ws, ss = [], []
        for su in cutlass.range_constexpr(scu):
            off = Int64(sc0 + su) * Int64(RECORD)
            for t in cutlass.range_constexpr(ntl):
                base = (ra if t == 0 else rb) + off
                ws.append([ld4w(base + Int64(512 * q) + Int64(16) * Int64(lane)) for q in range(4)])
                ss.append(ld4w(base + Int64(WBYTES) + Int64(16) * Int64(g)))
        for su in cutlass.range_constexpr(scu):
            sc = sc0 + su
            for q in cutlass.range_constexpr(4):
                for b in cutlass.range_constexpr(2):
                    hi, lo = [], []
                    if cutlass.const_expr(from_smem):
                        w0 = 2 * (256 * sc + 64 * q + 32 * b + 8 * c)  # the block's 8 fp16 of this lane, bytes
                        hv = lds4(sbase + w0)
                        lv = lds4(sbase + 2 * D + w0)
                        hi = [hv[0], hv[1], hv[2], hv[3]]
                        lo = [lv[0], lv[1], lv[2], lv[3]]
                    else:
                        xv = ld8(Float32, xrow + Int64(256 * sc + 64 * q + 32 * b + 8 * c) * 4)
                        for i in cutlass.range_constexpr(4):
                            h, l_ = f16x2_split(xv[2 * i] * up_s, xv[2 * i + 1] * up_s)
                            hi.append(h)
                            lo.append(l_)
                    mb = 2 * q + b
                    for t in cutlass.range_constexpr(ntl):
                        p0, p1, p2, p3 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
                        for s2 in cutlass.range_constexpr(2):
                            w = ws[su * ntl + t][q][2 * b + s2]
                            a0, a1, a2, a3 = frag_dec(w, 0), frag_dec(w, 1), frag_dec(w, 2), frag_dec(w, 3)
                            p0, p1, p2, p3 = mma_f16(a0, a1, a2, a3, hi[2 * s2], hi[2 * s2 + 1], p0, p1, p2, p3)
                            p0, p1, p2, p3 = mma_f16(a0, a1, a2, a3, lo[2 * s2], lo[2 * s2 + 1], p0, p1, p2, p3)
                        sq = ss[su * ntl + t]
                        s_lo = frag_scale(sq[mb // 4], mb % 4)
                        s_hi = frag_scale(sq[2 + mb // 4], mb % 4)
                        acc[4 * t] += p0 * s_lo
                        acc[4 * t + 1] += p1 * s_lo
                        acc[4 * t + 2] += p2 * s_hi
                        acc[4 * t + 3] += p3 * s_hi

    @cute.jit
    def tiles_chunked(ra: Int64, rb: Int64, ntl: Constexpr, scu: Constexpr, nsc: Int32, xrow: Int64, up_s: Float32,
                      sbase: Int32, D: Int32, from_smem: Constexpr, lane: Int32, acc: cute.Tensor):
        """frag_tiles' sums, scu records a loop trip (the last nsc % scu one at a time)."""
        for i in cutlass.range_constexpr(8):
            acc[i] = Float32(0.0)
        nfull = nsc // scu * scu
        for sc0 in cutlass.range(0, nfull, scu):
            records(ra, rb, ntl, scu, sc0, xrow, up_s, sbase, D, from_smem, lane, acc)
        if cutlass.const_expr(scu > 1):
            for sc in cutlass.range(nfull, nsc):
                records(ra, rb, ntl, 1, sc, xrow, up_s, sbase, D, from_smem, lane, acc)

    @cute.jit
    def frag_tiles_scu(ra: Int64, rb: Int64, ntl: Constexpr, nsc: Int32, xrow: Int64, up_s: Float32, lane: Int32,
                       acc: cute.Tensor):
        if cutlass.const_expr(ntl == 2):
            tiles_chunked(ra, rb, 2, scu_up, nsc, xrow, up_s, Int32(0), Int32(0), False, lane, acc)
        else:
            tiles_chunked(ra, rb, 1, scu_down, nsc, xrow, up_s, Int32(0), Int32(0), False, lane, acc)

    @cute.jit
    def expert_up_staged(fb: Int64, ib: Int64, wtab: cute.Tensor, sm: cute.Tensor, smi: cute.Tensor, tid: Int32):
        warp, lane = tid // 32, tid % 32
        A_ = "EXPERT_UP"
        use_situ = (arg(smi, 3) & F_SITU) != 0
        gu = wtab[arg(smi, ARG[A_]["gu"])]
        I, D, x_off, h_off = args(smi, A_, "I D x_off h_off")
        w, W = args(smi, A_, "w W")
        nuniq = ldi(ia(ib, arg(smi, ARG[A_]["nuniq_off"])))
        uniq_off, pstart_off, ptok_off = args(smi, A_, "uniq_off pstart_off ptok_off")
        M.pair_experts(ib, smi, tid, nuniq, uniq_off, pstart_off)
        npairs = ldi(ia(ib, pstart_off + nuniq))
        nt = I // FRAG_TILE
        nsc = D // 256
        N = npairs * nt
        lo = Int32(Int64(w) * Int64(N) // Int64(W))
        hi = Int32(Int64(w + 1) * Int64(N) // Int64(W))
        sbase = Int32(sm.iterator.toint())
        red = sbase + 4 * D  # 8 words after the two planes (kernel_check: D + 8 <= SMEM_F)
        acc = cute.make_rmem_tensor(8, Float32)
        c, g = lane % 4, lane // 4
        if lo < hi:
            for p in cutlass.range(lo // nt, (hi - 1) // nt + 1):
                xrow = fa(fb, x_off + ldi(ia(ib, ptok_off + p)) * D)
                fs = stage_row(xrow, D, sbase, red, tid)
                u0 = cutlass.max(lo, p * nt)
                u1 = cutlass.min(hi, (p + 1) * nt)
                for unit in cutlass.range(u0 + warp, u1, NW):
                    rt = unit % nt
                    ra = gu + (Int64(smi[p]) * Int64(2 * nt) + Int64(rt)) * Int64(nsc) * Int64(RECORD)
                    tiles_chunked(ra, ra + Int64(nt) * Int64(nsc) * Int64(RECORD), 2, scu_up, nsc, xrow, Float32(1.0),
                                  sbase, D, True, lane, acc)
                    if c == 0:
                        for i in cutlass.range_constexpr(2):
                            gv = acc[2 * i] * fs
                            uv = acc[4 + 2 * i] * fs
                            hv = silu(gv) * uv
                            if use_situ:
                                hv = situ(gv, uv)
                            stf(Float32, fa(fb, h_off + p * I + rt * FRAG_TILE + g + 8 * i), hv)
                cute.arch.sync_threads()  # the planes are read before the next pair's staging

    @cute.jit
    def op_expert_up_staged(pb: Int64, idx: Int32, fb: Int64, ib: Int64, wtab: cute.Tensor, ptab: cute.Tensor,
                            sm: cute.Tensor, smi: cute.Tensor, tid: Int32):
        if (arg(smi, 3) & F_FRAG) != 0:
            expert_up_staged(fb, ib, wtab, sm, smi, tid)
        else:
            M.expert_up_rows(fb, ib, wtab, smi, tid)

    swaps = []
    if (scu_up, scu_down) != (1, 1):
        # two CTAs an SM pinned (ptxas's own pick for these bodies is ~180 registers: one CTA an SM)
        @cute.jit
        def launch_2cta(prog: cute.Tensor, qstart: cute.Tensor, qorder: cute.Tensor, ctr: cute.Tensor,
                        f32: cute.Tensor, i32: cute.Tensor, wtab: cute.Tensor, ptab: cute.Tensor, err: cute.Tensor,
                        max_spin: Int32, tl: cute.Tensor, timeline: Int32, delay_ns: Int32, num_ctas: Int32,
                        stream: K.cuda_drv.CUstream):
            K.mega_kernel(prog, qstart, qorder, ctr, f32, i32, wtab, ptab, err, max_spin, tl, timeline,
                          delay_ns).launch(grid=(num_ctas, 1, 1), block=(NT, 1, 1), stream=stream, min_blocks_per_mp=2)

        swaps += [(M, "frag_tiles", frag_tiles_scu), (K, "launch", launch_2cta)]
    if staged:
        swaps.append((K, "BODIES", tuple((n, op_expert_up_staged if n == "EXPERT_UP" else f) for n, f in K.BODIES)))
    return swaps


def build(name: str, device):
    with swapped(_swaps(name)):
        return compile_launcher(device, cache=False)


def build_ptx(name: str) -> str:
    """The variant's PTX compiled without a GPU (the CPU test of each variant's trace)."""
    from megadecode.backends.mega import cute_kernel as K

    with swapped(_swaps(name)):
        return K.compile_ptx_cubin().__ptx__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-mini")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--variants", default="shipped,staged_up,hi_only")
    ap.add_argument("--out", default="mega-frag-ab.json")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: {', '.join(VARIANTS)}")
    # hi_only may exceed the pyvm bounds: its check is reported, and it is still timed
    run_ab(names, build, "tiny-k3-frag", args.preset, args.batch, args.context, args.rounds, args.out)
    print(f"wrote {args.out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
