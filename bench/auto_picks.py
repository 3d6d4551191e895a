"""The measured table `--executor auto` picks from (megadecode/backends/picks/<gpu>.json), made from the benchmark
results in bench/results: for each model family measured at full size (FAMILY_PRESETS) and each batch size, the
executors fastest first by their latest step time at context 1024 (each executor's row from the newest commit
that measured it at that batch: git's commit order of the files' `git_sha`), with where each figure comes from.
A test recomputes the committed table from the files.

    python bench/auto_picks.py            # writes megadecode/backends/picks/nvidia-h200.json
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "megadecode" / "backends" / "picks" / "nvidia-h200.json"
FAMILY_PRESETS = {"qwen3_moe": "qwen3-30b-a3b", "kimi_k3": "k3-mini"}  # full-size presets measured on the H200
CONTEXT = 1024


def _depth(sha: str) -> int:
    """How deep in main's history a commit is (a newer commit is deeper); -1 for one not in it."""
    r = subprocess.run(["git", "rev-list", "--count", sha], cwd=ROOT, capture_output=True, text=True)
    return int(r.stdout) if r.returncode == 0 else -1


def rows(results: Path = ROOT / "bench" / "results") -> list[dict]:
    out = []
    for f in sorted(results.glob("*-nvidia-h200*.json")):
        try:
            d = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(d, dict) or not isinstance(d.get("rows"), list) or "nvidia-h200-ep" in f.name \
                or "-ep" in f.name:
            continue
        sha = str(d.get("git_sha") or "")[:7]
        for r in d["rows"]:
            if isinstance(r, dict) and "ms_per_step" in r and r.get("context") == CONTEXT:
                out.append({**r, "file": f.name, "git_sha": sha})
    return out


def table(all_rows: list[dict]) -> dict:
    depth = {s: _depth(s) for s in {r["git_sha"] for r in all_rows}}
    fams = {}
    for fam, preset in FAMILY_PRESETS.items():
        latest: dict[tuple[int, str], dict] = {}
        for r in all_rows:
            if r["preset"] != preset or depth[r["git_sha"]] < 0:
                continue
            k = (r["batch"], r["executor"])
            if k not in latest or depth[r["git_sha"]] > depth[latest[k]["git_sha"]]:
                latest[k] = r
        by_batch = {}
        for b in sorted({b for b, _ in latest}):
            cands = sorted((r for (bb, _), r in latest.items() if bb == b), key=lambda r: r["ms_per_step"])
            by_batch[str(b)] = [{"executor": r["executor"], "ms": round(r["ms_per_step"], 3),
                                 "from": f"bench/results/{r['file']} at {r['git_sha']}"} for r in cands]
        fams[fam] = {"preset": preset, "batches": by_batch}
    return {"gpu": "NVIDIA H200", "command": "python bench/auto_picks.py", "context": CONTEXT,
            "rule": "per batch, executors fastest first by each one's latest measured step (ms) at context 1024",
            "families": fams}


def main() -> None:
    t = table(rows())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(t, indent=1) + "\n")
    for fam, d in t["families"].items():
        print(fam, {b: [c["executor"] for c in cs] for b, cs in d["batches"].items()}, file=sys.stderr)


if __name__ == "__main__":
    main()
