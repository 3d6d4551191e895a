"""The CuTe DSL megakernel without a GPU: it compiles for sm_90a, its PTX and SASS pass the static ordering audit
(no non-coherent load of anything, every wait acquires, every signal releases after a block barrier, no store after
a signal, every produced read covered by an acquire, every spin loop reports its timeout), and the co-residency
arithmetic refuses what does not fit. The audit's catches of planted mistakes: tests/test_mega_plants.py."""

from __future__ import annotations

import importlib
import re

import pytest

pytest.importorskip("cutlass", reason="the megakernel needs nvidia-cutlass-dsl (the test extra installs it)")

from megadecode.backends.mega import cute_kernel as K  # noqa: E402
from megadecode.backends.mega.runtime import assemble, ctas_per_sm, cubin_registers, registers_per_thread  # noqa: E402
from megadecode.validate.mega_audit import audit_megakernel  # noqa: E402


def test_compiles_for_sm90a_without_a_gpu():
    ptx = K.compile_for().__ptx__
    assert ".target sm_90a" in ptx and "mega_kernel" in ptx
    assert "ld.acquire.gpu" in ptx and "atom.global.release.add" in ptx


def test_audit_passes_the_kernel_with_every_rule():
    rep = audit_megakernel()
    assert rep.passed, rep.to_markdown()
    assert {"nc-load-of-produced", "wait-without-acquire", "signal-without-release", "store-after-signal",
            "signal-before-barrier", "timeout-unreported", "produced-read-uncovered"} <= set(rep.rules_checked)
    # the only reads outside the coherent path: the weight ring's bulk copies, each proven to read wtab[] alone
    assert rep.nc_loads and all(t == ("wtab[]",) for _, t in rep.nc_loads)
    if assemble(K.compile_for().__ptx__)[0] is not None:
        assert "sass-nc-load-of-produced" in rep.rules_checked and not rep.sass_nc_loads


def test_co_residency_arithmetic():
    # 123 registers x 256 threads: 4096 registers per warp-allocation unit x 8 warps -> 2 CTAs in 64K registers
    assert ctas_per_sm(123, 256, 56 * 1024) == 2
    assert ctas_per_sm(64, 256, 56 * 1024) == 4  # registers and shared memory (56 KiB + 1 KiB) both allow 4
    assert ctas_per_sm(64, K.NTL, K.SMEM_RING_BYTES) == 1  # the weight ring takes most of the SM
    assert ctas_per_sm(64, 256, 100 * 1024) == 2  # then shared memory decides
    assert ctas_per_sm(None, 256, K.SMEM_BYTES) == 1  # unknown registers: one CTA always fits
    regs = registers_per_thread(K.compile_for().__ptx__)
    if assemble(K.compile_for().__ptx__)[0] is not None:
        assert regs is not None and 32 <= regs <= 255


def test_the_kernel_fits_one_cta_per_sm():
    """The weight ring makes the CTA the SM's (one a SM, 132 on the H200): its shared memory must fit the SM's 227
    KiB a block, and its registers (ptxas takes up to 255 when the shared memory allows one CTA) 256 threads."""
    ptx = K.compile_for().__ptx__
    cubin, report = assemble(ptx)
    if cubin is None:
        pytest.skip(f"no ptxas here: {report}")
    regs = registers_per_thread(ptx)
    assert K.SMEM_RING_BYTES <= 227 * 1024
    assert ctas_per_sm(regs, K.NTL, K.SMEM_RING_BYTES) == 1, f"{regs} registers per thread"
    # what the runtime's residency check reads instead of running ptxas again: the DSL's own cubin's count
    assert cubin_registers(K.compile_for().artifacts.CUBIN) == regs == cubin_registers(cubin)


def test_the_other_build_fits_two_ctas_per_sm():
    """Past batch 1 the executor runs the build without the ring, two CTAs an SM (runtime.ring_build; 1.25x faster
    than one at qwen3-30b-a3b batch 8): 256 threads of at most 128 registers. ptxas picks the count itself (no cap in
    the PTX), so a body that needs more registers would take the build to one CTA an SM, and `default_ctas` would
    follow by halving the CTAs, silently (a first form of F_TC's token groups did: 196 registers)."""
    regs = cubin_registers(K.compile_for(False).artifacts.CUBIN)
    assert regs is not None
    assert ctas_per_sm(regs, K.block_threads(False), K.block_smem(False)) == 2, f"{regs} registers per thread"


