"""The torch executor with some plan ops replaced by variants, their manifests enforced.

For each plan op whose kind a variant replaces and whose scope admits (config, dtype, tokens, device),
the variant runs on preallocated outputs poisoned (contract/outputs.py: a NaN bit pattern, the integer minimum); every other
op runs the reference (the fallback reason is logged once). Around each variant op the executor keeps
references and position-weighted byte checksums of every step buffer, the op's weights and the other
layers' caches: if any of them changed, or an output was left partly unwritten, it raises
ManifestViolation. (On big GPU models the weight checksums cost a full read of the op's weights per op:
a validation mode, never a serving one.)
"""

from __future__ import annotations

import functools
import logging

import torch

from ..cache import KVCache
from ..contract import ManifestViolation, Variant, output_specs, poisoned, unwritten
from ..backends.torch.executor import TorchExecutor
from ..backends.torch.ops import OP_IMPLS, StepContext
from ..plan import DecodePlan, Op
from ..step import Step

log = logging.getLogger(__name__)
_CHUNK = 1 << 24  # bytes per checksum chunk (bounds the int64 temporaries)


_PERIOD = 65521  # positions' weights repeat with this period (a prime)


@functools.lru_cache(maxsize=8)
def _random_weights(device: str) -> torch.Tensor:
    """Two fixed rows of random position weights in [1, 2**20) (so a chunk's sums stay below 2**63)."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 1 << 20, (2, _PERIOD), generator=g, dtype=torch.int64).to(device)


def checksum(t: torch.Tensor) -> tuple[int, int, int]:
    """Three position-weighted sums of the tensor's bytes. The first, weights position + 1, changes with any single
    changed byte. It misses moved values: weights linear in the position make a swap of two values change it by a
    multiple of the difference of their byte sums, zero for about 1 random fp32 pair in 300 (a flaky test found
    it). The other two weigh each position by a fixed random number, so a swap or any other change keeps all
    three only by a coincidence of ~2**-20 each."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    rw = _random_weights(str(b.device))
    totals = [0, 0, 0]
    for start in range(0, b.numel(), _CHUNK):
        part = b[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), device=b.device, dtype=torch.int64) % _PERIOD
        totals[0] += int((part * (pos + 1)).sum())
        totals[1] += int((part * rw[0][pos]).sum())
        totals[2] += int((part * rw[1][pos]).sum())
    return tuple(totals)


class VariantExecutor(TorchExecutor):
    name = "variants"

    def __init__(self, plan: DecodePlan, weights: dict[str, torch.Tensor], cache: KVCache,
                 variants: list[Variant] = (), *, enforce: bool = True):
        super().__init__(plan, weights, cache)
        self.variants, self.enforce = list(variants), enforce
        any_w = next(iter(weights.values()))
        self.dtype, self.device = any_w.dtype, any_w.device
        self._logged: set[tuple] = set()
        self.ran: dict[str, int] = {}  # variant name -> ops it ran (so tests can see it did run)

    def pick(self, op: Op, batch: int) -> Variant | None:
        for v in self.variants:
            if op.kind not in v.manifest.replaces:
                continue
            reason = v.supports(self.cfg, self.dtype, batch, self.device)
            if reason is None:
                return v
            if (v.name, op.kind, reason) not in self._logged:
                self._logged.add((v.name, op.kind, reason))
                log.info("variant %s does not run %s ops (%s): reference op instead", v.name, op.kind, reason)
        return None

    def run_ops(self, step: Step, hook=None) -> StepContext:
        ctx = StepContext(self.cfg, self.weights, self.cache, step, self.experts_impl)
        for op in self.plan.ops:
            v = self.pick(op, step.num_tokens)
            if v is None:
                OP_IMPLS[op.kind](ctx, op)
            else:
                self._run_variant(v, op, ctx)
            if hook is not None:
                hook(op, ctx)
        return ctx

    def _watched(self, op: Op, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Everything the variant must leave alone: step buffers, its weights, the other caches."""
        watched = {f"buffer {n}": t for n, t in ctx.buf.items()}
        watched.update({f"weight {n}": self.weights[n] for n in op.weights})
        for name, ts in self.cache.layers.items():
            if name != op.cache:
                watched.update({f"{name}[{j}]": t for j, t in enumerate(ts)})
        return watched

    def _run_variant(self, v: Variant, op: Op, ctx: StepContext) -> None:
        inputs = {n: ctx.buf[n] for n in op.inputs}
        weights = {n: self.weights[n] for n in op.weights}
        cache = self.cache[op.cache] if op.cache else None
        outputs = {n: poisoned(shape, dt, self.device)
                   for n, (shape, dt) in output_specs(self.cfg, op, ctx.buf, self.weights).items()}
        before = {k: (t, checksum(t)) for k, t in self._watched(op, ctx).items()} if self.enforce else {}
        v.run(op, inputs, weights, outputs, self.cfg, ctx.step, cache)
        self.ran[v.name] = self.ran.get(v.name, 0) + 1
        if self.enforce:
            changed = [k for k, (t, s) in before.items() if checksum(t) != s]
            if changed:
                raise ManifestViolation(
                    f"variant {v.name} on {op.name} modified {', '.join(changed)}; its manifest lets it "
                    f"write only {', '.join(op.outputs)}" + (f" and {op.cache}" if op.cache else ""))
            partial = {n: unwritten(t) for n, t in outputs.items()}
            partial = {n: k for n, k in partial.items() if k}
            if partial:
                raise ManifestViolation(f"variant {v.name} on {op.name} left outputs unwritten: " + ", ".join(
                    f"{n} ({k} of {outputs[n].numel()} elements)" for n, k in partial.items()))
        ctx.buf.update(outputs)
