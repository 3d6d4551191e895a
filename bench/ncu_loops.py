"""Where a kernel's warps stall, loop by loop: Nsight Compute's per-SASS-line source page (CSV, as
`bench/gpu_evidence.sh ncu` writes it) grouped by the innermost loop holding each line (a loop is the span from a
backward branch's target to the branch), with each group's share of the stall samples, executed instructions, its
load / FMA mix, spill lines and top stall reasons. No GPU needed.

    python bench/ncu_loops.py evidence/mega-k3-mini-b1-sass.csv [--top 20] [--json out.json]
    python bench/ncu_loops.py --details evidence/mega-k3-mini-b1-details.csv   # the details page's metrics, one a line
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from collections import Counter

BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-fA-F]+)")


def read_sass_csv(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and the instruction rows (those whose first field is an address) of a source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next((r for r in rows if r and r[0] == "Address"), None)
    if header is None:
        raise SystemExit(f"{path}: no 'Address' header row: not an `ncu --page source --csv` export")
    data = [r for r in rows if len(r) == len(header) and r[0].startswith("0x")]
    if not data:
        raise SystemExit(f"{path}: no instruction rows")
    return header, data


def opcode(text: str) -> str:
    parts = text.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0].split(".")[0] if parts else ""


def group_by_loop(header: list[str], data: list[list[str]]) -> list[dict]:
    """One entry per innermost loop (and one for the lines outside every loop), most samples first."""
    ix = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    addr = [int(r[0], 16) for r in data]
    base = addr[0]
    loops = []
    for r, a in zip(data, addr):
        m = BRANCH.search(r[ix["Source"]])
        if m and int(m.group(1), 16) < a:
            loops.append((int(m.group(1), 16), a))
    loops.sort(key=lambda t: t[1] - t[0])

    def num(r, h):
        v = r[ix[h]].replace(",", "") if h in ix else ""
        return int(float(v)) if v not in ("", "-") else 0

    groups: dict = {}
    for r, a in zip(data, addr):
        key = next(((lo, hi) for lo, hi in loops if lo <= a <= hi), None)
        g = groups.setdefault(key, {"samples": 0, "executed": 0, "lines": 0, "mix": Counter(), "local": 0,
                                    "stalls": Counter()})
        g["samples"] += num(r, "# Samples")
        g["executed"] += num(r, "Instructions Executed")
        g["lines"] += 1
        g["mix"][opcode(r[ix["Source"]])] += 1
        g["local"] += r[ix["Address Space"]] == "Local" if "Address Space" in ix else 0
        for h in stalls:
            g["stalls"][h[len("stall_"):]] += num(r, h)
    total = sum(g["samples"] for g in groups.values()) or 1
    out = []
    for key, g in groups.items():
        out.append({
            "loop": "outside loops" if key is None else f"+{key[0] - base:x}..+{key[1] - base:x}",
            "lines": g["lines"], "share": g["samples"] / total, "executed": g["executed"],
            "LDG": g["mix"]["LDG"], "LDS": g["mix"]["LDS"], "FFMA": g["mix"]["FFMA"], "HADD2": g["mix"]["HADD2"],
            "SHFL": g["mix"]["SHFL"], "BAR": g["mix"]["BAR"], "spill_lines": g["local"],
            "stalls": {k: v / max(g["samples"], 1) for k, v in g["stalls"].most_common(3)},
        })
    return sorted(out, key=lambda e: -e["share"])


def details(path: str) -> list[tuple[str, str, str, str]]:
    """(section, metric, value, unit) of an `ncu --page details --csv` export, without its long per-row kernel name."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "Metric Name" not in rows[0]:
        raise SystemExit(f"{path}: no 'Metric Name' column: not an `ncu --page details --csv` export")
    return [(r["Section Name"], r["Metric Name"], r["Metric Value"], r["Metric Unit"]) for r in rows if r["Metric Name"]]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--details", action="store_true", help="the file is the details page: print its metrics")
    a = ap.parse_args(argv)
    if a.details:
        for section, metric, value, unit in details(a.csv):
            print(f"{section[:30]:30s} {metric[:48]:48s} {value:>16s} {unit}")
        return
    header, data = read_sass_csv(a.csv)
    groups = group_by_loop(header, data)
    print(f"{'loop':20s} {'lines':>5s} {'samples':>7s} {'executed':>9s}  LDG LDS FFMA HADD2 SHFL BAR spill  top stalls")
    for g in groups[:a.top]:
        st = ", ".join(f"{k} {100 * v:.0f}%" for k, v in g["stalls"].items())
        print(f"{g['loop']:20s} {g['lines']:5d} {100 * g['share']:6.1f}% {g['executed']:9.3g}  {g['LDG']:3d} {g['LDS']:3d} "
              f"{g['FFMA']:4d} {g['HADD2']:5d} {g['SHFL']:4d} {g['BAR']:3d} {g['spill_lines']:5d}  {st}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(groups, f, indent=1)


if __name__ == "__main__":
    main()
