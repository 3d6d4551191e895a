"""triton-attn-res (megadecode/backends/fused/kernels/attn_res.py) under the Triton interpreter: the harness's checks on tiny-k3
(ops that close a block included), the kernel against reference/attn_res.py for every source arrangement
(the partial sum alone, closed blocks alone, both), input checks and the static sm_90 audit."""

from __future__ import annotations

import pytest
import torch

from interp import (  # noqa: E402, F401 (interpreter_env: an autouse fixture, imported to apply here)
    DEVICE, import_interpreted, interpreter_env, static_audits, triton_gate,
)

AR = import_interpreted("megadecode.backends.fused.kernels.attn_res", "megadecode.validate.catalog")

from megadecode.presets import preset_config  # noqa: E402
from megadecode.reference.attn_res import attn_res  # noqa: E402
from megadecode.validate.catalog import get  # noqa: E402
from megadecode.validate.checks import check_op  # noqa: E402

TRITON_OK, needs_triton = triton_gate(AR.attn_res_kernel)


@needs_triton
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_variant_passes_check_op(dtype):
    for batch in (1, 5, 17):
        row = check_op(get("triton-attn-res"), preset_config("tiny-k3"), "attn_res", dtype, batch, seed=batch,
                       device=DEVICE)
        assert row["status"] == "PASS", row


@needs_triton
@pytest.mark.parametrize("nb,partial", [(0, True), (1, False), (3, False), (3, True), (4, True)])
def test_matches_reference_for_every_source_arrangement(nb, partial):
    g = torch.Generator().manual_seed(nb * 2 + partial)
    N, D = 3, 80  # D not a power of two: the tail chunk is masked
    blocks = torch.randn(nb, N, D, generator=g) * 2 if nb else None
    hidden = torch.randn(N, D, generator=g) if partial else None
    q, w = torch.randn(D, generator=g) / 4, torch.rand(D, generator=g) + 0.5
    srcs = torch.cat([t for t in (blocks, None if hidden is None else hidden[None]) if t is not None])
    want = attn_res(srcs, q, w, 1e-5)
    got = AR.attn_res_fused(*(None if t is None else t.to(DEVICE) for t in (blocks, hidden)), q.to(DEVICE),
                            w.to(DEVICE), 1e-5).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if nb + partial > 1:  # a real mixture, not one source copied
        assert not torch.allclose(got, srcs[-1], atol=1e-3)


def test_rejects_mismatched_sources():
    with pytest.raises(ValueError, match="no sources"):
        AR.attn_res_fused(None, None, torch.zeros(4), torch.zeros(4), 1e-5)
    with pytest.raises(ValueError, match="contiguous sources"):
        AR.attn_res_fused(torch.zeros(2, 3, 4), torch.zeros(3, 5), torch.zeros(4), torch.zeros(4), 1e-5)


def test_static_audit_sm90():
    assert len(static_audits(("megadecode.backends.fused.kernels.attn_res", [{}]))) == 1
