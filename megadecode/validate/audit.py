"""Static memory-ordering audit of a compiled Triton kernel (PTX, and SASS when nvdisasm is present).

Compiles for sm_90 on a machine without a GPU, then checks the rules of SPEC.md:
- nc-load-of-produced: a non-coherent / read-only load (`ld.global.nc`) of a buffer produced during
  the launch. Such loads may be hoisted above the wait that guards them or hit stale lines.
- wait-without-acquire: a read of a flag (the spin-wait) that is neither `.acquire`/`.acq_rel` nor
  followed by a gpu-scope fence in its block.
- signal-without-release: a write/atomic on a flag that is neither `.release`/`.acq_rel` nor
  preceded by a gpu-scope fence in its block.
- store-after-signal: a store to a produced buffer after a flag signal in the same basic block.
- signal-before-barrier (opt-in, `cta_signals`): a signal reached, on some path of the control-flow graph, from
  a store to produced data with no block barrier in between: one thread signals for its whole CTA, so the other
  threads' stores must be ordered before it by a barrier.
- timeout-unreported (opt-in, `reports`): a spin loop on a flag whose exits reach no store to an error buffer
  before a barrier: a wait that gives up would let the launch go on silently with unsynchronised data.
- produced-read-uncovered (opt-in, `read_coverage`): a coherent load of produced data that some path reaches
  without a wait on a flag first (in the thread, or in the CTA before a block barrier), from the kernel entry or
  from the previous iteration of a loop that waits.
- sass-nc-load-of-produced: a SASS `LDG...CONSTANT` (read-only path) whose source line only has
  PTX loads of produced buffers among its candidates (catches ptxas promoting a coherent load).

`audit_spec` compiles any declared kernel spec (contract/kernels.py) and audits it; validate/kernel_audit.py runs
the audits of a variant's declared kernels (cached, in a fresh process when Triton runs interpreted here).

Pointer parameters are named by role: "static" (never written during the launch: weights, step
inputs), "produced" (written during the launch) or "flag" (a produced synchronisation word).
Loads are mapped to parameters by tracing `ld.param` registers through address arithmetic. A kernel that reaches
tensors through address tables (a parameter holding device addresses) names what each table's entries point to
(`pointees`): a 64-bit load from table P gives its value the pseudo-parameter "P[]", traced like a parameter and
with P's pointee role, so a load through it is attributed to the table it came from. With `pointees` given, every
non-coherent load must be proven to read static data only.
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
R_BAR, R_TIMEOUT, R_UNCOV = "signal-before-barrier", "timeout-unreported", "produced-read-uncovered"
RULES = (R_NC, R_ACQ, R_REL, R_ORDER, R_BAR, R_TIMEOUT, R_UNCOV, R_SASS)
_NO_DEST = ("st", "red", "bar", "barrier", "bra", "ret", "exit", "fence", "membar", "prefetch",
            "trap", "call", "cp", "mbarrier", "@")
_GPU_FENCES = ("fence.acq_rel", "fence.sc", "membar.gl", "membar.sys")
_REG = re.compile(r"%[A-Za-z_][\w.]*")
_IMM = re.compile(r"^-?(0[xX][0-9a-fA-F]+|\d+)$")
_WORDS64 = ("u64", "b64", "s64")


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
    checked: dict[str, str] = field(default_factory=dict)  # rule -> what it looked at ("3 signals")

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
                   d.get("error"), dict(d.get("path") or {}), dict(d.get("checked") or {}))

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
        for rule in self.rules_checked:
            if rule in self.checked:
                out.append(f"- {rule}: {self.checked[rule]}")
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
    value: str | None = None  # last operand (atomic value, branch target)
    where: str = ""  # src with its inlined-at call sites
    guarded: bool = False  # under a predicate (`@%p ...`): some threads, or some passes, skip it

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def _parse_ptx(ptx: str):
    """(entry name, instructions, label -> index of the instruction it precedes)."""
    files = {int(k): v for k, v in re.findall(r"^\s*\.file\s+(\d+)\s+\"([^\"]+)\"", ptx, re.M)}
    ins: list[_Ins] = []
    labels: dict[str, int] = {}
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
                labels[stmt[:-1].strip()] = len(ins)
                continue
            guard = re.match(r"^@!?%?\w+\s+", stmt)
            stmt = stmt[guard.end():] if guard else stmt
            op, _, rest = stmt.partition(" ")
            rest = rest.strip()
            parts = op.split(".")
            if rest.startswith("{"):
                dest_s, _, rest2 = rest[1:].partition("}")
            elif parts[0] in _NO_DEST:
                dest_s, rest2 = "", rest
            else:
                dest_s, _, rest2 = rest.partition(",")
            brackets = re.findall(r"\[([^\]]*)\]", rest2)
            if _copies_to_shared(parts) and len(brackets) > 1:
                brackets = brackets[1:]  # a copy into shared memory ([dst], [src]): its global source is traced
            addr_regs = _REG.findall(brackets[0]) if brackets else []
            pm = re.search(r"_param_(\d+)\]", rest2) if op.startswith("ld.param") else None
            operands = [o.strip() for o in rest2.split(",") if o.strip()]
            ins.append(_Ins(no, op, tuple(parts[1:]), _REG.findall(dest_s), _REG.findall(rest2),
                            addr_regs[0] if addr_regs else None, block, src,
                            int(pm.group(1)) if pm else None, operands[-1] if operands else None, where,
                            guard is not None))
            if parts[0] == "bra":
                block += 1
    return entry, ins, labels


def _is_pointer_load(i: _Ins) -> bool:
    """A 64-bit global load: what reads a device address out of an address table."""
    return i.base in ("ld", "ldu") and _is_global(i) and bool(set(i.mods) & set(_WORDS64))


def _provenance(ins: list[_Ins], tables: dict[int, int] | None = None
                ) -> tuple[dict[str, set[int]], dict[str, str | None]]:
    """Which ld.param slots flow into each register (through arithmetic, not through memory). `tables`: address
    table slot -> the pseudo slot of what its entries point to; a 64-bit load whose address derives from a table
    gives its value that pseudo slot (a 32-bit load, an index, gives none)."""
    tables = tables or {}
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
            elif tables and _is_pointer_load(i):
                new = {tables[k] for k in prov.get(i.addr, ()) if k in tables}
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


def _copies_to_shared(parts) -> bool:
    """An asynchronous copy from global into shared memory (`cp.async[.bulk]...shared....global...`)."""
    return parts[0] == "cp" and "async" in parts and "global" in parts and any(p.startswith("shared") for p in parts)


def _is_copy_read(i: _Ins) -> bool:
    """A copy-engine read of global memory (the async proxy, which no acquire of the generic proxy orders): held to
    the non-coherent loads' rule, static data only. Both bulk forms: `cp.async.bulk.prefetch.L2.global [src]` and
    `cp.async.bulk.shared::cluster.global... [dst], [src], ...`, whose traced address is the global source
    (_parse_ptx)."""
    if i.base != "cp" or "bulk" not in i.mods or "global" not in i.mods:
        return False
    return "prefetch" in i.mods or _copies_to_shared((i.base,) + tuple(i.mods))


def _is_copy_load(i: _Ins) -> bool:
    """A non-bulk `cp.async.{ca,cg}.shared.global [dst], [src], n`: a read of global memory by the generic proxy
    (through L1 or L2 like a plain ld.global, into shared memory), so a coherent load for the rules: of produced
    data, it must come after a wait (produced-read-uncovered). Its traced address is the global source."""
    return i.base == "cp" and "bulk" not in i.mods and _copies_to_shared((i.base,) + tuple(i.mods))


def _is_global(i: _Ins) -> bool:
    return _is_copy_read(i) or _is_copy_load(i) or i.base in ("ld", "ldu", "st", "atom", "red") and not (
        {"param", "shared", "local", "const", "tex"} & set(i.mods))


def _narrow_scope(i: _Ins) -> bool:
    return "cta" in i.mods or "cluster" in i.mods


def _is_barrier(i: _Ins) -> bool:
    """A block barrier that waits for the CTA's threads (bar.sync, barrier.sync[.aligned], bar.red): not
    bar.arrive (it does not wait) nor bar.warp.sync (one warp)."""
    if i.base not in ("bar", "barrier"):
        return False
    rest = [m for m in i.mods if m not in ("cta", "aligned")]
    return bool(rest) and rest[0] in ("sync", "red")


def _is_nc(i: _Ins) -> bool:
    return i.base == "ldu" or (i.base == "ld" and "nc" in i.mods) or _is_copy_read(i)


# ---- control-flow graph -------------------------------------------------------------------------------------

@dataclass
class _Cfg:
    """The basic blocks of a PTX entry: block b holds instructions [start[b], end[b]). Blocks start at labels
    and after branches and returns; a block falls through unless it ends in an unpredicated bra/ret/exit, and a
    bra adds an edge to its target. `back`: the edges that close a loop (retreating edges of a depth-first walk
    from the entry); `reached`: the blocks the entry reaches."""

    start: list[int]
    end: list[int]
    succ: list[list[int]]
    pred: list[list[int]]
    of: list[int]  # instruction index -> block
    back: set[tuple[int, int]] = field(default_factory=set)
    reached: list[bool] = field(default_factory=list)
    loops: dict[int, set[int]] = field(default_factory=dict)  # header -> its natural loop's blocks

    def __len__(self) -> int:
        return len(self.start)


def _build_cfg(ins: list[_Ins], labels: dict[str, int]) -> _Cfg:
    n = len(ins)
    leaders = {0} | {k for k in labels.values() if k < n}
    leaders |= {k + 1 for k, i in enumerate(ins) if i.base in ("bra", "ret", "exit") and k + 1 < n}
    start = sorted(leaders) if n else []
    end = start[1:] + [n]
    of = [0] * n
    for b, (s, e) in enumerate(zip(start, end)):
        of[s:e] = [b] * (e - s)
    succ: list[list[int]] = [[] for _ in start]
    for b, e in enumerate(end):
        last = ins[e - 1]
        target = labels.get(last.value or "") if last.base == "bra" else None
        if target is not None and target < n:
            succ[b].append(of[target])
        ends_here = last.base in ("bra", "ret", "exit") and not last.guarded
        if last.base == "bra" and target is None:
            ends_here = False  # an unknown target (an indirect branch): keep the fall-through edge at least
        if not ends_here and b + 1 < len(start) and of[e] not in succ[b]:
            succ[b].append(b + 1)
    pred: list[list[int]] = [[] for _ in start]
    for b, ss in enumerate(succ):
        for s in ss:
            pred[s].append(b)
    cfg = _Cfg(start, end, succ, pred, of)
    cfg.back, cfg.reached = _back_edges(cfg)
    cfg.loops = _natural_loops(cfg)
    return cfg


def _back_edges(cfg: _Cfg) -> tuple[set[tuple[int, int]], list[bool]]:
    """Edges to a block still on the stack of an iterative depth-first walk from the entry, and what it reached."""
    state = [0] * len(cfg)  # 0 unseen, 1 on the stack, 2 done
    back: set[tuple[int, int]] = set()
    if not len(cfg):
        return back, []
    state[0] = 1
    stack = [(0, iter(cfg.succ[0]))]
    while stack:
        b, it = stack[-1]
        for s in it:
            if state[s] == 1:
                back.add((b, s))
            elif state[s] == 0:
                state[s] = 1
                stack.append((s, iter(cfg.succ[s])))
                break
        else:
            state[b] = 2
            stack.pop()
    return back, [s != 0 for s in state]


def _natural_loops(cfg: _Cfg) -> dict[int, set[int]]:
    """Loop header -> the blocks of its natural loop (every back edge into the header merged)."""
    loops: dict[int, set[int]] = {}
    for tail, head in cfg.back:
        body = loops.setdefault(head, {head})
        work = [tail]
        while work:
            b = work.pop()
            if b in body:
                continue
            body.add(b)
            work.extend(cfg.pred[b])
    return loops


# ---- the sites the flow rules look at -----------------------------------------------------------------------

@dataclass
class _Sites:
    """Instruction indices by what they do to the launch's synchronisation."""

    waits: dict[int, tuple[str, ...]] = field(default_factory=dict)  # reads of a flag (any semantics)
    signals: dict[int, tuple[str, ...]] = field(default_factory=dict)  # writes of a flag
    barriers: set[int] = field(default_factory=set)
    stores: dict[int, tuple[str, ...]] = field(default_factory=dict)  # global writes of produced (or untraced) data
    loads: dict[int, tuple[str, ...]] = field(default_factory=dict)  # coherent global loads of produced data
    reports: set[int] = field(default_factory=set)  # global writes to an error buffer
    guarded: set[int] = field(default_factory=set)  # waits under a predicate: some threads skip them


