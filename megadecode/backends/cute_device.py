"""CuTe DSL device helpers that neither backend owns: memory access by address (the arenas' bases and the tensor
tables' entries are Int64), warp reductions, activations. The megakernel's bodies (mega/cute/) and the fused
backend's CuTe kernels (fused/kernels/cute_experts.py) both build on them. Importing this module sets
CUTE_DSL_ARCH (read when cutlass is first imported) to the H200's sm_90a; every compile also names it."""

from __future__ import annotations

import os

ARCH = "sm_90a"
os.environ.setdefault("CUTE_DSL_ARCH", ARCH)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Constexpr, Float32, Int32, Int64, Uint8, Uint32  # noqa: E402,F401


def _g(addr, dtype, align):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def ldf(dtype: Constexpr, addr: Int64) -> Float32:
    return Float32(cute.make_tensor(_g(addr, dtype, dtype.width // 8), cute.make_layout(1))[0])


@cute.jit
def ldi(addr: Int64) -> Int32:
    return cute.make_tensor(_g(addr, Int32, 4), cute.make_layout(1))[0]


@cute.jit
def ldi64(addr: Int64) -> Int64:
    return cute.make_tensor(_g(addr, Int64, 8), cute.make_layout(1))[0]


@cute.jit
def stf(dtype: Constexpr, addr: Int64, v: Float32):
    t = cute.make_tensor(_g(addr, dtype, dtype.width // 8), cute.make_layout(1))
    t[0] = dtype(v)


@cute.jit
def sti(addr: Int64, v: Int32):
    t = cute.make_tensor(_g(addr, Int32, 4), cute.make_layout(1))
    t[0] = v


@cute.jit
def ldu8(addr: Int64) -> Uint32:
    return Uint32(cute.make_tensor(_g(addr, Uint8, 1), cute.make_layout(1))[0])


@cute.jit
def from_bits(b: Uint32) -> Float32:
    """The fp32 whose bits are b."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32], read_only_args=[b])


@cute.jit
def warp_sum(v: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << i)
    return v


@cute.jit
def warp_max(v: Float32) -> Float32:
    for i in cutlass.range_constexpr(5):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1 << i))
    return v


@cute.jit
def warp_argmax(v: Float32, i: Int32):
    """(max value, lowest index holding it) over the warp."""
    for k in cutlass.range_constexpr(5):
        ov = cute.arch.shuffle_sync_bfly(v, offset=1 << k)
        oi = cute.arch.shuffle_sync_bfly(i, offset=1 << k)
        if ov > v or (ov == v and oi < i):
            v = ov
            i = oi
    return v, i


@cute.jit
def silu(x: Float32) -> Float32:
    return x / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def sigmoid(x: Float32) -> Float32:
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-x))


@cute.jit
def situ(g: Float32, u: Float32) -> Float32:
    """SiTU-GLU (reference/activations.situ_glu): 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)."""
    return Float32(4.0) * cute.math.tanh(g / Float32(4.0)) * sigmoid(g) * (Float32(25.0) * cute.math.tanh(u / Float32(25.0)))
