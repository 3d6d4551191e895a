"""The megakernel's checks against the harness's own planted mistakes (validate/mega_plants.py), on the CPU: each
plant whose catcher is a static audit rule is caught by that rule, the control (static weights through the
non-coherent path) passes, and the shipped kernel passes every rule; the host check keeps caches out of the static
address table; the GPU cases of mega_check reach attention splits of several chunks. The GPU catches are in
tests/test_mega_gpu.py and bench/mega_plants_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass", reason="the megakernel needs nvidia-cutlass-dsl (the test extra installs it)")

from megadecode.cache import KVCache  # noqa: E402
from megadecode.backends.mega.lower import lower  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.validate.mega_audit import audit_rules, plant_verdicts  # noqa: E402
from megadecode.validate.mega_plants import CONTROLS, PLANTS, audit_plant, planted  # noqa: E402
from megadecode.weights import random_weights  # noqa: E402

AUDITED = [n for n, p in PLANTS.items() if audit_rules(p.caught_by)]


@pytest.mark.parametrize("name", AUDITED)
def test_the_audit_catches_each_planted_mistake_by_its_rule(name):
    rep = audit_plant(name)
    fired = {f.rule for f in rep.errors}
    assert not rep.passed and set(audit_rules(PLANTS[name].caught_by)) <= fired, rep.to_markdown()


def test_the_plants_cover_the_five_classes_the_checks_must_catch():
    """The non-coherent read of a cache written in the launch, a signal without the block barrier, a timeout that
    goes on silently, relaxed waits and signals, a skipped partial chunk: each has a plant and a catcher."""
    assert {"nc_cache", "no_body_barrier", "silent_timeout", "weak_wait", "relaxed_signal",
            "skip_last_chunk"} <= set(PLANTS)
    assert all(p.caught_by for p in PLANTS.values())
    assert PLANTS["skip_last_chunk"].caught_by == ("gpu:long-splits",)


def test_weights_through_the_non_coherent_path_pass_and_are_proven_static():
    """The control: EMBED's bf16 weight rows read by `ld.global.nc`. The audit passes it and names each such load's
    source as the static table's entries (wtab[]); the nc_cache plant's loads trace to the produced table."""
    rep = audit_plant("nc_weights")
    assert rep.passed, rep.to_markdown()
    assert rep.nc_loads and all(ps == ("wtab[]",) for _, ps in rep.nc_loads), rep.nc_loads
    bad = audit_plant("nc_cache")
    assert any("ptab[]" in f.params for f in bad.by_rule("nc-load-of-produced")), bad.to_markdown()


def test_plants_swap_module_attributes_only_while_compiling():
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.validate.mega_plants import _patches

    bodies = K.BODIES
    for name in list(PLANTS) + list(CONTROLS):
        swaps = _patches(name)
        before = [getattr(mod, attr) for mod, attr, _ in swaps]
        with planted(name, ("EMBED",)):
            assert all(getattr(mod, attr) is not old for (mod, attr, _), old in zip(swaps, before)), name
            assert [b[0] for b in K.BODIES] == ["EMBED"]
        assert [getattr(mod, attr) for mod, attr, _ in swaps] == before and K.BODIES is bodies
    with pytest.raises(ValueError, match="unknown plant"):
        with planted("nope"):
            pass


def test_plant_verdicts_judge_every_plant_and_control():
    rows, reports = plant_verdicts()
    by = {r["variant"]: r for r in rows}
    assert set(by) == {f"mega_kernel+{n}" for n in list(PLANTS) + list(CONTROLS)}
    gpu_only = {f"mega_kernel+{n}" for n, p in PLANTS.items() if all(c.startswith("gpu:") for c in p.caught_by)}
    assert gpu_only == {f"mega_kernel+{n}" for n in ("skip_last_chunk", "ring_overtake", "ring_no_wait")}
    assert all(r["status"] == "PASS" for r in rows if r["variant"] not in gpu_only), rows
    assert all(by[v]["status"] == "SKIP" for v in gpu_only)  # GPU catches: bench/mega_plants_gpu.py
    assert len(reports) == len(rows) - len(gpu_only)


def _program(preset, batch, max_len, ctas=8):
    cfg = preset_config(preset)
    w = random_weights(cfg, "cpu", torch.bfloat16, 0)
    cache = KVCache(cfg, batch, max_len, "cpu", torch.bfloat16)
    return lower(cfg, w, cache, batch, ctas)


def test_kernel_check_keeps_caches_out_of_the_static_table_and_weights_out_of_the_produced_one():
    from megadecode.backends.mega.kernel_check import KernelLimit, check_program

    prog = _program("tiny-deepseek-v3", 2, 64)
    check_program(prog)
    cache = next(i for i, t in enumerate(prog.tensors) if t.role == "produced")
    prog.tensors[cache].role = "static"
    with pytest.raises(KernelLimit, match=r"cache .* is static; the megakernel reads it from the produced table"):
        check_program(prog)
    prog = _program("tiny-deepseek-v3", 2, 64)
    ins = next(i for i in prog.instrs if i.op == "MATVEC")
    prog.tensors[ins.args["w"]].role = "produced"
    with pytest.raises(KernelLimit, match=r"w .* is produced; the megakernel reads it from the static table"):
        check_program(prog)


@pytest.mark.parametrize("ctas", [16, 264])
def test_the_path_cases_reach_attention_splits_of_several_chunks_ending_partial(ctas):
    """mega_gpu.PATH_CASES' "max" context (the last position of a 1000-position cache): every such case has an
    attention split longer than the kernel's 64-position chunk whose length is no multiple of 64, at the tests' 16
    CTAs and mega_check's 264; the old random contexts never had one past 64."""
    from megadecode.validate.mega_gpu import CONTEXTS, PATH_CASES, longest_split

    for preset, batch, ctx in PATH_CASES:
        if ctx != "max" or batch > 5:
            continue
        prog = _program(preset, batch, CONTEXTS[ctx], ctas)
        pos = [CONTEXTS[ctx] - 1] * batch
        assert longest_split(prog, pos) > 64, (preset, batch)
        lens = [(a["s"] + 1) * 1000 // a["S"] - a["s"] * 1000 // a["S"] for a in
                (i.args for i in prog.instrs if i.op in ("ATTN_GQA", "MLA_ATTN"))]
        assert any(n > 64 and n % 64 for n in lens), (preset, batch, sorted(set(lens)))
    old = _program("tiny-qwen3-moe", 1, CONTEXTS["random"], ctas)
    assert longest_split(old, [199]) <= 64
    assert {b for _, b, _ in PATH_CASES} >= {1, 2, 3, 5, 9, 17, 33, 64}


