"""Per-op checks of a variant against the torch reference (fp32), on fresh random inputs.

One `check_op` call, for one (preset config, op kind, dtype, batch, seed, routing distribution, case options):
  1. inputs untouched: the variant's inputs and weights are compared bitwise with copies afterwards;
  2. outputs fully written: outputs are poisoned (a NaN of a specific bit pattern, the integer minimum) before
     the run, none may remain (bitwise: a NaN the variant computes is reported as such, not as poison left);
  3. nothing written outside an output: each sits between guard regions that must stay poisoned (guards.py);
  4. NaN/inf computed into an output never pass;
  5. every Triton kernel launched is declared in the manifest at that specialization (launches.py);
  6. deterministic: a second run on the same inputs must give bitwise-identical outputs (and cache);
  7. close to the reference: the fp32 reference op on the same (dtype-rounded) inputs, within bounds derived from
     the error the reference itself makes in the dtype (tolerances.py); integer outputs exactly (topk_ids as
     per-token sets); attention caches are compared too (the new tokens' entries and everything else); so are
     the side outputs the manifest declares (Manifest.side_outputs: LM_HEAD's greedy tokens, exact where the
     reference's top-2 margin is clear, and their logprobs, in nats), handed in guarded like the op's outputs;
     the scratch buffers it declares (Manifest.scratch) are handed in guarded too (check 3), not compared;
  8. on CUDA, the GPU-only checks (gpu_checks.py: graph replay, two streams, repeats under load, launch order);
  9. batch invariant: rows 0, T/2 and T-1 run alone match the same rows of the batch run.
Returns a row dict: status PASS/FAIL/SKIP, the failures, the error figures and the bounds they were held to.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..contract import (
    DTYPE_NAMES,
    Variant,
    check_kernels,
    dtype_name,
    nonfinite,
    output_specs,
    side_output_specs,
    unwritten,
)
from .guards import guard_failures, guarded_outputs, side_names
from .launches import record_launches, undeclared
from .inputs import OpCase, build_case, reference_outputs, token_rows
from .tolerances import ABSOLUTE_FLOORS, UNORDERED, Bound, derive, errors

DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def declared_kernels(variant: Variant) -> list:
    """The variant's declared kernel specs (Manifest.kernels), built once per manifest."""
    key = id(variant.manifest)
    hit = _DECLARED.get(key)
    if hit is None or hit[0] is not variant.manifest:
        hit = _DECLARED[key] = (variant.manifest, check_kernels(variant))
    return hit[1]


_DECLARED: dict[int, tuple] = {}


def _bitwise_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included, which torch.equal never calls equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.numel():
        return True
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def run_variant(variant: Variant, case: OpCase) -> tuple[dict[str, torch.Tensor], tuple | None, list[str]]:
    """Run once on a private copy of the case, its outputs (the op's and the declared side outputs) inside guard
    regions (guards.py) and its Triton launches recorded (launches.py). Returns (outputs, cache after, contract
    failures)."""
    c = case.clone()
    buf = dict(c.inputs)
    specs = {**output_specs(c.cfg, c.op, buf, c.weights),
             **side_output_specs(c.op, buf, side_names(variant, c.op.kind))}
    scratch = variant.manifest.scratch(c.cfg, c.op, buf) if variant.manifest.scratch is not None else {}
    specs.update({f"scratch.{n}": s for n, s in scratch.items()})
    handed, bufs = guarded_outputs(specs, next(iter(buf.values())).device)
    with record_launches() as launched:
        variant.run(c.op, c.inputs, c.weights, handed, c.cfg, c.step, c.cache)
    outputs = {n: t for n, t in handed.items() if not n.startswith("scratch.")}
    failures = []
    for kind, mine, orig in (("input", c.inputs, case.inputs), ("weight", c.weights, case.weights)):
        for n, t in mine.items():
            if not _bitwise_same(t, orig[n]):
                failures.append(f"{kind} {n} modified by the variant")
    for n, t in outputs.items():
        left, bad = unwritten(t), nonfinite(t)
        if left:
            failures.append(f"output {n}: {left} of {t.numel()} elements not written (poison left)")
        if bad:
            failures.append(f"output {n}: {bad} of {t.numel()} elements non-finite (NaN/inf computed by the "
                            "variant, not the poison)")
    failures += guard_failures(handed, bufs)  # scratch buffers' guards too
    failures += undeclared(launched, declared_kernels(variant))
    return outputs, c.cache, failures


