"""Static instruction mix of the megakernel's hot loops, compiled for sm_90a on any machine (no GPU): the kernel is
built with one opcode body at a time (the others left out of the dispatch), so every loop in its SASS belongs to
that opcode; the report lists each backward-branch loop with its instruction count and mix.

How to read it: the H200 issues ~1.05e12 warp-instructions/s (132 SMs x 4 schedulers x ~1.98 GHz; the spec, not
measured) and streams ~2.3e12 bf16 weights/s at the measured 4.57 TB/s (9.1e12 MXFP4 weights/s), so a loop that
keeps up with HBM may spend ~0.46 warp-instructions per bf16 weight (~0.11 per MXFP4 weight), summed over the
tokens it multiplies each weight with. `--op MATVEC` etc.; default: MATVEC, GLU, EXPERT_UP, EXPERT_DOWN.

    python bench/mega_sass_mix.py [--op MATVEC] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from megadecode.validate.audit import sass_loops

DEFAULT_OPS = ("MATVEC", "GLU", "EXPERT_UP", "EXPERT_DOWN")


def sass_of(op: str) -> str:
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.runtime import assemble
    from megadecode.validate.audit import disassemble

    bodies = K.BODIES
    K.BODIES = tuple(b for b in bodies if b[0] == op)
    if not K.BODIES:
        raise SystemExit(f"unknown opcode {op!r}; opcodes: {', '.join(b[0] for b in bodies)}")
    # compile_for is cached: without clearing, every op after the first got the first op's kernel, and a later
    # compile in the same process would get this one-opcode kernel
    K.compile_for.cache_clear()
    try:
        cubin, _ = assemble(K.compile_for().__ptx__)
    finally:
        K.BODIES = bodies
        K.compile_for.cache_clear()
    text, why = disassemble(cubin)
    if text is None:
        raise SystemExit(why)
    return text


def loops(sass: str) -> list[dict]:
    """Every loop closed by a backward branch: its span, instruction count and opcode mix (innermost first)."""
    return [{"start": hex(lo), "end": hex(hi), "instructions": sum(mix.values()), "mix": dict(mix)}
            for lo, hi, mix in sass_loops(sass)]


def summary(mix: dict) -> str:
    def n(*prefixes):
        return sum(v for k, v in mix.items() if k.startswith(prefixes))
    return (f"LDG {n('LDG')} (128-bit {mix.get('LDG.E.128', 0)}), LDS {n('LDS')}, FFMA {n('FFMA')}, FMUL {n('FMUL')}, "
            f"FADD {n('FADD')}, int/logic {n('IADD', 'IMAD', 'LOP3', 'SHF', 'LEA', 'PRMT', 'SEL', 'VIADD')}, "
            f"SHFL {n('SHFL')}, BRA {n('BRA')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", action="append", help="an opcode (repeatable); default: " + ", ".join(DEFAULT_OPS))
    ap.add_argument("--json", help="write every loop of every opcode here")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one opcode, its loops as JSON on stdout
    args = ap.parse_args()
    if args.one:  # CuTe DSL reuses a traced kernel within a process: one opcode per process
        print(json.dumps(loops(sass_of(args.one))))
        return 0
    res = {}
    for op in args.op or DEFAULT_OPS:
        r = subprocess.run([sys.executable, __file__, "--one", op], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"{op}: {r.stderr.strip()[-500:]}")
        res[op] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"## {op}: {len(res[op])} loops (largest 6 with a 128-bit global load)")
        for d in [d for d in res[op] if d["mix"].get("LDG.E.128")][-6:]:
            print(f"  {d['start']}-{d['end']}: {d['instructions']} instructions; {summary(d['mix'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
