"""The harness's planted megakernel mistakes that only a GPU run can catch, run on the GPU against the checks that
must catch them (validate/mega_plants.py PLANTS, their "gpu:" catchers), beside the shipped kernel on the same
checks (which must pass). Exit 0 when every plant is caught and every control passes. Writes JSON to --out.

    python bench/mega_plants_gpu.py --out $OUT/mega-plants-gpu.json

- gpu:timeout (silent_timeout): validate.mega_gpu.timeout_case, a wait forced past its limit, must raise MegaError
  naming the instruction and the counter.
- gpu:long-splits (skip_last_chunk): diff_program against pyvm at the last position of a 1000-position cache
  (splits of several chunks); the same plant at the old cases' contexts (splits of one chunk) is run too, to show
  what they missed.
- gpu:delayed-build (no_body_barrier): diff_program's delayed launches (every warp delayed before its stores);
  (ring_overtake, ring_no_wait): the same at batch 1, the weight ring's build (its loader delayed before each
  page), on 5 CTAs (many staged instructions a queue: the ring wraps) and 16.
- nc_cache (caught by the static audit): run too, to record whether a GPU run sees it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch

from megadecode.backends.mega.runtime import MegaError
from megadecode.validate.mega_gpu import diff_failures, diff_program, timeout_case, timeout_failures
from megadecode.validate.mega_plants import planted_launcher

CTAS = 16


def _diff(preset, batch, context, kernel, delay_runs=3, ctas=CTAS):
    """diff_program's failures; a launch that reports an error (MegaError: a ring page that never landed, a wait
    past its limit) is a catch too: the mistake was named, not run on silently."""
    try:
        r = diff_program(preset, batch, ctas, seed=batch, delay_runs=delay_runs, context=context, kernel=kernel)
    except MegaError as e:
        return {"preset": preset, "batch": batch, "context": context, "longest_split": None,
                "failures": [f"MegaError: {e}"]}
    return {"preset": preset, "batch": batch, "context": context, "longest_split": r["longest_split"],
            "failures": diff_failures(r)}


def run(out: dict, save) -> None:
    """The plants and controls in turn; `save()` after each row, so a run cut by the device's limit keeps its rows."""
    dev = torch.device("cuda")
    rows = out["rows"]

    def add(subject, check, expect_caught, results):
        caught = any(x["failures"] for x in results)
        rows.append({"subject": subject, "check": check, "expected": "caught" if expect_caught else "passes",
                     "caught": caught, "ok": caught == expect_caught, "results": results})
        save()
        print(f"{'OK ' if caught == expect_caught else 'BAD'} {subject:<28} {check:<26} caught={caught} "
              f"{[x['failures'][:2] for x in results if x['failures']][:2]}", flush=True)

    # timeouts: the shipped kernel reports; the silent plant (waits only: EMBED's body) does not
    r = timeout_case()
    add("mega_kernel", "gpu:timeout", False, [{**r, "failures": timeout_failures(r)}])
    t0 = time.perf_counter()
    silent = planted_launcher("silent_timeout", dev, bodies=("EMBED",))
    out["compile_s"]["silent_timeout"] = time.perf_counter() - t0
    r = timeout_case(kernel=silent)
    add("mega_kernel+silent_timeout", "gpu:timeout", True, [{**r, "failures": timeout_failures(r)}])
    # long splits: the shipped kernel passes them; skip_last_chunk fails them, and passes the old contexts
    presets = ("tiny-qwen3-moe", "tiny-deepseek-v3")
    add("mega_kernel", "gpu:long-splits", False, [_diff(p, b, "max", None, 1) for p in presets for b in (1, 5)])
    ring_cases = [("tiny-qwen3-moe", 1, 5), ("tiny-qwen3-moe", 1, 16), ("tiny-k3-frag", 1, 5)]
    add("mega_kernel", "gpu:delayed-build (ring)", False, [_diff(p, b, "random", None, 3, c) for p, b, c in ring_cases])
    for name in ("ring_overtake", "ring_no_wait"):
        t0 = time.perf_counter()
        k = planted_launcher(name, dev)
        out["compile_s"][name] = time.perf_counter() - t0
        add(f"mega_kernel+{name}", "gpu:delayed-build (ring)", True, [_diff(p, b, "random", k, 3, c)
                                                                       for p, b, c in ring_cases])
    for name in ("skip_last_chunk", "no_body_barrier", "nc_cache"):
        t0 = time.perf_counter()
        k = planted_launcher(name, dev)
        out["compile_s"][name] = time.perf_counter() - t0
        if name == "skip_last_chunk":
            add(f"mega_kernel+{name}", "gpu:long-splits", True, [_diff(p, b, "max", k, 1) for p in presets
                                                                  for b in (1, 5)])
            add(f"mega_kernel+{name}", "old cases (splits <= 64)", False, [_diff(p, b, "random", k, 1)
                                                                            for p in presets for b in (1, 3)])
        elif name == "no_body_barrier":
            add(f"mega_kernel+{name}", "gpu:delayed-build", True, [_diff(p, b, "random", k, 3)
                                                                    for p in presets + ("tiny-k3",) for b in (1, 3)])
        else:  # recorded, not expected either way: the audit is what catches it
            res = [_diff("tiny-deepseek-v3", b, "max", k, 1) for b in (1, 5)]
            rows.append({"subject": f"mega_kernel+{name}", "check": "diff vs pyvm (not its catcher)",
                         "expected": "recorded", "caught": any(x["failures"] for x in res), "ok": True,
                         "results": res})
            save()
            print(f"    mega_kernel+{name} on the GPU: caught={rows[-1]['caught']}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mega-plants-gpu.json")
    args = ap.parse_args()
    out = {"gpu": torch.cuda.get_device_name(), "git_sha": os.environ.get("MEGADECODE_GIT_SHA"), "ctas": CTAS,
           "compile_s": {}, "rows": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    try:
        run(out, save)
    except Exception as e:  # noqa: BLE001  (write what ran)
        traceback.print_exc()
        out["error"] = repr(e)
    save()
    ok = "error" not in out and all(r["ok"] for r in out["rows"])
    print(f"{'all plants caught, controls pass' if ok else 'NOT all as expected'}: wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
