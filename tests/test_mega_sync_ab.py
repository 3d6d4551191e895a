"""bench/mega_sync_ab.run_ab on a card too small for one of its presets (k3-mini's fragment-order conversion on an
H100): that preset's row says it was skipped and why, and the other presets are still timed and written. The GPU
parts (builds, pyvm diffs, timed launches) are stand-ins here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mega_sync_ab  # noqa: E402  (bench/)


def test_a_preset_out_of_memory_is_skipped_and_the_rest_are_timed(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(mega_sync_ab, "diff_program", lambda *a, **k: {"buffers": [{"rel": 1e-7}]})
    monkeypatch.setattr(mega_sync_ab, "diff_failures", lambda r: [])

    def timed(preset, batch, context, kernels, rounds):
        if preset == "big":
            raise torch.cuda.OutOfMemoryError("no room to convert the experts\nmore detail")
        return {"preset": preset, "batch": batch, "median_us": {n: 10.0 for n, _ in kernels}, "min_us": {}}

    monkeypatch.setattr(mega_sync_ab, "timed", timed)
    path = tmp_path / "ab.json"
    out = mega_sync_ab.run_ab(["shipped", "other"], lambda n, dev, ring: n, "tiny-qwen3-moe", "small,big,last", "1",
                              64, 2, str(path), "1")
    rows = {r["preset"]: r for r in out["runs"]}
    assert rows["small"]["median_us"] == {"shipped": 10.0, "other": 10.0} and "median_us" in rows["last"]
    assert rows["big"]["skipped"] == "out of GPU memory: no room to convert the experts"
    assert "median_us" not in rows["big"]
    assert json.loads(path.read_text())["runs"] == out["runs"]


def test_each_variant_is_built_checked_and_timed_as_the_build_its_batch_runs(monkeypatch, tmp_path):
    """Batch 1 runs the ring build and the batches past it the two-CTA build (runtime.ring_build): a variant is
    compiled once per build the run's batches need, and each check and timing takes that batch's build (the A/B
    once timed the ring build at every batch, which the executor runs at batch 1 only)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(mega_sync_ab, "diff_failures", lambda r: [])
    built, checked, timed_with = [], [], []

    def build(name, dev, ring):
        built.append((name, ring))
        return f"{name}-{'ring' if ring else 'two-cta'}"

    def diff_program(preset, b, ctas, seed, kernel=None, ring=None):
        checked.append((b, kernel, ring))
        return {"buffers": []}

    def timed(preset, batch, context, kernels, rounds):
        timed_with.append((batch, kernels))
        return {"preset": preset, "batch": batch, "median_us": {}, "min_us": {}}

    monkeypatch.setattr(mega_sync_ab, "diff_program", diff_program)
    monkeypatch.setattr(mega_sync_ab, "timed", timed)
    mega_sync_ab.run_ab(["shipped", "v"], build, "tiny-qwen3-moe", "p", "1,17", 64, 2, str(tmp_path / "ab.json"),
                        "3")
    assert sorted(built) == [("shipped", False), ("shipped", True), ("v", False), ("v", True)]
    assert checked == [(3, "shipped-two-cta", False), (3, "v-two-cta", False)]
    assert [b for b, _ in timed_with] == [1, 17]
    kernels = timed_with[0][1]
    assert kernels[("v", True)] == "v-ring" and kernels[("v", False)] == "v-two-cta"


def test_variant_names_joined_by_plus_only_where_the_script_builds_them():
    ap = mega_sync_ab.ab_parser("p", "1", 1, "shipped", "out.json")
    known = ("shipped", "a", "b")

    def names(v, joins):
        return mega_sync_ab.ab_variants(ap, ap.parse_args(["--variants", v]), known, joins=joins)

    assert names("shipped,a+b,b", True) == ["shipped", "a+b", "b"]
    for v, joins in (("a+b", False), ("a+c", True), ("shipped+a", True), ("c", True)):
        with pytest.raises(SystemExit):
            names(v, joins)


