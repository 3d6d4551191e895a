"""Expert parallelism on the GPUs: greedy tokens of `megadecode generate --ep N` against one process, per preset and
executor (issue 17, item 3 on NCCL; tests/test_ep.py checks the same on the CPU with gloo).

    python bench/ep_tokens.py --ep 2 --out ep-tokens.json        # exit status 1 when any tokens differ

Each run is the CLI itself (`python -m megadecode generate ... --json`), fp32 weights and cache on CUDA, so the
combine's fp32 partial sums are compared at the precision the CPU test holds them to. A differing run prints the
index at which each sequence first parts. Greedy equality is the claim; logprobs are not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

PROMPTS = ["256,72,101,108,108,111", "256,7,9"]
STACK_LINES = 200  # of a hung run's stderr, kept in its row: the stacks of every rank


def generate(model: str, executor: str, ep: int, tokens: int, timeout_s: float = 120.0) -> dict:
    cmd = [sys.executable, "-m", "megadecode", "generate", "--model", model, "--executor", executor, "--device",
           "cuda", "--greedy", "--max-new-tokens", str(tokens), "--json"]
    for p in PROMPTS:
        cmd += ["--token-ids", p]
    if ep > 1:
        cmd += ["--ep", str(ep)]
    # its own process group: on a hang the launcher's ranks (its children, holding the GPUs) are stopped with it
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:  # a hang is a finding (its row says so), not the end of the check
        # first every process's Python stacks (the CLI prints them on SIGUSR1, cli.main): where each rank waits
        os.killpg(p.pid, signal.SIGUSR1)
        time.sleep(2.0)
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        return {"error": f"did not finish in {timeout_s:.0f} s", "hung": True,
                "stderr_tail": err.splitlines()[-STACK_LINES:]}
    if p.returncode != 0:
        return {"error": (err.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--presets", default="tiny-qwen3-moe,tiny-deepseek-v3,tiny-k3")
    ap.add_argument("--executors", default="graph,fused")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per generate run (tiny presets: ~10-20)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, ok, hung = [], True, None
    for preset in args.presets.split(","):
        for ex in args.executors.split(","):
            if hung:  # one hang is enough to report; the rest would each wait out the limit too
                rows.append({"preset": preset, "executor": ex, "ep": args.ep, "equal": False,
                             "error": f"not run: {hung} hung", "first_difference": None, "tokens": None})
                print(f"{preset:18s} {ex:6s} ep={args.ep}: not run ({hung} hung)")
                continue
            one = generate(preset, ex, 1, args.tokens, args.timeout)
            many = generate(preset, ex, args.ep, args.tokens, args.timeout)
            if one.get("hung") or many.get("hung"):
                hung = f"{preset} {ex}"
            err = one.get("error") or many.get("error")
            same = err is None and one["token_ids"] == many["token_ids"]
            ok &= same
            first = None
            if err is None and not same:
                first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                         for x, y in zip(one["token_ids"], many["token_ids"])]
            rows.append({"preset": preset, "executor": ex, "ep": args.ep, "equal": same, "error": err,
                         "first_difference": first, "tokens": None if err else one["token_ids"],
                         "stderr_tail": one.get("stderr_tail") or many.get("stderr_tail")})
            if rows[-1]["stderr_tail"]:
                print("\n".join(rows[-1]["stderr_tail"][-60:]), file=sys.stderr)
            print(f"{preset:18s} {ex:6s} ep={args.ep}: " + (f"error: {err}" if err else
                  "greedy tokens equal" if same else f"DIFFER (first at {first})"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python", "bench/ep_tokens.py", *sys.argv[1:]]), "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