def _block_events(cfg: _Cfg, marks: set[int]) -> list[list[int]]:
    """Per block, the marked instruction indices in it, in order."""
    ev: list[list[int]] = [[] for _ in range(len(cfg))]
    for k in sorted(marks):
        ev[cfg.of[k]].append(k)
    return ev


def _stores_before(cfg: _Cfg, sites: _Sites, at: int, ev: list[list[int]]) -> list[int]:
    """Stores of produced data on some backward path from instruction `at` that meets no barrier first."""
    found: list[int] = []

    def scan(b: int, upto: int) -> bool:
        """Collect the block's stores before `upto`, walking back; True when a barrier stops the path."""
        for k in reversed(ev[b]):
            if k >= upto:
                continue
            if k in sites.barriers:
                return True
            found.append(k)
        return False

    seen: set[int] = set()
    work = [] if scan(cfg.of[at], at) else list(cfg.pred[cfg.of[at]])
    while work:
        b = work.pop()
        if b in seen:
            continue
        seen.add(b)
        if not scan(b, cfg.end[b]):
            work.extend(cfg.pred[b])
    return sorted(set(found))


def _reports_on_exit(cfg: _Cfg, body: set[int], sites: _Sites, ev: list[list[int]]) -> bool:
    """Whether a write to an error buffer is reachable from the loop's exits, outside the loop, before a barrier
    and before any other loop: a loop after this one (another wait, bounded) reports its own timeout, and its
    report reachable from here would pass a wait here that gives up silently."""
    others = set().union(*(b2 for b2 in cfg.loops.values() if not body <= b2))
    work = [s for b in body for s in cfg.succ[b] if s not in body]
    seen: set[int] = set()
    while work:
        b = work.pop()
        if b in seen or b in others:
            continue
        seen.add(b)
        stopped = False
        for k in ev[b]:
            if k in sites.reports:
                return True
            if k in sites.barriers:
                stopped = True
                break
        if not stopped:
            work.extend(s for s in cfg.succ[b] if s not in body)
    return False