def _as_sets(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(out)
    for ids_name, follow in UNORDERED.items():
        if ids_name in out:
            order = out[ids_name].argsort(dim=-1, stable=True)
            out[ids_name] = out[ids_name].gather(-1, order)
            if follow in out:
                out[follow] = out[follow].gather(-1, order)
    return out


def compare(name: str, got: torch.Tensor, ref: torch.Tensor, bound: Bound | None,
            key: str | None = None) -> tuple[list[str], dict]:
    """Failures and error figures (tolerances.errors of output `key`, default `name`) of one tensor against its
    reference; integers exactly."""
    if got.shape != ref.shape:
        return [f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"], {}
    if not got.is_floating_point():
        bad = int((got != ref).reshape(got.shape[0], -1).any(-1).sum()) if got.numel() else 0
        return ([f"{name}: {bad} of {got.shape[0]} rows differ (exact match required)"] if bad else []), {}
    if not torch.isfinite(got).all():
        return [f"{name}: {int((~torch.isfinite(got)).sum())} non-finite values"], {}
    e = errors(key or name, got, ref)
    stats = {"max_rel_err": e["max_rel"], "mean_rel_err": e["mean_rel"]}
    if bound is None:
        return [], stats
    stats.update(tol_max_rel=bound.max_rel, tol_mean_rel=bound.mean_rel,
                 margin=max(e["max_rel"] / bound.max_rel, e["mean_rel"] / bound.mean_rel))
    fails = []
    kind = "absolute" if (key or name) in ABSOLUTE_FLOORS else "row-relative"
    if e["max_rel"] > bound.max_rel:
        fails.append(f"{name}: max {kind} error {e['max_rel']:.3g} > {bound.max_rel:.3g}")
    if e["mean_rel"] > bound.mean_rel:
        fails.append(f"{name}: mean {kind} error {e['mean_rel']:.3g} > {bound.mean_rel:.3g}")
    return fails, stats


def compare_all(got: dict, ref: dict, bounds: dict[str, Bound], what: str) -> tuple[list[str], dict]:
    """Every output of `ref` against `got`; the figures of the output closest to its bound (largest margin)."""
    got, ref = _as_sets(got), _as_sets(ref)
    fails, worst = [], {}
    for n in ref:
        f, s = compare(f"{what}{n}", got[n], ref[n], bounds.get(n), key=n)
        fails += f
        if s and s.get("margin", -1.0) >= worst.get("margin", -1.0):
            worst = {**s, "binding": n}
    return fails, worst


def token_failures(got: dict, ref: dict, bounds: dict[str, Bound]) -> tuple[list[str], dict, dict]:
    """LM_HEAD's greedy tokens against the reference logits: a row's token must be the reference's unless a rival's
    reference logit is within the logits' tolerance of the row's maximum (twice max_rel x max |logit|: each of two
    logits may move by one), where either may win. The logprobs are then compared at the token the variant picked.
    Returns (failures, got and ref without the tokens, ref's logprobs taken at the variant's tokens)."""
    if "tokens" not in ref:
        return [], got, ref
    got, ref = dict(got), dict(ref)
    tok, ref_tok = got.pop("tokens"), ref.pop("tokens")
    if tok.shape != ref_tok.shape:
        return [f"tokens: shape {tuple(tok.shape)} != reference {tuple(ref_tok.shape)}"], got, ref
    logits = ref["logits"].double()
    V = logits.shape[-1]
    if ((tok < 0) | (tok >= V)).any():
        return [f"tokens: {int(((tok < 0) | (tok >= V)).sum())} of {tok.numel()} outside the vocabulary"], got, ref
    slack = 2 * bounds["logits"].max_rel * logits.abs().amax(-1) if "logits" in bounds else torch.zeros(len(tok))
    short = logits.amax(-1) - logits.gather(-1, tok[:, None].to(logits.device))[:, 0]
    wrong = (short > slack.to(short.device)) & (tok != ref_tok)
    fails = [f"tokens: {int(wrong.sum())} of {tok.numel()} rows pick a token other than the reference's where its "
             "top-2 margin is clear (beyond the logits' tolerance)"] if wrong.any() else []
    if "logprobs" in ref:
        ref["logprobs"] = torch.log_softmax(logits, -1).gather(-1, tok[:, None].to(logits.device))[:, 0].to(
            ref["logprobs"].dtype)
    return fails, got, ref


def _cache_dict(cache) -> dict[str, torch.Tensor]:
    return {} if cache is None else {f"cache[{j}]": t for j, t in enumerate(cache)}


def derive_bounds(c: OpCase, dtype: torch.dtype, ref: dict, ref_cache,
                  side: tuple[str, ...] = ()) -> tuple[dict[str, Bound], dict]:
    """Per floating output (side outputs and cache parts included) the bound of tolerances.py, from the torch
    reference computed in `dtype` against `ref`. Returns (bounds, figures for the row: the reference's own errors
    and the source)."""
    dt = dtype_name(dtype)
    targets = {**ref, **_cache_dict(ref_cache)}
    if dtype == torch.float32:
        own = {n: {"max_rel": 0.0, "mean_rel": 0.0} for n, t in targets.items() if t.is_floating_point()}
        source = "fp32: the reference itself (floors)"
    else:
        source = "torch reference in " + dt
        try:
            out_dt, cache_dt = reference_outputs(c, dtype, side)
            got = {**out_dt, **_cache_dict(cache_dt)}
            if not all(torch.isfinite(t).all() for t in got.values() if t.is_floating_point()):
                raise ArithmeticError("non-finite values")
        except (RuntimeError, ValueError, NotImplementedError, ArithmeticError) as e:
            source = f"fp32 reference rounded to {dt} (the reference in {dt}: {type(e).__name__}: {str(e)[:80]})"
            got = {n: t.to(dtype) if t.is_floating_point() else t for n, t in targets.items()}
        own = _own_errors(got, targets)
    bounds = {n: derive(dt, e, n) for n, e in own.items()}
    figures = {"tol_source": source}
    if own:
        figures.update(ref_dt_max_rel=max(e["max_rel"] for e in own.values()),
                       ref_dt_mean_rel=max(e["mean_rel"] for e in own.values()))
    return bounds, figures


def _own_errors(got: dict, ref: dict) -> dict[str, dict]:
    """row_errors of the dtype reference; a row set (topk_weights) only over the tokens whose picks agree."""
    got, ref = _as_sets(got), _as_sets(ref)
    agree = None
    for ids_name in UNORDERED:
        if ids_name in ref:
            agree = (got[ids_name] == ref[ids_name]).all(-1)
    out = {}
    for n, t in ref.items():
        if not t.is_floating_point():
            continue
        g, r = got[n], t
        if n in UNORDERED.values() and agree is not None:
            g, r = g[agree], r[agree]
        out[n] = errors(n, g, r)
    return out


def _bitwise_equal(a: dict, b: dict) -> list[str]:
    return [n for n in a if not _bitwise_same(a[n], b[n])]


def check_case(variant: Variant, case: OpCase, dtype: torch.dtype) -> dict:
    c = case.clone(dtype)
    side = side_names(variant, c.op.kind)
    ref, ref_cache = reference_outputs(c, side=side)
    bounds, figures = derive_bounds(c, dtype, ref, ref_cache, side)
    out1, cache1, failures = run_variant(variant, c)
    out2, cache2, _ = run_variant(variant, c)
    if not failures:
        diff = _bitwise_equal(out1, out2)
        if cache1 is not None:
            diff += [f"cache[{j}]" for j, (a, b) in enumerate(zip(cache1, cache2)) if not _bitwise_same(a, b)]
        if diff:
            failures.append(f"not deterministic: a second identical run differs bitwise in {', '.join(diff)}")
        f, got, want = token_failures(out1, ref, bounds)
        failures += f
        f, worst = compare_all({**got, **_cache_dict(cache1)}, {**want, **_cache_dict(ref_cache)}, bounds, "")
        failures += f
        figures.update(worst)
    if not failures and out1 and next(iter(out1.values())).is_cuda:
        from .gpu_checks import gpu_failures

        failures += gpu_failures(variant, c)
    if not failures and c.batch > 1:
        for i in sorted({0, c.batch // 2, c.batch - 1}):
            alone, _, f = run_variant(variant, c.row(i))
            failures += [f"row {i} alone: {m}" for m in f]
            if not f:
                failures += compare_all(alone, {n: token_rows(n, t, i) for n, t in out1.items()}, bounds,
                                        f"batch invariance, row {i} alone vs in batch {c.batch}: ")[0]
    return {"status": "FAIL" if failures else "PASS", "failures": failures, **figures}


def check_op(variant: Variant, cfg: ModelConfig, kind: str, dtype, batch: int, seed: int = 0,
             dist: str = "uniform", device="cpu", **build) -> dict:
    """One matrix cell. SKIP (with the manifest's reason) when the variant's scope excludes it. `build`:
    build_case options (cache_len, slots, magnitude)."""
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    row = {"variant": variant.name, "op": kind, "family": cfg.family, "dtype": dtype_name(dt), "batch": batch,
           "seed": seed, "dist": dist, "device": str(device), **{k: v for k, v in build.items() if v is not None}}
    reason = variant.supports(cfg, dt, batch, device)
    if reason is not None:
        return {**row, "status": "SKIP", "reason": reason}
    try:
        res = check_case(variant, build_case(cfg, kind, batch, seed, dist, device, **build), dt)
    except Exception as e:  # a crash is a failure of the variant, recorded with its message
        res = {"status": "FAIL", "failures": [f"raised {type(e).__name__}: {e}"]}
    return {**row, **res}
