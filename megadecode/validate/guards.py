"""Guard regions around a variant's outputs: each output is a view into a larger poisoned buffer, with GUARD
poisoned elements (at least one output row's worth) before and after it. After the run, every element outside
the view must still hold the poison bit for bit: a kernel whose mask lets a partial last tile write past the end
of its output (or before its start) is caught even when nothing inside the output looks wrong.

Writes past a row into the next row of the same output are caught by the comparison with the reference (the
next row's values), and on the GPU by the repeat checks (which program wins is a race there).
"""

from __future__ import annotations

import torch

from ..contract import poison_mask, poisoned

GUARD = 256  # elements on each side, at least; at least one row of the output


def guarded(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(output view [shape], the buffer holding it with a guard on each side), all poisoned."""
    numel = 1
    for d in shape:
        numel *= d
    row = shape[-1] if len(shape) else 1
    g = max(GUARD, row)
    buf = poisoned((numel + 2 * g,), dtype, device)
    return buf[g:g + numel].view(shape), buf


def breaches(view: torch.Tensor, buf: torch.Tensor) -> tuple[int, int]:
    """(elements written before the output, after it)."""
    g = view.storage_offset() - buf.storage_offset()
    before, after = buf[:g], buf[g + view.numel():]
    return int((~poison_mask(before)).sum()), int((~poison_mask(after)).sum())


def guarded_outputs(specs: dict, device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """For output specs {name: (shape, dtype)}: (outputs, their guarded buffers)."""
    views, bufs = {}, {}
    for n, (shape, dt) in specs.items():
        views[n], bufs[n] = guarded(shape, dt, device)
    return views, bufs


def guard_failures(views: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor]) -> list[str]:
    fails = []
    for n, v in views.items():
        before, after = breaches(v, bufs[n])
        if before or after:
            what = f"scratch {n[len('scratch.'):]}" if n.startswith("scratch.") else f"output {n}"
            fails.append(f"{what}: wrote outside its bounds ({before} elements before it, {after} after it, "
                         f"in the guard regions around its {v.numel()} elements)")
    return fails


def side_names(variant, kind: str) -> tuple[str, ...]:
    """The side outputs the variant declares for an op of `kind` (the harness hands them in, guards and compares
    them)."""
    from ..contract.outputs import SIDE_OUTPUTS

    return tuple(n for n in variant.manifest.side_outputs if n in SIDE_OUTPUTS.get(kind, ()))
