"""The op contract: what a fast path of plan ops must declare and satisfy.

A fast path is a **Variant** of one or more plan op kinds (`megadecode.plan`), registered by name. It declares a
**Manifest**: what it replaces, its **Scope** (families, dtypes, devices, batch range, GPU architecture, model
dims, each refusal with its reason), the files it owns, whether it may be captured in a CUDA graph. Its code is

    run(op, inputs, weights, outputs, cfg, step, cache=None) -> None

`inputs` maps the op's input buffer names to tensors, `weights` its weight names, `outputs` its output names to
PREALLOCATED tensors that the variant must write completely, in place: their shapes and dtypes are the reference
op's, given per op kind by `outputs.output_specs`; a variant may also write the side outputs its manifest declares
(`Manifest.side_outputs`, `outputs.SIDE_OUTPUTS`: LM_HEAD's tokens and logprobs) and use the scratch buffers it
declares (`Manifest.scratch`) when the caller hands them in. `cache` is the op's cache tuple (attention only),
which the variant reads and writes. A variant must not modify anything else: inputs, weights, other buffers.

A variant that runs compiled kernels declares each of them, at every launch specialization it can run, with the
role of each pointer (`Manifest.kernels`, specs of `kernels.py`): the harness audits every declared kernel (data
produced during the step is never read through the non-coherent path) and checks that every kernel a variant
launches is declared. Registration refuses a Triton variant that declares none.

    variant.py   Variant, Manifest, Scope, ManifestViolation
    registry.py  register / lookup / registered
    outputs.py   output_specs per op kind, side outputs; poisoned / unwritten / nonfinite (the harness's fill and
                 checks)
    kernels.py   KernelSpec and kernel_spec (the kernels' side of the static audit), Compiled, spec kinds

The contract sits between the plan and the kernels: kernels import it, executors pick variants through it, and
the validation harness (`megadecode.validate`, on top) checks that every variant keeps it.
"""

from .kernels import Compiled, KernelSpec, kernel_spec, register_spec_kind
from .outputs import (
    SIDE_OUTPUTS,
    nonfinite,
    output_specs,
    poison_mask,
    poisoned,
    side_output_reference,
    side_output_specs,
    unwritten,
)
from .registry import check_kernels, lookup, register, registered
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

__all__ = ["DTYPE_NAMES", "SIDE_OUTPUTS", "Compiled", "KernelSpec", "Manifest", "ManifestViolation", "Scope", "Variant",
           "check_kernels", "dtype_name", "float_experts", "kernel_spec", "lookup", "nonfinite", "output_specs",
           "poison_mask", "poisoned", "register", "register_spec_kind", "registered", "side_output_reference",
           "side_output_specs", "triton_interpreted", "unwritten"]
