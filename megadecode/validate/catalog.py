"""Every variant the harness knows: the shipped kernels (megadecode.backends.fused.kernels.catalog), the plain-torch variants
(torch_variants.py) and the deliberately broken ones (broken.py). `get` and `all_variants` import them first.

Triton kernels are decorated when their module is first imported: on a CPU-only machine set
TRITON_INTERPRET=1 before that (their variants otherwise SKIP on cpu, saying why)."""

from __future__ import annotations

from ..contract import Variant, lookup, registered
from ..backends.fused.kernels import catalog as _shipped  # noqa: F401  (registers the shipped variants)
from . import broken, torch_variants  # noqa: F401  (register the harness's own)


def get(name: str) -> Variant:
    """A registered variant by name (ValueError listing the registered ones)."""
    return lookup(name)


def all_variants() -> list[Variant]:
    """Every registered variant, by name: the catalog's and any registered elsewhere."""
    return registered()
