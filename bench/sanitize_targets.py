"""Small launches of the shipped Triton kernels, to run under compute-sanitizer (memcheck, initcheck,
synccheck). Exits non-zero if an output is wrong, so a sanitizer run checks behaviour too.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python bench/sanitize_targets.py
"""

from __future__ import annotations

import torch

from megadecode.validate import handoff as H
from megadecode.presets import preset_config
from megadecode.validate.checks import check_op
from megadecode.validate.catalog import get
import megadecode.validate.catalog  # noqa: F401  (registers the variants)


def main() -> int:
    bad = 0
    for name, kind, preset in (("triton-router", "router", "tiny-deepseek-v3"), ("triton-router", "router", "tiny-qwen3-moe"),
                               ("triton-rmsnorm", "rmsnorm", "tiny-qwen3-moe")):
        for batch in (1, 7, 33):
            row = check_op(get(name), preset_config(preset), kind, torch.float32, batch, device="cuda")
            bad += row["status"] == "FAIL"
            print(name, preset, batch, row["status"], row.get("reason") or "")
    W, x, V = torch.randn(256, 256, device="cuda"), torch.randn(4, 256, device="cuda"), torch.randn(256, 256, device="cuda")
    z, err = H.handoff(W, x, V)
    ok = torch.allclose(z, H.handoff_reference(W, x, V), rtol=1e-3, atol=1e-3) and not err.any()
    print("handoff", "PASS" if ok else "FAIL")
    bad += not ok
    torch.cuda.synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