def _flow(cfg: _Cfg, init: bool, meet, transfer, kill: set[tuple[int, int]]) -> list[bool]:
    """A forward data-flow fixed point over the reached blocks: the state at each block's entry. The entry block
    starts from False; every other from `init` (True for an all-paths fact, False for a some-path one); `meet`
    (all / any) joins the predecessors' exit states; an edge in `kill` carries False; `transfer(b, state)` is a
    block's effect. Each block is visited again only when a predecessor's exit state changed."""
    inn = [init] * len(cfg)
    out = [init] * len(cfg)
    work = [b for b in range(len(cfg)) if cfg.reached[b]]
    queued = set(work)
    work.reverse()  # pop from the end: blocks in program order first
    while work:
        b = work.pop()
        queued.discard(b)
        ps = [False if (p, b) in kill else out[p] for p in cfg.pred[b] if cfg.reached[p]]
        state = meet(ps + ([False] if b == 0 else []))
        inn[b] = state
        new = transfer(b, state)
        if new != out[b]:
            out[b] = new
            for s in cfg.succ[b]:
                if s not in queued:
                    queued.add(s)
                    work.append(s)
    return inn


def _uncovered_loads(cfg: _Cfg, sites: _Sites, kill: set[tuple[int, int]], ev: list[list[int]]) -> list[int]:
    """Coherent loads of produced data that some path reaches with no wait before them: `may` is "some thread of
    the CTA may have waited since the last barrier" (a guarded wait counts only here), `covered` is "this thread
    waited, or a barrier met since a wait made the CTA's threads wait with it", on every path. A barrier sets
    covered when may holds at it, and covered then lasts through later barriers, until an edge in `kill` (the back
    edge of a loop that waits: each pass must wait again)."""

    def step_may(b: int, may: bool) -> bool:
        for k in ev[b]:
            if k in sites.waits:
                may = True
            elif k in sites.barriers:
                may = False
        return may

    may_in = _flow(cfg, False, any, step_may, kill)

    def step_cov(b: int, cov: bool, hits: list[int] | None = None) -> bool:
        may = may_in[b]
        for k in ev[b]:
            if k in sites.waits:
                may = True
                cov = cov or k not in sites.guarded
            elif k in sites.barriers:
                cov, may = cov or may, False
            elif k in sites.loads and not cov and hits is not None:
                hits.append(k)
        return cov

    cov_in = _flow(cfg, True, all, step_cov, kill)
    hits: list[int] = []
    for b in range(len(cfg)):
        if cfg.reached[b]:
            step_cov(b, cov_in[b], hits)
    return hits


