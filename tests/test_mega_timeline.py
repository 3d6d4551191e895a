"""bench/mega_timeline.py --from: the phases of a recorded megakernel step, on the CPU (the program lowered again on
meta tensors). A made-up recording of tiny-qwen3-moe: bytes, spans, rates and imbalance come out as constructed, and
a recording of another program is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import mega_timeline  # noqa: E402

from megadecode.cache import KVCache  # noqa: E402
from megadecode.backends.mega.lower import lower  # noqa: E402
from megadecode.backends.mega.schedule import schedule  # noqa: E402
from megadecode.presets import preset_config  # noqa: E402
from megadecode.weights import param_specs  # noqa: E402


def _recording(ctas=8, batch=2):
    cfg = preset_config("tiny-qwen3-moe")
    w = {n: torch.empty(p.shape, device="meta", dtype=torch.float32 if p.fp32 else torch.bfloat16)
         for n, p in param_specs(cfg).items()}
    prog = schedule(lower(cfg, w, KVCache(cfg, batch, 16 + 8, "meta", torch.bfloat16), batch, ctas), ctas)
    rows, t = [], 0
    for i, ins in enumerate(prog.instrs):  # one after another, instruction i lasting 1000 + i ns
        rows.append({"instr": i, "name": ins.name, "op": ins.op, "layer": ins.layer, "sm": i % ctas,
                     "wait": t, "start": t, "end": t + 1000 + i})
        t += 1000 + i
    summary = {"preset": "tiny-qwen3-moe", "batch": batch, "context": 16, "ctas": ctas, "step_us": t / 1e3}
    return prog, {"summary": summary, "rows": rows}


def test_phases_add_up_what_was_recorded():
    prog, rec = _recording()
    ph = mega_timeline.phases(rec)
    assert sum(d["instructions"] for d in ph) == len(prog.instrs)
    assert sum(d["bytes"] for d in ph) == sum(i.bytes for i in prog.instrs) > 0
    for d in ph:
        mine = [(i, ins) for i, ins in enumerate(prog.instrs) if ins.name.split("[")[0] == d["phase"]]
        durs = [1000 + i for i, _ in mine]
        assert d["mean_us"] == pytest.approx(sum(durs) / len(durs) / 1e3)
        assert d["max_us"] == pytest.approx(max(durs) / 1e3)
        if d["span_us"]:
            assert d["hbm_share"] == pytest.approx(d["bytes"] / (d["span_us"] * 1e-6) / mega_timeline.HBM)
    assert [d["start_us"] for d in ph] == sorted(d["start_us"] for d in ph)


def test_body_marks_split_an_instruction_into_its_segments():
    """ROUTE's 4 marks (cute/moe.py, base.mark) give 5 segments: start -> mark 0 -> ... -> mark 3 -> end, averaged
    over the instructions with every mark stamped; instructions without marks (a build without them) are left out."""
    _, rec = _recording()
    routes = [r for r in rec["rows"] if r["op"] == "ROUTE"]
    assert len(routes) >= 2
    for k, r in enumerate(routes):
        r["marks"] = [r["start"] + 100 * (j + 1) * (k + 1) for j in range(4)]
        r["end"] = r["start"] + 1000 * (k + 1)
    routes[-1]["marks"] = [None] * 4
    segs = dict(mega_timeline.marked_segments(rec["rows"])["ROUTE"])
    n = len(routes) - 1
    mean_k = sum(k + 1 for k in range(n)) / n
    assert list(segs) == list(mega_timeline.MARKS["ROUTE"])
    for name in list(segs)[:4]:
        assert segs[name] == pytest.approx(0.1 * mean_k)
    assert segs["pair lists"] == pytest.approx(0.6 * mean_k)
    assert "MATVEC" not in mega_timeline.marked_segments(rec["rows"])


def test_the_kernel_marks_route_and_keeps_tlw_words_per_instruction():
    """The kernel's timeline layout and ROUTE's and ATTN_GQA's marks as mega_timeline reads them: TLW words per
    instruction, and as many mark calls in op_route (op_attn_gqa) as MARKS names segments, less one."""
    import re

    from megadecode.backends.mega.isa import TLW

    root = Path(__file__).resolve().parent.parent / "megadecode/backends/mega/cute"
    for op, file, start, end in (("ROUTE", "moe.py", "def op_route", "def up_mx_rows1"),
                                 ("ATTN_GQA", "attention.py", "def op_attn_gqa", "def op_mla_kv")):
        src = (root / file).read_text()
        body = src[src.index(start):src.index(end)]
        marks = sorted({int(k) for k in re.findall(r"mark\(smi, idx, (\d)\)", body)})  # ROUTE's 3: either path
        assert marks == list(range(len(mega_timeline.MARKS[op]) - 1)), op
    # the kernel's own timeline words and base.mark's slots (4 + k) fit the TLW words a row has
    kernel = (Path(__file__).resolve().parent.parent / "megadecode/backends/mega/cute_kernel.py").read_text()
    assert {int(i) for i in re.findall(r"tl\[TLW \* idx \+ (\d)\]", kernel)} == {1, 2, 3}
    assert "tl[TLW * idx] = " in kernel and 4 + max(marks) < TLW


def test_a_recording_of_another_program_is_refused():
    _, rec = _recording()
    rec["rows"][3]["name"] = "L9.something[0]"
    with pytest.raises(SystemExit, match="lowered differently"):
        mega_timeline.phases(rec)


def test_the_image_of_a_recording_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    _, rec = _recording()
    out = tmp_path / "t.png"
    mega_timeline.render(rec["rows"], str(out), "made up")
    img = Image.open(out)
    assert img.size[0] > 1000 and len(img.getcolors(64) or []) > 3  # drawn, in the palette, not blank


def test_the_fit_recovers_a_made_up_cost_per_opcode():
    """Durations made to be 5 us + bytes / (2 GB/s) for MATVEC (and a constant 3 us for every other opcode): the
    fit returns those constants and no error."""
    prog, rec = _recording()
    for r in rec["rows"]:
        ins = prog.instrs[r["instr"]]
        us = 5.0 + ins.bytes / 2e9 * 1e6 if ins.op == "MATVEC" else 3.0
        r["end"] = r["start"] + round(us * 1e3)
    got = mega_timeline.fit([rec])
    mv = got["MATVEC b2"]
    assert mv["fixed_us"] == pytest.approx(5.0, abs=0.01) and mv["gbps_per_cta"] == pytest.approx(2.0, rel=1e-2)
    assert mv["median_rel_err"] < 1e-3 and mv["instructions"] == sum(i.op == "MATVEC" for i in prog.instrs)
    assert all(d["measured_us"] == pytest.approx(3.0, abs=1e-3) for op, d in got.items() if op != "MATVEC b2")


def test_sass_mix_compiles_each_opcode_alone_and_leaves_the_whole_kernel(monkeypatch):
    """bench/mega_sass_mix.py builds the kernel with one opcode body at a time. compile_for is cached, so each op
    must get its own build (the cache once handed every op after the first the first op's kernel), and a later
    compile_for must be the whole kernel again."""
    import functools
    import types

    cute_kernel = pytest.importorskip("megadecode.backends.mega.cute_kernel")  # needs the cute extra (CuTe DSL)
    import mega_sass_mix

    from megadecode.backends.mega import runtime
    from megadecode.validate import audit

    @functools.lru_cache(maxsize=4)
    def fake_compile(plant=None):
        return types.SimpleNamespace(__ptx__=",".join(b[0] for b in cute_kernel.BODIES))

    monkeypatch.setattr(cute_kernel, "compile_for", fake_compile)
    monkeypatch.setattr(runtime, "assemble", lambda ptx: (ptx, ""))
    monkeypatch.setattr(audit, "disassemble", lambda cubin: (cubin, None))
    assert mega_sass_mix.sass_of("MATVEC") == "MATVEC"
    assert mega_sass_mix.sass_of("GLU") == "GLU"
    assert cute_kernel.compile_for().__ptx__ == ",".join(b[0] for b in cute_kernel.BODIES)


def test_mega_check_exit_status_says_whether_every_launch_agreed(tmp_path, monkeypatch, capsys):
    """bench/mega_check.py (the GPU's buffers against pyvm) exits 1 on a buffer over its tolerance, a repeat or
    delayed build that differs, a failed launch, or decode logits off pyvm's, so gpu_evidence.sh (kernel, sanitizer)
    can act on its status. Its verdicts are the GPU tests' (mega_gpu.diff_failures / e2e_failures): at 8511b25 it
    exited 0 on logits 1.1e-2 from pyvm that the GPU test failed at 1e-3."""
    import mega_check

    from megadecode.validate.mega_gpu import BUFFER_TOL, E2E_PYVM_TOL

    good = {"instructions": 3, "first_launch_s": 0.1, "repeat_bitwise_equal": True, "delayed_runs": 3,
            "delayed_bitwise_equal": True, "buffers": [{"buffer": "hidden", "rel": 1e-7}], "mismatched": [],
            "longest_split": 40}
    row = dict(good)
    monkeypatch.setattr(mega_check, "diff_program",
                        lambda preset, b, ctas, seed, context: {**row, "preset": preset, "batch": b,
                                                                "context": context})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    out = tmp_path / "m.json"
    monkeypatch.setattr(sys, "argv", ["mega_check.py", "--presets", "tiny-k3", "--batches", "1", "--tokens", "0",
                                      "--ctas", "4", "--out", str(out)])
    assert mega_check.main() == 0
    # the evidence file: a buffer's row on one line, its difference at 3 significant digits
    row = {**good, "buffers": [{"buffer": "hidden", "rel": 1.23456e-4}]}
    assert mega_check.main() == 0
    assert any(line.strip().startswith('{"buffer": "hidden", "rel": 0.000123}') for line in out.read_text().splitlines())
    row = dict(good)
    for bad in ({"mismatched": ["hidden"]}, {"repeat_bitwise_equal": False}, {"delayed_bitwise_equal": False},
                {"buffers": [{"buffer": "cache.1.0", "rel": BUFFER_TOL * 1.2}]},
                {"buffers": [{"buffer": "logits", "rel": float("nan")}]}):
        row = {**good, **bad}
        assert mega_check.main() == 1, bad
    assert "FAIL diff tiny-k3 b=1: over" in capsys.readouterr().out

    row = dict(good)  # the decode steps against pyvm
    vp_good = {"worst": 1e-6, "median": 1e-7, "frac_over": 0.0, "clear_token_mismatches": 0, "finite": True}
    vt = {"worst": 0.5, "median": 1e-2, "frac_over": 0.25, "clear_token_mismatches": 0}
    greedy = {"equal": 8, "tokens": 8, "first_divergence": [None]}
    e2e = {"vs_pyvm": vp_good}
    monkeypatch.setattr(mega_check, "end_to_end", lambda preset, b, tokens, seed: {
        "preset": preset, "batch": b, "steps": 4, "vs_torch_bf16": vt, "smallest_routing_margin": 1e-4,
        "torch_bf16": greedy, "torch_fp32": greedy, **e2e})
    monkeypatch.setattr(sys, "argv", ["mega_check.py", "--presets", "tiny-k3", "--batches", "1", "--tokens", "8",
                                      "--ctas", "4", "--out", str(out)])
    assert mega_check.main() == 0  # torch's statistical agreement (half a logit off, routing ties) is read only
    for bad in ({"worst": E2E_PYVM_TOL * 11}, {"finite": False}, {"clear_token_mismatches": 1}):
        e2e = {"vs_pyvm": {**vp_good, **bad}}
        assert mega_check.main() == 1, bad
    assert "FAIL e2e tiny-k3 b=4: logits 1.1e-02 from pyvm" in capsys.readouterr().out

    def boom(*a):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(mega_check, "diff_program", boom)
    assert mega_check.main() == 1 and "error" in json.loads(out.read_text())["diff"][0]


def test_timeline_rows_read_tlw_words_and_the_marks_stamped():
    """MegaRuntime.timeline_rows (on a CPU runtime, its buffer filled by hand as the kernel would): times relative
    to the earliest wait, marks None where not stamped."""
    from megadecode.backends.mega.isa import TLW
    from megadecode.backends.mega.runtime import MegaRuntime

    from megadecode.weights import random_weights

    cfg = preset_config("tiny-qwen3-moe")
    w = random_weights(cfg, "cpu", torch.bfloat16, 0)
    prog = schedule(lower(cfg, w, KVCache(cfg, 1, 24, "cpu", torch.bfloat16), 1, 8), 8)
    rt = MegaRuntime(prog, "cpu", timeline=True)
    t = rt.tl.view(-1, TLW)
    n = t.shape[0]
    assert n == len(prog.instrs)
    t[:, 0] = torch.arange(n) * 10 + 100
    t[:, 1] = t[:, 0] + 2
    t[:, 2] = t[:, 0] + 9
    t[:, 3] = torch.arange(n) % 5
    t[3, 4:6] = torch.tensor([104, 106])
    rows = rt.timeline_rows()
    assert rows[0]["wait"] == 0 and rows[1]["start"] == 12 and rows[2]["end"] == 29 and rows[4]["sm"] == 4
    assert rows[3]["marks"] == [4, 6, None, None] and rows[0]["marks"] == [None] * 4


def test_one_process_records_every_preset_and_batch_asked_for(monkeypatch, capsys):
    """`--preset a,b --batch 1,8` records each (preset, batch) in one process (the kernel compiles once per process:
    gpu_evidence.sh's timelines paid one compile per recording), each to its own file from the {preset} / {batch}
    template; a template that would write two recordings to one file is refused before any GPU work."""
    calls = []
    monkeypatch.setattr(mega_timeline, "record", lambda *a: calls.append(a))
    mega_timeline.main(["--preset", "qwen3-30b-a3b,tiny-k3", "--batch", "1,8", "--out", "ev/{preset}-b{batch}"])
    assert calls == [("qwen3-30b-a3b", 1, 1024, "ev/qwen3-30b-a3b-b1"), ("qwen3-30b-a3b", 8, 1024, "ev/qwen3-30b-a3b-b8"),
                     ("tiny-k3", 1, 1024, "ev/tiny-k3-b1"), ("tiny-k3", 8, 1024, "ev/tiny-k3-b8")]
    calls.clear()
    mega_timeline.main(["--preset", "k3-mini", "--batch", "1", "--out", "ev/one"])  # one recording: any name
    assert calls == [("k3-mini", 1, 1024, "ev/one")]
    calls.clear()
    with pytest.raises(SystemExit):
        mega_timeline.main(["--preset", "k3-mini", "--batch", "1,8", "--out", "ev/k3-mini-b{preset}"])
    assert calls == [] and "put {preset}" in capsys.readouterr().err


def test_matvec_marks_are_reported_per_projection():
    """Batch-1 MATVEC rows carry 4 marks (cute/dense.py op_rows): reported per projection name, 5 segments each."""
    _, rec = _recording(batch=1)
    mv = [r for r in rec["rows"] if r["op"] == "MATVEC"]
    for r in mv:
        r["marks"] = [r["start"] + 100 * (j + 1) for j in range(4)]
        r["end"] = r["start"] + 1000
    segs = mega_timeline.marked_segments(rec["rows"])
    kinds = {r["name"].split("[")[0].split(".", 1)[1] for r in mv}
    assert {f"MATVEC {k}" for k in kinds} == {k for k in segs if k.startswith("MATVEC")}
    for k in kinds:
        assert [round(us, 6) for _, us in segs[f"MATVEC {k}"]] == [0.1, 0.1, 0.1, 0.1, 0.6]


def test_a_layers_phases_are_averaged_over_the_layers():
    """layer_kinds: per phase kind of the layers (L<i>.<kind>), the mean span and instruction time over the layers and
    the gap from the last earlier end; layer_walls: each layer's first start to last end. Back-to-back instructions
    leave no gap; a layer's wall is the sum of its instructions."""
    prog, rec = _recording()
    ph = mega_timeline.phases(rec)
    kinds = mega_timeline.layer_kinds(ph)
    layered = [d for d in ph if d["phase"].split(".")[0][1:].isdigit()]
    assert {k["kind"] for k in kinds} == {d["phase"].split(".", 1)[1] for d in layered}
    for k in kinds:
        mine = [d for d in layered if d["phase"].split(".", 1)[1] == k["kind"]]
        assert k["layers"] == len(mine)
        assert k["span_us"] == pytest.approx(sum(d["span_us"] for d in mine) / len(mine))
        assert k["mean_us"] == pytest.approx(sum(d["mean_us"] for d in mine) / len(mine))
        assert k["gap_us"] == pytest.approx(0.0)
    walls = mega_timeline.layer_walls(ph)
    layers = sorted({ins.layer for ins in prog.instrs if ins.layer >= 0})
    assert len(walls) == len(layers)
    for layer, wall in zip(layers, walls):
        durs = [1000 + i for i, ins in enumerate(prog.instrs) if ins.name.startswith(f"L{layer}.")]
        assert wall == pytest.approx(sum(durs) / 1e3)
    # layer_floors: each layer's bytes at the HBM's rate, in the same order
    floors = mega_timeline.layer_floors(ph)
    for layer, floor in zip(layers, floors):
        nb = sum(ins.bytes for ins in prog.instrs if ins.name.startswith(f"L{layer}."))
        assert nb > 0 and floor == pytest.approx(nb / mega_timeline.HBM * 1e6)
    # a gap: every phase of layer 1 starts 5 us late
    late = {r["instr"] for r in rec["rows"] if r["name"].startswith("L1.")}
    first = min(r["start"] for r in rec["rows"] if r["instr"] in late)
    for r in rec["rows"]:
        if r["start"] >= first:
            for key in ("wait", "start", "end"):
                r[key] += 5000
    gaps = {k["kind"]: k["gap_us"] for k in mega_timeline.layer_kinds(mega_timeline.phases(rec))}
    n = {k["kind"]: k["layers"] for k in kinds}
    first_kind = next(d["phase"].split(".", 1)[1] for d in layered if d["phase"].startswith("L1."))
    assert gaps[first_kind] == pytest.approx(5.0 / n[first_kind])


def test_compare_sets_a_layers_phases_side_by_side(tmp_path, capsys):
    """--compare BEFORE AFTER: every phase kind of a layer with its span before and after and the difference; a
    recording against itself differs by nothing, one 2 us slower phase shows as +2.0 (and in the layer and step
    lines); recordings of two presets or batches are refused."""
    _, before = _recording()
    _, after = _recording()
    table = mega_timeline.compare(before, after)
    kinds = mega_timeline.layer_kinds(mega_timeline.phases(before))
    assert all(f"{k['kind']:<16}" in table for k in kinds)
    assert "+0.0" in table and "+2.0" not in table
    # one instruction of one phase kind 2 us longer in every layer (the synthetic instructions run one after the
    # other, so its phase's span grows by 2 us), everything after it shifted
    kind = kinds[0]["kind"]
    shift, seen = 0, set()
    for r in after["rows"]:
        r["wait"] += shift
        r["start"] += shift
        phase = r["name"].split("[")[0]
        if phase.split(".", 1)[-1] == kind and phase[1:2].isdigit() and phase not in seen:
            seen.add(phase)
            shift += 2000
        r["end"] += shift
    after["summary"]["step_us"] += shift / 1e3
    line = next(x for x in mega_timeline.compare(before, after).splitlines() if x.startswith(f"{kind:<16}"))
    assert "+2.0" in line
    paths = []
    for name, rec in (("a", before), ("b", after)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(rec))
    mega_timeline.main(["--compare", str(paths[0]), str(paths[1])])
    assert "a layer" in capsys.readouterr().out
    other = {**after, "summary": {**after["summary"], "batch": 8}}
    with pytest.raises(ValueError, match="one preset at one batch"):
        mega_timeline.compare(before, other)


def test_occupancy_spreads_each_instructions_bytes_over_its_span():
    """Two instructions on two CTAs: A moves 1.2 us of HBM's bytes over [0, 2) us, B 0.5 us of them over [1, 3.5) us;
    in 1 us bins the occupancy is A's rate (0.6 of HBM's 4.57 TB/s) in bin 0, A's plus B's (0.2) in bin 1, B's after,
    and half a bin of B in the last: the bins hold every byte, and the bands split the step's bins by occupancy."""
    rows = [{"start": 0, "end": 2000}, {"start": 1000, "end": 3500}]
    hbm_us = mega_timeline.HBM * 1e-6  # bytes a us at the rate
    nbytes = [round(1.2 * hbm_us), round(0.5 * hbm_us)]
    occ = mega_timeline.occupancy(rows, nbytes)
    assert occ == pytest.approx([0.6, 0.8, 0.2, 0.1], rel=1e-6)
    assert sum(occ) * hbm_us == pytest.approx(sum(nbytes), rel=1e-6)
    assert mega_timeline.occupancy_bands(occ) == [0.5, 0.5, 0.75, 0.25]  # below 25%, 50%, 75%; at or above 75%
    # an instruction without bytes or time adds nothing; a wider bin averages
    assert mega_timeline.occupancy(rows + [{"start": 10, "end": 10}], nbytes + [5]) == occ
    assert mega_timeline.occupancy(rows, nbytes, bin_us=2.0) == pytest.approx([(occ[0] + occ[1]) / 2,
                                                                               (occ[2] + occ[3]) / 2])


def test_the_report_gives_the_steps_hbm_occupancy(capsys, tmp_path):
    """--from prints the step's mean occupancy and its bands, from the recording's rows and the cost model's bytes;
    --png draws the occupancy panel under the SMs."""
    prog, rec = _recording()
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    mega_timeline.report(str(path))
    out = capsys.readouterr().out
    occ = mega_timeline.occupancy(rec["rows"], [ins.bytes for ins in prog.instrs])
    assert f"HBM occupancy over the step (1 us bins, each instruction's bytes over its work span): mean " \
           f"{sum(occ) / len(occ):.0%}" in out
    pytest.importorskip("matplotlib")
    mega_timeline.main(["--from", str(path), "--png", str(tmp_path / "rec.png")])
    assert (tmp_path / "rec.png").stat().st_size > 1000


def test_a_recording_carrying_its_bytes_is_read_without_lowering_again(monkeypatch):
    """Rows that carry their cost-model bytes (recordings made since) are read as they are: a later lowering change
    cannot refuse them, and phases and occupancy use the recorded bytes; rows without them lower again."""
    prog, rec = _recording()
    for r in rec["rows"]:
        r["bytes"] = prog.instrs[r["instr"]].bytes + 7  # bytes the lowering would not give
    monkeypatch.setattr(mega_timeline, "lowered", lambda recording: pytest.fail("lowered again"))
    ph = mega_timeline.phases(rec)
    assert sum(d["bytes"] for d in ph) == sum(i.bytes + 7 for i in prog.instrs)
    assert mega_timeline.row_bytes(rec) == [i.bytes + 7 for i in prog.instrs]
    monkeypatch.undo()
    del rec["rows"][0]["bytes"]
    assert mega_timeline.row_bytes(rec) == [i.bytes for i in prog.instrs]
