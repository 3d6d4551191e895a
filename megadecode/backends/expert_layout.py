"""The order K3's routed MXFP4 experts are held in, per executor: the checkpoint's (every path but one) or the
fragment order of quant/mxfp4_frag.py (the fused executor's CuTe experts, backends/fused/kernels/cute_experts.py).

An executor takes the weights it is given (`take`): it keeps its own dict (a shallow copy: the tensors are shared,
not copied) with each LatentMoE op's two stacked weights in the order it reads, and when the caller's dict holds
the other order it converts them, one tensor at a time, and puts the converted tensors into the caller's dict as
well. So one copy of the experts' bytes exists at a time however many engines are built on one dict in turn
(bench builds one per executor and batch): the other order's tensors are freed as soon as no live executor holds
them. An executor never sees its weights change order under it (its own dict keeps its tensors alive, and a
captured CUDA graph keeps reading them); a second executor alive at the same time with the other order costs the
experts' bytes twice, as it must.

Which order a weight is in is read from its entries' shapes (quant/mxfp4_frag.entry_shape): records under
`.weight_packed`, an empty [E, R, 0] under `.weight_scale`. Re-laying out K3's 896 experts takes ~2.4 s a layer
on the H200 (bench/cute_experts_probe.py's relayout_s, one layer's gate_up and down).
"""

from __future__ import annotations

import math

import torch

from ..plan import LATENT_MOE, DecodePlan
from ..quant.mxfp4 import MXFP4Tensor
from ..quant.mxfp4_frag import entries_of, frag_from_entries, is_frag_entry, relayout_experts, restore_experts

CHECKPOINT, FRAGMENT = "checkpoint", "fragment"
# bytes a weight of quant/mxfp4_frag.relayout's intermediates, at most (the codes, their int64 copy, the words)
SCRATCH_PER_WEIGHT = 16


def expert_pairs(plan: DecodePlan) -> list[tuple[str, str]]:
    """(packed, scale) entry names of every LatentMoE op's routed experts: gate_up, then down, per op."""
    out = []
    for op in plan.ops:
        if op.kind == LATENT_MOE:
            _, gu_p, gu_s, dn_p, dn_s, _, _ = op.weights
            out += [(gu_p, gu_s), (dn_p, dn_s)]
    return out


def conversion_bytes(cfg, shard=None, chunk: int = 8) -> int:
    """The most memory `take` allocates beside the weights while it converts: the largest stack in its new order
    (as many bytes as the old, freed only once the new is whole) plus one chunk of experts' scratch."""
    from ..weights import param_specs

    stacks = {}
    for name, spec in param_specs(cfg, shard).items():
        if spec.quant == "mxfp4" and spec.stacked:
            stacks[name.rsplit(".", 1)[0]] = stacks.get(name.rsplit(".", 1)[0], 0) + math.prod(spec.shape)
            if name.endswith(".weight_packed"):
                E, R, half = spec.shape
                stacks[name.rsplit(".", 1)[0]] += min(chunk, E) * R * 2 * half * SCRATCH_PER_WEIGHT
    return max(stacks.values(), default=0)


def order_of(weights: dict[str, torch.Tensor], plan: DecodePlan) -> str | None:
    """FRAGMENT or CHECKPOINT when every routed expert weight of the plan is in that order; None for a plan
    without them. A dict holding both is refused (only `take` converts, and it converts every weight)."""
    seen = {FRAGMENT if is_frag_entry(weights[p]) else CHECKPOINT for p, _ in expert_pairs(plan)}
    if len(seen) > 1:
        raise ValueError("the routed experts' weights are held partly in fragment order and partly in the "
                         "checkpoint's: an interrupted conversion (backends/expert_layout.take)")
    return next(iter(seen), None)


def take(weights: dict[str, torch.Tensor], plan: DecodePlan, order: str) -> dict[str, torch.Tensor]:
    """The executor's own dict of `weights` with the plan's routed experts in `order`, converting (and
    replacing in `weights` too) those held in the other (the module doc)."""
    if order not in (CHECKPOINT, FRAGMENT):
        raise ValueError(f"order must be {CHECKPOINT!r} or {FRAGMENT!r}, got {order!r}")
    own = dict(weights)
    for p, s in expert_pairs(plan):
        if is_frag_entry(own[p]) == (order == FRAGMENT):
            continue
        try:
            if order == FRAGMENT:
                new = entries_of(relayout_experts(MXFP4Tensor(own[p], own[s])))
            else:
                w = restore_experts(frag_from_entries(own[p], own[s]))
                new = (w.packed, w.scales)
        except torch.cuda.OutOfMemoryError as e:
            need = (own[p].numel() + own[s].numel()) / 1e9
            raise torch.cuda.OutOfMemoryError(
                f"no room to convert {p} to the {order} order: it needs ~{need:.1f} GB beside the weights (one "
                f"expert stack at a time, plus a few experts' scratch); free memory (smaller cache: --max-batch, "
                f"--max-seq-len) or use an executor that reads the other order") from e
        # the old tensors' last references go here (unless another live executor holds them)
        weights[p], weights[s] = own[p], own[s] = new
        del new
    return own