def test_attn_l2_variant_is_todays_loop_with_the_prefetch_step_before_the_wait():
    """The attn_l2 build's module is the shipped cute_kernel.py with one step inserted before the wait (so the
    variant follows the loop as it changes), its prefetch helper beside it."""
    mod = mega_sync_ab._attn_l2_module()
    src = Path(mod.__file__).read_text()
    assert src.count("attn_l2_prefetch(ib, ptab, smi, tid)") == 1
    assert src.index(mega_sync_ab.ATTN_L2_STEP) + len(mega_sync_ab.ATTN_L2_STEP) == src.index(mega_sync_ab.ATTN_L2_AT)
    assert callable(mod.attn_l2_prefetch) and callable(mod.mega_kernel)


def test_attn_early_variant_is_todays_attention_body_with_its_first_chunk_loaded_at_the_wait():
    """The attn_early build's module is the shipped cute/attention.py with op_attn_gqa's first chunk loaded right
    after the split's bounds (before the q norm) and folded where the chunk loop began; the other bodies as they
    are. Its swap replaces ATTN_GQA's body only."""
    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K

    mod = mega_body_ab._attn_early_module()
    src = Path(mod.__file__).read_text()
    gqa = src[src.index("def op_attn_gqa"):src.index("def op_mla_kv")]
    assert gqa.index(mega_body_ab.EARLY_LOADS) < gqa.index("for g in cutlass.range(warp, NQ, NW)")  # before q's norm
    assert gqa.count("gqa_fold(sm, tid, kq0, vq0, pre,") == 1 and mega_body_ab.EARLY_LOOP not in gqa
    assert src.count(mega_body_ab.EARLY_LOADS) == 1  # MLA's attention untouched
    ((_, _, bodies),) = mega_body_ab._swaps("attn_early")
    assert [n for n, _ in bodies] == [n for n, _ in K.BODIES]
    assert [n for (n, f), (_, g) in zip(bodies, K.BODIES) if f is not g] == ["ATTN_GQA"]


def test_tc_warps_variant_traces_its_own_tc_rows_and_keeps_the_shipped_one_up_to_8_tokens():
    """The tc_warps build's module is the shipped cute/dense.py with tc_rows renamed tc_rows_ks (what batches up to
    8 run) and a tc_rows appended that deals the token groups to the warps past 8; its swap replaces MATVEC's and
    GLU's bodies only, with the module's own (whose tc_rows is the appended one)."""
    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute import dense

    mod = mega_body_ab._tc_warps_module()
    src = Path(mod.__file__).read_text()
    assert src.count("def tc_rows(") == 1 and src.index("def tc_rows_ks(") < src.index("def tc_rows(")
    assert "for tg in cutlass.range(sl, ntw, ks):" in src[src.index("def tc_rows_tg("):]
    assert Path(dense.__file__).read_text().count("def tc_rows_ks(") == 0  # the shipped source untouched
    assert mod.tc_rows is not dense.tc_rows and mod.tc_rows_ks is not dense.tc_rows
    ((_, _, bodies),) = mega_body_ab._swaps("tc_warps")
    assert [n for n, _ in bodies] == [n for n, _ in K.BODIES]
    changed = {n for (n, f), (_, g) in zip(bodies, K.BODIES) if f is not g}
    assert changed == {"MATVEC", "GLU"} & {n for n, _ in K.BODIES} and "MATVEC" in changed


def test_hi_diagnostics_drop_only_the_low_half_mma_and_swap_one_module_each():
    """tc_hi / group_hi trace a tc_step whose k halves run their mma against hi alone (the edit made once, in
    tc_step), swapped into cute/dense.py (MATVEC / GLU) or cute/moe.py (F_GROUP's experts) only."""
    import mega_body_ab
    from megadecode.backends.mega.cute import dense, moe

    src = Path(mega_body_ab._hi_module().__file__).read_text()
    step = src[src.index("def tc_step("):src.index("TC_UC = ")]
    assert "for p in (hi,):" in step and "for p in (hi, lo):" not in src
    assert Path(dense.__file__).read_text().count(mega_body_ab.HI_AT) == 1  # the shipped source untouched
    ((mod, attr, fn),) = mega_body_ab._swaps("tc_hi")
    assert (mod, attr) == (dense, "tc_step") and fn is not dense.tc_step
    ((mod, attr, fn2),) = mega_body_ab._swaps("group_hi")
    assert (mod, attr) == (moe, "tc_step") and fn2 is fn


