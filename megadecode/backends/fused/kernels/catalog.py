"""The shipped kernels: importing this module imports every kernel module whose variants serving may run, which
registers them (megadecode.contract). The `fused` executor picks among these, in this order per op kind.

Triton kernels are decorated when their module is first imported: on a CPU-only machine set TRITON_INTERPRET=1
before that (their variants otherwise refuse the CPU, saying why)."""

from __future__ import annotations

from ....contract import Variant
from . import (
    attn_res,
    cute_experts,
    fp8_experts,
    fused_experts,
    gqa,
    grouped_experts,
    kda,
    kda_fused,
    latent_moe,
    lm_head,
    mla,
    mlp,
    rmsnorm,
    router,
)

# In order of preference per op kind: the first whose scope admits a configuration runs it.
SHIPPED: tuple[Variant, ...] = (
    rmsnorm.RMSNORM_VARIANT, rmsnorm.ADD_RMSNORM_VARIANT, router.ROUTER_VARIANT,
    grouped_experts.GROUPED_EXPERTS_VARIANT, fused_experts.FUSED_EXPERTS_VARIANT, fp8_experts.FP8_EXPERTS_VARIANT,
    cute_experts.CUTE_LATENT_MOE_VARIANT, latent_moe.LATENT_MOE_VARIANT,
    mlp.MLP_VARIANT, attn_res.ATTN_RES_VARIANT, kda_fused.KDA_FUSED_VARIANT, kda.KDA_VARIANT, mla.MLA_VARIANT, gqa.GQA_VARIANT, lm_head.LM_HEAD_VARIANT)


def shipped(names: tuple[str, ...] | None = None) -> list[Variant]:
    """The shipped variants (those named, in that order, when `names` is given)."""
    if names is None:
        return list(SHIPPED)
    by_name = {v.name: v for v in SHIPPED}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"not shipped variants: {unknown}; shipped: {', '.join(sorted(by_name))}")
    return [by_name[n] for n in names]
