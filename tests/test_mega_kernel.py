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
