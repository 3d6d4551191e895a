"""`megadecode validate`: list the variants, or run one variant's validation matrix on this machine.

    megadecode validate --list
    megadecode validate triton-router --quick --json out.json
    megadecode validate triton-router --e2e

Without a GPU, Triton variants run under the Triton interpreter (TRITON_INTERPRET=1 is set before the
kernels are imported) in fp32/fp16; bf16 and sm_90-only variants SKIP with the reason. Every mode also audits
every kernel the variant declares (static sm_90 PTX/SASS audit, validate/kernel_audit.py) and runs the extra
cases of validate/cases.py (all of them; --quick: every case family's first case and a seeded sample of the rest,
printed with the families run). Exit code 1 when any cell or audit
FAILs, and when no cell ran (NOT RUN: every cell skipped proves nothing).
"""

from __future__ import annotations

import os
import shlex
import sys

import torch

from ..args import add_quiet, bar_off


def add_parser(sub, help_: str) -> None:
    """The validate command's parser (`help_`: its line in `megadecode --help`, cli.HEAVY_COMMANDS)."""
    p = sub.add_parser("validate", help=help_,
                       description="Run a variant's validation matrix (ops x presets x batches x dtypes x "
                                   "routing distributions x seeds) and print PASS/FAIL/SKIP.")
    p.add_argument("variant", nargs="?", help="variant name (see --list; without one, --list)")
    p.add_argument("--list", action="store_true", help="list the variants with their scopes")
    p.add_argument("--quick", action="store_true", help="batches 1,3,8,67, fp32+fp16, one seed")
    p.add_argument("--seeds", type=int, default=None, help="seeds per cell (default: 1 quick, 3 full)")
    p.add_argument("--e2e", action="store_true", help="also run 128 greedy steps against the torch executor")
    p.add_argument("--extra", type=int, default=None, metavar="K",
                   help="extra cases (odd dims, tile edges, long caches, permuted slots, magnitudes) per (preset, op) "
                        "(default: all of them; with --quick: 4, batches <= 65, and at least the first case of every "
                        "family); 0: none")
    p.add_argument("--case-seed", type=int, default=0, help="seed of the extra cases' sample (default: 0)")
    p.add_argument("--preset", action="append", default=None,
                   help="run on this preset (repeatable; default: the tiny presets of the families in scope)")
    p.add_argument("--json", metavar="OUT", help="write the matrix rows as JSON to OUT (default: not written)")
    add_quiet(p)
    p.add_argument("--report", metavar="DIR", help="write DIR/<variant>.html (evidence report) and DIR/<variant>.md "
                   "(default: not written)")
    p.add_argument("--executor", choices=("pyvm", "mega"), default=None,
                   help="validate a whole-step executor instead of a variant: the megakernel's static audit, then "
                        "greedy generation in lockstep on the tiny presets (pyvm: against torch in fp32, with the "
                        "race check; mega: against pyvm in bf16 on the GPU) (default: not run)")
    p.add_argument("--steps", type=int, default=64, help="greedy steps per sequence with --executor (default: 64)")
    p.add_argument("--ordering", action="store_true",
                   help="audit the persistent handoff kernel and its planted ordering bugs: static sm_90 "
                        "audit (CPU), plus random-delay and repeat runs on a GPU")
    p.add_argument("--launches", type=int, default=100, help="launches per jitter placement (--ordering)")
    p.set_defaults(func=cmd_validate)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_validate(args, argv) -> int:
    from ..backends.fused.kernels import require_triton

    if _device() == "cpu":  # before triton is first imported (require_triton imports it): the interpreter needs it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    require_triton("megadecode validate")  # every variant but the torch ones, and the ordering audit
    from .catalog import all_variants, get
    from .kernel_audit import audit_rows, audit_variant
    from .matrix import (
        BATCH_SWEEP,
        DTYPES,
        QUICK_BATCHES,
        QUICK_EXTRA,
        QUICK_EXTRA_MAX_BATCH,
        case_plan,
        plan_lines,
        run_matrix,
        save_json,
        summary_table,
        verdict,
    )

    if args.ordering:
        return _cmd_ordering(args, argv)
    if args.executor:
        return _cmd_executor(args, argv)
    if args.list or not args.variant:
        for v in all_variants():
            m = v.manifest
            print(f"{m.name:<34} replaces {','.join(m.replaces):<9} {m.description}\n{'':<34} scope: "
                  f"{m.scope.describe()}{'  (Triton)' if m.uses_triton else ''}")
        return 0
    v = get(args.variant)
    quick = args.quick
    seeds = tuple(range(args.seeds if args.seeds is not None else (1 if quick else 3)))
    device = _device()
    extra = args.extra if args.extra is not None else (QUICK_EXTRA if quick else None)
    extra_max = QUICK_EXTRA_MAX_BATCH if quick and device == "cpu" else None
    from tqdm import tqdm

    with tqdm(desc=f"validate {v.name}", unit="cell", file=sys.stderr, disable=bar_off(args)) as bar:
        rows = run_matrix(v, presets=args.preset, batches=QUICK_BATCHES if quick else BATCH_SWEEP,
                          dtypes=("float32", "float16") if quick else DTYPES, seeds=seeds, device=device,
                          extra=extra, case_seed=args.case_seed, extra_max_batch=extra_max,
                          progress=lambda row: bar.update(1))
    print(f"variant {v.name} on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})")
    print(summary_table(rows))
    plan = case_plan(v, presets=args.preset, extra=extra, case_seed=args.case_seed, device=device,
                     extra_max_batch=extra_max) if extra != 0 else {}
    for line in plan_lines(plan, args.case_seed):
        print(line)
    audits = audit_variant(v)
    for a in audits:
        print(f"audit {'PASS' if a.passed else 'FAIL'} {a.kernel} {a.path or ''}"
              f"{'' if a.passed else ': ' + (a.error or ', '.join(sorted({f.rule for f in a.errors})))}")
    if not audits:
        print("audit: no compiled kernel declared (Manifest.kernels is None: plain torch)")
    status = verdict(rows)
    failed = status != "PASS" or any(not a.passed for a in audits)
    if status == "NOT RUN":
        print("NOT RUN: no cell ran on this machine (every one skipped): nothing was validated", file=sys.stderr)
    if args.e2e:
        from ..presets import preset_config
        from .e2e import compare_generation

        for preset in ("tiny-qwen3-moe", "tiny-deepseek-v3"):
            if v.supports(preset_config(preset), torch.float32, 1, device) is None:
                res = compare_generation([v], preset, device=device)
                print(f"e2e {preset}: {res['status']} ({res['steps']} steps x {res['sequences']} sequences, "
                      f"max logit diff {res['max_logit_diff_before_divergence']:.2e}) {res['divergences'] or ''}")
                rows.append({"e2e": True, **res})
                failed |= res["status"] == "FAIL"
    if args.json:
        path = save_json(rows + audit_rows(v, audits), args.json, v, command="megadecode " + shlex.join(argv))
        print(f"wrote {path}", file=sys.stderr)
    if args.report:
        from .staleness import inputs_hash

        coverage = {"extra cases run (sampled)": "; ".join(f"{k}: {', '.join(p['cases'])} (of {p['of']})"
                                                           for k, p in plan.items()) or "none",
                    "case families run": "; ".join(f"{k}: {', '.join(p['families'])}" for k, p in plan.items())
                                         or "none",
                    "inputs hash": inputs_hash(v.manifest.sources)}
        _write_report(args, argv, v.name, _manifest_dict(v.manifest), rows, audits, _time_variant(v, device),
                      coverage)
    return 1 if failed else 0


