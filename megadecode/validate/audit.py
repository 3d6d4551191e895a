"""Static memory-ordering audit of a compiled Triton kernel (PTX, and SASS when nvdisasm is present).

Compiles for sm_90 on a machine without a GPU, then checks the rules of SPEC.md:
- nc-load-of-produced: a non-coherent / read-only load (`ld.global.nc`) of a buffer produced during
  the launch. Such loads may be hoisted above the wait that guards them or hit stale lines.
- wait-without-acquire: a read of a flag (the spin-wait) that is neither `.acquire`/`.acq_rel` nor
  followed by a gpu-scope fence in its block.
- signal-without-release: a write/atomic on a flag that is neither `.release`/`.acq_rel` nor
  preceded by a gpu-scope fence in its block.
- store-after-signal: a store to a produced buffer after a flag signal in the same basic block.
- sass-nc-load-of-produced: a SASS `LDG...CONSTANT` (read-only path) whose source line only has
  PTX loads of produced buffers among its candidates (catches ptxas promoting a coherent load).

`audit_spec` compiles any declared kernel spec (contract/kernels.py) and audits it; validate/kernel_audit.py runs
the audits of a variant's declared kernels (cached, in a fresh process when Triton runs interpreted here).

Pointer parameters are named by role: "static" (never written during the launch: weights, step
inputs), "produced" (written during the launch) or "flag" (a produced synchronisation word).
Loads are mapped to parameters by tracing `ld.param` registers through address arithmetic.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field

from ..contract.kernels import ROLES
R_NC, R_ACQ, R_REL, R_ORDER, R_SASS = ("nc-load-of-produced", "wait-without-acquire",
                                       "signal-without-release", "store-after-signal",
                                       "sass-nc-load-of-produced")
RULES = (R_NC, R_ACQ, R_REL, R_ORDER, R_SASS)
_NO_DEST = ("st", "red", "bar", "barrier", "bra", "ret", "exit", "fence", "membar", "prefetch",
            "trap", "call", "cp", "mbarrier", "@")
_GPU_FENCES = ("fence.acq_rel", "fence.sc", "membar.gl", "membar.sys")
_REG = re.compile(r"%[A-Za-z_][\w.]*")
_IMM = re.compile(r"^-?(0[xX][0-9a-fA-F]+|\d+)$")


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str  # "error" | "warn" | "info"
    line: int  # line in the PTX (or SASS listing for the sass rule), 1-based
    text: str
    src: str = ""  # "file.py:LINE" of the Triton source when known
    params: tuple[str, ...] = ()


@dataclass
class AuditReport:
    kernel: str
    target: str
    rules_checked: list[str]
    findings: list[Finding] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # rule -> reason
    nc_loads: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (where, params), PTX
    sass_nc_loads: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)  # (src, params)
    error: str | None = None  # the kernel could not be compiled or audited: a failure, never a pass
    path: dict = field(default_factory=dict)  # the spec's launch specialization (its path constexprs)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def passed(self) -> bool:
        return not self.errors and self.error is None

    @classmethod
    def from_dict(cls, d: dict) -> "AuditReport":
        return cls(d["kernel"], d["target"], list(d["rules_checked"]),
                   [Finding(**{**f, "params": tuple(f["params"])}) for f in d["findings"]], dict(d["skipped"]),
                   [(w, tuple(p)) for w, p in d["nc_loads"]], [(w, tuple(p)) for w, p in d["sass_nc_loads"]],
                   d.get("error"), dict(d.get("path") or {}))

    def by_rule(self, rule: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == rule]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def to_markdown(self) -> str:
        path = f" {self.path}" if self.path else ""
        out = [f"### Audit `{self.kernel}`{path} ({self.target}): {'PASS' if self.passed else 'FAIL'}", "",
               f"Rules checked: {', '.join(self.rules_checked) or 'none'}."]
        if self.error:
            out.append(f"- ERROR: {self.error}")
        for rule, why in self.skipped.items():
            out.append(f"- SKIP {rule}: {why}")
        if self.findings:
            out += ["", "| rule | severity | line | source | params | finding |", "|---|---|---|---|---|---|"]
            for f in self.findings:
                text = f.text.replace("|", "\\|")
                out.append(f"| {f.rule} | {f.severity} | {f.line} | {f.src} | {', '.join(f.params)} | {text} |")
        else:
            out += ["", "No findings."]
        for title, rows in (("Non-coherent loads (PTX)", self.nc_loads),
                            ("Read-only-path loads (SASS)", self.sass_nc_loads)):
            if rows:
                counts = Counter(rows)
                out += ["", f"{title}: " + "; ".join(f"{n}x {w} -> {', '.join(p) or '?'}"
                                                     for (w, p), n in counts.items())]
        return "\n".join(out) + "\n"


@dataclass
class _Ins:
    line: int
    op: str
    mods: tuple[str, ...]
    dests: list[str]
    srcs: list[str]
    addr: str | None
    block: int
    src: str
    param_index: int | None = None
    value: str | None = None  # last operand (atomic value)
    where: str = ""  # src with its inlined-at call sites

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def _parse_ptx(ptx: str):
    files = {int(k): v for k, v in re.findall(r"^\s*\.file\s+(\d+)\s+\"([^\"]+)\"", ptx, re.M)}
    ins: list[_Ins] = []
    entry, block, src, where = "", 0, "", ""
    for no, raw in enumerate(ptx.splitlines(), 1):
        code = raw.split("//")[0].strip()
        if code.startswith(".file"):
            continue
        m = re.match(r"\.loc\s+(\d+)\s+(\d+)", code)
        if m:
            if m.group(2) != "0":
                src = f"{os.path.basename(files.get(int(m.group(1)), '?'))}:{m.group(2)}"
                chain = re.findall(r"@\[\s*([\w.]+:\d+)", raw.partition("//")[2])
                where = src + "".join(f" <- {c}" for c in chain)  # innermost first, then call sites
            continue
        m = re.match(r"(?:\.visible\s+)?\.entry\s+(\w+)", code)
        if m:
            entry = m.group(1)
            continue
        for stmt in code.split(";"):
            stmt = stmt.strip().strip("{}").strip()
            if not stmt or stmt.startswith("."):
                continue
            if stmt.endswith(":"):
                block += 1
                continue
            stmt = re.sub(r"^@!?%?\w+\s+", "", stmt)
            op, _, rest = stmt.partition(" ")
            rest = rest.strip()
            parts = op.split(".")
            if rest.startswith("{"):
                dest_s, _, rest2 = rest[1:].partition("}")
            elif parts[0] in _NO_DEST:
                dest_s, rest2 = "", rest
            else:
                dest_s, _, rest2 = rest.partition(",")
            am = re.search(r"\[([^\]]*)\]", rest2)
            addr_regs = _REG.findall(am.group(1)) if am else []
            pm = re.search(r"_param_(\d+)\]", rest2) if op.startswith("ld.param") else None
            operands = [o.strip() for o in rest2.split(",") if o.strip()]
            ins.append(_Ins(no, op, tuple(parts[1:]), _REG.findall(dest_s), _REG.findall(rest2),
                            addr_regs[0] if addr_regs else None, block, src,
                            int(pm.group(1)) if pm else None, operands[-1] if operands else None, where))
            if parts[0] == "bra":
                block += 1
    return entry, ins


def _provenance(ins: list[_Ins]) -> tuple[dict[str, set[int]], dict[str, str | None]]:
    """Which ld.param slots flow into each register (through arithmetic, not through memory)."""
    prov: dict[str, set[int]] = {}
    const: dict[str, str | None] = {}
    for i in ins:
        for d in i.dests:
            if i.op.startswith("mov") and i.value and _IMM.match(i.value):
                const[d] = i.value if const.get(d, i.value) == i.value else None
            else:
                const[d] = None
    for _ in range(20):
        changed = False
        for i in ins:
            if not i.dests:
                continue
            if i.param_index is not None:
                new = {i.param_index}
            elif i.base in ("ld", "atom", "ldu") or "shared" in i.mods:
                new = set()
            else:
                new = set().union(*(prov.get(s, set()) for s in i.srcs)) if i.srcs else set()
            for d in i.dests:
                cur = prov.setdefault(d, set())
                if not new <= cur:
                    cur |= new
                    changed = True
        if not changed:
            break
    return prov, const


def _is_global(i: _Ins) -> bool:
    return i.base in ("ld", "ldu", "st", "atom", "red") and not (
        {"param", "shared", "local", "const", "tex"} & set(i.mods))


def _narrow_scope(i: _Ins) -> bool:
    return "cta" in i.mods or "cluster" in i.mods


def audit_ptx(ptx: str, params: list[str], roles: dict[str, str], *, kernel: str | None = None,
              target: str = "cuda:90", pointer_params: set[str] | None = None,
              sass: str | None = None, sass_skip_reason: str | None = None) -> AuditReport:
    """Audit PTX text. `params`: the kernel's runtime parameter names in PTX order; `roles`:
    pointer parameter -> "static" | "produced" | "flag"; `sass`: an nvdisasm listing (-c -g)."""
    bad = {p: r for p, r in roles.items() if r not in ROLES}
    if bad:
        raise ValueError(f"unknown roles {bad}; roles are {ROLES}")
    missing = set(roles) - set(params)
    if missing:
        raise ValueError(f"roles name parameters the kernel does not have: {sorted(missing)}")
    pointer_params = set(roles) if pointer_params is None else set(pointer_params)
    entry, ins = _parse_ptx(ptx)
    prov, const = _provenance(ins)
    rep = AuditReport(kernel or entry, target, [R_NC, R_ORDER])
    produced = {p for p, r in roles.items() if r in ("produced", "flag")}
    flags = {p for p, r in roles.items() if r == "flag"}

    def names(i: _Ins) -> tuple[str, ...]:
        idx = prov.get(i.addr, set()) if i.addr else set()
        return tuple(sorted(params[k] for k in idx if k < len(params) and params[k] in pointer_params))

    def add(rule, sev, i, text, ps=()):
        rep.findings.append(Finding(rule, sev, i.line, text, i.where or i.src, tuple(ps)))

    mem = [(n, i, names(i)) for n, i in enumerate(ins) if _is_global(i)]

    def fence_between(a: int, b: int, block: int) -> bool:
        return any(ins[k].block == block and ins[k].op.startswith(_GPU_FENCES) for k in range(a, b))

    # Rule: non-coherent loads of produced buffers.
    for n, i, ps in mem:
        if not (i.base == "ldu" or (i.base == "ld" and "nc" in i.mods)):
            continue
        rep.nc_loads.append((i.where or i.src, ps))
        hit = [p for p in ps if p in produced]
        unknown = [p for p in ps if p not in roles]
        if hit:
            add(R_NC, "error", i, f"`{i.op}` reads {', '.join(hit)}, produced during the launch: "
                f"non-coherent loads are for static data only (may be hoisted above the wait or read stale)", hit)
        elif not ps and produced:
            add(R_NC, "warn", i, f"unattributed non-coherent load `{i.op}`: its base could not be traced "
                f"to a parameter and the kernel has produced buffers")
        elif unknown:
            add(R_NC, "warn", i, f"non-coherent load `{i.op}` of parameter(s) with no declared role", unknown)

    # Rules on flags: every read of a flag acquires; every write releases; no produced store after it.
    def is_read(i: _Ins) -> bool:
        if i.base in ("ld", "ldu"):
            return True
        return i.base == "atom" and bool({"add", "or", "xor"} & set(i.mods)) and (
            i.value is not None and (const.get(i.value) in ("0", "0x0") or i.value in ("0", "0x0")))

    if not flags:
        rep.skipped[R_ACQ] = rep.skipped[R_REL] = "no parameter declared with role 'flag'"
    else:
        rep.rules_checked[1:1] = [R_ACQ, R_REL]
        for n, i, ps in mem:
            fl = [p for p in ps if p in flags]
            if not fl:
                continue
            if is_read(i):
                acq = bool({"acquire", "acq_rel"} & set(i.mods)) and not _narrow_scope(i)
                if not acq:
                    nxt = next((k for k, j, q in mem if k > n and not set(q) & flags), len(ins))
                    acq = fence_between(n + 1, nxt, i.block)
                if not acq:
                    kind = "volatile" if "volatile" in i.mods else ("cta-scope" if _narrow_scope(i) else "relaxed/weak")
                    add(R_ACQ, "error", i, f"wait on {', '.join(fl)} reads it with a {kind} `{i.op}`: no acquire "
                        f"(and no gpu fence before the next data load), so the data it guards may be read stale", fl)
            elif i.base in ("st", "atom", "red"):
                rel = bool({"release", "acq_rel"} & set(i.mods)) and not _narrow_scope(i)
                if not rel:
                    rel = fence_between(max(0, n - 64), n, i.block)
                if not rel:
                    sem = next((s for s in ("relaxed", "acquire", "volatile") if s in i.mods), "no semantics")
                    add(R_REL, "error", i, f"signal on {', '.join(fl)} with `{i.op}` ({sem}): no release and no "
                        f"gpu fence before it, so the data it publishes may become visible after the flag", fl)
    for n, i, ps in mem:
        if not (set(ps) & flags) or is_read(i) or i.base not in ("st", "atom", "red"):
            continue
        for k, j, q in mem:
            hit = [p for p in q if p in produced and p not in flags]
            if k > n and j.block == i.block and j.base in ("st", "atom", "red") and hit:
                add(R_ORDER, "error", j, f"store to {', '.join(hit)} after the signal `{i.op}` on "
                    f"{', '.join(set(ps) & flags)} (ptx line {i.line}): consumers may read it before it lands", hit)

    if sass is not None:
        rep.rules_checked.append(R_SASS)
        _audit_sass(rep, sass, mem, produced)
    else:
        rep.skipped[R_SASS] = sass_skip_reason or "no SASS given"
    return rep


def _audit_sass(rep: AuditReport, sass: str, mem, produced: set[str]) -> None:
    by_src: dict[str, list[tuple[bool, tuple[str, ...]]]] = {}
    for _, i, ps in mem:
        if i.base in ("ld", "ldu") and i.src:
            by_src.setdefault(i.src, []).append(("nc" in i.mods or i.base == "ldu", ps))
    src, seen = "", set()
    for no, line in enumerate(sass.splitlines(), 1):
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            src = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            continue
        m = re.search(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", line)
        if not m:
            continue
        parts = m.group(1).split(".")
        if not (parts[0] in ("LDG", "LD") and ({"CONSTANT", "NC"} & set(parts[1:]))):
            continue
        cands = by_src.get(src, [])
        nc = [ps for is_nc, ps in cands if is_nc]
        pool = nc or [ps for _, ps in cands]
        ps = tuple(sorted({p for q in pool for p in q}))
        rep.sass_nc_loads.append((src, ps))
        if (src, m.group(1)) in seen:
            continue
        seen.add((src, m.group(1)))
        hit = [p for p in ps if p in produced]
        how = "from a PTX non-coherent load" if nc else "promoted by ptxas from a coherent PTX load"
        if hit:
            rep.findings.append(Finding(R_SASS, "error", no, f"`{m.group(1)}` at {src} ({how}) may read "
                                        f"{', '.join(hit)}, produced during the launch (candidates: {', '.join(ps)})",
                                        src, tuple(hit)))
        elif not ps and produced:
            rep.findings.append(Finding(R_SASS, "warn", no, f"`{m.group(1)}` at {src or '?'}: read-only-path "
                                        f"load with no attributable PTX load at that source line", src))


def tool(name: str) -> str | None:
    """Path of an NVIDIA binary shipped with triton (nvdisasm, cuobjdump, ptxas), else on PATH."""
    try:
        import triton
        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    except ImportError:
        pass
    return shutil.which(name)


def disassemble(cubin: bytes) -> tuple[str | None, str]:
    """SASS listing of a cubin with line info: (text, "") or (None, reason)."""
    nvd, cuo = tool("nvdisasm"), tool("cuobjdump")
    if not (nvd or cuo):
        return None, "neither nvdisasm nor cuobjdump found (triton/backends/nvidia/bin or PATH)"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        cmd = [nvd, "-c", "-g", path] if nvd else [cuo, "-sass", path]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{os.path.basename(cmd[0])} failed: {e}"
    if r.returncode != 0:
        return None, f"{os.path.basename(cmd[0])} exit {r.returncode}: {r.stderr.strip()[:200]}"
    return r.stdout, ""


def sass_loops(sass: str) -> list[tuple[int, int, Counter]]:
    """Every loop of a SASS listing closed by a backward branch: (first address, branch address, opcode counts of
    the instructions between them), innermost (fewest instructions) first. For the instruction-mix probes
    (bench/sass_mix.py, bench/mega_sass_mix.py)."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = re.match(r"^(\.L_x_\d+):", line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update({p: addr for p in pending})
            pending = []
            ins.append((addr, m.group(3), m.group(4)))
    out = []
    for addr, op, rest in ins:
        t = re.search(r"\((\.L_x_\d+)\)", rest) if op.startswith("BRA") else None
        if t and labels.get(t.group(1), 1 << 62) < addr:
            lo = labels[t.group(1)]
            out.append((lo, addr, Counter(x[1] for x in ins if lo <= x[0] <= addr)))
    return sorted(out, key=lambda t: sum(t[2].values()))