@pytest.mark.parametrize("name", ["ring_overtake", "ring_no_wait"])
def test_the_weight_rings_plants_build_and_differ_where_they_say(name):
    """The weight ring's plants (a page freed a ring ahead of its readers, a page read without its wait) compile;
    the GPU catches them (bench/mega_plants_gpu.py: the delayed build at batch 1 against pyvm). Their builds differ
    from the shipped one in the planted step only: fewer page waits, or the freed count stored a ring ahead."""
    from megadecode.backends.mega import cute_kernel as K
    from megadecode.validate.mega_plants import planted_ptx

    assert PLANTS[name].caught_by == ("gpu:delayed-build",) and PLANTS[name].bodies == ("MATVEC",)
    saved = K.BODIES
    K.BODIES = tuple(b for b in saved if b[0] in PLANTS[name].bodies)  # the shipped build with the plant's bodies
    try:
        shipped = K.compile_ptx_cubin().__ptx__
    finally:
        K.BODIES = saved
    ptx = planted_ptx(name)
    waits = [p.count("mbarrier.try_wait") for p in (shipped, ptx)]
    frees = [p.count("st.release.cta.shared") for p in (shipped, ptx)]
    assert frees[0] == frees[1] > 0 and ptx != shipped
    if name == "ring_no_wait":
        assert 0 < waits[1] < waits[0], waits  # the loader's drain keeps its waits
    else:
        assert waits[1] == waits[0], waits
