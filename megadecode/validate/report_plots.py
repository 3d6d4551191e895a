"""The evidence report's error plots: one panel pair per dtype (max and mean row-relative error of every cell
that ran), each cell's error as a dot and its derived tolerance (validate/tolerances.py) as the line it must stay
under, cells sorted by tolerance. PNG data URIs; None without matplotlib (the report then says so)."""

from __future__ import annotations

import base64
import io

PAIRS = (("max_rel_err", "tol_max_rel", "max row-relative error"),
         ("mean_rel_err", "tol_mean_rel", "mean row-relative error"))
FLOOR = 1e-12  # log scale: exact results are drawn here


def error_plots(rows: list[dict]) -> dict[str, str]:
    """{dtype: PNG data URI} for every dtype with numeric errors."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    out = {}
    for dtype in sorted({r.get("dtype") for r in rows if r.get("dtype")}):
        cells = [r for r in rows if r.get("dtype") == dtype and r.get("status") in ("PASS", "FAIL")
                 and all(isinstance(r.get(k), (int, float)) for k, _, _ in PAIRS)]
        if not cells:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.0), squeeze=False)
        for ax, (err, tol, title) in zip(axes[0], PAIRS):
            with_tol = [r for r in cells if isinstance(r.get(tol), (int, float))]
            with_tol.sort(key=lambda r: r[tol])
            xs = range(len(with_tol))
            ax.plot(xs, [max(r[tol], FLOOR) for r in with_tol], color="#c0392b", lw=1.2, label="tolerance")
            for status, color in (("PASS", "#3b6ea5"), ("FAIL", "#e67e22")):
                pts = [(i, max(r[err], FLOOR)) for i, r in enumerate(with_tol) if r["status"] == status]
                if pts:
                    ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=6, color=color, label=status)
            ax.set_yscale("log")
            ax.set_title(f"{dtype}: {title} ({len(with_tol)} cells)", fontsize=9)
            ax.set_xlabel("cells, by tolerance")
            ax.legend(fontsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        plt.close(fig)
        out[dtype] = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return out