def test_attn_warp_variant_replaces_the_chunk_loop_and_swaps_attn_gqa_only():
    """attn_warp's module is the shipped cute/attention.py with ATTN_GQA's chunk loop and partials (gqa_chunk,
    store_partial) replaced by one call of the appended attn_warps; its swap replaces the ATTN_GQA body only. The
    two staged buffers (keys then values, AW_CH padded rows each at d = 128) fit below the working memory's last
    words, above q's."""
    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute.base import SMEM_F

    mod = mega_body_ab._attn_warp_module()
    src = Path(mod.__file__).read_text()
    gqa = src[src.index("def op_attn_gqa"):src.index("def op_mla_kv")]
    assert gqa.count("attn_warps(") == 1 and "gqa_chunk(" not in gqa and "store_partial(" not in gqa
    assert src.count("def attn_warps(") == 1
    assert mod.AW_K + 2 * 2 * mod.AW_CH * (2 * 128 + 16) <= 4 * (SMEM_F - 128)  # below RSTD's (dense.py)
    assert mod.AW_K >= 4 * 16 * 128  # q of 16 heads at d = 128 below the staged keys
    ((_, _, bodies),) = mega_body_ab._swaps("attn_warp")
    assert [n for (n, f), (_, g) in zip(bodies, K.BODIES) if f is not g] == ["ATTN_GQA"]


def test_merge_one_variant_keeps_the_general_merge_under_its_else():
    """merge_one's op_merge takes S == 1 (no W_UV) in one trip without barriers and runs the shipped body, every
    line of it, under the else; its swap replaces the MERGE body only."""
    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute import dense

    src = Path(mega_body_ab._merge_one_module().__file__).read_text()
    merge = src[src.index("def op_merge("):src.index("def op_sample(")]
    shipped = Path(dense.__file__).read_text()
    general = shipped[shipped.index(mega_body_ab.MERGE_ONE_FROM):shipped.index("\n\n@cute.jit\ndef op_sample(")]
    assert "    if S == 1 and wuv < 0:" in merge and "\n    else:\n" in merge
    assert all(("    " + ln) in merge for ln in general.splitlines() if ln.strip())
    body = merge[merge.index("    if S == 1 and wuv < 0:"):merge.index("\n    else:\n")]
    assert "cta_sync" not in body
    ((_, _, bodies),) = mega_body_ab._swaps("merge_one")
    assert [n for (n, f), (_, g) in zip(bodies, K.BODIES) if f is not g] == ["MERGE"]


def test_tables_match_variant_edits_the_rank_loop_only_and_fits_its_counts():
    """tables_match's route_tables replaces the shipped all-pairs rank loop (made once) with match.any ranks, each
    warp's counts of each expert in shared words 2n .. 2n + NW E: those fit below the working memory's last words
    at the largest batch for K3's experts; its swap replaces cute/moe.py's route_tables only."""
    import mega_body_ab
    from megadecode.backends.mega.cute import moe
    from megadecode.backends.mega.cute.base import NW, SMEM_F
    from megadecode.backends.mega.lower import MAX_BATCH

    src = Path(mega_body_ab._tables_match_module().__file__).read_text()
    tables = src[src.index("def route_tables("):]
    assert "cute.arch.match_sync(" in tables and "for k in cutlass.range(n, unroll=8):" not in tables
    assert Path(moe.__file__).read_text().count(mega_body_ab.TABLES_AT) == 1  # the shipped source untouched
    n, E = MAX_BATCH * 16, 896  # K3: top-16 of 896 experts
    assert 2 * n + NW * E <= SMEM_F - 128
    ((mod, attr, fn),) = mega_body_ab._swaps("tables_match")
    assert (mod, attr) == (moe, "route_tables") and fn is not moe.route_tables


