"""The megakernel's ahead-of-time export, probed on the GPU (issue 40 item 5, the cold start): compile the launcher
as the runtime does, export it with the DSL's `export_to_c` (a C header and a host object holding the cubin), then
in a fresh process load the object with `cute.runtime.load_module` (JITLink in-process, no tracing, no C compiler)
and diff the loaded launcher against pyvm (validate.mega_gpu.diff_program: every buffer, a repeat and delayed
launches) on tiny-qwen3-moe at batch 1 and tiny-k3-frag at batch 3. Each stage's seconds and the diffs to --out as
JSON after every step (a run cut short keeps what it measured).

    python bench/mega_aot_probe.py --out $OUT/mega-aot-probe.json

The loaded launcher keeps no cubin, so the runtime's residency check (which reads the register count from it)
is bypassed in the loading process; the runtime's disk cache (backends/mega/kernel_cache.py, built on these
stages) stores the count beside the object. On a machine without the CUDA runtime the export fails to link
(docs/megakernel.md, "Cold start").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

CASES = (("tiny-qwen3-moe", 1), ("tiny-k3-frag", 3))
PREFIX = "mega_step"


def _save(res: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def export(out: str, where: str) -> dict:
    """Compile (as runtime.compile_launcher, uncached) and export to `where`; seconds of each stage."""
    res = {"git_sha": os.environ.get("MEGADECODE_GIT_SHA")}
    t0 = time.perf_counter()
    import torch

    from megadecode.backends.mega.runtime import compile_launcher, cubin_registers
    res["gpu"] = torch.cuda.get_device_name()
    res["import_s"] = round(time.perf_counter() - t0, 2)
    t = time.perf_counter()
    k = compile_launcher(torch.device("cuda"), cache=False)
    res["compile_s"] = round(time.perf_counter() - t, 2)
    res["registers"] = cubin_registers(getattr(getattr(k, "artifacts", None), "CUBIN", None))
    res["compiled_type"] = type(k).__name__
    _save(res, out)
    t = time.perf_counter()
    try:
        k.export_to_c(where, PREFIX)
        res["export_s"] = round(time.perf_counter() - t, 2)
        res["files"] = {f: os.path.getsize(os.path.join(where, f)) for f in sorted(os.listdir(where))}
    except Exception:
        res["export_error"] = traceback.format_exc()[-1500:]
    _save(res, out)
    return res


def load(out: str, where: str) -> None:
    """In this (fresh) process: load the export, then diff the loaded launcher against pyvm on CASES."""
    with open(out) as f:
        res = json.load(f)
    t0 = time.perf_counter()
    from megadecode.backends.mega import runtime
    runtime.kernel_module()  # first: it sets the DSL's architecture before cutlass is imported

    import cutlass.cute as cute
    res["load_import_s"] = round(time.perf_counter() - t0, 2)
    t = time.perf_counter()
    try:
        fn = getattr(cute.runtime.load_module(os.path.join(where, PREFIX + ".o")), PREFIX)
        res["load_s"] = round(time.perf_counter() - t, 2)
    except Exception:
        res["load_error"] = traceback.format_exc()[-1500:]
        _save(res, out)
        return
    _save(res, out)
    runtime.MegaRuntime.check_residency = lambda self: None  # the loaded launcher keeps no cubin (see above)
    from megadecode.validate.mega_gpu import diff_failures, diff_program
    res["diffs"] = []
    for preset, batch in CASES:
        t = time.perf_counter()
        try:
            r = diff_program(preset, batch, 16, seed=batch, kernel=fn)
            worst = max((x.get("rel", 0.0) for x in r.get("buffers", [])), default=None)
            res["diffs"].append({"preset": preset, "batch": batch, "failures": diff_failures(r), "worst_rel": worst,
                                 "s": round(time.perf_counter() - t, 1)})
        except Exception:
            res["diffs"].append({"preset": preset, "batch": batch, "error": traceback.format_exc()[-1500:]})
        _save(res, out)
    res["load_process_s"] = round(time.perf_counter() - t0, 2)
    _save(res, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mega-aot-probe.json")
    ap.add_argument("--load", metavar="DIR", help=argparse.SUPPRESS)  # the fresh process's part
    args = ap.parse_args(argv)
    if args.load:
        load(args.out, args.load)
        return 0
    where = tempfile.mkdtemp(prefix="megadecode-aot-")
    res = export(args.out, where)
    if "export_error" in res:
        print(res["export_error"])
        return 1
    t = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--out", args.out, "--load", where], timeout=300, check=False)
    with open(args.out) as f:
        res = json.load(f)
    res["load_process_wall_s"] = round(time.perf_counter() - t, 2)
    _save(res, args.out)
    print(json.dumps(res, indent=1))
    ok = "diffs" in res and all(not d.get("failures") and "error" not in d for d in res["diffs"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