def _is_flag_read(i: _Ins, const: dict[str, str | None]) -> bool:
    """A read of a flag's value: a load, or an atomic that adds/ors/xors 0 (a read written as an atomic)."""
    if i.base in ("ld", "ldu"):
        return True
    return i.base == "atom" and bool({"add", "or", "xor"} & set(i.mods)) and (
        i.value is not None and (const.get(i.value) in ("0", "0x0") or i.value in ("0", "0x0")))


def _find_sites(ins: list[_Ins], mem, const, flags: set[str], data: set[str], reports: set[str]) -> _Sites:
    """Waits, signals, barriers, and the stores and coherent loads of produced data (`data`: produced, not flags)."""
    s = _Sites(barriers={k for k, i in enumerate(ins) if _is_barrier(i)})
    for n, i, ps in mem:
        fl = tuple(p for p in ps if p in flags)
        writes = i.base in ("st", "atom", "red")
        if fl and _is_flag_read(i, const):
            s.waits[n] = fl
            if i.guarded:
                s.guarded.add(n)
        elif fl and writes:
            s.signals[n] = fl
        if writes and set(ps) & reports:
            s.reports.add(n)
        hit = tuple(p for p in ps if p in data)
        if writes and (any(p not in reports for p in hit) or not ps):
            s.stores[n] = tuple(p for p in hit if p not in reports)  # () an untraced address: maybe produced
        elif (i.base == "ld" and not _is_nc(i) or _is_copy_load(i)) and hit:
            s.loads[n] = hit
    return s