def test_capped_variant_swaps_the_launcher_only():
    """capped replaces cute_kernel.launch (what compile_launcher and compile_ptx_cubin trace) with a launcher that
    asks two CTAs an SM of the two-CTA build, its parameter types given as objects."""
    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K

    ((mod, attr, fn),) = mega_body_ab._swaps("capped")
    assert (mod, attr) == (K, "launch") and fn is not K.launch
    assert 0 < mega_body_ab.CAPPED_CARVEOUT <= 100
    from megadecode.backends.mega.cute import moe

    joined = mega_body_ab._swaps("capped+tables_match")
    assert [(m, a) for m, a, _ in joined] == [(K, "launch"), (moe, "route_tables")]


def test_wna_variants_load_tc_steps_weights_with_ld4w_and_swap_their_modules():
    """wna / group_wna trace a tc_step whose four weight loads are base.ld4w (not allocating in L1) and whose inputs
    load as shipped; wna swaps it into cute/dense.py (MATVEC / GLU) and cute/moe.py (F_GROUP), group_wna into
    cute/moe.py only."""
    import mega_body_ab
    from megadecode.backends.mega.cute import dense, moe

    src = Path(mega_body_ab._wna_module().__file__).read_text()
    step = src[src.index("def tc_step("):src.index("TC_UC = ")]
    assert step.count("ld4w(") == 4 and "ld4u32(" not in step and step.count("ld8(") == 3
    assert Path(dense.__file__).read_text().count("ld4w") == 0  # the shipped source untouched
    swaps = mega_body_ab._swaps("wna")
    assert [(m, a) for m, a, _ in swaps] == [(dense, "tc_step"), (moe, "tc_step")]
    assert all(fn is not dense.tc_step for _, _, fn in swaps)
    assert [(m, a) for m, a, _ in mega_body_ab._swaps("group_wna")] == [(moe, "tc_step")]


def test_raw_wna_variant_swaps_only_the_weight_loads_of_the_cuda_core_bodies():
    """raw_wna's ld8raw loads through base.ld4w (16 bytes, not allocating in L1) and is swapped into dense.py and
    moe.py, with moe.py's ld4u32 as ld4w: in those modules every use of the two names loads a static weight's row
    (the inputs load with ld8), so no produced data changes its load."""
    import inspect
    import re

    import mega_body_ab
    from megadecode.backends.mega.cute import base, dense, moe

    mod = mega_body_ab._raw_wna_module()
    src = inspect.getsource(mod.ld8raw)
    assert "ld4w(addr)" in src and "recast_tensor" in src and mod.ld8raw is not base.ld8raw
    swaps = mega_body_ab._swaps("raw_wna")
    assert [(m, a) for m, a, _ in swaps] == [(dense, "ld8raw"), (moe, "ld8raw"), (moe, "ld4u32")]
    assert swaps[0][2] is mod.ld8raw and swaps[2][2] is base.ld4w
    for m, name in ((dense, "ld8raw"), (moe, "ld8raw"), (moe, "ld4u32")):
        uses = [ln for ln in Path(m.__file__).read_text().splitlines() if re.search(rf"\b{name}\(", ln)
                and not ln.lstrip().startswith("def ")]
        assert uses and all(re.search(r"(row|rows\[\w+\]|gu|dn|wrow|urow) \+", ln) for ln in uses), uses


