"""The op contract: what a fast path of plan ops must declare and satisfy.

A fast path is a **Variant** of one or more plan op kinds (`megadecode.plan`), registered by name. It declares a
**Manifest**: what it replaces, its **Scope** (families, dtypes, devices, batch range, GPU architecture, model
dims, each refusal with its reason), the files it owns, whether it may be captured in a CUDA graph. Its code is

    run(op, inputs, weights, outputs, cfg, step, cache=None) -> None

`inputs` maps the op's input buffer names to tensors, `weights` its weight names, `outputs` its output names to
PREALLOCATED tensors that the variant must write completely, in place: their shapes and dtypes are the reference
op's, given per op kind by `outputs.output_specs`. `cache` is the op's cache tuple (attention only), which the
variant reads and writes. A variant must not modify anything else: inputs, weights, other buffers.

A Triton kernel also declares, for the static memory-ordering audit, each compiled kernel with the role of each
pointer (`kernels.KernelSpec`): data produced during the step is never read through the non-coherent path.

    variant.py   Variant, Manifest, Scope, ManifestViolation
    registry.py  register / lookup / registered
    outputs.py   output_specs per op kind; poisoned / unwritten (the harness's fill and check)
    kernels.py   KernelSpec and kernel_spec, the kernels' side of the static audit

The contract sits between the plan and the kernels: kernels import it, executors pick variants through it, and
the validation harness (`megadecode.validate`, on top) checks that every variant keeps it.
"""

from .kernels import KernelSpec, kernel_spec
from .outputs import output_specs, poisoned, unwritten
from .registry import lookup, register, registered
from .variant import (
           DTYPE_NAMES,
           Manifest,
           ManifestViolation,
           Scope,
           Variant,
           dtype_name,
           float_experts,
           triton_interpreted,
)

__all__ = ["DTYPE_NAMES", "KernelSpec", "Manifest", "ManifestViolation", "Scope", "Variant", "dtype_name",
           "float_experts", "kernel_spec", "lookup", "output_specs", "poisoned", "register", "registered",
           "triton_interpreted", "unwritten"]
