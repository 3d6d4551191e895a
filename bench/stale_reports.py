"""The shipped variants (and the ordering audit) whose H200 evidence report (docs/evidence/<variant>-h200.md) is stale: made before a change
of the variant's sources, the harness's checks or tolerances, or the reference ops (validate/staleness.py: the
report records a hash of those files; a report without one is stale). Prints one variant name per line (what
bench/gpu_evidence.sh regenerates), the reasons on stderr.

    python bench/stale_reports.py            # names of the stale ones
    python bench/stale_reports.py --all      # every shipped variant, stale or not
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from megadecode.backends.fused.kernels.catalog import shipped
    from megadecode.validate.staleness import ORDERING_SOURCES, stale_reason

    subjects = [(v.name, v.manifest.sources) for v in shipped()] + [("ordering-audit", ORDERING_SOURCES)]
    for name, sources in subjects:
        why = stale_reason(sources, ROOT / "docs" / "evidence" / f"{name}-h200.md")
        if why is not None or "--all" in argv:
            print(name)
            print(f"{name}: {why or 'current'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