def test_kv_wna_variant_swaps_attentions_cache_loads_only():
    """kv_wna swaps attention.py's ld8raw and ld4raw (used only by gqa_loads, for the cache's key and value rows)
    for loads that do not allocate in L1: plain `ld.global` still (the cache is written in the launch), no .nc."""
    import inspect
    import re

    import mega_body_ab
    from megadecode.backends.mega.cute import attention

    mod = mega_body_ab._raw_wna_module()
    src = inspect.getsource(mod.ld4raw)
    assert "ld.global.L1::no_allocate.v2.u32" in src and ".nc" not in src
    swaps = mega_body_ab._swaps("kv_wna")
    assert [(m, a) for m, a, _ in swaps] == [(attention, "ld8raw"), (attention, "ld4raw")]
    assert swaps[0][2] is mod.ld8raw and swaps[1][2] is mod.ld4raw
    text = Path(attention.__file__).read_text()
    for name in ("ld8raw", "ld4raw"):
        uses = [ln for ln in text.splitlines() if re.search(rf"\b{name}\(", ln) and not ln.lstrip().startswith("def ")]
        assert len(uses) == 1 and ("krow" in uses[0] or "vc + rowb" in uses[0]), uses
    loads = inspect.getsource(attention.gqa_loads)
    assert "ld8raw(" in loads and "ld4raw(" in loads  # the one use of each is gqa_loads'


def test_group_cp_variant_stages_within_each_warps_share_and_swaps_the_expert_bodies_only():
    """group_cp's F_GROUP bodies take the working memory, their stages (EXPERT_UP: gate and up rows g, g + 8, 4 x
    512 bytes a step; EXPERT_DOWN: 2 x 512) fit a warp's share of it at least twice, and its swap replaces
    EXPERT_UP's and EXPERT_DOWN's bodies only, with op bodies that call the appended group_units_cp."""
    import inspect

    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute.base import NW, SMEM_F

    mod = mega_body_ab._group_cp_module()
    src = Path(mod.__file__).read_text()
    assert src.count("def group_units_cp(") == 1 and src.count("expert_up_group(fb, ib, wtab, smi, tid, sm)") == 1
    assert src.count("expert_down_group(fb, ib, wtab, smi, tid, sm)") == 1
    assert mod.GC_WB * NW == 4 * SMEM_F and mod.GC_WB // 2048 >= 2 and mod.GC_WB // 1024 >= 2
    assert "group_units_cp(" in inspect.getsource(mod.expert_up_group)
    ((_, _, bodies),) = mega_body_ab._swaps("group_cp")
    assert {n for (n, f), (_, g) in zip(bodies, K.BODIES) if f is not g} == {"EXPERT_UP", "EXPERT_DOWN"}


def test_group_ring_variant_stages_in_the_ring_and_needs_the_ring_build():
    """group_ring is group_cp with its stages in the weight ring (each warp an equal share of it, at least the
    stages group_cp has), swapping the same two bodies; asked for without --ring-all it is refused in one line."""
    import mega_body_ab
    from megadecode.backends.mega.cute.base import NW, RING_PAGE, RING_SLOTS

    mod = mega_body_ab._group_ring_module()
    src = Path(mod.__file__).read_text()
    units = src[src.index("def group_units_cp("):src.index("def expert_up_group(", src.index("def group_units_cp("))]
    assert "wbase = smi[RING_S + 5] + warp * GC_WB" in units and "sm.iterator" not in units
    assert mod.GC_WB * NW == RING_SLOTS * RING_PAGE and mod.GC_WB >= mega_body_ab._group_cp_module().GC_WB
    cp = [n for n, _ in mega_body_ab._swaps("group_cp")[0][2]]
    assert [n for n, _ in mega_body_ab._swaps("group_ring")[0][2]] == cp
    with pytest.raises(SystemExit):
        mega_body_ab.main(["--variants", "shipped,group_ring", "--batch", "64"])