def test_the_launches_compile_is_made_once_from_placeholders_and_keeps_the_register_count(monkeypatch):
    """runtime.compiled_launcher: the one compile per process that the engine build (default_ctas) and every
    runtime's launches share, made from placeholder tensors (here on the CPU: the compile needs no GPU). Its cubin
    has the kernel's register count, the same as the audited compile's; a second call compiles nothing."""
    from megadecode.backends.mega import runtime as R

    monkeypatch.setattr(R, "_COMPILED", None)
    c = R.compiled_launcher("cpu")
    assert c.source == "compiled"  # without a GPU the disk cache is not used (tests/test_mega_kernel_cache.py)
    assert c.registers == R.cubin_registers(c.fn.artifacts.CUBIN) == R.cubin_registers(
        K.compile_for().artifacts.CUBIN) is not None
    calls = []
    monkeypatch.setattr(K.cute, "compile", lambda *a, **k: calls.append(a))
    assert R.compiled_launcher("cpu") is c and not calls


def test_cubin_registers_reads_the_regcount_attribute_and_refuses_what_is_not_a_cubin():
    """EIATTR_REGCOUNT in a hand-made ELF64 .nv.info section (other attributes around it skipped by their
    formats); None for no cubin, a non-ELF, a truncated ELF and a cubin without the attribute."""
    import struct

    def elf(info: bytes) -> bytes:
        names = b"\0.shstrtab\0.nv.info\0"
        body = names + info
        shoff = 64 + len(body)
        head = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, shoff, 0,
                                                                           64, 0, 0, 64, 3, 1)
        sh = [bytes(64),
              struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0),
              struct.pack("<IIQQQQIIQQ", 11, 0x70000000, 0, 0, 64 + len(names), len(info), 0, 0, 4, 0)]
        return head + body + b"".join(sh)

    other = bytes([0x04, 0x11]) + struct.pack("<H", 8) + struct.pack("<II", 13, 104)  # EIATTR_FRAME_SIZE
    nval = bytes([0x01, 0x0A])  # a 2-byte attribute
    hval = bytes([0x03, 0x1B]) + struct.pack("<H", 255)
    regc = bytes([0x04, 0x2F]) + struct.pack("<H", 8) + struct.pack("<II", 13, 128)
    assert cubin_registers(elf(other + nval + hval + regc)) == 128
    assert cubin_registers(elf(other + hval)) is None
    assert cubin_registers(None) is None
    assert cubin_registers(b"not an elf at all") is None
    assert cubin_registers(elf(other + regc)[:80]) is None


def test_e8m0_bit_formula_of_the_kernel_decodes_every_scale_exactly():
    """cute/base.py e8m0: scale byte s -> fp32 bits s << 23 (s = 0: 2**-127, 255: NaN), against quant.mxfp4 for all
    256 bytes."""
    import struct

    import torch

    from megadecode.quant.mxfp4 import e8m0_to_float

    def f(bits):
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]

    ref = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    for s in range(256):
        bits = 0x00400000 if s == 0 else 0x7FC00000 if s == 255 else s << 23
        got = torch.tensor(f(bits))
        assert torch.equal(got, ref[s]) or (s == 255 and got.isnan() and ref[s].isnan()), s


def test_mxfp4_fp16_decode_of_e2m1x8_times_its_block_scale_equals_the_table_for_every_code_and_scale():
    """e2m1x8 moves nibble j's magnitude bits (e1 e0 m) to 9..11 and its sign to 15, nibble j + 4's by the same shifts to
    the high fp16 half (base.E2M1X8_SHIFTS and masks, which the kernel uses): each half is the e2m1 value times
    2**-14, fp16's subnormals carrying e = 0. mx_scale multiplies a block's sum by 2**14 and the e8m0 scale. The same,
    evaluated here in numpy, for all 4 nibble pairs of a word, all 16 codes in both halves and every scale byte,
    equals quant.mxfp4's dequantization (a one-term block sum, so the products are exact)."""
    import numpy as np
    import torch

    from megadecode.backends.mega.cute.base import E2M1X8_MAG, E2M1X8_SHIFTS, E2M1X8_SIGN
    from megadecode.quant.mxfp4 import E2M1_VALUES, e8m0_to_float

    scales = e8m0_to_float(torch.arange(256, dtype=torch.uint8)).numpy().astype(np.float32)
    for j, (sm, ss) in enumerate(E2M1X8_SHIFTS):
        for c in range(16):
            for c4 in (c, 15 - c):
                word = np.uint32((c << (4 * j)) | (c4 << (4 * j + 16)))
                word |= np.uint32(0x5A5A5A5A & ~((0xF << (4 * j)) | (0xF << (4 * j + 16))))  # other nibbles: noise
                mag = (word << np.uint32(sm)) if sm >= 0 else (word >> np.uint32(-sm))
                sgn = (word << np.uint32(ss)) if ss > 0 else word
                h = (mag & np.uint32(E2M1X8_MAG)) | (sgn & np.uint32(E2M1X8_SIGN))
                lo, hi = np.array([h], dtype=np.uint32).view(np.float16).astype(np.float32)
                for v, code in ((lo, c), (hi, c4)):
                    assert v == np.float32(E2M1_VALUES[code]) * np.float32(2.0 ** -14), (j, code)
                    assert np.signbit(v) == np.signbit(np.float32(E2M1_VALUES[code])), (j, code)
                    with np.errstate(over="ignore", invalid="ignore"):
                        got = v * np.float32(16384.0) * scales
                        want = np.float32(E2M1_VALUES[code]) * scales
                    same = (got == want) | (np.isnan(got) & np.isnan(want))
                    assert same.all(), (j, code, np.flatnonzero(~same)[:4])


