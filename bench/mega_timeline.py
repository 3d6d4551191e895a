"""A per-SM timeline of one megakernel decode step: which instruction each CTA ran when, and how long it waited.

Runs one step of `--preset` at `--batch` with the timeline build (MegaRuntime(timeline=True)), writes the rows as
JSON and renders a PNG: one row per SM, each instruction a bar coloured by opcode from its work start to its end,
the wait before it in grey. Random weights, cache filled with random values, every sequence `--context` long.

    python bench/mega_timeline.py --preset qwen3-30b-a3b --batch 1 --out $OUT/mega-timeline

`--from FILE.json` (no GPU): the phases of a recorded step (and with `--png FILE` its image), a layer's phases
averaged over the layers, the marks of the bodies. `--compare BEFORE.json AFTER.json` (no GPU): a layer's phases of
two recordings side by side. `--fit FILE.json ...`
(no GPU): the scheduler's cost model against the recorded instruction times, per opcode, with a fitted
fixed cost and rate. Each instruction's HBM bytes by the cost model are the recording's own (its rows carry
them), or for older recordings the program's lowered again on meta tensors (same preset, batch and CTAs; checked
instruction by instruction against the recording); per phase: instructions, bytes, the span from its first start
to its last end, the rate that is over the span (and as a share of the H200's measured 4.57 TB/s), the mean and
longest instruction, and the time the longest instruction kept the phase open past the mean one (imbalance).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import torch

from megadecode.cache import KVCache
from megadecode.backends import expert_layout
from megadecode.backends.mega.executor import default_ctas, frag_order
from megadecode.backends.mega.lower import lower
from megadecode.backends.mega.runtime import MegaRuntime, ring_build
from megadecode.backends.mega.schedule import schedule
from megadecode.plan import build_plan
from megadecode.presets import preset_config
from megadecode.quant.mxfp4_frag import entry_shape
from megadecode.weights import random_weights


def render(rows: list[dict], path: str, title: str, occ: list[float] | None = None, bin_us: float = 1.0) -> None:
    """One row per SM: each instruction a bar from its work start to its end coloured by opcode, the wait before it
    grey. One broken_barh call per SM and kind (a step has 15-20k instructions; a bar each took minutes). With
    `occ` (`occupancy`, bins of bin_us), a panel below: the HBM occupancy over the step against the rate (1.0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows})
    colours = {op: plt.cm.tab20(i % 20) for i, op in enumerate(ops)}
    sms = sorted({r["sm"] for r in rows})
    by_sm: dict[int, list[dict]] = {}
    for r in rows:
        by_sm.setdefault(r["sm"], []).append(r)
    h = max(4, len(sms) * 0.06)
    if occ is None:
        fig, ax = plt.subplots(figsize=(16, h))
    else:
        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(16, h + 2.5), sharex=True,
                                      gridspec_kw={"height_ratios": [h, 2.5]})
        xs = [(k + 0.5) * bin_us for k in range(len(occ))]
        ax2.fill_between(xs, occ, step="mid", color="tab:blue", linewidth=0)
        ax2.axhline(1.0, color="k", linewidth=0.8)
        ax2.set_ylim(0, max(1.1, max(occ, default=0) * 1.05))
        ax2.set_ylabel("HBM occupancy")
        ax2.set_xlabel("us since the first wait (occupancy: each instruction's bytes over its work span)")
    for y, sm in enumerate(sms):
        rs = by_sm[sm]
        ax.broken_barh([(r["wait"] / 1e3, (r["start"] - r["wait"]) / 1e3) for r in rs], (y - 0.4, 0.8),
                       facecolors="0.85", linewidth=0)
        ax.broken_barh([(r["start"] / 1e3, (r["end"] - r["start"]) / 1e3) for r in rs], (y - 0.4, 0.8),
                       facecolors=[colours[r["op"]] for r in rs], linewidth=0)
    ax.set_xlim(0, max(r["end"] for r in rows) / 1e3)
    ax.set_ylim(-1, len(sms))
    if occ is None:
        ax.set_xlabel("us since the first wait")
    ax.set_ylabel("SM")
    ax.set_title(title)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[o]) for o in ops] +
              [plt.Rectangle((0, 0), 1, 1, color="0.85")], labels=ops + ["waiting"], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency: a 32-colour palette keeps the evidence image ~25 KB

    Image.open(path).convert("RGB").quantize(colors=32).save(path, optimize=True)


