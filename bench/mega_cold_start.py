"""The megakernel's cold start with the on-disk kernel cache (issue 40 item 5: a second `generate --executor mega`
starts in <= 15 s): `megadecode generate --executor mega` run as a user runs it, each a fresh process, wall clock
of the whole command, against one fresh cache directory (MEGADECODE_KERNEL_CACHE):

    1. tiny-qwen3-moe, the cache empty (the process compiles and stores the kernel);
    2. tiny-qwen3-moe again (it loads the kernel), and once more with the config cache off (MEGADECODE_CONFIG_CACHE
       =off: transformers imported to resolve the config, config/hf_class.py);
    3. each --preset with the cache warm, then with the cache off (MEGADECODE_KERNEL_CACHE=off: the compile), the
       same tokens expected from both.

Each row: the command, wall seconds, whether the process said it compiled, the tokens; the JSON is rewritten after
every row (a run cut short keeps what it measured). `--profile`: then the warm tiny-qwen3-moe run once more under
`python -X importtime -m cProfile`: the slowest imports (cumulative) and functions (cumulative) of the warm start,
to find what it spends besides the kernel.

    python bench/mega_cold_start.py --preset qwen3-30b-a3b --out $OUT/mega-cold-start.json
    python bench/mega_cold_start.py --preset qwen3-30b-a3b,k3-mini --skip-off   # the warm starts alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run(model: str, cache: str, new_tokens: int, timeout: int, config_cache: bool = True) -> dict:
    cmd = [sys.executable, "-m", "megadecode", "generate", "--model", model, "--executor", "mega", "--device", "cuda",
           "--max-new-tokens", str(new_tokens), "--dtype", "bfloat16", "--greedy", "--json"]
    env = {**os.environ, "MEGADECODE_KERNEL_CACHE": cache}
    if not config_cache:  # configs resolved through transformers again (config/hf_class.py), as before 3b513ae
        env["MEGADECODE_CONFIG_CACHE"] = "off"
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    row = {"model": model, "cache": "off" if cache == "off" else "dir", "config_cache": config_cache,
           "wall_s": round(time.perf_counter() - t, 2),
           "rc": p.returncode, "compiled": "compiling the megakernel" in p.stderr,
           "command": f"MEGADECODE_KERNEL_CACHE={'off' if cache == 'off' else '<dir>'} " + " ".join(cmd[1:])}
    if p.returncode:
        row["stderr"] = p.stderr[-2000:]
        return row
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("megadecode:")]
    if said:
        row["said"] = said
    try:
        doc = json.loads(p.stdout)
        row["tokens"] = doc["token_ids"]
        row.update({k: round(doc[k], 3) for k in ("warmup_s", "prefill_s", "decode_s") if k in doc})
    except (json.JSONDecodeError, KeyError, TypeError):
        row["stdout"] = p.stdout[-500:]
    return row


def profile(cache: str, new_tokens: int, timeout: int, top: int = 25) -> dict:
    """The warm start of tiny-qwen3-moe under -X importtime and cProfile: its slowest imports and functions."""
    import pstats
    import re

    prof = os.path.join(tempfile.mkdtemp(prefix="megadecode-prof-"), "generate.prof")
    cmd = [sys.executable, "-X", "importtime", "-m", "cProfile", "-o", prof, "-m", "megadecode", "generate",
           "--model", "tiny-qwen3-moe", "--executor", "mega", "--device", "cuda", "--max-new-tokens",
           str(new_tokens), "--dtype", "bfloat16", "--greedy", "--json"]
    t = time.perf_counter()
    p = subprocess.run(cmd, env={**os.environ, "MEGADECODE_KERNEL_CACHE": cache}, capture_output=True, text=True,
                       timeout=timeout)
    out = {"wall_s": round(time.perf_counter() - t, 2), "rc": p.returncode}
    imports = []
    for ln in p.stderr.splitlines():  # "import time: self [us] | cumulative | imported package"
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (.*)$", ln)
        if m:
            imports.append((int(m.group(2)) / 1e6, m.group(3).rstrip()))
    out["imports_top_s"] = [[round(s_, 3), name] for s_, name in sorted(imports, reverse=True)[:top]]
    if os.path.exists(prof):
        st = pstats.Stats(prof)
        rows = sorted(((v[3], f"{k[0]}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)[:top]
        out["functions_top_cumulative_s"] = [[round(c, 3), name] for c, name in rows]
    else:
        out["stderr"] = p.stderr[-2000:]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="comma-separated presets for step 3")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=300, help="seconds a command may take")
    ap.add_argument("--out", default="mega-cold-start.json")
    ap.add_argument("--profile", action="store_true", help="then profile the warm start (imports, functions)")
    ap.add_argument("--skip-off", action="store_true",
                    help="no run of a --preset with the kernel cache off (its compile: ~90 s each)")
    args = ap.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="megadecode-kcache-")
    res = {"git_sha": os.environ.get("MEGADECODE_GIT_SHA"), "rows": []}

    def add(row):
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "stderr")}), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    add(run("tiny-qwen3-moe", cache, args.new_tokens, args.timeout))
    add(run("tiny-qwen3-moe", cache, args.new_tokens, args.timeout))
    add(run("tiny-qwen3-moe", cache, args.new_tokens, args.timeout, config_cache=False))
    for preset in [p for p in args.preset.split(",") if p]:  # --preset "": the tiny rows (and --profile) alone
        warm = run(preset, cache, args.new_tokens, args.timeout)
        add(warm)
        if args.skip_off:
            continue
        off = run(preset, "off", args.new_tokens, args.timeout)
        off["same_tokens_as_cached"] = off.get("tokens") == warm.get("tokens") and off.get("tokens") is not None
        add(off)
    r = res["rows"]
    # the tiny runs: compiled, then loaded twice, the same tokens each time; each preset's rows: loaded (then, without
    # --skip-off, compiled with the cache off and the same tokens)
    loads = [x for x in r[1:] if x["cache"] == "dir"]
    ok = (all(x["rc"] == 0 for x in r) and r[0]["compiled"] and not any(x["compiled"] for x in loads)
          and r[0].get("tokens") is not None and all(x.get("tokens") == r[0]["tokens"] for x in r[1:3])
          and all(x.get("same_tokens_as_cached") for x in r[3:] if x["cache"] == "off"))
    res["checks_passed"] = ok
    if args.profile:
        res["profile"] = profile(cache, args.new_tokens, args.timeout)
        for c, name in res["profile"].get("functions_top_cumulative_s", [])[:15]:
            print(f"{c:8.2f} s  {name}")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'model':<18} {'cache':<5} {'configs':<8} {'compiled':<9} wall s")
    for x in r:
        print(f"{x['model']:<18} {x['cache']:<5} {str(x['config_cache']):<8} {str(x['compiled']):<9} {x['wall_s']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
