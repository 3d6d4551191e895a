"""A Triton kernel defined outside megadecode, for tests/test_harness_contract.py: a variant declared anywhere
(here, a test module) must be audited like the shipped ones. NC reads the produced input through the non-coherent
path (inline PTX, compiled for the audit only: the interpreter never runs this kernel)."""

from __future__ import annotations

import triton
import triton.language as tl

from megadecode.contract import kernel_spec
from megadecode.validate.handoff import _ld_nc_f32


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, NC: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    if NC:
        x = _ld_nc_f32(x_ptr + i, ok)
    else:
        x = tl.load(x_ptr + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, x * 2.0, mask=ok)


def specs(nc: bool) -> list:
    return [kernel_spec(scale_kernel, {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
                        {"BLOCK": 128, "NC": nc})]
