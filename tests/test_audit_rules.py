"""The static audit's address-table and control-flow rules (validate/audit.py), on small hand-written PTX and on
the real megakernel and handoff kernel compiled without a GPU.

- pointee provenance: a 64-bit load from an address table names its value "P[]" with the role of what P's entries
  point to; with `pointees` given, every non-coherent load must be proven to read static data.
- signal-before-barrier: every store of produced data that can precede a signal is ordered by a block barrier.
- timeout-unreported: a spin loop's exits write the error buffer before any barrier.
- produced-read-uncovered: every coherent load of produced data comes after a wait on every path, the back edge
  of a loop that waits included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from megadecode.backends.mega import spec as S
from megadecode.validate import audit as A

# prog, ctr, f32, wtab, ptab, err: %rd1..%rd6; thread 0 is the one with !%p1
PARAMS = ["prog", "ctr", "f32", "wtab", "ptab", "err"]
ROLES = {"prog": "static", "ctr": "flag", "f32": "produced", "wtab": "static", "ptab": "static", "err": "produced"}
POINTEES = {"wtab": "static", "ptab": "produced"}
HEAD = "\n".join([".visible .entry k(", ",\n".join(f"\t.param .u64 k_param_{n}" for n in range(len(PARAMS))),
                  ")", "{"]
                 + [f"\tld.param.u64 %rd{n + 1}, [k_param_{n}];" for n in range(len(PARAMS))]
                 + ["\tmov.u32 %r1, %tid.x;", "\tsetp.ne.s32 %p1, %r1, 0;", ""])


def _audit(body: str, **kw) -> A.AuditReport:
    kw.setdefault("pointees", POINTEES)
    return A.audit_ptx(HEAD + textwrap.dedent(body) + "\tret;\n}\n", PARAMS, ROLES, **kw)


def _errors(rep: A.AuditReport, rule: str) -> list[A.Finding]:
    return [f for f in rep.by_rule(rule) if f.severity == "error"]


def _line_of(ptx: str, needle: str) -> int:
    """1-based line of the first line containing `needle` in HEAD + body (as _audit builds it)."""
    return next(n for n, line in enumerate(ptx.splitlines(), 1) if needle in line)


# ---- pointee provenance -------------------------------------------------------------------------------------

def _table_load(table_reg: str) -> str:
    """Read an entry of the table in `table_reg` at an index read from prog, then a non-coherent load through it."""
    return f"""
        ld.global.b32 %r2, [%rd1];
        mul.wide.s32 %rd10, %r2, 8;
        add.s64 %rd11, {table_reg}, %rd10;
        ld.global.b64 %rd12, [%rd11];
        add.s64 %rd13, %rd12, 64;
        ld.global.nc.v4.b32 {{ %r3, %r4, %r5, %r6 }}, [%rd13];
    """


def test_nc_load_through_a_static_table_is_proven_static():
    rep = _audit(_table_load("%rd4"))
    assert rep.findings == [], rep.to_markdown()
    assert [p for _, p in rep.nc_loads] == [("wtab[]",)]
    assert rep.checked[A.R_NC] == "1 non-coherent load, 1 proven static"
    assert "nc-load-of-produced: 1 non-coherent load, 1 proven static" in rep.to_markdown()


def test_nc_load_through_a_produced_table_is_an_error():
    rep = _audit(_table_load("%rd5"))
    (f,) = _errors(rep, A.R_NC)
    assert f.params == ("ptab[]",) and "produced during the launch" in f.text, rep.to_markdown()
    assert [p for _, p in rep.nc_loads] == [("ptab[]",)]


def _bulk_prefetch(table_reg: str) -> str:
    """The copy engine's L2 prefetch of a table entry's bytes (the async proxy: no acquire orders it)."""
    return f"""
        ld.global.b32 %r2, [%rd1];
        mul.wide.s32 %rd10, %r2, 8;
        add.s64 %rd11, {table_reg}, %rd10;
        ld.global.b64 %rd12, [%rd11];
        mov.u32 %r3, 4096;
        cp.async.bulk.prefetch.L2.global [%rd12], %r3;
    """


def test_bulk_reads_of_global_memory_are_held_to_the_non_coherent_rule():
    rep = _audit(_bulk_prefetch("%rd4"))
    assert rep.findings == [], rep.to_markdown()
    assert [p for _, p in rep.nc_loads] == [("wtab[]",)]
    (f,) = _errors(_audit(_bulk_prefetch("%rd5")), A.R_NC)
    assert f.params == ("ptab[]",) and "produced during the launch" in f.text


def test_a_bulk_copy_into_shared_memory_is_held_to_the_non_coherent_rule():
    """cp.async.bulk from global into shared memory ([dst], [src], the async proxy) is traced by its global source,
    the second address: through wtab's entries it passes, through ptab's it is an error."""
    copy = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r9], [%rd12], %r3, [%r8];"
    for table, ok in (("%rd4", True), ("%rd5", False)):
        rep = _audit(f"""
            ld.global.b32 %r2, [%rd1];
            mul.wide.s32 %rd10, %r2, 8;
            add.s64 %rd11, {table}, %rd10;
            ld.global.b64 %rd12, [%rd11];
            mov.u32 %r9, 256;
            mov.u32 %r8, 64;
            mov.u32 %r3, 4096;
            {copy}
        """)
        if ok:
            assert rep.findings == [] and [p for _, p in rep.nc_loads] == [("wtab[]",)], rep.to_markdown()
        else:
            (f,) = _errors(rep, A.R_NC)
            assert f.params == ("ptab[]",), rep.to_markdown()


@pytest.mark.parametrize("cache", ["ca", "cg"])
def test_a_cp_async_copy_is_a_coherent_load_held_to_the_wait(cache):
    """A non-bulk cp.async (the generic proxy, through L1 or L2 as ld.global reads) is a coherent load of its global
    source: of static data (prog, the megakernel's next row) anywhere, of produced data only after a wait and its
    barrier (before it: produced-read-uncovered), and never listed as a non-coherent read."""
    copy = f"cp.async.{cache}.shared.global [%r20], [%rd3], 16;"
    static = f"cp.async.{cache}.shared.global [%r20], [%rd1], 16;"
    rep = _audit(_persistent(head="mov.u32 %r20, 0;\n" + static, body=copy), cta_signals=True)
    assert not rep.findings and not rep.nc_loads, rep.to_markdown()
    assert rep.checked[A.R_UNCOV] == "2 coherent loads of produced data"
    rep = _audit(_persistent(head="mov.u32 %r20, 0;\n" + copy, entry="ld.acquire.gpu.global.b32 %r2, [%rd2];"),
                 cta_signals=True)
    assert [(f.rule, f.params) for f in rep.findings] == [(A.R_UNCOV, ("f32",))], rep.to_markdown()


def test_unattributed_nc_load_is_an_error_only_with_pointees():
    body = """
        ld.global.b64 %rd12, [%rd1];
        ld.global.nc.b32 %r3, [%rd12];
    """  # an address read from prog, which is no declared table: it traces to nothing
    strict = _audit(body)
    (f,) = strict.findings
    assert (f.rule, f.severity, f.params) == (A.R_NC, "error", ()) and "unattributed" in f.text
    assert strict.checked[A.R_NC] == "1 non-coherent load, 0 proven static"
    loose = _audit(body, pointees=None)
    assert [(f.rule, f.severity) for f in loose.findings] == [(A.R_NC, "warn")]


def test_a_32_bit_value_loaded_from_a_table_is_no_pointer():
    """An index read (32 bits) from a table and added to f32's base: the load reads f32, not wtab[]."""
    rep = _audit("""
        ld.global.b32 %r2, [%rd4];
        mul.wide.s32 %rd10, %r2, 4;
        add.s64 %rd11, %rd3, %rd10;
        ld.global.nc.b32 %r3, [%rd11];
    """)
    (f,) = _errors(rep, A.R_NC)
    assert f.params == ("f32",), rep.to_markdown()


def test_pointee_arguments_are_validated():
    with pytest.raises(ValueError, match="pointee roles"):
        _audit("", pointees={"wtab": "flag"})
    with pytest.raises(ValueError, match="does not have"):
        _audit("", pointees={"nope": "static"})
    with pytest.raises(ValueError, match="does not have"):
        _audit("", reports=("nope",))


# ---- signal-before-barrier ----------------------------------------------------------------------------------

SIGNAL = """
        @%p1 bra $L_done;
        fence.acq_rel.gpu;
        atom.global.release.gpu.add.u32 %r9, [%rd2], 1;
    $L_done:
"""


def test_store_barrier_signal_passes():
    rep = _audit("st.global.b32 [%rd3], %r1;\nbar.sync 0;\n" + SIGNAL, cta_signals=True)
    assert A.R_BAR in rep.rules_checked and not rep.findings, rep.to_markdown()
    assert rep.checked[A.R_BAR] == "1 signal against 1 store of produced or untraced data"


def test_signal_without_barrier_is_flagged():
    body = "st.global.b32 [%rd3], %r1;\n" + SIGNAL
    rep = _audit(body, cta_signals=True)
    (f,) = rep.findings
    assert (f.rule, f.params) == (A.R_BAR, ("f32",)), rep.to_markdown()
    ptx = HEAD + textwrap.dedent(body)
    assert f.line == _line_of(ptx, "atom.global.release") and f"ptx line {_line_of(ptx, 'st.global')}" in f.text
    assert A.R_BAR in _audit(body).skipped  # opt-in


def test_a_path_around_the_barrier_is_flagged():
    rep = _audit("""
        st.global.b32 [%rd3], %r1;
        setp.eq.s32 %p2, %r1, 7;
        @%p2 bra $L_skip;
        bar.sync 0;
    $L_skip:
    """ + SIGNAL, cta_signals=True)
    assert [(f.rule, f.params) for f in rep.findings] == [(A.R_BAR, ("f32",))], rep.to_markdown()


def test_stores_through_a_produced_table_count_and_error_reports_do_not():
    rep = _audit("""
        ld.global.b64 %rd12, [%rd5];
        st.global.b32 [%rd12], %r1;
        st.global.b32 [%rd6], %r1;
    """ + SIGNAL, cta_signals=True, reports=("err",))
    assert [(f.rule, f.params) for f in rep.findings] == [(A.R_BAR, ("ptab[]",))], rep.to_markdown()


def test_a_store_to_an_untraced_address_counts():
    """An address read from prog (no table): it may point to produced data, so the store needs the barrier too."""
    body = "ld.global.b64 %rd12, [%rd1];\nst.global.b32 [%rd12], %r1;\n"
    rep = _audit(body + SIGNAL, cta_signals=True)
    (f,) = rep.findings
    assert (f.rule, f.params) == (A.R_BAR, ()) and "untraced address" in f.text, rep.to_markdown()
    assert not _audit(body + "bar.sync 0;\n" + SIGNAL, cta_signals=True).findings


def test_a_store_after_the_signal_reaches_the_next_pass_through_the_back_edge():
    rep = _audit("""
        mov.u32 %r10, 0;
    $L_work:
        bar.sync 0;
        @%p1 bra $L_next;
        fence.acq_rel.gpu;
        atom.global.release.gpu.add.u32 %r9, [%rd2], 1;
    $L_next:
        st.global.b32 [%rd3], %r10;
        add.s32 %r10, %r10, 1;
        setp.lt.s32 %p6, %r10, 4;
        @%p6 bra $L_work;
    """, cta_signals=True)
    assert not rep.findings, rep.to_markdown()  # the loop's barrier orders last pass's store
    rep = _audit("""
        mov.u32 %r10, 0;
    $L_work:
        @%p1 bra $L_next;
        fence.acq_rel.gpu;
        atom.global.release.gpu.add.u32 %r9, [%rd2], 1;
    $L_next:
        st.global.b32 [%rd3], %r10;
        add.s32 %r10, %r10, 1;
        setp.lt.s32 %p6, %r10, 4;
        @%p6 bra $L_work;
        bar.sync 0;
    """, cta_signals=True)
    assert [(f.rule, f.params) for f in rep.findings] == [(A.R_BAR, ("f32",))], rep.to_markdown()


# ---- timeout-unreported -------------------------------------------------------------------------------------

def _spin(record: str, after_barrier: str = "") -> str:
    """Thread 0 polls ctr (acquire) up to 1000 times; when the count did not come, `record`; then a barrier."""
    return f"""
        @%p1 bra $L_after;
        mov.u32 %r6, 0;
    $L_spin:
        ld.acquire.gpu.global.b32 %r7, [%rd2];
        add.s32 %r6, %r6, 1;
        setp.lt.s32 %p3, %r7, 1;
        setp.lt.s32 %p4, %r6, 1000;
        and.pred %p5, %p3, %p4;
        @%p5 bra $L_spin;
        @!%p3 bra $L_after;
        {record}
    $L_after:
        bar.sync 0;
        {after_barrier}
        ld.global.b32 %r8, [%rd3];
    """


def test_a_spin_loop_whose_exit_records_the_timeout_passes():
    rep = _audit(_spin("atom.global.cas.b32 %r9, [%rd6], 0, 1;"), reports=("err",))
    assert A.R_TIMEOUT in rep.rules_checked and not rep.findings, rep.to_markdown()
    assert rep.checked[A.R_TIMEOUT] == "1 spin loop"


def test_a_spin_loop_that_gives_up_silently_is_flagged():
    rep = _audit(_spin(""), reports=("err",))
    (f,) = rep.findings
    assert (f.rule, f.params) == (A.R_TIMEOUT, ("ctr",)), rep.to_markdown()
    assert "records nothing" in f.text and "err" in f.text
    # a record after the barrier is too late: the CTA has gone on with the data by then
    rep = _audit(_spin("", after_barrier="st.global.b32 [%rd6+4], %r7;"), reports=("err",))
    assert [f.rule for f in rep.findings] == [A.R_TIMEOUT], rep.to_markdown()


def test_a_silent_spin_loop_is_flagged_even_when_a_later_wait_reports_its_own_timeout():
    """A second bounded wait after the first (a ring slot's, say) whose exit writes the error buffer: that record
    is reachable from the first loop's exits too, but it reports the second wait, not the first."""
    later = """
        mov.u32 %r10, 0;
    $L_spin2:
        ld.shared.b32 %r11, [%r12];
        add.s32 %r10, %r10, 1;
        setp.eq.s32 %p6, %r11, 0;
        setp.lt.s32 %p7, %r10, 1000;
        and.pred %p8, %p6, %p7;
        @%p8 bra $L_spin2;
        @!%p6 bra $L_after;
        atom.global.cas.b32 %r9, [%rd6], 0, 1;
    """
    rep = _audit(_spin(later), reports=("err",))
    assert [f.rule for f in rep.findings] == [A.R_TIMEOUT], rep.to_markdown()
    rep = _audit(_spin("atom.global.cas.b32 %r13, [%rd6], 0, 1;" + later), reports=("err",))
    assert not rep.findings, rep.to_markdown()


def test_timeout_rule_is_skipped_without_reports():
    rep = _audit(_spin(""))
    assert A.R_TIMEOUT in rep.skipped and A.R_TIMEOUT not in rep.rules_checked and not rep.findings


# ---- produced-read-uncovered --------------------------------------------------------------------------------

def _persistent(head: str = "", after_wait: str = "bar.sync 0;", body: str = "", entry: str = "") -> str:
    """A persistent loop: thread 0 waits on ctr[0], the CTA reads and writes f32, thread 0 signals ctr[1]."""
    return f"""
        {entry}
        mov.u32 %r10, 0;
    $L_work:
        {head}
        @%p1 bra $L_waited;
    $L_spin:
        ld.acquire.gpu.global.b32 %r7, [%rd2];
        setp.lt.s32 %p3, %r7, 1;
        @%p3 bra $L_spin;
    $L_waited:
        {after_wait}
        ld.global.b32 %r8, [%rd3];
        {body}
        st.global.b32 [%rd3+4], %r8;
        bar.sync 0;
        @%p1 bra $L_next;
        fence.acq_rel.gpu;
        atom.global.release.gpu.add.u32 %r9, [%rd2+4], 1;
    $L_next:
        bar.sync 0;
        add.s32 %r10, %r10, 1;
        setp.lt.s32 %p6, %r10, 4;
        @%p6 bra $L_work;
    """


def test_a_load_after_the_wait_and_its_barrier_passes():
    body = "bar.sync 0;\nld.global.b32 %r12, [%rd3+8];"  # a body's own barrier keeps what it follows covered
    rep = _audit(_persistent(body=body), cta_signals=True)
    assert A.R_UNCOV in rep.rules_checked and not rep.findings, rep.to_markdown()
    assert rep.checked[A.R_UNCOV] == "2 coherent loads of produced data"


def test_a_load_at_the_loop_head_before_the_wait_is_flagged_through_the_back_edge():
    """The kernel acquires ctr once at its entry (the megakernel's epoch read), so the first pass is covered: only
    the back edge, whose last barrier has the signal behind it and no wait, leaves the hoisted load uncovered."""
    hoisted = "ld.global.b32 %r11, [%rd3+8];"
    src = _persistent(head=hoisted, entry="ld.acquire.gpu.global.b32 %r2, [%rd2];")
    rep = _audit(src, cta_signals=True)
    (f,) = rep.findings
    assert (f.rule, f.params) == (A.R_UNCOV, ("f32",)), rep.to_markdown()
    assert f.line == _line_of(HEAD + textwrap.dedent(src), hoisted)


def test_a_load_before_any_wait_is_flagged():
    rep = _audit("ld.global.b32 %r11, [%rd6];\n" + _persistent(), cta_signals=True)
    assert [(f.rule, f.params) for f in rep.findings] == [(A.R_UNCOV, ("err",))], rep.to_markdown()


def test_without_a_barrier_after_the_wait_the_other_threads_are_uncovered():
    rep = _audit(_persistent(after_wait=""), cta_signals=True)
    assert [(f.rule, f.params) for f in rep.findings] == [(A.R_UNCOV, ("f32",))], rep.to_markdown()
    rep = _audit(_persistent(after_wait=""), cta_signals=True, read_coverage=False)
    assert not rep.findings and A.R_UNCOV in rep.skipped


# ---- the real kernels -----------------------------------------------------------------------------------------

def _audit_mega(ptx: str) -> A.AuditReport:
    """The audit as backends/mega/spec.py declares the megakernel."""
    return A.audit_ptx(ptx, list(S.AUDIT_PARAMS), dict(S.AUDIT_ROLES), pointees=dict(S.POINTEES), reports=S.REPORTS,
                       cta_signals=True)


@pytest.fixture(scope="module")
def embed_ptx() -> str:
    """The megakernel with only its EMBED body (0.4 s to compile instead of ~100 s): the persistent loop's waits,
    barriers and signal, and a body that reads a static tensor through the table and writes f32."""
    K = pytest.importorskip("megadecode.backends.mega.cute_kernel", reason="the megakernel needs nvidia-cutlass-dsl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "BODIES", tuple(b for b in K.BODIES if b[0] == "EMBED"))
        return K.compile_ptx_cubin().__ptx__


def test_the_embed_megakernel_passes_every_rule(embed_ptx):
    rep = _audit_mega(embed_ptx)
    assert rep.passed and not rep.findings, rep.to_markdown()
    assert set(A.RULES) - {A.R_SASS} == set(rep.rules_checked)
    assert rep.checked[A.R_TIMEOUT] == "2 spin loops"  # the instruction's two counters
    assert rep.checked[A.R_BAR].startswith("1 signal against")
    # the only reads outside the coherent path: the weight ring's loader's bulk copies (the compiler may duplicate
    # the site), each proven to read wtab[] alone
    assert rep.nc_loads and all(p == ("wtab[]",) for _, p in rep.nc_loads)


def test_the_embed_megakernel_reads_its_rows_through_the_table(embed_ptx):
    """The embedding row (bf16) read through the non-coherent path: attributed to the table's static pointees."""
    ptx, n = re.subn(r"\bld\.global\.b16\b", "ld.global.nc.b16", embed_ptx)
    assert n >= 1
    rep = _audit_mega(ptx)
    assert rep.passed, rep.to_markdown()
    static = {f"{t}[]" for t, r in S.POINTEES.items() if r == "static"}
    # the rows' loads and the weight ring's bulk copies (as many as the unchanged build holds), each proven to read
    # a static tensor
    m = len(_audit_mega(embed_ptx).nc_loads)
    assert len(rep.nc_loads) == n + m and all(p and set(p) <= static for _, p in rep.nc_loads), rep.nc_loads
    assert rep.checked[A.R_NC] == f"{A._count(n + m, 'non-coherent load')}, {n + m} proven static"


def _drop(ptx: str, pattern: str, before: str | None = None) -> str:
    """`ptx` without the lines matching `pattern` (only the last one before the first line matching `before`)."""
    lines = ptx.splitlines()
    hits = [k for k, line in enumerate(lines) if re.search(pattern, line)]
    if before is not None:
        stop = next(k for k, line in enumerate(lines) if re.search(before, line))
        hits = [max(k for k in hits if k < stop)]
    assert hits, pattern
    return "\n".join(line for k, line in enumerate(lines) if k not in hits) + "\n"


def _param_reg(ptx: str, params: list[str], name: str) -> str:
    """The register the kernel loads parameter `name` into."""
    return re.search(rf"ld\.param\.\w+\s+(%rd\d+), \[\w+_param_{params.index(name)}\]", ptx).group(1)


def _outer_loop_head(lines: list[str]) -> int:
    """Index of the label the longest backward branch around the signal goes to: the persistent loop's head (the
    ring build's loader has loops of its own, which hold no signal)."""
    labels = {line.strip()[:-1]: k for k, line in enumerate(lines) if re.match(r"^\$L\w+:$", line.strip())}
    sig = next(k for k, line in enumerate(lines) if "atom.global.release" in line)
    spans = [(k - labels[m.group(1)], labels[m.group(1)]) for k, line in enumerate(lines)
             for m in [re.search(r"\bbra(?:\.uni)?\s+(\$L\w+);", line)]
             if m and labels.get(m.group(1), k) < sig < k]
    return max(spans)[1]


def test_the_embed_megakernel_without_its_body_barrier_is_flagged(embed_ptx):
    rep = _audit_mega(_drop(embed_ptx, r"\bbar\.sync\b", before=r"atom\.global\.release"))
    assert {f.rule for f in rep.errors} == {A.R_BAR}, rep.to_markdown()
    assert all("f32" in f.params for f in rep.errors)


def test_the_embed_megakernel_with_a_silent_timeout_is_flagged(embed_ptx):
    reg = _param_reg(embed_ptx, list(S.AUDIT_PARAMS), "err")
    silent = _drop(embed_ptx, rf"(st|atom)\.global[\w.]*\s+(%r\d+,\s*)?\[{reg}[\]+]")
    rep = _audit_mega(silent)
    assert {f.rule for f in rep.errors} == {A.R_TIMEOUT} and len(rep.errors) == 2, rep.to_markdown()


def test_the_embed_megakernel_with_a_read_hoisted_above_its_wait_is_flagged(embed_ptx):
    """An i32 load put at the head of the persistent loop: the kernel's epoch read (an acquire at its entry)
    covers the first pass, the loop's back edge leaves it uncovered."""
    reg = _param_reg(embed_ptx, list(S.AUDIT_PARAMS), "i32")
    lines = embed_ptx.splitlines()
    lines.insert(_outer_loop_head(lines) + 1, f"\tld.global.b32 \t%r99999, [{reg}];")
    rep = _audit_mega("\n".join(lines) + "\n")
    assert [(f.rule, f.params) for f in rep.errors] == [(A.R_UNCOV, ("i32",))], rep.to_markdown()


# ---- the Triton handoff kernel (one thread signals after tl.debug_barrier, too) --------------------------------

HANDOFF_COMPILE = """
import json, sys
from megadecode.contract.kernels import KernelSpec
from megadecode.validate import handoff as H
out = {}
for name in sys.argv[1:]:
    planted = {name: True} if name else {}
    c = KernelSpec(H.handoff_kernel, H.handoff_signature(), H.PARAM_ROLES, H.handoff_constexprs(**planted)).compile()
    out[name] = [c.ptx, c.params]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def handoff_ptx() -> dict:
    """planted flag ("" for the correct kernel) -> (PTX, params) of the handoff kernel for sm_90. Compiled in a
    process without TRITON_INTERPRET: the kernel is decorated for the interpreter in this one (tests/conftest.py)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", HANDOFF_COMPILE, "", "SIGNAL_BEFORE_STORE"], env=env, cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return {k: tuple(v) for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def _audit_handoff(ptx: str, params: list[str]) -> A.AuditReport:
    from megadecode.validate import handoff as H

    return A.audit_ptx(ptx, params, H.PARAM_ROLES, reports=("ERR",), cta_signals=True, read_coverage=False)


def test_the_handoff_kernel_passes_the_cta_rules(handoff_ptx):
    ptx, params = handoff_ptx[""]
    rep = _audit_handoff(ptx, params)
    assert rep.passed and not rep.findings, rep.to_markdown()
    assert {A.R_BAR, A.R_TIMEOUT} <= set(rep.rules_checked) and rep.checked[A.R_TIMEOUT] == "1 spin loop"
    # without the consumer's timeout record (its store to ERR) the spin loop gives up silently
    reg = _param_reg(ptx, params, "ERR")
    addr = {m.group(1) for m in re.finditer(rf"mad\.wide\.[su]32\s+(%rd\d+), %r\d+, 4, {reg};", ptx)}
    assert addr
    silent = _drop(ptx, r"st\.global\.b32 \[ (" + "|".join(addr) + r") ")
    assert [f.rule for f in _audit_handoff(silent, params).errors] == [A.R_TIMEOUT]


def test_the_handoffs_signal_before_store_is_caught_by_the_barrier_rule(handoff_ptx):
    ptx, params = handoff_ptx["SIGNAL_BEFORE_STORE"]
    rep = _audit_handoff(ptx, params)
    hits = _errors(rep, A.R_BAR)
    assert hits and hits[0].params == ("Y",), rep.to_markdown()
