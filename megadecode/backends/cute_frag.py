"""The MXFP4 fragment-order records (quant/mxfp4_frag.py) on the tensor cores, in CuTe DSL: a record word's
registers decoded to A fragments, a record's block scales, the warp's mma.sync, a tile's sums of one 32-weight
block from them (frag_block), and the 16-byte shared-memory read its B fragments take. One implementation for both
users: the megakernel's expert bodies (mega/cute/moe.py, through mega/cute/base.py) and the fused backend's CuTe
experts (fused/kernels/cute_experts.py)."""

from __future__ import annotations

from .cute_device import ARCH, from_bits  # noqa: F401  (first: it sets the DSL's architecture)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Constexpr, Float32, Int32, Uint32  # noqa: E402

from ..quant.mxfp4_frag import MAG_AT, MAG_MASK, SIGN_AT, SIGN_MASK  # noqa: E402


@cute.jit
def mma(t: Constexpr, a0: Uint32, a1: Uint32, a2: Uint32, a3: Uint32, b0: Uint32, b1: Uint32, c0: Float32,
        c1: Float32, c2: Float32, c3: Float32):
    """One warp-wide mma.sync m16n8k16 with operands of type t ("bf16": the dense rows; "f16": the fragment-order
    MXFP4 weights, which decode to fp16, frag_dec) and fp32 sums: this lane's 4 sums of C + A B, where lane
    (g = lane / 4, t = lane % 4) holds A[g, 2t..2t+1] (a0), A[g + 8, 2t..] (a1), A[g, 2t + 8..] (a2),
    A[g + 8, 2t + 8..] (a3), B[2t..2t+1, g] (b0), B[2t + 8.., g] (b1), and C / D[g, 2t..2t+1], [g + 8, 2t..2t+1]."""
    return cute.arch.inline_ptx(
        f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{ {{$w0}}, {{$w1}}, {{$w2}}, {{$w3}} }}, "
        "{ {$r0}, {$r1}, {$r2}, {$r3} }, { {$r4}, {$r5} }, { {$r6}, {$r7}, {$r8}, {$r9} };",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3])


@cute.jit
def frag_dec(w: Uint32, j: Constexpr) -> Uint32:
    """Register j (0..3) of an MXFP4 record word as its A-fragment fp16 pair, e2m1 * 2**-14 exactly
    (quant/mxfp4_frag.py: one shift and mask for registers 0 and 1, two of each for 2 and 3)."""
    sm = 9 - MAG_AT[j]
    ss = 15 - SIGN_AT[j]
    out = Uint32(0)
    if cutlass.const_expr(sm == ss):
        out = (w << Uint32(sm) if cutlass.const_expr(sm > 0) else w) & Uint32(MAG_MASK | SIGN_MASK)
    else:
        out = ((w << Uint32(sm)) & Uint32(MAG_MASK)) | ((w << Uint32(ss)) & Uint32(SIGN_MASK))
    return out


@cute.jit
def frag_scale(word: Uint32, m: Constexpr) -> Float32:
    """2**(byte m of word - 127) as fp32 (the e8m0 byte shifted into the exponent field; byte 0 -> 0)."""
    sh = 23 - 8 * m
    b = (word << Uint32(sh)) if cutlass.const_expr(sh >= 0) else (word >> Uint32(-sh))
    return from_bits(b & Uint32(0x7F800000))


@cute.jit
def lds4(addr: Int32):
    """16 bytes of shared memory at byte address addr as 4 words."""
    return cute.arch.inline_ptx("ld.shared.v4.u32 { {$w0}, {$w1}, {$w2}, {$w3} }, [{$r0}];",
                                write_only_types=[Uint32, Uint32, Uint32, Uint32], read_only_args=[addr])


def frag_block(acc: cute.Tensor, t: int, words, scales, mb: int, hi, lo=None) -> None:
    """Traced inline (a plain function, called while a body is traced): tile t's sums of one 32-weight block, its
    two k-steps' record words `words` against the B plane hi and, where the activations carry one, the remainder
    plane lo (mma.sync m16n8k16, fp16; hi / lo: 4 words each, this lane's 8 fp16 of the block), times the block's
    weight scales (block mb of the record's scale words `scales`), added to acc[4t..4t+3]."""
    p0, p1, p2, p3 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
    for s2 in range(2):
        w = words[s2]
        a0, a1, a2, a3 = frag_dec(w, 0), frag_dec(w, 1), frag_dec(w, 2), frag_dec(w, 3)
        p0, p1, p2, p3 = mma("f16", a0, a1, a2, a3, hi[2 * s2], hi[2 * s2 + 1], p0, p1, p2, p3)
        if lo is not None:
            p0, p1, p2, p3 = mma("f16", a0, a1, a2, a3, lo[2 * s2], lo[2 * s2 + 1], p0, p1, p2, p3)
    s_lo = frag_scale(scales[mb // 4], mb % 4)
    s_hi = frag_scale(scales[2 + mb // 4], mb % 4)
    acc[4 * t] += p0 * s_lo
    acc[4 * t + 1] += p1 * s_lo
    acc[4 * t + 2] += p2 * s_hi
    acc[4 * t + 3] += p3 * s_hi