def _check_args(params: list[str], roles: dict[str, str], pointees: dict[str, str] | None,
                reports: tuple[str, ...]) -> None:
    bad = {p: r for p, r in roles.items() if r not in ROLES}
    if bad:
        raise ValueError(f"unknown roles {bad}; roles are {ROLES}")
    missing = set(roles) - set(params)
    if missing:
        raise ValueError(f"roles name parameters the kernel does not have: {sorted(missing)}")
    bad = {p: r for p, r in (pointees or {}).items() if r not in ("static", "produced")}
    if bad:
        raise ValueError(f"unknown pointee roles {bad}; what a table points to is 'static' or 'produced'")
    missing = (set(pointees or {}) | set(reports)) - set(params)
    if missing:
        raise ValueError(f"pointees/reports name parameters the kernel does not have: {sorted(missing)}")


def audit_ptx(ptx: str, params: list[str], roles: dict[str, str], *, kernel: str | None = None,
              target: str = "cuda:90", pointer_params: set[str] | None = None,
              sass: str | None = None, sass_skip_reason: str | None = None,
              pointees: dict[str, str] | None = None, reports: tuple[str, ...] = (),
              cta_signals: bool = False, read_coverage: bool | None = None) -> AuditReport:
    """Audit PTX text. `params`: the kernel's runtime parameter names in PTX order; `roles`:
    pointer parameter -> "static" | "produced" | "flag"; `sass`: an nvdisasm listing (-c -g).

    `pointees`: address table parameter -> the role of what its entries point to ("static" | "produced"); loads
    through them are named "P[]", and every non-coherent load must then be proven static (an unattributed one
    is an error, not a warning). `reports`: the error buffers a wait that gives up writes (enables
    timeout-unreported). `cta_signals`: one thread signals for its whole CTA, after a block barrier (the
    megakernel; Triton's scalar atomics too): enables signal-before-barrier, which would misread a kernel whose
    every thread signals for itself. `read_coverage` (default: as `cta_signals`): every load of produced data is
    reached only through a wait, on every control-flow path: enables produced-read-uncovered. The megakernel
    branches around its body when a wait fails; Triton's handoff consumer skips its wait after a timeout and
    masks its loads off instead (a data dependence the control-flow graph does not see), so it keeps this off."""
    _check_args(params, roles, pointees, tuple(reports))
    pointees = dict(pointees) if pointees is not None else None
    reports_set = set(reports)
    pointer_params = set(roles) if pointer_params is None else set(pointer_params)
    entry, ins, labels = _parse_ptx(ptx)
    tables = {params.index(p): len(params) + j for j, p in enumerate(pointees or {})}
    slots = list(params) + [f"{p}[]" for p in (pointees or {})]
    roles = {**roles, **{f"{p}[]": r for p, r in (pointees or {}).items()}}
    prov, const = _provenance(ins, tables)
    rep = AuditReport(kernel or entry, target, [R_NC, R_ORDER])
    produced = {p for p, r in roles.items() if r in ("produced", "flag")}
    flags = {p for p, r in roles.items() if r == "flag"}

    def names(i: _Ins) -> tuple[str, ...]:
        idx = prov.get(i.addr, set()) if i.addr else set()
        return tuple(sorted(slots[k] for k in idx
                            if k < len(slots) and (k >= len(params) or params[k] in pointer_params)))

    def add(rule, sev, i, text, ps=()):
        rep.findings.append(Finding(rule, sev, i.line, text, i.where or i.src, tuple(ps)))

    mem = [(n, i, names(i)) for n, i in enumerate(ins) if _is_global(i)]
    _rule_nc(rep, mem, roles, produced, strict=pointees is not None, add=add)
    _rules_flags(rep, ins, mem, const, flags, produced, add)

    sites = _find_sites(ins, mem, const, flags, {p for p, r in roles.items() if r == "produced"}, reports_set)
    cfg = _build_cfg(ins, labels)
    if cta_signals:
        _rule_signal_barrier(rep, ins, cfg, sites, add)
    else:
        rep.skipped[R_BAR] = "opt-in (cta_signals): the kernel does not declare that one thread signals for its CTA"
    if reports:
        _rule_timeout(rep, ins, cfg, sites, sorted(reports_set), add)
    else:
        rep.skipped[R_TIMEOUT] = "no error buffer declared (reports): nothing to check a wait's timeout against"
    if not flags:
        rep.skipped[R_UNCOV] = "no parameter declared with role 'flag'"
    elif not (cta_signals if read_coverage is None else read_coverage):
        rep.skipped[R_UNCOV] = "opt-in (read_coverage): the kernel does not declare its produced loads follow a wait"
    else:
        _rule_uncovered(rep, ins, cfg, sites, add)

    if sass is not None:
        rep.rules_checked.append(R_SASS)
        _audit_sass(rep, sass, mem, produced)
    else:
        rep.skipped[R_SASS] = sass_skip_reason or "no SASS given"
    rep.rules_checked = [r for r in RULES if r in rep.rules_checked]
    return rep