def _manifest_dict(m) -> dict:
    import dataclasses

    d = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)}
    d["scope"] = m.scope.describe()
    d["kernels"] = m.to_dict()["kernels"]
    return d


def _time_variant(v, device: str) -> list[dict]:
    """The variant's op against the torch reference op on the GPU (do_bench medians, bf16, real model
    dims of qwen3-30b-a3b / deepseek-style routing where in scope). Empty on the CPU."""
    if device != "cuda":
        return []
    from .perf import time_against_reference

    return time_against_reference(v)


def _write_report(args, argv, name, manifest, rows, audits, perf_rows, coverage=None) -> None:
    from .report import environment, write_report

    h, m = write_report(args.report, name, manifest=manifest, rows=rows, audits=audits, perf_rows=perf_rows,
                        env=environment(), command="megadecode " + shlex.join(argv), coverage=coverage)
    print(f"wrote {h} and {m}", file=sys.stderr)


def _cmd_executor(args, argv) -> int:
    """A whole-step executor (the megakernel, or pyvm, its golden model): the kernel's static audit and lockstep
    greedy generation against the torch executor. Exit 1 on any FAIL, and when nothing ran."""
    import json

    from .e2e import compare_generation

    device = _device()
    rows, audits, failed, ran = [], [], False, 0
    try:
        from .mega_audit import audit_megakernel, plant_verdicts

        rep = audit_megakernel()
        audits.append(rep)
        print(f"audit {'PASS' if rep.passed else 'FAIL'} {rep.kernel}: rules {', '.join(rep.rules_checked)}"
              + "".join(f"; SKIP {r}: {why}" for r, why in rep.skipped.items()))
        for rule, what in rep.checked.items():
            print(f"  {rule}: {what}")
        rows.append({"variant": rep.kernel, "check": "verdict", "expected": "passes the audit",
                     "status": "PASS" if rep.passed else "FAIL",
                     "caught_by": ", ".join(sorted({f.rule for f in rep.errors})) or None})
        failed |= not rep.passed
        # the harness's planted mistakes: each must be caught by the rules it names (validate/mega_plants.py)
        prow, preps = plant_verdicts()
        audits += preps
        for r in prow:
            print(f"plant {r['status']:<4} {r['variant']}: expected {r['expected']}; "
                  f"{r.get('caught_by') or r.get('reason')}")
        rows += prow
        failed |= any(r["status"] == "FAIL" for r in prow)
    except ImportError as e:
        print(f"audit SKIP mega_kernel: CuTe DSL is not installed ({e}); pip install -e '.[cute]'")
        rows.append({"variant": "mega_kernel", "check": "verdict", "status": "SKIP", "reason": str(e)})
    if args.executor == "mega" and device != "cuda":
        print("mega: SKIP generation: the megakernel runs on a CUDA GPU (validate --executor pyvm on the CPU)")
    else:
        presets = args.preset or ["tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-k3"]
        dtype = torch.bfloat16 if args.executor == "mega" else torch.float32
        attrs = {"check_races": True} if args.executor == "pyvm" else {}
        # pyvm against torch in fp32 (the golden model against the spec); mega against pyvm in bf16 (the kernel
        # against its golden model: bf16 torch rounds activations the kernel keeps in fp32, see e2e.py)
        reference = "pyvm" if args.executor == "mega" else "torch"
        for preset in presets:
            res = compare_generation(None, preset, steps=args.steps, dtype=dtype, device=device,
                                     executor=args.executor, reference=reference, **attrs)
            ran += 1
            failed |= res["status"] == "FAIL"
            print(f"e2e {preset} {res['dtype']} vs {reference}: {res['status']} ({res['steps']} steps x {res['sequences']} "
                  f"sequences, max logit diff {res['max_logit_diff_before_divergence']:.2e}) {res['divergences'] or ''}")
            rows.append({**res, "variant": f"e2e {preset} vs {reference}", "check": "verdict",
                         "expected": "PASS"})
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "megadecode " + shlex.join(argv), "executor": args.executor,
                                               "rows": rows}, indent=1, default=str))
    if args.report:
        manifest = {"name": args.executor, "subject": "the CuTe DSL megakernel (backends/mega/cute_kernel.py): its static "
                    "audit, the harness's planted mistakes (validate/mega_plants.py) and greedy generation against "
                    + ("pyvm" if args.executor == "mega" else "torch"),
                    "plants": {p.name: p.what for p in _plants()}}
        _write_report(args, argv, f"{args.executor}-executor", manifest, rows, audits, [])
    if ran == 0:
        print("NOT RUN: no generation ran on this machine", file=sys.stderr)
    return 1 if failed or ran == 0 else 0


def _plants():
    from .mega_plants import CONTROLS, PLANTS

    return list(PLANTS.values()) + list(CONTROLS.values())


def _cmd_ordering(args, argv) -> int:
    from .ordering import HANDOFF_VARIANTS, run_ordering

    rows, reports = run_ordering(launches=args.launches)
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("variant", "check", "status") and v is not None}
        print(f"{r['status']:<5} {r['variant']:<36} {r['check']:<20} {extra if extra else ''}")
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": "megadecode " + shlex.join(argv), "rows": rows}, indent=1))
    if args.report:
        manifest = {"name": "ordering-audit", "subject": "megadecode/validate/handoff.py (persistent producer/"
                    "consumer handoff through flags) and its planted ordering mistakes",
                    "variants": list(HANDOFF_VARIANTS)}
        from .staleness import ORDERING_SOURCES, inputs_hash

        _write_report(args, argv, "ordering-audit", manifest, rows, reports, [],
                      {"inputs hash": inputs_hash(ORDERING_SOURCES)})
    # the planted bugs' own checks fail by design: the verdict rows say whether each subject was judged right
    return 1 if any(r["status"] == "FAIL" for r in rows if r["check"] == "verdict") else 0


__all__ = ["add_parser", "cmd_validate"]