def audit_spec(spec, *, arch: int = 90, sass: bool = True) -> AuditReport:
    """Compile a declared kernel (any spec of contract/kernels.py: Triton's KernelSpec, or another framework's
    spec with the same interface) for sm_<arch> and audit its PTX, and its SASS when `sass` and nvdisasm exist.
    Must run where the spec can compile (not needs_fresh_process(): see validate/kernel_audit.py)."""
    if hasattr(spec, "check"):
        spec.check()
    c = spec.compile(arch)
    text, why = (None, "SASS not requested")
    if sass:
        text, why = disassemble(c.cubin) if c.cubin else (None, "the compiler gave no cubin")
    return audit_ptx(c.ptx, c.params, spec.roles, kernel=spec.name, target=f"cuda:sm_{arch}",
                     pointer_params=c.pointer_params, sass=text, sass_skip_reason=why)


def roles_from_plan(plan, param_buffers: dict[str, str], flags: tuple[str, ...] = ()) -> dict[str, str]:
    """Roles for kernel parameters bound to plan buffers: written during a step -> "produced",
    otherwise (weights, step inputs) -> "static"; parameters in `flags` -> "flag"."""
    written = plan.written_buffers()
    roles = {p: ("produced" if b in written else "static") for p, b in param_buffers.items()}
    roles.update({f: "flag" for f in flags})
    return roles