def _rule_nc(rep: AuditReport, mem, roles: dict[str, str], produced: set[str], *, strict: bool, add) -> None:
    """Non-coherent loads read static data only. `strict` (address tables declared): each must be proven to."""
    loads = static = 0
    for n, i, ps in mem:
        if not _is_nc(i):
            continue
        loads += 1
        rep.nc_loads.append((i.where or i.src or f"ptx line {i.line}", ps))
        hit = [p for p in ps if p in produced]
        unknown = [p for p in ps if p not in roles]
        static += bool(ps) and not hit and not unknown
        if hit:
            add(R_NC, "error", i, f"`{i.op}` reads {', '.join(hit)}, produced during the launch: "
                f"non-coherent loads are for static data only (may be hoisted above the wait or read stale)", hit)
        elif not ps and strict:
            add(R_NC, "error", i, f"unattributed non-coherent load `{i.op}`: its address traces to no parameter "
                f"nor address table, so nothing proves it reads static data")
        elif not ps and produced:
            add(R_NC, "warn", i, f"unattributed non-coherent load `{i.op}`: its base could not be traced "
                f"to a parameter and the kernel has produced buffers")
        elif unknown:
            add(R_NC, "error" if strict else "warn", i, f"non-coherent load `{i.op}` of parameter(s) with no "
                f"declared role", unknown)
    rep.checked[R_NC] = _count(loads, "non-coherent load") + (f", {static} proven static" if strict else "")


