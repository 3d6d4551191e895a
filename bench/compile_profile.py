"""Where the megakernel's compile time goes, on any machine (no GPU): `compile_for()` whole, then once with each
opcode body left out (a fresh process each, so nothing is cached between them). Prints seconds per run; a body's
share is roughly the whole minus its line (runs spread ~5 s on a 2-core CPU).

    python bench/compile_profile.py [--bodies MATVEC,GLU] [--out compile-profile.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

ONE = r"""
import sys, time
import megadecode.backends.mega.cute_kernel as K
if sys.argv[1] != "-":
    K.BODIES = tuple(b for b in K.BODIES if b[0] != sys.argv[1])
t = time.perf_counter()
K.compile_for()
print(time.perf_counter() - t)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bodies", help="comma-separated opcodes to leave out in turn (default: every body)")
    ap.add_argument("--out", help="also write the seconds as JSON here")
    args = ap.parse_args(argv)
    from megadecode.backends.mega.cute_kernel import BODIES

    names = args.bodies.split(",") if args.bodies else [name for name, _ in BODIES]
    unknown = set(names) - {name for name, _ in BODIES}
    if unknown:
        ap.error(f"no body {sorted(unknown)}: one of {[name for name, _ in BODIES]}")
    out = {}
    for name in ["-", *names]:
        r = subprocess.run([sys.executable, "-c", ONE, name], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            return 1
        out["whole" if name == "-" else f"without {name}"] = float(r.stdout.split()[-1])
        print(f"{'whole' if name == '-' else 'without ' + name:<24} {out[list(out)[-1]]:7.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
