"""Importing this module registers every shipped variant: the kernels and the deliberately broken ones.

Triton kernels are decorated when their module is first imported: on a CPU-only machine set
TRITON_INTERPRET=1 before that (their variants otherwise SKIP on cpu, saying why)."""

from ..kernels import rmsnorm, router, torch_variants  # noqa: F401
from ..kernels import fused_experts, gqa, grouped_experts, kda, latent_moe, lm_head, mla  # noqa: F401
from . import broken  # noqa: F401
