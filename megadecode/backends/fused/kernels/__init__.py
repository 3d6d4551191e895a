"""Triton (and plain-torch) implementations of plan ops, each registered as a validation variant.

Importing a kernel module decorates its @triton.jit functions: for CPU runs set TRITON_INTERPRET=1
before that import. This package's __init__ imports nothing, so importing one kernel module does not
decorate the others.
"""

from __future__ import annotations


class TritonMissing(ModuleNotFoundError):
    """Triton cannot be imported here; the message names what needed it and how to install it."""


def require_triton(what: str) -> None:
    """Raise TritonMissing, naming `what` (e.g. "the fused executor"), when triton cannot be imported. Importing
    triton decorates nothing, so checking first does not change how kernels imported later are decorated."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise TritonMissing(f"{what} runs Triton kernels, and triton cannot be imported here ({e}); install it with "
                            "`pip install triton==3.6.0` (or the package's [triton] extra)", name="triton") from None