HBM = 4.57e12  # bytes/s, the H200's measured copy rate (shared/GPU.md)
BANDS = (0.25, 0.5, 0.75)  # occupancy bands the report gives the step's time in


def occupancy(rows: list[dict], nbytes: list[int], bin_us: float = 1.0) -> list[float]:
    """The step's HBM occupancy over time: each instruction's bytes (the cost model's, `nbytes[i]` for rows[i])
    spread evenly over its work span (start to end), summed over the CTAs in bins of `bin_us` from time 0, as a
    share of HBM's rate. An estimate of when bytes moved (the kernel does not time its loads), whose bins below
    the rate are the bubbles of the step: phases waiting on latency, not on bytes."""
    step = max(r["end"] for r in rows)
    w = bin_us * 1e3  # ns a bin
    acc = [0.0] * max(1, math.ceil(step / w))
    for r, b in zip(rows, nbytes):
        t0, t1 = r["start"], r["end"]
        if b <= 0 or t1 <= t0:
            continue
        rate = b / (t1 - t0)  # bytes a ns
        k = int(t0 // w)
        while k * w < t1 and k < len(acc):
            lo, hi = max(t0, k * w), min(t1, (k + 1) * w)
            acc[k] += rate * (hi - lo)
            k += 1
    return [a / (w * 1e-9) / HBM for a in acc]


def occupancy_bands(occ: list[float]) -> list[float]:
    """The share of the bins below each of BANDS' occupancies (the last share: at or above the highest)."""
    n = max(1, len(occ))
    below = [sum(o < b for o in occ) / n for b in BANDS]
    return below + [1.0 - below[-1]]


def lowered(recording: dict):
    """The recorded step's program, lowered again on meta tensors (same preset, batch, context and CTAs) and checked
    instruction by instruction against the recording."""
    from megadecode.weights import param_specs

    s = recording["summary"]
    cfg = preset_config(s["preset"])
    frag = s.get("experts") == expert_layout.FRAGMENT  # the routed experts' order in the recording

    def shape(n, p):
        return entry_shape(n, p.shape) if frag and p.quant == "mxfp4" and p.stacked else p.shape

    w = {n: torch.empty(shape(n, p), device="meta", dtype=torch.uint8 if p.quant == "mxfp4" else
                        torch.float32 if p.fp32 else torch.bfloat16) for n, p in param_specs(cfg).items()}
    cache = KVCache(cfg, s["batch"], s["context"] + 8, "meta", torch.bfloat16)
    prog = schedule(lower(cfg, w, cache, s["batch"], s["ctas"]), s["ctas"])
    for r in recording["rows"]:
        ins = prog.instrs[r["instr"]]
        if ins.name != r["name"]:
            raise SystemExit(f"instruction {r['instr']} is {ins.name!r} here, {r['name']!r} in the recording: "
                             "lowered differently (another commit?)")
    return prog


def phases(recording: dict, nbytes: list[int] | None = None) -> list[dict]:
    """Per phase (instruction names up to '['), in the order the phases started; `nbytes`: row_bytes' (computed
    here when not given)."""
    if nbytes is None:
        nbytes = row_bytes(recording)
    by: dict[str, list] = {}
    for r, b in zip(recording["rows"], nbytes):
        by.setdefault(r["name"].split("[")[0], []).append((r, b))
    out = []
    for name, got in by.items():
        rs = [r for r, _ in got]
        dur = [r["end"] - r["start"] for r in rs]
        span_ns = max(r["end"] for r in rs) - min(r["start"] for r in rs)
        nbytes = sum(b for _, b in got)
        out.append({"phase": name, "op": rs[0]["op"], "instructions": len(rs), "bytes": nbytes,
                    "start_us": min(r["start"] for r in rs) / 1e3, "end_us": max(r["end"] for r in rs) / 1e3,
                    "span_us": span_ns / 1e3,
                    "hbm_share": nbytes / (span_ns * 1e-9) / HBM if span_ns else 0.0,
                    "mean_us": sum(dur) / len(dur) / 1e3, "max_us": max(dur) / 1e3,
                    "imbalance_us": (max(dur) - sum(dur) / len(dur)) / 1e3})
    return sorted(out, key=lambda d: d["start_us"])


def layer_kinds(ph: list[dict]) -> list[dict]:
    """A layer's phases, averaged over the layers (phases named L<i>.<kind>, i >= 0), in the order they start: per
    kind the layers it is in, its mean span, its mean instruction time, and the mean gap from the last end of an
    earlier phase to its start (the dependency's hand-over: signal, wait, the next instruction's start)."""
    by: dict[str, list] = {}
    ends: list[float] = []
    for d in sorted(ph, key=lambda d: d["start_us"]):
        before = [e for e in ends if e <= d["start_us"]]
        gap = d["start_us"] - max(before) if before else 0.0
        ends.append(d["end_us"])
        layer, _, kind = d["phase"].partition(".")
        if layer[:1] == "L" and layer[1:].isdigit() and kind:
            by.setdefault(kind, []).append((d, gap))
    out = []
    for kind, got in by.items():
        n = len(got)
        out.append({"kind": kind, "op": got[0][0]["op"], "layers": n,
                    "span_us": sum(d["span_us"] for d, _ in got) / n,
                    "mean_us": sum(d["mean_us"] for d, _ in got) / n, "gap_us": sum(g for _, g in got) / n})
    return out


def layer_floors(ph: list[dict]) -> list[float]:
    """Per layer (phases L<i>.*, i >= 0, in layer_walls' order): its phases' bytes at the HBM's rate, us (what the
    layer would take if only its bytes held it)."""
    nb: dict[str, int] = {}
    for d in ph:
        layer = d["phase"].partition(".")[0]
        if layer[:1] == "L" and layer[1:].isdigit():
            nb[layer] = nb.get(layer, 0) + d["bytes"]
    return [b / HBM * 1e6 for b in nb.values()]


def layer_walls(ph: list[dict]) -> list[float]:
    """Per layer (phases L<i>.*, i >= 0): the time from its first phase's start to its last phase's end, us."""
    span: dict[str, list[float]] = {}
    for d in ph:
        layer = d["phase"].partition(".")[0]
        if layer[:1] == "L" and layer[1:].isdigit():
            lo, hi = span.get(layer, [d["start_us"], d["end_us"]])
            span[layer] = [min(lo, d["start_us"]), max(hi, d["end_us"])]
    return [hi - lo for lo, hi in span.values()]


def compare(before: dict, after: dict) -> str:
    """Two recordings of the same preset and batch, a layer's phases side by side (layer_kinds: mean span and
    instruction time, us), then the layer's wall time and the step's: the table a kernel change is judged by."""
    sb, sa = before["summary"], after["summary"]
    if (sb["preset"], sb["batch"]) != (sa["preset"], sa["batch"]):
        raise ValueError(f"recordings of {sb['preset']} batch {sb['batch']} and {sa['preset']} batch {sa['batch']}: "
                         "compare one preset at one batch")
    pb, pa = phases(before), phases(after)
    kb = {d["kind"]: d for d in layer_kinds(pb)}
    ka = layer_kinds(pa)
    lines = [f"{sa['preset']} batch {sa['batch']}: before -> after",
             f"{'kind':<16} {'op':<11} {'span us':>15} {'delta':>7} {'instr us':>15}"]
    for d in ka:
        o = kb.get(d["kind"])
        if o is None:
            lines.append(f"{d['kind']:<16} {d['op']:<11} {'-':>6} -> {d['span_us']:>6.1f} {'':>7} {'-':>6} -> "
                         f"{d['mean_us']:>6.1f}")
            continue
        lines.append(f"{d['kind']:<16} {d['op']:<11} {o['span_us']:>6.1f} -> {d['span_us']:>6.1f} "
                     f"{d['span_us'] - o['span_us']:>+7.1f} {o['mean_us']:>6.1f} -> {d['mean_us']:>6.1f}")
    for k in kb.keys() - {d["kind"] for d in ka}:
        lines.append(f"{k:<16} {kb[k]['op']:<11} {kb[k]['span_us']:>6.1f} ->      - (not in after)")
    wb, wa = layer_walls(pb), layer_walls(pa)
    if wb and wa:
        lines.append(f"{'a layer':<28} {sum(wb) / len(wb):>6.1f} -> {sum(wa) / len(wa):>6.1f} "
                     f"{sum(wa) / len(wa) - sum(wb) / len(wb):>+7.1f}")
    lines.append(f"{'the step':<28} {sb['step_us']:>6.0f} -> {sa['step_us']:>6.0f} {sa['step_us'] - sb['step_us']:>+7.0f}"
                 + (f"   without the timeline {sb['launch_us']:.0f} -> {sa['launch_us']:.0f}"
                    if sb.get("launch_us") and sa.get("launch_us") else ""))
    return "\n".join(lines)


def fit(recordings: list[dict]) -> dict[str, dict]:
    """The cost model against the measured instruction times, per opcode and batch ("MATVEC b8"): the scheduler's
    prediction (CostModel) and a least-squares fit of duration = fixed + bytes / rate over every recorded instruction
    of that opcode at that batch (fixed and rate kept >= 0). Returns per key: instructions, measured and predicted
    mean us, the fitted fixed us and rate (GB/s per CTA, None when bytes explain nothing), and the fit's median
    relative error."""
    from megadecode.backends.mega.schedule import CostModel

    cost = CostModel()
    pts: dict[str, list[tuple[float, float, float]]] = {}
    for rec in recordings:
        prog, ctas, batch = lowered(rec), rec["summary"]["ctas"], rec["summary"]["batch"]
        for r in rec["rows"]:
            ins = prog.instrs[r["instr"]]
            pts.setdefault(f"{ins.op} b{batch}", []).append((float(ins.bytes), (r["end"] - r["start"]) / 1e3, cost.us(ins, ctas)))
    out = {}
    for op, p in pts.items():
        b = torch.tensor([x[0] for x in p], dtype=torch.float64)
        d = torch.tensor([x[1] for x in p], dtype=torch.float64)
        if float(b.max() - b.min()) > 0:
            A = torch.stack([torch.ones_like(b), b], 1)
            a0, slope = torch.linalg.lstsq(A, d[:, None]).solution[:, 0].tolist()
            if slope <= 0 or a0 < 0:  # keep the model physical: refit the one free term
                slope = max(0.0, float((b * d).sum() / (b * b).sum())) if a0 < 0 else 0.0
                a0 = 0.0 if a0 < 0 else float(d.mean())
        else:
            a0, slope = float(d.mean()), 0.0
        pred = a0 + slope * b
        out[op] = {"instructions": len(p), "measured_us": float(d.mean()), "model_us": sum(x[2] for x in p) / len(p),
                   "fixed_us": a0, "gbps_per_cta": (1e-3 / slope) if slope > 0 else None,
                   "median_rel_err": float(((pred - d).abs() / d.clamp_min(1e-3)).median())}
    return out


def report(path: str) -> tuple[dict, list[int]]:
    """The recording's tables printed; returns it and its rows' bytes (row_bytes, computed once)."""
    with open(path) as f:
        rec = json.load(f)
    nbytes = row_bytes(rec)
    ph = phases(rec, nbytes)
    s = rec["summary"]
    print(f"{s['preset']} batch {s['batch']} context {s['context']}, {s['ctas']} CTAs, step {s['step_us']:.0f} us"
          + (f" (without the timeline: {s['launch_us']:.0f} us)" if s.get("launch_us") else ""))
    print(f"{'phase':<18} {'op':<11} {'n':>4} {'MB':>8} {'span us':>8} {'HBM':>5} {'mean us':>8} {'max us':>7}")
    for d in ph:
        print(f"{d['phase']:<18} {d['op']:<11} {d['instructions']:>4} {d['bytes'] / 1e6:>8.1f} {d['span_us']:>8.1f} "
              f"{d['hbm_share']:>5.0%} {d['mean_us']:>8.1f} {d['max_us']:>7.1f}")
    lk = layer_kinds(ph)
    if lk:
        print(f"\na layer's phases, mean over the layers: {'kind':<14} {'op':<11} {'layers':>6} {'span us':>8} "
              f"{'instr us':>8} {'gap us':>7}")
        for d in lk:
            print(f"{'':<41}{d['kind']:<14} {d['op']:<11} {d['layers']:>6} {d['span_us']:>8.1f} {d['mean_us']:>8.1f} "
                  f"{d['gap_us']:>7.1f}")
        walls, floors = layer_walls(ph), layer_floors(ph)
        print(f"{'':<41}a layer from its first start to its last end: {sum(walls) / len(walls):.1f} us "
              f"(mean of {len(walls)}; {sum(walls):.0f} us of the step); its bytes at the HBM's rate: "
              f"{sum(floors) / len(floors):.1f} us")
    by_op: dict[str, list] = {}
    for d in ph:
        by_op.setdefault(d["op"], []).append(d)
    print("\nby opcode: phases, summed span, bytes over summed span, summed imbalance (longest - mean instruction)")
    for op, ds in sorted(by_op.items(), key=lambda kv: -sum(d["span_us"] for d in kv[1])):
        span = sum(d["span_us"] for d in ds)
        print(f"  {op:<11} {len(ds):>3} {span:>8.0f} us {sum(d['bytes'] for d in ds) / (span * 1e-6) / HBM:>5.0%}"
              f" {sum(d['imbalance_us'] for d in ds):>7.0f} us")
    spans = marked_spans(rec["rows"])
    marked = mean_segments(spans)
    if marked:
        print("\nmarks of the bodies (base.mark; mean us between the work start, the marks and the end; n: "
              "instructions, all layers)")
    for op, segs in marked.items():
        print(f"  {op:<22} n {len(spans[op]):>4}: " + "  ".join(f"{name} {us:.1f}" for name, us in segs))
    wait = [r["start"] - r["wait"] for r in rec["rows"]]
    work = [r["end"] - r["start"] for r in rec["rows"]]
    print(f"\nall instructions: wait {sum(wait) / 1e3:.0f} us summed, work {sum(work) / 1e3:.0f} us summed")
    occ = occupancy(rec["rows"], nbytes)
    bands = occupancy_bands(occ)
    print(f"HBM occupancy over the step (1 us bins, each instruction's bytes over its work span): mean "
          f"{sum(occ) / len(occ):.0%}; the step's time below " + ", ".join(
              f"{b:.0%}: {x:.0%}" for b, x in zip(BANDS, bands)) + f"; at or above {BANDS[-1]:.0%}: {bands[-1]:.0%}")
    return rec, nbytes


def row_bytes(recording: dict) -> list[int]:
    """The cost model's HBM bytes of each recorded instruction: the recording's own (rows recorded since they
    carry them), else the program lowered again (`lowered`), which a later change to the lowering refuses."""
    if all("bytes" in r for r in recording["rows"]):
        return [r["bytes"] for r in recording["rows"]]
    prog = lowered(recording)
    return [prog.instrs[r["instr"]].bytes for r in recording["rows"]]


# what each opcode's marks stamp (cute/moe.py op_route, cute/dense.py op_rows at batch 1, cute/attention.py
# op_attn_gqa); the segment names end at the mark of the same index. MATVEC and GLU are reported per projection (the
# name's part before "["); in their recordings before ef36c38 the norm falls in "args", not after "first sums"
MARKS = {"ROUTE": ("scores", "picks", "weights+barrier", "counts+table", "pair lists"),
         "MATVEC": ("args", "first sums", "norm+other sums/slices", "store", "barrier+signal"),
         "GLU": ("args", "first sums", "norm+other sums/slices", "store", "barrier+signal"),
         "ATTN_GQA": ("args+q norm", "rope+cache write", "chunks", "partials", "barrier+signal")}
PER_NAME = ("MATVEC", "GLU")


def marked_spans(rows: list[dict]) -> dict[str, list[list[float]]]:
    """Per opcode (MATVEC and GLU: per projection, "MATVEC o_proj"), each of its instructions whose marks were all
    stamped: the us from the work start to mark 0, between consecutive marks, and from the last to the end."""
    spans: dict[str, list] = {}
    for r in rows:
        names = MARKS.get(r["op"])
        m = [x for x in r.get("marks") or [] if x is not None]
        if names is None or len(m) != len(names) - 1:
            continue
        key = r["op"]
        if key in PER_NAME:
            key = f"{key} {r['name'].split('[')[0].split('.', 1)[-1]}"
        t = [r["start"], *m, r["end"]]
        spans.setdefault(key, []).append([(b - a) / 1e3 for a, b in zip(t, t[1:])])
    return spans


def mean_segments(spans: dict[str, list[list[float]]]) -> dict[str, list[tuple[str, float]]]:
    """marked_spans' segments averaged over the instructions: per key, (segment name, mean us) in order."""
    return {key: [(n, sum(s[i] for s in sp) / len(sp)) for i, n in enumerate(MARKS[key.split()[0]])]
            for key, sp in spans.items()}


def marked_segments(rows: list[dict]) -> dict[str, list[tuple[str, float]]]:
    """mean_segments of the recording's rows."""
    return mean_segments(marked_spans(rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b", help="a preset, or several comma-separated")
    ap.add_argument("--batch", default="1", help="a batch size, or several comma-separated")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="mega-timeline",
                    help="the recording's path without .json / .png; with several presets or batches it must hold "
                         "{preset} and / or {batch} to tell them apart")
    ap.add_argument("--from", dest="recording", help="analyse this recorded JSON instead (no GPU)")
    ap.add_argument("--png", help="with --from: also draw the recording's per-SM image to this file")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="two recordings of one preset and batch (no GPU): a layer's phases side by side")
    ap.add_argument("--fit", nargs="+", metavar="RECORDING",
                    help="the cost model against these recordings, per opcode (no GPU)")
    args = ap.parse_args(argv)
    if args.compare:
        recs = []
        for path in args.compare:
            with open(path) as f:
                recs.append(json.load(f))
        try:
            print(f"before: {args.compare[0]}\nafter:  {args.compare[1]}\n" + compare(*recs))
        except ValueError as e:
            ap.error(str(e))
        return
    if args.fit:
        recs = []
        for path in args.fit:
            with open(path) as f:
                recs.append(json.load(f))
        print(f"{'opcode':<16} {'n':>6} {'measured us':>11} {'model us':>9} {'fit: fixed us':>13} {'GB/s/CTA':>9} "
              f"{'median err':>10}")
        for op, d in sorted(fit(recs).items(), key=lambda kv: -kv[1]["measured_us"] * kv[1]["instructions"]):
            rate = f"{d['gbps_per_cta']:9.2f}" if d["gbps_per_cta"] else f"{'-':>9}"
            print(f"{op:<16} {d['instructions']:>6} {d['measured_us']:>11.1f} {d['model_us']:>9.1f} "
                  f"{d['fixed_us']:>13.1f} {rate} {d['median_rel_err']:>10.0%}")
        return
    if args.recording:
        rec, nbytes = report(args.recording)
        if args.png:
            s = rec["summary"]
            render(rec["rows"], args.png, f"{s['preset']} batch {s['batch']}: one megakernel step, "
                                          f"{s['step_us']:.0f} us" + (f" ({s['git_sha']})" if s.get("git_sha") else ""),
                   occupancy(rec["rows"], nbytes))
        return
    runs = [(p, int(b)) for p in args.preset.split(",") for b in args.batch.split(",")]
    outs = [args.out.format(preset=p, batch=b) for p, b in runs]
    if len(set(outs)) < len(runs):
        ap.error(f"--out {args.out!r} does not name a file per recording: put {{preset}} and / or {{batch}} in it")
    for (preset, batch), out in zip(runs, outs):  # one process: the kernel compiles once for all of them
        record(preset, batch, args.context, out)


def record(preset: str, batch: int, context: int, out: str) -> None:
    """One megakernel step of `preset` at `batch` with the timeline: out.json (summary and per-instruction rows)
    and out.png (the per-SM image); the summary printed."""
    cfg = preset_config(preset)
    w = random_weights(cfg, "cuda", torch.bfloat16, 0)
    order = frag_order(cfg, "cuda")  # the routed experts in the order the mega executor holds them
    w = expert_layout.take(w, build_plan(cfg), order)
    cache = KVCache(cfg, batch, context + 8, "cuda", torch.bfloat16)
    for parts in cache.layers.values():
        for t in parts:
            t.normal_()
    ctas = default_ctas(torch.device("cuda"), ring_build(batch))  # the build the executor runs at this batch
    prog = schedule(lower(cfg, w, cache, batch, ctas), ctas)
    _record_one(prog, preset, batch, context, ctas, out, order)
    del prog, cache, w
    torch.cuda.empty_cache()


def _runtime(prog, batch: int, context: int, **kw) -> MegaRuntime:
    rt = MegaRuntime(prog, "cuda", **kw)
    rt.view("tokens").copy_(torch.arange(batch))
    rt.view("positions").fill_(context)
    rt.view("slots").copy_(torch.arange(batch))
    for _ in range(3):  # compile, warm
        rt.launch()
    torch.cuda.synchronize()
    rt.check()
    return rt


def launch_us(prog, batch: int, context: int, n: int = 20) -> float:
    """The median time of n launches of the build without a timeline (CUDA events around each)."""
    rt = _runtime(prog, batch, context)
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        rt.launch()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    rt.check()
    return sorted(ts)[n // 2]


def _record_one(prog, preset: str, batch: int, context: int, ctas: int, out: str, order: str) -> None:
    rt = _runtime(prog, batch, context, timeline=True)
    rows = rt.timeline_rows()
    for r in rows:  # the cost model's bytes, so that --from reads the recording after the lowering changes
        r["bytes"] = prog.instrs[r["instr"]].bytes
    step_us = max(r["end"] for r in rows) / 1e3
    busy = Counter()
    for r in rows:
        busy[r["op"]] += r["end"] - r["start"]
    summary = {"preset": preset, "batch": batch, "context": context, "ctas": ctas,
               "instructions": len(rows), "step_us": step_us, "experts": order,
               "launch_us": launch_us(prog, batch, context),  # without the timeline, median of 20
               "work_us_by_op": {k: v / 1e3 for k, v in busy.most_common()},
               "wait_us_total": sum(r["start"] - r["wait"] for r in rows) / 1e3}
    if "qst" in prog.i32:  # the last MoE layer's routing (the buffers are reused per layer): pairs per selected
        # expert, to tie EXPERT_UP / EXPERT_DOWN times to their passes (pairs / TB per expert)
        nu = int(rt.view("nuniq")[0])
        summary["last_moe_routing"] = {"nuniq": nu, "pstart": rt.view("pstart")[:nu + 1].tolist(),
                                       "qst": rt.view("qst")[:nu + 1].tolist(),
                                       "uniq": rt.view("uniq")[:nu].tolist()}
    with open(out + ".json", "w") as f:
        json.dump({"summary": summary, "rows": rows}, f)
    render(rows, out + ".png", f"{preset} batch {batch}: one megakernel step, {step_us:.0f} us",
           occupancy(rows, [r["bytes"] for r in rows]))
    print(json.dumps(summary, indent=1))
    del rt


if __name__ == "__main__":
    main()