def test_mv_ring_variant_streams_tc_rows_slices_through_the_ring_and_joins_group_ring():
    """mv_ring's tc_rows runs each k slice's steps through cp_steps (its tc_step loops gone), op_rows passes it the
    ring's address, and its swap is op_rows alone, so `group_ring+mv_ring` keeps both variants' changes; without
    --ring-all it is refused."""
    import inspect

    import mega_body_ab
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.backends.mega.cute import dense

    mod = mega_body_ab._mv_ring_module()
    rows = inspect.getsource(mod.tc_rows)
    assert "cp_steps(" in rows and "tc_step(" not in rows
    assert "smi[RING_S + 5], glu)" in inspect.getsource(mod.op_rows)
    ((m, attr, fn),) = mega_body_ab._swaps("mv_ring")
    assert (m, attr) == (dense, "op_rows") and fn is mod.op_rows
    joined = mega_body_ab._swaps("group_ring+mv_ring")
    assert [a for _, a, _ in joined] == ["BODIES", "op_rows"]
    assert {n for (n, f), (_, g) in zip(joined[0][2], K.BODIES) if f is not g} == {"EXPERT_UP", "EXPERT_DOWN"}
    with pytest.raises(SystemExit):
        mega_body_ab.main(["--variants", "shipped,mv_ring", "--batch", "17"])


FAKE_TAG = None  # a module-level option the parallel builds set in each worker (prebuilt's `settings`)


class _FakeCompiled:
    """A stand-in for a compiled launcher: its export writes the object file's text (no GPU to export a kernel)."""

    class artifacts:
        CUBIN = None

    def __init__(self, text: str):
        self.text = text

    def export_to_c(self, path: str, name: str) -> None:
        Path(path, f"{name}.o").write_text(self.text)


def fake_build(name, device, ring):
    """Runs in prebuilt's worker processes: `shipped` is the runtimes' own (None), `broken` fails to trace."""
    if name == "shipped":
        return None
    if name == "broken":
        raise RuntimeError("a trace error\nits last line")
    mega_sync_ab.cubin_registers = lambda cubin: 96  # this worker's module: a stand-in has no cubin to count
    return _FakeCompiled(f"{name} {ring} {device.type} {FAKE_TAG}")


def test_parallel_builds_run_in_worker_processes_with_the_options_and_failures_are_left_to_the_caller(monkeypatch,
                                                                                                        capsys):
    """prebuilt compiles each (variant, build) in a spawned process with the build module's options set there,
    exports it as the kernel cache lays out an entry, and loads it here as a Launcher; `shipped` stays None and a
    build that failed in its worker is absent (run_ab compiles it in its own process), said in one line."""
    from megadecode.backends.mega import kernel_cache

    def load(root, key):  # the parent's load of each exported entry (the real one links a CUDA object)
        meta = json.loads((root / key / "meta.json").read_text())
        return ("module", (root / key / f"{kernel_cache.PREFIX}.o").read_text()), meta["registers"]

    monkeypatch.setattr(kernel_cache, "load", load)
    kernels = mega_sync_ab.prebuilt(fake_build, {"FAKE_TAG": "tagged"}, ["shipped", "v", "broken"], [False, True],
                                    jobs=2, device="cpu")
    assert kernels[("shipped", False)] is None and kernels[("shipped", True)] is None
    assert ("broken", False) not in kernels and ("broken", True) not in kernels
    for ring in (False, True):
        k = kernels[("v", ring)]
        assert (k.fn, k.registers, k.source, k.ring) == (f"v {ring} cpu tagged", 96, "cache", ring)
        assert k.compile_s >= 0
    said = capsys.readouterr().out
    assert "parallel build of broken.two_cta failed (RuntimeError: its last line)" in said


