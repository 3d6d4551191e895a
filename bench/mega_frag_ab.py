"""The megakernel's tensor-core expert bodies (F_FRAG, backends/mega/cute/moe.py) against alternatives, by launch time
on the GPU, as bench/mega_sync_ab.py measures the loop: each variant is a build of the kernel with module-level
functions swapped for one compile (the shipped source holds no switch), first diffed against pyvm
(validate.mega_gpu.diff_program on tiny-k3-frag at batch 1 and 3, delayed launches included), then timed on
k3-mini (experts in fragment order) in interleaved rounds (mega_sync_ab.timed). Medians to --out as JSON.

    python bench/mega_frag_ab.py --batch 1,8 --out $OUT/mega-frag-ab.json

Variants (EXPERT_UP as shipped: its pair's row staged once a CTA as fp16 planes; the variants change
EXPERT_DOWN, whose warps convert their pair's h row per 32-weight block):
- `shipped`: EXPERT_DOWN scales h by a power of two from the row's max (a pass over the row a unit,
  frag_row_scale) and loads one record of its tile a loop trip.
- `down_scu2`: two records a trip, both loaded before the first is used (twice the bytes in flight a warp).
- `down_block_scale`: no pass over the row; each 32-block of h scaled by its own power of two (the max over the
  4 lanes that hold it: two shuffles) and the block's products descaled with the weights' block scale.
- `down_block_scale_scu2`: both.

Measured at 918ac56 (bench/results/mega-frag-ab-nvidia-h200.json): EXPERT_UP staged (`staged_up`, since shipped)
against the per-warp conversion, and loading two or three records a trip with two CTAs an SM pinned (spilling).
"""


import argparse

from megadecode.backends.mega.runtime import compile_launcher
from mega_sync_ab import run_ab, swapped  # bench/: the swaps' context, the checks and the interleaved timing

VARIANTS = ("shipped", "down_scu2", "down_block_scale", "down_block_scale_scu2")


def _swaps(name: str) -> list[tuple[object, str, object]]:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Constexpr, Float32, Int32, Int64, Uint32

    from megadecode.backends.mega.cute import moe as M
    from megadecode.backends.mega.cute.base import (NT, RECORD, WBYTES, f16x2_split, f32_bits, fa, from_bits, ld4w,
                                                    ld8, stf)
    from megadecode.backends.mega.isa import FRAG_TILE

    if name == "shipped":
        return []

    @cute.jit
    def records(ra: Int64, ntl: Constexpr, scu: Constexpr, sc0: Int32, rb: Int64, xrow: Int64, up_s: Float32,
                block_scale: Constexpr, lane: Int32, acc: cute.Tensor):
        """Records [sc0, sc0 + scu) of the unit's ntl tiles against the fp32 row at xrow, every record's words
        loaded before the first is used; block_scale: each 32-block of x scaled by its own power of two (the max
        over the 4 lanes holding it) and the products descaled per block, else by up_s (the row's)."""
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
                    xv = ld8(Float32, xrow + Int64(256 * sc + 64 * q + 32 * b + 8 * c) * 4)
                    xs = up_s
                    fsb = Float32(1.0)
                    if cutlass.const_expr(block_scale):
                        m = Float32(0.0)
                        for j in cutlass.range_constexpr(8):
                            m = cute.arch.fmax(m, cute.arch.fmax(xv[j], -xv[j]))
                        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1))
                        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=2))
                        ex = (f32_bits(m) >> 23) & 255
                        kk = Int32(0)
                        if ex > 0 and ex < 255:
                            kk = cutlass.min(Int32(141) - ex, Int32(127))
                        xs = from_bits(Uint32((kk + 127) << 23))
                        fsb = from_bits(Uint32((141 - kk) << 23))
                    hi, lo = [], []
                    for i in cutlass.range_constexpr(4):
                        h, l_ = f16x2_split(xv[2 * i] * xs, xv[2 * i + 1] * xs)
                        hi.append(h)
                        lo.append(l_)
                    for t in cutlass.range_constexpr(ntl):
                        M.frag_block(acc, t, ws[su * ntl + t][q][2 * b:2 * b + 2], ss[su * ntl + t], 2 * q + b, hi,
                                     lo, fsb if block_scale else None)

    scu, block_scale = {"down_scu2": (2, False), "down_block_scale": (1, True),
                        "down_block_scale_scu2": (2, True)}[name]

    @cute.jit
    def expert_down_frag_v(fb: Int64, ib: Int64, dn: Int64, smi: cute.Tensor, tid: Int32, I: Int32, D: Int32,
                           h_off: Int32, y_off: Int32, r0: Int32, r1: Int32, npairs: Int32):
        warp, lane = tid // 32, tid % 32
        c, g = lane % 4, lane // 4
        nt = (r1 - r0) // FRAG_TILE
        ntd = D // FRAG_TILE
        nsc = I // 256
        acc = cute.make_rmem_tensor(8, Float32)
        for unit in cutlass.range(warp, npairs * nt, NT // 32):
            p = unit // nt
            rt = r0 // FRAG_TILE + unit % nt
            xrow = fa(fb, h_off + p * I)
            up_s, fs = Float32(1.0), Float32(1.0)
            if cutlass.const_expr(not block_scale):
                up_s, fs = M.frag_row_scale(xrow, I, lane)
            ra = dn + (Int64(smi[p]) * Int64(ntd) + Int64(rt)) * Int64(nsc) * Int64(RECORD)
            for i in cutlass.range_constexpr(8):
                acc[i] = Float32(0.0)
            nfull = nsc // scu * scu
            for sc0 in cutlass.range(0, nfull, scu):
                records(ra, 1, scu, sc0, ra, xrow, up_s, block_scale, lane, acc)
            if cutlass.const_expr(scu > 1):
                for sc in cutlass.range(nfull, nsc):
                    records(ra, 1, 1, sc, ra, xrow, up_s, block_scale, lane, acc)
            if c == 0:
                for i in cutlass.range_constexpr(2):
                    stf(Float32, fa(fb, y_off + p * D + rt * FRAG_TILE + g + 8 * i), acc[2 * i] * fs)

    return [(M, "expert_down_frag", expert_down_frag_v)]


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
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="mega-frag-ab.json")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}: {', '.join(VARIANTS)}")
    run_ab(names, build, "tiny-k3-frag", args.preset, args.batch, args.context, args.rounds, args.out)
    print(f"wrote {args.out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
