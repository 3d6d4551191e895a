"""End to end: greedy generation with a variant executor against the torch executor, same random
weights, several prompts, in lockstep. Where a sequence's tokens first diverge it reports the step, both
tokens, whether each is in the other side's top-5 and the logprob gap (in the reference's distribution:
logprob of the reference token minus that of the variant's token). A divergence is a near tie (not a
failure) when the gap is below the dtype's `e2e_logprob_gap` and each token is in the other's top-2."""

from __future__ import annotations

import torch

from ..contract import Variant, dtype_name
from ..engine import Engine
from ..presets import preset_config
from ..weights import random_weights
from .executor import VariantExecutor
from .tolerances import E2E_LOGPROB_GAP

DEFAULT_PROMPTS = ([256, 72, 101, 108, 108, 111], [256, 1, 2, 3], [256, 77, 111, 69], [256, 40])


def _engine(cfg, weights, prompts, steps, variants=None, executor: str = "torch", **executor_attrs) -> Engine:
    eng = Engine(cfg, weights, executor=executor, max_batch=len(prompts),
                 max_seq_len=max(map(len, prompts)) + steps + 1)
    if variants is not None:
        eng.executor = VariantExecutor(eng.plan, weights, eng.cache, variants)
    for k, v in executor_attrs.items():  # e.g. pyvm's check_races
        setattr(eng.executor, k, v)
    return eng


@torch.inference_mode()
def compare_generation(variants: list[Variant] | None, preset: str = "tiny-qwen3-moe", *, prompts=DEFAULT_PROMPTS,
                       steps: int = 128, dtype=torch.float32, seed: int = 0, device="cpu", executor: str = "torch",
                       reference: str = "torch", **executor_attrs) -> dict:
    """`variants` replace plan ops in the torch executor; or, with variants None, a whole-step `executor` (pyvm,
    mega) runs every step, `executor_attrs` set on it. `reference`: the executor it runs in lockstep with; "pyvm"
    for the megakernel in bf16, because the bf16 torch executor rounds activations between ops where the kernel
    keeps fp32, and on the tiny presets that flips routing decisions within 1e-4 of a tie (validate/near_tie.py)
    with logprob gaps past any bf16 bound; pyvm computes the kernel's own math, so the fp32 gap applies."""
    cfg = preset_config(preset)
    prompts = [list(p) for p in prompts]
    weights = random_weights(cfg, device, dtype, seed)
    ref = _engine(cfg, weights, prompts, steps, executor=reference)
    var = _engine(cfg, weights, prompts, steps, variants, executor, **executor_attrs)
    gap_tol = E2E_LOGPROB_GAP["float32" if reference == "pyvm" else dtype_name(dtype)]
    lr, lv = ref.prefill(prompts, steps), var.prefill(prompts, steps)
    first: dict[int, dict] = {}
    max_diff = 0.0  # largest |logit difference| while the sequences still agree
    for step in range(steps):
        pr, pv = torch.log_softmax(lr, -1), torch.log_softmax(lv, -1)
        tr, tv = pr.argmax(-1), pv.argmax(-1)
        for i in range(len(prompts)):
            if i in first:
                continue
            a, b = int(tr[i]), int(tv[i])
            if a == b:
                max_diff = max(max_diff, float((lr[i] - lv[i]).abs().max()))
                continue
            gap = float(pr[i, a] - pr[i, b])
            top5_r, top5_v = pr[i].topk(5).indices.tolist(), pv[i].topk(5).indices.tolist()
            first[i] = {"sequence": i, "step": step, "ref_token": a, "variant_token": b,
                        "variant_token_in_ref_top5": b in top5_r, "ref_token_in_variant_top5": a in top5_v,
                        "logprob_gap": gap,
                        "near_tie": gap <= gap_tol and b in top5_r[:2] and a in top5_v[:2]}
        if step + 1 < steps:
            lr, lv = ref.decode(tr), var.decode(tv)
    ran = dict(getattr(var.executor, "ran", {}))
    var.executor.check_errors()  # the mega executor: a wait that timed out in a launch fails the comparison
    status = "PASS" if all(d["near_tie"] for d in first.values()) else "FAIL"
    return {"status": status, "preset": preset, "dtype": dtype_name(dtype), "device": str(device), "steps": steps,
            "reference": reference, "logprob_gap_tol": gap_tol,
            "sequences": len(prompts), "variants": [v.name for v in variants] if variants else [executor],
            "variant_ops_run": ran,
            "max_logit_diff_before_divergence": max_diff, "divergences": [first[i] for i in sorted(first)]}
