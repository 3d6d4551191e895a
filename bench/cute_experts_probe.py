"""Check and time the CuTe DSL MXFP4 routed experts (backends/fused/kernels/cute_experts.py) against the Triton paths, on the GPU,
at K3's shape (a development probe: the committed figures come from `megadecode bench --preset k3-moe`).

Checks (every batch, fresh random inputs): the output poisoned with NaN before the run and fully written, finite,
within the stated tolerance of the exact fp32 reference (reference/latent_moe.latent_experts), two runs bitwise
equal; per pair and grouped; a skipped pair (-1). Times: bench_moe's method (rotating id sets in one CUDA graph,
do_bench, floor = the distinct experts' bytes / HBM_READ_BPS).

    python bench/cute_experts_probe.py --out probe.json
"""

import argparse
import json
import statistics
import time

import torch

from megadecode.bench_moe import ROTATIONS, expert_inputs
from megadecode.backends.fused.kernels import cute_experts as ce
from megadecode.backends.fused.kernels.grouped_experts import routed_experts
from megadecode.measure import HBM_READ_BPS, SHAPES, expert_weights, graph_replay_ms
from megadecode.quant.mxfp4_frag import relayout_experts
from megadecode.reference.latent_moe import latent_experts

TUNES = [(True, {}), (False, {}), (False, {"wpc": 8}), (False, {"scu": 2}), (False, {"ntok": 4, "wpc_grouped": 4}),
         (False, {"stages": ("up",)}), (False, {"stages": ("down",)})]
TOL = {True: 1e-5, False: 4e-3}  # max |out - ref| / max |ref| with and without the remainder plane (fp32 x)


def check(gu, dn, guf, dnf, shape, T, grouped, split, gen, skip=False, tune=None):
    D, A, E = shape["D"], shape["A"], shape["E"]
    ids = torch.argsort(torch.rand(T, E, device="cuda", generator=gen), dim=1)[:, :A].contiguous()
    if skip:
        ids[0, 1] = -1
    x = torch.randn(T, D, device="cuda", generator=gen)
    w = torch.rand(T, A, device="cuda", generator=gen) + 0.1
    ref = latent_experts(x, ids, w, gu, dn, shape["act"])
    outs = []
    for _ in range(2):
        o = torch.full((T, D), float("nan"), device="cuda")
        ce.cute_experts(x, ids, w, guf, dnf, act=shape["act"], out=o, grouped=grouped, split=split, tune=tune)
        torch.cuda.synchronize()
        outs.append(o)
    err = float((outs[0] - ref).abs().max()) / float(ref.abs().max())
    ok = bool(torch.isfinite(outs[0]).all()) and err <= TOL[split] and torch.equal(outs[0], outs[1])
    return {"T": T, "grouped": grouped, "split": split, "skip": skip, "tune": tune, "rel_err": err, "finite":
            bool(torch.isfinite(outs[0]).all()), "repeat_equal": torch.equal(outs[0], outs[1]), "ok": ok}


def timed(fn, sets):
    outs = [torch.empty(x.shape, dtype=x.dtype, device="cuda") for x, _, _ in sets]
    return graph_replay_ms(lambda: [fn(x, ids, w, o) for (x, ids, w), o in zip(sets, outs)], ROTATIONS)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cute-experts-probe.json")
    ap.add_argument("--batch", default="1,8,64,256")
    ap.add_argument("--checks", default="1,3,16,17,64")
    args = ap.parse_args()
    shape = SHAPES["k3"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    gu, dn, per_expert = expert_weights(shape, "mxfp4", gen)
    t0 = time.time()
    guf, dnf = relayout_experts(gu), relayout_experts(dn)
    torch.cuda.synchronize()
    relayout_s = time.time() - t0
    res = {"gpu": torch.cuda.get_device_name(), "relayout_s": relayout_s, "checks": [], "times": []}
    for T in [int(t) for t in args.checks.split(",")]:
        for grouped in (False, True):
            for split in (True, False):
                for tune in ({},):
                    r = check(gu, dn, guf, dnf, shape, T, grouped, split, gen, skip=(T == 3), tune=tune)
                    res["checks"].append(r)
                    print(r, flush=True)
    for T in [int(t) for t in args.batch.split(",")]:
        sets = expert_inputs(shape, "mxfp4", T, gen)
        floor = statistics.mean(int(ids.unique().numel()) for _, ids, _ in sets) * per_expert / HBM_READ_BPS * 1e3
        variants = {"triton": lambda x, ids, w, o: routed_experts(x, ids, w, gu, dn, act="situ", out=o)}
        for split, tune in TUNES:
            name = f"cute s={int(split)} " + ",".join(f"{k}={v}" for k, v in tune.items())
            tn = {k: v for k, v in tune.items() if k != "stages"}
            st = tune.get("stages", ("up", "down", "combine"))
            variants[name] = (lambda x, ids, w, o, s=split, tn=tn, st=st: ce.cute_experts(
                x, ids, w, guf, dnf, act="situ", out=o, split=s, tune=tn, stages=st))
        for name, fn in variants.items():
            try:
                ms = timed(fn, sets)
                row = {"T": T, "path": name, "ms": ms, "floor_ms": floor, "mbu": floor / ms}
            except Exception as e:  # noqa: BLE001 - a probe reports and goes on
                row = {"T": T, "path": name, "error": f"{type(e).__name__}: {e}"[:300]}
            res["times"].append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nrelayout {relayout_s:.1f} s; checks ok {sum(c['ok'] for c in res['checks'])}/{len(res['checks'])}")
    print(f"{'T':>4} {'path':<44} {'ms':>8} {'MBU':>6}")
    for r in res["times"]:
        print(f"{r['T']:>4} {r['path']:<44} {r.get('ms', float('nan')):8.4f} {r.get('mbu', float('nan')):6.3f}")
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
