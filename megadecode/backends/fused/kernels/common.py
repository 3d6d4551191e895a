"""Triton pieces that several kernels share (@triton.jit device functions, inlined where they are called).

    dot                   tl.dot, IEEE fp32 when asked (fp32 inputs)
    online_softmax_step   one cache tile of an online softmax (the MLA and GQA decode attention kernels)
    mma                   acc + w @ v on tensor cores with the activations split in two for fp32 accuracy
                          (the routed experts, the tensor-core projection)
    e8m0_to_f32           an MXFP4 block scale byte -> its fp32 power of two, exactly
    tanh_f32              tanh without libdevice (SiTU-GLU in the routed experts)
    run_of                which expert and which of its (token, slot) pairs a program of a routed-experts kernel
                          takes (per pair, or grouped by expert); a pair whose id is negative is skipped
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def online_softmax_step(s, l_ok, vt, m_i, l_i, acc, IEEE: tl.constexpr):
    """One cache tile of an online softmax: s [rows, BLOCK_L] scaled scores, l_ok the tile's visible positions,
    vt [BLOCK_L, cols] the values; -> (m_i, l_i, acc) updated (running max, running sum, unnormalised
    output). The probabilities are rounded to the values' dtype before the product (as the reference)."""
    s = tl.where(l_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot(p.to(vt.dtype), vt, acc * alpha[:, None], IEEE)
    return m_new, l_i, acc


@triton.jit
def mma(w, v, acc, SPLIT: tl.constexpr):
    """acc + w @ v on tensor cores: w [R, K] (fp16/bf16/fp32), v [K, M] fp32/fp16/bf16 activations. fp32 w: an
    IEEE fp32 dot. Else v is rounded to w's dtype; SPLIT (fp32 activations): v = hi + lo, both in w's dtype,
    two products (about 2x the mantissa bits of one)."""
    if w.dtype == tl.float32:
        return tl.dot(w, v.to(tl.float32), acc, input_precision="ieee")
    vh = v.to(w.dtype)
    acc = tl.dot(w, vh, acc)
    if SPLIT:
        acc = tl.dot(w, (v.to(tl.float32) - vh.to(tl.float32)).to(w.dtype), acc)
    return acc


@triton.jit
def e8m0_to_f32(s):
    """e8m0 byte (int32) -> fp32 2**(s - 127), exactly: biased exponent bits; 0 -> 2**-127 (subnormal),
    255 -> NaN."""
    bits = tl.where(s == 0, 1 << 22, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def tanh_f32(z):
    """tanh in fp32 without libdevice (the interpreter lacks it): odd Taylor series below |z| = 0.125 (error
    < 1e-10 relative), sign(z) (1 - e) / (1 + e) with e = exp(-2|z|) above (no overflow)."""
    a = tl.abs(z)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    z2 = a * a
    small = a * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0))))
    r = tl.where(a < 0.125, small, big)
    return tl.where(z < 0, -r, r)


@triton.jit
def run_of(pid, ids_ptr, offs_ptr, GROUPED: tl.constexpr):
    """(expert, first, end) of program row `pid`: grouped, expert pid's run [offs[e], offs[e+1]) of the
    sorted pairs; else pair pid alone (its expert read from ids). A negative id (expert parallelism: an expert
    another rank owns) is an empty run: grouped, such pairs sort before expert 0's run and belong to none; per
    pair, the program's run is empty (expert 0 is returned only to keep addresses in bounds)."""
    if GROUPED:
        return pid, tl.load(offs_ptr + pid), tl.load(offs_ptr + pid + 1)
    else:
        e = tl.load(ids_ptr + pid).to(tl.int32)
        return tl.maximum(e, 0), pid, tl.where(e >= 0, pid + 1, pid)
