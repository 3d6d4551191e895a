"""The registry of variants, by name. Registering a variant is what makes it visible to executors and to
the validation harness; a module of kernels registers its variants when it is imported.

Which modules get imported is the caller's choice: `megadecode.backends.fused.kernels.catalog` imports the shipped kernels
(what the `fused` executor may run), `megadecode.validate.catalog` those plus the harness's own variants
(torch restatements, the deliberately broken `broken-*`)."""

from __future__ import annotations

from .variant import Variant

_REGISTRY: dict[str, Variant] = {}


def check_kernels(variant: Variant) -> list:
    """The variant's declared kernel specs (Manifest.kernels), or ValueError: a variant that uses Triton must
    declare the kernels it runs (the static audit and the launch check key on them, never on its name), and a
    declaration must list at least one spec, each with the audit's interface (contract/kernels.py)."""
    m = variant.manifest
    if m.kernels is None:
        if m.uses_triton or variant.kernel is not None:
            raise ValueError(f"variant {m.name!r} runs Triton kernels but declares none: set Manifest.kernels to a "
                             "function returning a KernelSpec per kernel and launch specialization it runs")
        return []
    specs = list(m.kernels())
    if not specs:
        raise ValueError(f"variant {m.name!r}: Manifest.kernels returned no spec (None means no compiled kernel)")
    need = ("name", "kernel_id", "roles", "path", "key", "compile", "portable", "needs_fresh_process")
    bad = [type(s).__name__ for s in specs if not all(hasattr(s, a) for a in need)]
    if bad:
        raise ValueError(f"variant {m.name!r}: Manifest.kernels returned objects without the kernel spec interface "
                         f"(contract/kernels.py): {bad}")
    return specs


def register(variant: Variant) -> Variant:
    """Make a variant visible to executors and the harness. ValueError when its name is taken or its kernel
    declaration is missing or empty (check_kernels)."""
    if variant.name in _REGISTRY and _REGISTRY[variant.name] is not variant:
        raise ValueError(f"variant {variant.name!r} is already registered")
    check_kernels(variant)
    _check_side_outputs(variant)
    _REGISTRY[variant.name] = variant
    return variant


def _check_side_outputs(variant: Variant) -> None:
    """Each declared side output exists for an op kind the variant replaces (outputs.SIDE_OUTPUTS)."""
    from .outputs import SIDE_OUTPUTS

    known = {n for k in variant.manifest.replaces for n in SIDE_OUTPUTS.get(k, ())}
    unknown = [n for n in variant.manifest.side_outputs if n not in known]
    if unknown:
        raise ValueError(f"variant {variant.name!r} declares side outputs {unknown} that no op kind it replaces "
                         f"has (contract/outputs.py SIDE_OUTPUTS)")


def lookup(name: str) -> Variant:
    """The registered variant `name` (ValueError naming the registered ones if there is none)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown variant {name!r}; variants: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def registered() -> list[Variant]:
    """Every registered variant, by name."""
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]
