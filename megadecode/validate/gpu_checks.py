"""Checks that only mean something on a GPU, added to every matrix cell run on CUDA:

- graph replay: the variant's op captured in a CUDA graph, replayed on fresh inputs copied into the
  captured buffers, must give bitwise what an eager run on those inputs gives (a kernel that caches a
  pointer, a shape or a host value at capture time fails this);
- concurrent stress: two copies of the case with different inputs run at once on two streams, each
  must match its own eager result bitwise (a kernel that shares scratch memory or counters between
  launches fails this);
- repeats under load: the case run LOAD_REPEATS times while another stream keeps the SMs busy with matmuls of
  changing sizes, each bitwise equal to a lone run. Programs then start, stall and finish in other orders, so a
  combine whose result depends on the order of its float additions across programs (atomics, a scatter-add, a
  "last program finishes the sum" counter) shows in the bits. The sequential CPU interpreter can never show it;
- launch order: three independent copies of the op (fresh inputs) launched back to back in two different orders
  without a sync between them, each equal to its lone run (state carried from one launch into the next, or a
  scratch buffer reused before the previous launch is done reading it, shows).
"""

from __future__ import annotations

import torch

from ..contract import output_specs, side_output_specs
from .guards import side_names
from .inputs import OpCase


def _outputs(case: OpCase, variant) -> dict[str, torch.Tensor]:
    """The op's outputs and the side outputs the variant declares (guards.side_names), filled with NaN / -1."""
    buf = dict(case.inputs)
    specs = {**output_specs(case.cfg, case.op, buf, case.weights),
             **side_output_specs(case.op, buf, side_names(variant, case.op.kind))}
    return {n: torch.full(shape, float("nan"), dtype=dt, device="cuda") if dt.is_floating_point
            else torch.full(shape, -1, dtype=dt, device="cuda") for n, (shape, dt) in specs.items()}


def _run(variant, case: OpCase, outs) -> None:
    variant.run(case.op, case.inputs, case.weights, outs, case.cfg, case.step, case.cache)


def _fresh_like(case: OpCase, seed: int) -> OpCase:
    """Same shapes, new random floating inputs (the op's integer inputs and the cache stay)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    c = case.clone()
    for t in c.inputs.values():
        if t.is_floating_point():
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype) * t.float().std().clamp_min(1e-3))
    return c


def graph_replay_failures(variant, case: OpCase) -> list[str]:
    static = case.clone()
    outs = _outputs(static, variant)
    _run(variant, static, outs)  # warm-up: compiles, autotunes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            _run(variant, static, outs)
    except Exception as e:  # noqa: BLE001  (not capturable is a finding, not a crash)
        return [f"not CUDA-graph capturable: {type(e).__name__}: {e}"]
    fresh = _fresh_like(case, seed=1234)
    for name, t in static.inputs.items():
        t.copy_(fresh.inputs[name])
    if static.cache is not None:
        for a, b in zip(static.cache, fresh.cache):
            a.copy_(b)
    for t in outs.values():
        t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
    graph.replay()
    eager = _outputs(fresh, variant)
    _run(variant, fresh, eager)
    torch.cuda.synchronize()
    return [f"graph replay on fresh inputs differs from eager in {n}" for n in outs if not torch.equal(outs[n], eager[n])]


def concurrent_failures(variant, case: OpCase) -> list[str]:
    cases = [case.clone(), _fresh_like(case, seed=99)]
    alone = []
    for c in cases:
        o = _outputs(c, variant)
        _run(variant, c.clone(), o)
        alone.append(o)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in cases]
    together = []
    for _ in range(3):
        outs = [_outputs(c, variant) for c in cases]
        runs = [c.clone() for c in cases]
        torch.cuda.synchronize()
        for s, c, o in zip(streams, runs, outs):
            with torch.cuda.stream(s):
                _run(variant, c, o)
        torch.cuda.synchronize()
        together.append(outs)
    fails = []
    for rep in together:
        for k, (o, ref) in enumerate(zip(rep, alone)):
            fails += [f"concurrent run {k} differs from its lone run in {n}" for n in o if not torch.equal(o[n], ref[n])]
    return sorted(set(fails))


LOAD_REPEATS = 6


def _load(stream: torch.cuda.Stream, gen: torch.Generator, dtype) -> None:
    """Queue a few matmuls of random size (1024..4096) on `stream`: tens of microseconds to milliseconds of SM
    load that overlaps what the current stream runs next."""
    with torch.cuda.stream(stream):
        n = int(torch.randint(1024, 4097, (1,), generator=gen))
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            a = a @ a
            a = a / a.abs().amax().clamp_min(1.0)


def load_repeat_failures(variant, case: OpCase, repeats: int = LOAD_REPEATS, seed: int = 0) -> list[str]:
    """The case `repeats` times under a concurrent load (module doc), each bitwise equal to a lone run."""
    ref = _outputs(case, variant)
    _run(variant, case.clone(), ref)
    torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(seed)
    side = torch.cuda.Stream()
    fails = set()
    for _ in range(repeats):
        c, outs = case.clone(), _outputs(case, variant)
        torch.cuda.synchronize()
        _load(side, gen, torch.bfloat16)
        _run(variant, c, outs)  # on the current stream, while the side stream computes
        torch.cuda.synchronize()
        fails |= {f"a run under concurrent load differs bitwise from a lone run in {n}" for n in outs
                  if not _bitwise(outs[n], ref[n])}
    return sorted(fails)


def launch_order_failures(variant, case: OpCase) -> list[str]:
    """Three independent copies launched back to back in two orders, each equal to its lone run."""
    cases = [case.clone(), _fresh_like(case, seed=7), _fresh_like(case, seed=8)]
    alone = []
    for c in cases:
        o = _outputs(c, variant)
        _run(variant, c.clone(), o)
        torch.cuda.synchronize()
        alone.append(o)
    fails = set()
    for order in ((0, 1, 2), (2, 0, 1)):
        runs = {k: (cases[k].clone(), _outputs(cases[k], variant)) for k in order}
        torch.cuda.synchronize()
        for k in order:
            _run(variant, *runs[k])
        torch.cuda.synchronize()
        for k in order:
            fails |= {f"copy {k} launched in order {order} differs from its lone run in {n}"
                      for n, t in runs[k][1].items() if not _bitwise(t, alone[k][n])}
    return sorted(fails)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) if a.numel() else True


def gpu_failures(variant, case: OpCase) -> list[str]:
    """Every GPU-only check of a matrix cell."""
    fails = graph_replay_failures(variant, case) if variant.manifest.graph_capturable else []
    fails += concurrent_failures(variant, case)
    fails += load_repeat_failures(variant, case)
    return fails + launch_order_failures(variant, case)
