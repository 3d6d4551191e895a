"""The registry of variants, by name. Registering a variant is what makes it visible to executors and to
the validation harness; a module of kernels registers its variants when it is imported.

Which modules get imported is the caller's choice: `megadecode.kernels.catalog` imports the shipped kernels
(what the `fused` executor may run), `megadecode.validate.catalog` those plus the harness's own variants
(torch restatements, the deliberately broken `broken-*`)."""

from __future__ import annotations

from .variant import Variant

_REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    if variant.name in _REGISTRY and _REGISTRY[variant.name] is not variant:
        raise ValueError(f"variant {variant.name!r} is already registered")
    _REGISTRY[variant.name] = variant
    return variant


def lookup(name: str) -> Variant:
    """The registered variant `name` (ValueError naming the registered ones if there is none)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; variants: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered() -> list[Variant]:
    """Every registered variant, by name."""
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]