def test_kernel_keeps_fp32_subnormals():
    """The MXFP4 decode keeps subnormals: e2m1x8's fp16 halves carry e = 0 as fp16 subnormals (converted without
    flush), and e8m0's byte 0 is the fp32 subnormal 2**-127; no flush-to-zero on the kernel's fp32 multiplies, adds
    and FMAs (the approximate ex2 / rcp of softmax and sigmoid may flush: they never see the decode's values)."""
    from megadecode.backends.mega import cute_kernel as K

    ptx = K.compile_for().__ptx__
    assert re.search(r"\bmul(\.rn)?\.f32", ptx)
    assert re.search(r"\bcvt\.f32\.f16\b", ptx)
    assert not re.search(r"\b(mul|fma|add|sub)(\.\w+)*\.ftz", ptx)
    assert not re.search(r"\bcvt(\.\w+)*\.ftz(\.\w+)*\.f32\.f16", ptx)


def test_each_opcode_is_one_module_whose_tables_name_its_row_and_whose_body_the_kernel_dispatches():
    """ops/: every opcode of the ISA table (but NOP) has a module; what it declares of its arguments (dtypes, MXFP4
    forms, produced tensors, lengths, aligned offsets) names arguments of its row; the kernel's dispatch takes each
    opcode's body, the function its module names, once; pyvm runs its `run`."""
    from megadecode.backends.mega import ops
    from megadecode.backends.mega.isa import OPS

    assert set(ops.BY_NAME) == set(OPS) - {"NOP"}
    for m in ops.MODULES:
        op, row = m.OP, set(OPS[m.OP.name][1])
        declared = set(op.dtypes) | set(op.mxfp4) | set(op.produced) | set(op.lengths) | set(op.aligned)
        assert declared <= row, (op.name, declared - row)
        assert set(op.produced) <= set(op.dtypes), op.name
        assert callable(m.run) and m.__name__.endswith("." + op.name.lower())
    assert sorted(K.DISPATCH) == sorted(ops.BY_NAME)
    for name, body in K.BODIES:
        mod, fn = ops.BY_NAME[name].OP.body
        assert body is getattr(importlib.import_module(f"megadecode.backends.mega.cute.{mod}"), fn), name


def test_the_shared_int_words_of_the_kernel_do_not_overlap():
    """smi's fixed words (cute/base.py): ROUTE's counts, starts and scans stay below the instruction rows (kernel_check
    refuses an E past that), and the two rows (current, next), the current index, FLAG_S, the timeline address and
    the wait flag take distinct words; the rows are 16-byte aligned (cp.async copies the next one)."""
    from megadecode.backends.mega.cute import base
    from megadecode.backends.mega.kernel_check import BODY_I

    assert BODY_I == base.BODY_I
    fixed = {"row": range(base.ROW_S, base.ROW_S + base.ROW), "next row": range(base.NEXT_S, base.NEXT_S + base.ROW),
             "index": [base.IDX_S], "flag": [base.FLAG_S], "timeline": [base.TL_S, base.TL_S + 1],
             "wait ok": [base.SMEM_I - 1]}
    words = [w for ws in fixed.values() for w in ws]
    assert len(words) == len(set(words)) and max(words) < base.SMEM_I and min(words) == base.BODY_I
    assert base.ROW_S % 4 == 0 and base.NEXT_S % 4 == 0 and base.ROW % 4 == 0
