"""Whether an A/B result lets a variant land: every pyvm check of the variant passed, its launch median is at least
--faster percent under the baseline's at each of --batches, and no worse than --slack percent over it at each of
--hold. Exit 0 when it does, 1 when it does not (the reasons printed), 2 on a file without the rows asked for. A
device call can then measure and land in one go, while the machine is warm:

    python bench/mega_body_ab.py --variants shipped,capped+group_wna ... --out $OUT/ab.json
    python bench/ab_gate.py $OUT/ab.json --variant capped+group_wna --faster 2 --batches 64,17 --hold 8 \\
        && git apply docs/history/mega-cap-wna-landing.patch && bash bench/gpu_evidence.sh tests -m gpu

Reads the JSON of bench/mega_sync_ab.run_ab (mega_body_ab.py, mega_sync_ab.py): "checks" and "runs".
"""

from __future__ import annotations

import argparse
import json
import sys


def verdict(doc: dict, variant: str, against: str, faster: float, batches: list[int], slack: float,
            hold: list[int], preset: str | None = None) -> tuple[bool, list[str]]:
    """(lands, lines): the gate's answer and a line a reason, or ValueError when a batch asked for has no row
    timing both variants."""
    lines, ok = [], True
    checks = [c for c in doc.get("checks", []) if c.get("variant") == variant]
    if not checks:
        ok = False
        lines.append(f"{variant}: no pyvm check recorded")
    for c in checks:
        if c.get("failures"):
            ok = False
            lines.append(f"{variant}: check at batch {c.get('batch')} failed: {c['failures']}")
    rows = {}
    for r in doc.get("runs", []):
        med = r.get("median_us", {})
        if variant in med and against in med and (preset is None or r.get("preset") == preset):
            rows[int(r["batch"])] = (med[variant], med[against])
    for b, limit, what in [(b, 1 - faster / 100, f"at least {faster}% faster") for b in batches] + \
            [(b, 1 + slack / 100, f"within {slack}%") for b in hold]:
        if b not in rows:
            raise ValueError(f"no run at batch {b} times both {variant} and {against}")
        v, a = rows[b]
        good = v <= a * limit
        ok &= good
        lines.append(f"batch {b}: {variant} {v:.0f} us, {against} {a:.0f} us ({v / a - 1:+.1%}): "
                     f"{'ok' if good else 'NOT'} {what}")
    return ok, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="an A/B JSON (bench/mega_sync_ab.run_ab's)")
    ap.add_argument("--variant", required=True)
    ap.add_argument("--against", default="shipped")
    ap.add_argument("--faster", type=float, default=1.0, help="percent under the baseline at each of --batches")
    ap.add_argument("--batches", default="", help="comma-separated batches the variant must be faster at")
    ap.add_argument("--slack", type=float, default=0.5, help="percent over the baseline allowed at each of --hold")
    ap.add_argument("--hold", default="", help="comma-separated batches the variant must be no slower at")
    ap.add_argument("--preset", help="only the runs of this preset")
    args = ap.parse_args(argv)

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    with open(args.result) as f:
        doc = json.load(f)
    try:
        ok, lines = verdict(doc, args.variant, args.against, args.faster, ints(args.batches), args.slack,
                            ints(args.hold), args.preset)
    except ValueError as e:
        print(f"ab_gate: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"{args.variant}: {'lands' if ok else 'does not land'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
