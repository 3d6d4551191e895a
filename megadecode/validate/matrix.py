"""The validation matrix: one variant over ops x presets x batches x dtypes x routing distributions x
seeds (the base cases), plus the cases of validate/cases.py that leave the easy corner (odd dims, tile edges,
scope edges, long caches, permuted slots, magnitudes: all of them, or a seeded sample per (preset, op)), each
cell PASS / FAIL / SKIP (out of scope, with the manifest's reason). Rows are dicts (the evidence report reads
them; `case` names the extra case, "base" otherwise); `save_json` writes them with the conditions that produced
them. `verdict` is PASS only when something ran and nothing failed."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from ..contract import Variant
from ..plan import EXPERTS, LATENT_MOE
from ..presets import preset_config
from . import cases as C
from .checks import check_op
from .inputs import DISTRIBUTIONS, ROUTED

BATCH_SWEEP = (1, 2, 3, 7, 8, 33, 64, 67, 128, 255, 256)
QUICK_BATCHES = (1, 3, 8, 67)  # CI: the smallest, odd sizes, a tile and the 67 of the batch-sweep
QUICK_EXTRA, QUICK_EXTRA_MAX_BATCH = 4, 65  # --quick: 4 extra cases per (preset, op), seeded, batches <= 65
CPU_PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-kimi-linear", "tiny-k3")
# Presets that differ from a CPU preset only in their routed experts (FP8; tiny-k3-wide: K3's at a record's k span):
# run for the expert variants whose scope admits them.
EXPERT_PRESETS = ("tiny-qwen3-moe-fp8", "tiny-deepseek-v3-fp8", "tiny-k3-wide")
DTYPES = ("float32", "float16", "bfloat16")


def run_matrix(variant: Variant, *, presets=None, batches=BATCH_SWEEP, dtypes=DTYPES,
               dists=DISTRIBUTIONS, seeds=(0,), device="cpu", progress=None, extra: int | None = 0,
               case_seed: int = 0, extra_max_batch: int | None = None) -> list[dict]:
    """presets None: the CPU_PRESETS of the families in the variant's scope, and for a variant of the routed
    experts (EXPERTS or LATENT_MOE) the EXPERT_PRESETS its scope's dims admit (named presets run as given, a family out of scope then gives
    SKIP rows). extra: the extra cases per (preset, op kind): 0 none, None all candidates, k a sample of k drawn with
    `case_seed` (each run at every dtype, the first seed, uniform routing)."""
    if presets is None:
        scope = variant.manifest.scope
        presets = [p for p in CPU_PRESETS if preset_config(p).family in scope.families]
        if EXPERTS in variant.manifest.replaces or LATENT_MOE in variant.manifest.replaces:
            presets += [p for p in EXPERT_PRESETS if preset_config(p).family in scope.families
                        and scope.dims is not None and scope.dims(preset_config(p)) is None]
    rows = []

    def cell(preset, cfg, kind, dtype, batch, seed, dist, case="base", case_family="base", **build):
        t0 = time.perf_counter()
        row = check_op(variant, cfg, kind, dtype, batch, seed, "uniform" if dist == "-" else dist, device, **build)
        rows.append({"preset": preset, "case": case, "case_family": case_family, **row, "dist": dist,
                     "seconds": round(time.perf_counter() - t0, 4)})
        if progress is not None:
            progress(rows[-1])

    for preset in presets:
        cfg = preset_config(preset)
        for kind in variant.manifest.replaces:
            for dist in (dists if kind in ROUTED else ("-",)):
                for dtype in dtypes:
                    for batch in batches:
                        for seed in seeds:
                            cell(preset, cfg, kind, dtype, batch, seed, dist)
            if extra == 0 or cfg.family not in variant.manifest.scope.families:
                continue
            picked = C.sample(C.candidates(variant, cfg, kind, device, extra_max_batch), extra, case_seed,
                              f"{preset}/{kind}")
            for case in picked:
                for dtype in dtypes:
                    cell(preset, case.cfg, kind, dtype, case.batch, seeds[0], "uniform" if kind in ROUTED else "-",
                         case=case.name, case_family=case.family, **case.build_kwargs())
    return rows


def case_plan(variant: Variant, presets=None, extra: int | None = None, case_seed: int = 0,
              device: str = "cpu", extra_max_batch: int | None = None) -> dict[str, dict]:
    """The extra cases run_matrix runs, by "preset/op": {"cases": names, "families": the families they cover,
    "of": how many candidates there were}; what the command prints and the report lists."""
    if presets is None:
        presets = [p for p in CPU_PRESETS if preset_config(p).family in variant.manifest.scope.families]
    out = {}
    for preset in presets:
        cfg = preset_config(preset)
        if cfg.family not in variant.manifest.scope.families:
            continue
        for kind in variant.manifest.replaces:
            cands = C.candidates(variant, cfg, kind, device, extra_max_batch)
            picked = C.sample(cands, extra, case_seed, f"{preset}/{kind}")
            out[f"{preset}/{kind}"] = {"cases": [c.name for c in picked], "families": C.families(picked),
                                       "of": len(cands)}
    return out


def plan_lines(plan: dict[str, dict], case_seed: int) -> list[str]:
    """One line per (preset, op) of a case_plan: the cases drawn, of how many, and the families they cover."""
    return [f"extra cases {where} (seed {case_seed}): {', '.join(p['cases'])} (of {p['of']}); families: "
            f"{', '.join(p['families']) or 'none'}" for where, p in plan.items()]


def counts(rows: list[dict]) -> dict[str, int]:
    c = Counter(r["status"] for r in rows)
    return {k: c.get(k, 0) for k in ("PASS", "FAIL", "SKIP")}


def verdict(rows: list[dict]) -> str:
    """FAIL when any row failed, NOT RUN when none passed (every cell skipped, or no cell): a matrix that ran
    nothing proves nothing and must not read as a pass; PASS otherwise."""
    c = counts(rows)
    return "FAIL" if c["FAIL"] else ("PASS" if c["PASS"] else "NOT RUN")


def summary_table(rows: list[dict]) -> str:
    """One line per (preset, op, dtype, dist): PASS/FAIL/SKIP counts over batches and seeds, the first
    failure or skip reason, and the worst error."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["preset"], r["op"], r["dtype"], r["dist"] if r.get("case", "base") == "base"
                           else "extra cases"), []).append(r)
    head = f"{'preset':<18} {'op':<9} {'dtype':<9} {'dist':<14} {'pass':>4} {'fail':>4} {'skip':>4} " \
           f"{'max_rel_err':>11}  note"
    lines = [head, "-" * len(head)]
    for (preset, op, dtype, dist), rs in groups.items():
        c = counts(rs)
        errs = [r["max_rel_err"] for r in rs if isinstance(r.get("max_rel_err"), float)]
        fail = next((r for r in rs if r["status"] == "FAIL"), None)
        skip = next((r for r in rs if r["status"] == "SKIP"), None)
        note = (f"{fail.get('case', 'base')} batch {fail['batch']} seed {fail['seed']}: {fail['failures'][0]}" if fail else
                f"skip: {skip['reason']}" if skip else "")
        lines.append(f"{preset:<18} {op:<9} {dtype:<9} {dist:<14} {c['PASS']:>4} {c['FAIL']:>4} {c['SKIP']:>4} "
                     f"{(f'{max(errs):.2e}' if errs else '-'):>11}  {note}")
    c = counts(rows)
    lines.append(f"total: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['SKIP']} SKIP: {verdict(rows)}")
    return "\n".join(lines)


def save_json(rows: list[dict], path, variant: Variant, command: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"variant": variant.manifest.to_dict(), "command": command, "torch": torch.__version__,
           "counts": counts(rows), "rows": rows}
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path