def _rules_flags(rep: AuditReport, ins: list[_Ins], mem, const, flags: set[str], produced: set[str], add) -> None:
    """Every read of a flag acquires; every write releases; no produced store after it in its block."""
    def fence_between(a: int, b: int, block: int) -> bool:
        return any(ins[k].block == block and ins[k].op.startswith(_GPU_FENCES) for k in range(a, b))

    reads = writes = 0
    if not flags:
        rep.skipped[R_ACQ] = rep.skipped[R_REL] = "no parameter declared with role 'flag'"
    else:
        rep.rules_checked[1:1] = [R_ACQ, R_REL]
        for n, i, ps in mem:
            fl = [p for p in ps if p in flags]
            if not fl:
                continue
            if _is_flag_read(i, const):
                reads += 1
                acq = bool({"acquire", "acq_rel"} & set(i.mods)) and not _narrow_scope(i)
                if not acq:
                    nxt = next((k for k, j, q in mem if k > n and not set(q) & flags), len(ins))
                    acq = fence_between(n + 1, nxt, i.block)
                if not acq:
                    kind = "volatile" if "volatile" in i.mods else ("cta-scope" if _narrow_scope(i) else "relaxed/weak")
                    add(R_ACQ, "error", i, f"wait on {', '.join(fl)} reads it with a {kind} `{i.op}`: no acquire "
                        f"(and no gpu fence before the next data load), so the data it guards may be read stale", fl)
            elif i.base in ("st", "atom", "red"):
                writes += 1
                rel = bool({"release", "acq_rel"} & set(i.mods)) and not _narrow_scope(i)
                if not rel:
                    rel = fence_between(max(0, n - 64), n, i.block)
                if not rel:
                    sem = next((s for s in ("relaxed", "acquire", "volatile") if s in i.mods), "no semantics")
                    add(R_REL, "error", i, f"signal on {', '.join(fl)} with `{i.op}` ({sem}): no release and no "
                        f"gpu fence before it, so the data it publishes may become visible after the flag", fl)
        rep.checked[R_ACQ] = _count(reads, "flag read")
        rep.checked[R_REL] = _count(writes, "flag write")
    signals = 0
    for n, i, ps in mem:
        if not (set(ps) & flags) or _is_flag_read(i, const) or i.base not in ("st", "atom", "red"):
            continue
        signals += 1
        for k, j, q in mem:
            hit = [p for p in q if p in produced and p not in flags]
            if k > n and j.block == i.block and j.base in ("st", "atom", "red") and hit:
                add(R_ORDER, "error", j, f"store to {', '.join(hit)} after the signal `{i.op}` on "
                    f"{', '.join(set(ps) & flags)} (ptx line {i.line}): consumers may read it before it lands", hit)
    rep.checked[R_ORDER] = _count(signals, "signal")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _site(i: _Ins) -> str:
    return f"ptx line {i.line}" + (f" ({i.where or i.src})" if i.where or i.src else "")


def _rule_signal_barrier(rep: AuditReport, ins: list[_Ins], cfg: _Cfg, sites: _Sites, add) -> None:
    """One thread signals for its CTA: every store of produced data that can precede a signal must be ordered
    before it by a block barrier, on every path (the signaller's fence orders only its own stores). A store whose
    address traces to no parameter may write produced data too, so it counts."""
    rep.rules_checked.append(R_BAR)
    ev = _block_events(cfg, set(sites.stores) | sites.barriers)
    for n, fl in sites.signals.items():
        stores = _stores_before(cfg, sites, n, ev)
        if not stores:
            continue
        i = ins[n]
        ps = sorted({p for k in stores for p in sites.stores[k]})
        shown = "; ".join(f"`{ins[k].op}` to {', '.join(sites.stores[k]) or 'an untraced address'} at "
                          f"{_site(ins[k])}" for k in stores[:4])
        more = f" (and {len(stores) - 4} more)" if len(stores) > 4 else ""
        verb = "reaches" if len(stores) == 1 else "reach"
        add(R_BAR, "error", i, f"signal `{i.op}` on {', '.join(fl)} may run before the CTA's other threads' stores "
            f"are done: {shown}{more} {verb} it on a path with no block barrier (bar.sync) between, so consumers "
            f"may read the data before it lands", ps)
    rep.checked[R_BAR] = (f"{_count(len(sites.signals), 'signal')} against "
                          f"{_count(len(sites.stores), 'store')} of produced or untraced data")


