"""The CuTe DSL megakernel without a GPU: it compiles for sm_90a, its PTX and SASS pass the static ordering audit
(no non-coherent load of anything, every wait acquires, every signal releases, no store after a signal), the
audit catches the kernel's own planted mistakes, and the co-residency arithmetic refuses what does not fit."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="the megakernel needs nvidia-cutlass-dsl (the test extra installs it)")

from megadecode.mega import cute_kernel as K  # noqa: E402
from megadecode.mega.runtime import assemble, ctas_per_sm, registers_per_thread  # noqa: E402
from megadecode.validate.mega_audit import audit_megakernel  # noqa: E402


def test_compiles_for_sm90a_without_a_gpu():
    ptx = K.compile_for().__ptx__
    assert ".target sm_90a" in ptx and "mega_kernel" in ptx
    assert "ld.acquire.gpu" in ptx and "atom.global.release.add" in ptx


def test_audit_passes_the_kernel_with_every_rule():
    rep = audit_megakernel()
    assert rep.passed, rep.to_markdown()
    assert {"nc-load-of-produced", "wait-without-acquire", "signal-without-release",
            "store-after-signal"} <= set(rep.rules_checked)
    assert not rep.nc_loads  # no non-coherent load at all: weights take the same plain loads
    if assemble(K.compile_for().__ptx__)[0] is not None:
        assert "sass-nc-load-of-produced" in rep.rules_checked and not rep.sass_nc_loads


@pytest.mark.parametrize("plant, rule", [("relaxed_signal", "signal-without-release"),
                                         ("weak_wait", "wait-without-acquire")])
def test_audit_catches_the_kernels_planted_mistakes(plant, rule):
    rep = audit_megakernel(plant, sass=False)
    assert not rep.passed and rule in {f.rule for f in rep.errors}, rep.to_markdown()


def test_unknown_plant_is_refused():
    with pytest.raises(ValueError, match="unknown plant"):
        K.compile_for("nope")


def test_co_residency_arithmetic():
    # 123 registers x 256 threads: 4096 registers per warp-allocation unit x 8 warps -> 2 CTAs in 64K registers
    assert ctas_per_sm(123, 256, K.SMEM_BYTES) == 2
    assert ctas_per_sm(64, 256, K.SMEM_BYTES) == 4  # registers and shared memory (57 KiB + 1 KiB) both allow 4
    assert ctas_per_sm(64, 256, 100 * 1024) == 2  # then shared memory decides
    assert ctas_per_sm(None, 256, K.SMEM_BYTES) == 1  # unknown registers: one CTA always fits
    regs = registers_per_thread(K.compile_for().__ptx__)
    if assemble(K.compile_for().__ptx__)[0] is not None:
        assert regs is not None and 32 <= regs <= 255


def test_mxfp4_bit_formulas_of_the_kernel_decode_every_code_and_scale_exactly():
    """cute/base.py decodes MXFP4 by building fp32 bits: e2m1 magnitude index m -> (m << 22) + 0x3F000000 (m >= 2),
    0.5 (m = 1), 0 (m = 0), the sign bit from bit 3; e8m0 byte s -> s << 23 (s = 0: 2**-127, 255: NaN). The same
    formulas, evaluated here, against quant.mxfp4's table for all 16 codes and all 256 scale bytes."""
    import struct

    import torch

    from megadecode.quant.mxfp4 import E2M1_VALUES, e8m0_to_float

    def f(bits):
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]

    for c in range(16):
        m = c & 7
        bits = 0 if m == 0 else 0x3F000000 if m == 1 else (m << 22) + 0x3F000000
        v = f(bits | ((c & 8) << 28))
        assert v == E2M1_VALUES[c] and (str(v) == str(E2M1_VALUES[c]) or c == 8), c  # code 8 is -0.0
    ref = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    for s in range(256):
        bits = 0x00400000 if s == 0 else 0x7FC00000 if s == 255 else s << 23
        got = torch.tensor(f(bits))
        assert torch.equal(got, ref[s]) or (s == 255 and got.isnan() and ref[s].isnan()), s


def test_kernel_check_constants_are_the_kernels():
    from megadecode.mega.cute import base
    from megadecode.mega.kernel_check import NT, SMEM_F

    assert (NT, SMEM_F) == (base.NT, base.SMEM_F)
