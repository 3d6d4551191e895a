"""The PTX of every CuTe DSL kernel build, hashed, so that a change to the kernels' Python source that should not
change what runs on the GPU (a helper moved between modules, a rename) is shown not to, without a GPU: the
fused backend's MXFP4 experts in each configuration the static audit compiles (cute_experts.audit_specs, fp32
activations) and with bf16 activations, and both megakernel builds (the ring build and the two-CTA build), compiled for sm_90a on the CPU. Identical PTX
assembles to the identical cubin, so the GPU evidence of the parent commit holds for the change.

    python bench/ptx_identity.py --out /tmp/before.json           # on the parent commit (a git worktree)
    python bench/ptx_identity.py --against /tmp/before.json       # on the change: exit 1 if any kernel differs

Comment lines (`//`: the DSL's and ptxas's version banners, file names) are left out of the hash. ~4 minutes on
a 2-core CPU (each megakernel build ~90 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys


def _text(ptx: str) -> str:
    return "\n".join(ln for ln in ptx.splitlines() if not ln.startswith("//"))


def builds():
    """(name, a function compiling it and returning its PTX) for every build hashed."""
    from megadecode.backends.fused.kernels.cute_experts import DEFAULT_TUNE, _build, _scu, audit_specs

    def experts(cfg):
        up, K, R, grouped, split, act, xdt = cfg
        t = DEFAULT_TUNE
        return lambda: _build(up, K, R, 16, t["ntok"] if grouped else 1, split, act, grouped, xdt,
                              _scu(t["scu_grouped"] if grouped else t["scu"], K),
                              t["wpc_grouped"] if grouped else t["wpc"]).__ptx__

    def mega(ring):
        def compile_():
            from megadecode.backends.mega import cute_kernel as K

            return K.compile_ptx_cubin(ring).__ptx__
        return compile_

    cfgs = [spec.cfg for spec in audit_specs()]  # fp32 activations; and bf16's, which run without the split plane
    cfgs += [(*c[:5], c[5], "bf16") for c in cfgs if not c[4]]
    out = [(f"cute_experts {json.dumps(c)}", experts(c)) for c in cfgs]
    return out + [("megakernel ring", mega(True)), ("megakernel two_cta", mega(False))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write {build: sha256 of its PTX} here")
    ap.add_argument("--against", help="an earlier --out: exit 1 naming each build whose PTX differs")
    args = ap.parse_args(argv)
    if not (args.out or args.against):
        ap.error("give --out, --against or both")
    hashes = {}
    for name, compile_ in builds():
        hashes[name] = hashlib.sha256(_text(compile_()).encode()).hexdigest()
        print(f"{hashes[name][:16]}  {name}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        differ = sorted(n for n in hashes.keys() | before.keys() if hashes.get(n) != before.get(n))
        for n in differ:
            print(f"differs: {n}", file=sys.stderr)
        print(f"{len(hashes) - len(differ)} of {len(hashes)} builds have the PTX of {args.against}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
