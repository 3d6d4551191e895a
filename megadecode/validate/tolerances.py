"""How close a variant must come to the fp32 torch reference: tolerances DERIVED per check from the error the
same computation makes in the dtype under test.

Every check rounds its inputs to the dtype under test (bf16, fp16, fp32) and computes
  ref     the torch reference op in fp32 on those rounded inputs (the target), and
  ref_dt  the same torch reference op computed in the dtype itself (inputs, weights and arithmetic in it),
and measures, per output tensor, two errors against `ref` (row r = the tensor's first index):
  max_rel   max over rows of  max_i |x[r, i] - ref[r, i]| / max_i |ref[r, i]|
  mean_rel  mean over rows of sum_i |x[r, i] - ref[r, i]| / sum_i |ref[r, i]|
Row-relative, so that rows of tiny norm or huge magnitude each count at their own scale. The variant passes when
  max_rel(variant)  <= max(FACTOR * max_rel(ref_dt),  FLOOR[dtype].max_rel)
  mean_rel(variant) <= max(FACTOR * mean_rel(ref_dt), FLOOR[dtype].mean_rel)
for every floating output (and for the attention caches). FACTOR = 4: a kernel may round differently than the torch
ops (more or less often, at other points) but not make several times their error. The floors cover outputs whose
dtype reference is exact (fp32 itself; fp32 outputs such as the router's weights) and are set from the dtype's unit
roundoff u (fp32 2^-24, fp16 2^-11, bf16 2^-8): max_rel 8 u and mean_rel 2 u for 16-bit; max_rel 1024 u (6.1e-5)
and mean_rel 128 u (7.6e-6) for fp32, whose kernels reorder long fp32 sums (the shipped ones stayed below 1e-6 on
the tiny presets under the interpreter). A 5% scale error (mean_rel 0.05) is above every bound: the bf16 reference's
own mean_rel was 0.0013-0.0051 for the experts, GQA attention, MLP and add ops (CPU, torch 2.13, tiny presets,
batches 1 and 8, 2026-11-30), so 4x stays at or under 0.02; the report's table gives every cell's.
Where the op cannot run in the dtype on this device (ValueError/RuntimeError of torch), ref_dt is the fp32
reference rounded to the dtype, and the row says so (`tol_source`).

Log-probabilities (LM_HEAD's side output `logprobs`) are held in absolute terms instead (ABSOLUTE_FLOORS): an error
in nats does not scale with the value, and near 0 (a confident token) a relative one means nothing; their figures
(max_rel, mean_rel) are then the largest and the mean absolute error, their floors the logits' rounding at |l| ~ 16
(fp32: 1e-4 nats; fp16: 16 x 2^-11 ~ 8e-3 -> 1e-2; bf16: 16 x 2^-8 ~ 6e-2 -> 8e-2).

NaN/inf never pass; integer outputs (topk_ids) must match exactly, as sets per token (UNORDERED). LM_HEAD's greedy
`tokens` must be the reference's wherever its top-2 margin is clear; within the logits' tolerance of the row's
maximum a rival token may win (checks.py).
End to end (e2e.py), a divergence counts as a near tie below E2E_LOGPROB_GAP[dtype] nats.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

FACTOR = 4.0
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


@dataclass(frozen=True)
class Bound:
    max_rel: float
    mean_rel: float

    def to_dict(self) -> dict:
        return asdict(self)


FLOORS: dict[str, Bound] = {
    "float32": Bound(max_rel=1024 * UNIT_ROUNDOFF["float32"], mean_rel=128 * UNIT_ROUNDOFF["float32"]),
    "float16": Bound(max_rel=8 * UNIT_ROUNDOFF["float16"], mean_rel=2 * UNIT_ROUNDOFF["float16"]),
    "bfloat16": Bound(max_rel=8 * UNIT_ROUNDOFF["bfloat16"], mean_rel=2 * UNIT_ROUNDOFF["bfloat16"]),
}

E2E_LOGPROB_GAP = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}


# Outputs whose rows are sets: topk_ids order is unspecified (a variant may emit the A picks in any
# order); rows are compared after sorting ids, and topk_weights follows the same permutation.
UNORDERED = {"topk_ids": "topk_weights"}


ABSOLUTE_FLOORS: dict[str, dict[str, float]] = {"logprobs": {"float32": 1e-4, "float16": 1e-2, "bfloat16": 8e-2}}


def errors(name: str, got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The figures output `name` is held to: absolute ones for ABSOLUTE_FLOORS outputs, else row_errors."""
    if name not in ABSOLUTE_FLOORS:
        return row_errors(got, ref)
    if not ref.numel():
        return {"max_rel": 0.0, "mean_rel": 0.0}
    err = (got.double() - ref.double()).abs()
    return {"max_rel": float(err.max()), "mean_rel": float(err.mean())}


def row_errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max_rel and mean_rel of `got` against `ref` (module doc), in float64; both finite tensors."""
    if not ref.numel():
        return {"max_rel": 0.0, "mean_rel": 0.0}
    g = got.double().reshape(ref.shape[0] if ref.dim() else 1, -1)
    r = ref.double().reshape(g.shape)
    err = (g - r).abs()
    tiny = torch.finfo(torch.float64).tiny
    max_rel = err.amax(1) / r.abs().amax(1).clamp_min(tiny)
    mean_rel = err.sum(1) / r.abs().sum(1).clamp_min(tiny)
    max_rel = torch.where(err.amax(1) == 0, 0.0, max_rel)
    mean_rel = torch.where(err.sum(1) == 0, 0.0, mean_rel)
    return {"max_rel": float(max_rel.max()), "mean_rel": float(mean_rel.mean())}


def derive(dtype: str, ref_dt_errors: dict[str, float], name: str | None = None) -> Bound:
    """The bound for output `name`, whose dtype reference makes `ref_dt_errors` (`errors` of ref_dt vs ref)."""
    f = FLOORS[dtype]
    if name in ABSOLUTE_FLOORS:
        f = Bound(ABSOLUTE_FLOORS[name][dtype], ABSOLUTE_FLOORS[name][dtype])
    return Bound(max(FACTOR * ref_dt_errors["max_rel"], f.max_rel), max(FACTOR * ref_dt_errors["mean_rel"], f.mean_rel))


def derivation_text() -> str:
    """The rule as the report states it."""
    floors = ", ".join(f"{k}: max_rel {v.max_rel:.2g}, mean_rel {v.mean_rel:.2g}" for k, v in FLOORS.items())
    return (f"bound = max({FACTOR:g} x the error of the torch reference computed in the dtype (against the fp32 "
            f"reference on the same rounded inputs), floor); floors: {floors}. max_rel = max over rows of max|err| / "
            "max|ref| of the row; mean_rel = mean over rows of sum|err| / sum|ref| of the row.")