def _rule_timeout(rep: AuditReport, ins: list[_Ins], cfg: _Cfg, sites: _Sites, reports: list[str], add) -> None:
    """Each spin loop (the innermost loop around a flag read, unless that loop also signals: then it is the
    kernel's work loop, not a wait) must reach a write to an error buffer from its exits before a barrier."""
    rep.rules_checked.append(R_TIMEOUT)
    loops = cfg.loops
    signal_blocks = {cfg.of[k] for k in sites.signals}
    spins: dict[int, tuple[set[int], int]] = {}
    for n in sorted(sites.waits):
        around = [(len(body), head) for head, body in loops.items() if cfg.of[n] in body]
        if not around:
            continue
        head = min(around)[1]
        if not loops[head] & signal_blocks:
            spins.setdefault(head, (loops[head], n))
    ev = _block_events(cfg, sites.reports | sites.barriers)
    for head, (body, n) in spins.items():
        if _reports_on_exit(cfg, body, sites, ev):
            continue
        i = ins[n]
        lines = [ins[k].line for b in body for k in (cfg.start[b], cfg.end[b] - 1)]
        add(R_TIMEOUT, "error", i, f"a wait that gives up records nothing: the launch would go on with "
            f"unsynchronised data (the spin loop on {', '.join(sites.waits[n])}, ptx lines {min(lines)}-{max(lines)}, "
            f"reaches no store or atomic to {', '.join(reports)} from its exits before a barrier)",
            sites.waits[n])
    rep.checked[R_TIMEOUT] = _count(len(spins), "spin loop")


def _rule_uncovered(rep: AuditReport, ins: list[_Ins], cfg: _Cfg, sites: _Sites, add) -> None:
    """Every coherent load of produced data comes after a wait on every path: in its thread, or in the CTA before
    a block barrier; a loop that waits must wait again in each pass (its back edges carry nothing)."""
    rep.rules_checked.append(R_UNCOV)
    wait_blocks = {cfg.of[k] for k in sites.waits}
    kill = {(t, h) for t, h in cfg.back if cfg.loops[h] & wait_blocks}
    ev = _block_events(cfg, set(sites.waits) | sites.barriers | set(sites.loads))
    seen: set[str] = set()
    for n in sorted(_uncovered_loads(cfg, sites, kill, ev)):
        i = ins[n]
        key = i.where or i.src or str(i.line)
        if key in seen:
            continue
        seen.add(key)
        add(R_UNCOV, "error", i, f"`{i.op}` reads {', '.join(sites.loads[n])}, produced during the launch, on a "
            f"path with no wait on a flag before it (from the kernel entry, or from the previous pass of a loop "
            f"that waits): it may read the data before its producers signal it", sites.loads[n])
    rep.checked[R_UNCOV] = _count(len(sites.loads), "coherent load") + " of produced data"


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
    rep.checked[R_SASS] = _count(len(rep.sass_nc_loads), "read-only-path load")


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
    A spec may also declare `pointees`, `reports`, `cta_signals` and `read_coverage` (audit_ptx's options;
    absent: off, read_coverage as cta_signals).
    Must run where the spec can compile (not needs_fresh_process(): see validate/kernel_audit.py)."""
    if hasattr(spec, "check"):
        spec.check()
    c = spec.compile(arch)
    text, why = (None, "SASS not requested")
    if sass:
        text, why = disassemble(c.cubin) if c.cubin else (None, "the compiler gave no cubin")
    return audit_ptx(c.ptx, c.params, spec.roles, kernel=spec.name, target=f"cuda:sm_{arch}",
                     pointer_params=c.pointer_params, sass=text, sass_skip_reason=why,
                     pointees=getattr(spec, "pointees", None), reports=tuple(getattr(spec, "reports", ()) or ()),
                     cta_signals=bool(getattr(spec, "cta_signals", False)),
                     read_coverage=getattr(spec, "read_coverage", None))


def roles_from_plan(plan, param_buffers: dict[str, str], flags: tuple[str, ...] = ()) -> dict[str, str]:
    """Roles for kernel parameters bound to plan buffers: written during a step -> "produced",
    otherwise (weights, step inputs) -> "static"; parameters in `flags` -> "flag"."""
    written = plan.written_buffers()
    roles = {p: ("produced" if b in written else "static") for p, b in param_buffers.items()}
    roles.update({f: "flag" for f in flags})
    return roles