def test_run_ab_compiles_here_what_the_parallel_builds_did_not(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(mega_sync_ab, "diff_program", lambda *a, **k: {"buffers": []})
    monkeypatch.setattr(mega_sync_ab, "diff_failures", lambda r: [])
    timed_with = []

    def timed(preset, batch, context, kernels, rounds):
        timed_with.append(dict(kernels))
        return {"preset": preset, "batch": batch, "median_us": {}, "min_us": {}}

    monkeypatch.setattr(mega_sync_ab, "timed", timed)
    asked = []

    def prebuilt(build, settings, names, rings, jobs):
        asked.append((settings, names, rings, jobs))
        return {("v", False): "v-parallel"}

    built = []
    monkeypatch.setattr(mega_sync_ab, "prebuilt", prebuilt)
    out = mega_sync_ab.run_ab(["shipped", "v", "w"], lambda n, dev, ring: built.append(n) or f"{n}-here",
                              "tiny-qwen3-moe", "p", "17", 64, 2, str(tmp_path / "ab.json"), "3", jobs=4,
                              settings={"X": 1})
    assert asked == [({"X": 1}, ["shipped", "v", "w"], [False], 4)] and built == ["shipped", "w"]
    assert timed_with == [{("shipped", False): "shipped-here", ("v", False): "v-parallel", ("w", False): "w-here"}]
    assert out["parallel_build"]["jobs"] == 4


def test_mv_cp_variant_stages_in_the_working_memory_past_the_partials_and_joins_group_cp():
    """mv_cp is mv_ring's tc_rows with each warp's stages in the working memory (4 KiB a warp from MV_CP_AT, past
    tc_rows' k-slice partials and before the norm's rstd words), so the two-CTA build can run it; its swap is
    op_rows alone, so `group_cp+mv_cp` keeps both variants' changes."""
    import inspect

    import mega_body_ab
    from megadecode.backends.mega.cute import dense
    from megadecode.backends.mega.cute.base import NW
    from megadecode.backends.mega.limits import SMEM_F

    mod = mega_body_ab._mv_cp_module()
    assert "cp_steps(" in inspect.getsource(mod.tc_rows) and "tc_step(" not in inspect.getsource(mod.tc_rows)
    rows = inspect.getsource(mod.op_rows)
    assert "Int32(sm.iterator.toint()) + MV_CP_AT, glu)" in rows and "RING_S" not in rows
    assert mod.MV_WB == 4096 and mod.MV_CP_AT >= 4 * 2048  # the partials: words 0 .. 2048
    assert mod.MV_CP_AT + NW * mod.MV_WB <= 4 * dense.RSTD_PART
    assert SMEM_F * 4 >= mod.MV_CP_AT + NW * mod.MV_WB
    ((m, attr, fn),) = mega_body_ab._swaps("mv_cp")
    assert (m, attr) == (dense, "op_rows") and fn is mod.op_rows
    assert [a for _, a, _ in mega_body_ab._swaps("capped+group_cp+mv_cp")] == ["launch", "BODIES", "op_rows"]


def test_jobs_is_an_option_only_of_the_scripts_that_compile_variants():
    ap = mega_sync_ab.ab_parser("p", "1", 1, "shipped", "out.json")
    assert ap.parse_args(["--jobs", "3"]).jobs == 3 and ap.parse_args([]).jobs == 0
    with pytest.raises(SystemExit):  # mega_lower_ab: one kernel for every variant, nothing to compile in parallel
        mega_sync_ab.ab_parser("p", "1", 1, "shipped", "out.json", builds=False).parse_args(["--jobs", "3"])


def test_mv_cp0_loads_the_input_at_its_step():
    """mv_cp0 is mv_cp with no input held a step ahead: cp_steps loads x at the step it multiplies, the copies as
    mv_cp's; its swap is op_rows, as mv_cp's."""
    import inspect

    import mega_body_ab
    from megadecode.backends.mega.cute import dense

    held, at = mega_body_ab._mv_cp_module(), mega_body_ab._mv_cp_module(prefetch_x=False)
    src = inspect.getsource(at.cp_steps)
    assert "xr." not in src and "xv = ld8(Float32, xrow + Int64(k) * 4)" in src
    assert "xr.store(" in inspect.getsource(held.cp_steps)
    assert at.MV_WB == held.MV_WB and at.MV_CP_AT == held.MV_CP_AT
    ((m, attr, fn),) = mega_body_ab._swaps("mv_cp0")
    assert (m, attr) == (dense, "op_rows") and fn is not held.op_rows
