"""Expert parallelism in one process (megadecode/parallel, megadecode/ranks.py, issue 17): which experts a rank owns,
the -1 convention of the routed experts, weights and checkpoints built per rank, the combine's mode data, the
command line's checks, the launcher, and the measuring helpers. Whole runs of several ranks: tests/test_ep.py."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from megadecode import cli, ranks
from megadecode.checkpoint import CheckpointError, _Reader, load_weights
from megadecode.engine import Engine
from megadecode.parallel import combine, group, launch
from megadecode.parallel.combine import ExpertParallel
from megadecode.parallel.experts import ExpertShard
from megadecode.parallel.vocab import VocabShard, shard_rows
from megadecode.presets import preset_config, preset_hf_config
from megadecode.reference.latent_moe import latent_experts
from megadecode.reference.moe import experts_grouped, experts_reference
from megadecode.weights import param_specs, random_weights, weight_bytes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "bench"))  # bench/ep_*.py, imported by the tests that use them
import ep_workers  # noqa: E402
from interp import DEVICE  # noqa: E402

PRESETS = ep_workers.PRESETS

# ---- the lm_head's rows a rank holds (parallel/vocab.py) ------------------------------------------------------------
def test_vocab_shard_splits_rows_evenly_padding_the_last_rank():
    from megadecode.parallel.vocab import pad_rows

    assert [(s.lo, s.hi, s.per_rank) for s in (VocabShard(8, 4, r) for r in range(4))] == \
        [(0, 2, 2), (2, 4, 2), (4, 6, 2), (6, 8, 2)]
    assert [(s.lo, s.hi) for s in (VocabShard(259, 4, r) for r in range(4))] == \
        [(0, 65), (65, 130), (130, 195), (195, 259)]  # 65 rows each, the last rank's 64 and one zero row
    assert (VocabShard(5, 4, 3).lo, VocabShard(5, 4, 3).hi) == (5, 5)  # a rank of padding only
    with pytest.raises(ValueError, match="cannot split a vocabulary of 3"):
        VocabShard(3, 4, 0)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        VocabShard(8, 2, 2)
    full = torch.arange(259 * 3, dtype=torch.float32).view(259, 3)
    last = shard_rows(full, VocabShard(259, 4, 3))
    assert last.shape == (65, 3) and torch.equal(last[:64], full[195:]) and not last[64].any()
    assert torch.equal(pad_rows(full[195:], VocabShard(259, 4, 3)), last)
    with pytest.raises(ValueError, match="lm_head has 258 rows, the vocabulary 259"):
        shard_rows(full[:258], VocabShard(259, 4, 0))


def test_rank_weights_hold_their_lm_head_rows_and_bytes(tiny_ckpt):
    """param_specs / random_weights / load_weights / weight_bytes with an expert shard: the untied lm_head is the
    rank's rows of the single-process model's (values equal), zero rows past the vocabulary; its bytes per rank
    1 / world (rounded up); one rank keeps it whole; a tied lm_head (the embedding) stays whole."""
    from dataclasses import replace

    cfg = preset_config("tiny-deepseek-v3")
    V, D = cfg.vocab_size, cfg.hidden_size
    whole = random_weights(cfg)["lm_head.weight"]
    ckpt = tiny_ckpt("tiny-deepseek-v3")
    _, loaded_whole = load_weights(ckpt, cfg)
    for world in (1, 2, 4):
        rows = -(-V // world)
        for r in range(world):
            shard = ExpertShard(cfg.num_experts, world, r)
            v = VocabShard(V, world, r)
            assert param_specs(cfg, shard)["lm_head.weight"].shape == (rows, D)
            for w, ref in ((random_weights(cfg, shard=shard), whole),
                           (load_weights(ckpt, cfg, shard=shard)[1], loaded_whole["lm_head.weight"])):
                got = w["lm_head.weight"]
                assert got.shape == (rows, D)
                assert torch.equal(got[:v.hi - v.lo], ref[v.lo:v.hi]) and not got[v.hi - v.lo:].any()
        assert weight_bytes(cfg, 2, ExpertShard(cfg.num_experts, world, 0))["lm_head"] == rows * D * 2
    tied = replace(cfg, tie_word_embeddings=True)
    specs = param_specs(tied, ExpertShard(cfg.num_experts, 2, 1))
    assert "lm_head.weight" not in specs and specs["model.embed_tokens.weight"].shape == (V, D)


def test_gathered_logits_are_the_single_process_logits_and_comm_off_keeps_shapes(monkeypatch):
    """The lm_head op of a rank with its rows and the all-gather (here a stand-in that hands back every rank's slice
    in rank order, as the collective does) gives the single-process logits, whatever the split; with the
    collectives off (bench's communication-off run) the shape stays [T, V], this rank's slice in place."""
    from megadecode.parallel.vocab import gather_logits

    V, D, T = 259, 16, 3
    x, w = torch.randn(T, D), torch.randn(V, D)
    want = x @ w.T
    for world in (2, 4):
        parts = [x @ shard_rows(w, VocabShard(V, world, r)).T for r in range(world)]
        monkeypatch.setattr(group, "all_gather_rows", lambda out, part, g: out.copy_(torch.cat(parts)))
        for r in range(world):
            got = gather_logits(parts[r], VocabShard(V, world, r), None)
            assert got.shape == (T, V) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        off = gather_logits(parts[1], VocabShard(V, world, 1), None, comm=False)
        P = -(-V // world)
        assert off.shape == (T, V) and torch.equal(off[:, P:2 * P], parts[1][:, :min(2 * P, V) - P])
        assert not off[:, :P].any() and not off[:, 2 * P:].any()


# ---- which experts a rank owns ------------------------------------------------------------------------------------
def test_shard_owns_contiguous_blocks_and_maps_ids():
    shards = [ExpertShard(8, 4, r) for r in range(4)]
    assert [(s.lo, s.hi) for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    ids = torch.tensor([[0, 3, 5], [7, 2, 6]])
    assert shards[1].local_ids(ids).tolist() == [[-1, 1, -1], [-1, 0, -1]]
    assert shards[3].local_ids(ids).tolist() == [[-1, -1, -1], [1, -1, 0]]
    # every pair is owned by exactly one rank
    owners = torch.stack([(s.local_ids(ids) >= 0) for s in shards]).sum(0)
    assert owners.eq(1).all()


def test_shard_refuses_an_uneven_split_naming_the_divisors():
    with pytest.raises(ValueError, match=r"16 routed experts.*\(1, 2, 4, 8, 16\)"):
        ExpertShard(16, 3, 0)
    with pytest.raises(ValueError, match="outside"):
        ExpertShard(16, 2, 2)


# ---- the -1 convention: a pair another rank serves is skipped -----------------------------------------------------
def _on_device(t):
    """A tensor or a quantized weight (its fields moved) on the tests' device: the GPU when there is one (Triton runs
    there, not on CPU tensors), else the CPU under the interpreter."""
    from dataclasses import fields, is_dataclass, replace

    if is_dataclass(t):
        return replace(t, **{f.name: _on_device(getattr(t, f.name)) for f in fields(t)
                             if isinstance(getattr(t, f.name), torch.Tensor)})
    return t.to(DEVICE)


def _problem(mxfp4: bool, fp8: bool = False):
    return tuple(_on_device(t) for t in _problem_cpu(mxfp4, fp8))


def _problem_cpu(mxfp4: bool, fp8: bool = False):
    g = torch.Generator().manual_seed(0)
    T, A, E, D, I = 3, 4, 8, 64, 32
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    w = torch.rand(T, A, generator=g)
    if mxfp4:
        from megadecode.quant.mxfp4 import MXFP4Tensor

        def mx(o, i):
            return MXFP4Tensor(torch.randint(0, 256, (E, o, i // 2), dtype=torch.uint8, generator=g),
                               torch.randint(118, 124, (E, o, i // 32), dtype=torch.uint8, generator=g))
        return x, ids, w, mx(2 * I, D), mx(D, I)
    if fp8:
        from megadecode.weights import ParamSpec, random_tensor
        from megadecode.quant.fp8 import FP8Tensor, scale_shape

        def f8(shape):
            b = (32, 32)
            return FP8Tensor(random_tensor(ParamSpec("w", shape, "fp8"), g, "cpu", torch.float32),
                             random_tensor(ParamSpec("s", scale_shape(shape, b), "fp8_scale", block=b), g, "cpu",
                                           torch.float32), b)
        return x, ids, w, f8((E, 2 * I, D)), f8((E, D, I))
    return x, ids, w, torch.randn(E, 2 * I, D, generator=g) / 8, torch.randn(E, D, I, generator=g) / 6


def _kernels():
    from megadecode.backends.fused.kernels import fp8_experts, fused_experts, grouped_experts

    return {
        "grouped": lambda *a, **kw: grouped_experts.grouped_experts(*a, grouped=True, **kw),
        "per-pair": lambda *a, **kw: grouped_experts.grouped_experts(*a, grouped=False, **kw),
        "fused": fused_experts.fused_experts,
        "fp8": fp8_experts.fp8_experts,
        "mx-grouped": lambda *a: grouped_experts.grouped_experts(*a, act="situ", grouped=True),
        "mx-per-pair": lambda *a: grouped_experts.grouped_experts(*a, act="situ", grouped=False),
        "mx-fused": lambda *a: fused_experts.fused_experts(*a, act="situ"),
    }


@pytest.mark.parametrize("impl", ["reference", "torch-grouped", "grouped", "per-pair", "fused", "fp8", "mx-grouped",
                                  "mx-per-pair", "mx-fused", "mx-reference"])
def test_pairs_with_id_minus_one_are_skipped(impl):
    """Every routed-experts implementation: ids -1 contribute nothing (the same as a zero router weight), the others
    are untouched; with an fp32 `out` the kernels return the unrounded sums."""
    mx, fp8 = impl.startswith("mx-"), impl == "fp8"
    x, ids, w, gu, dn = _problem(mx, fp8)
    skip = ids.masked_fill(ids >= 4, -1)
    if mx:
        want = latent_experts(x, ids, w * (ids < 4), gu, dn)
        fn = (lambda *a: latent_experts(*a)) if impl == "mx-reference" else _kernels()[impl]
        got = fn(x, skip, w, gu, dn)
    else:
        want = experts_reference(x, ids, w * (ids < 4), gu, dn)
        if impl == "reference":
            got = experts_reference(x, skip, w, gu, dn)
        elif impl == "torch-grouped":
            got = experts_grouped(x, skip, w, gu, dn)
        else:
            got = _kernels()[impl](x, skip, w, gu, dn, out=torch.empty(x.shape, device=x.device))
    scale = want.abs().max()
    assert scale > 0 and ((got - want).abs().max() / scale) < 1e-4, impl


def test_a_token_with_no_local_pair_gets_zeros():
    from megadecode.backends.fused.kernels.grouped_experts import grouped_experts

    x, ids, w, gu, dn = _problem(False)
    none = torch.full_like(ids, -1)
    for grouped in (False, True):
        assert torch.equal(grouped_experts(x, none, w, gu, dn, grouped=grouped), torch.zeros_like(x))
    assert torch.equal(experts_grouped(x, none, w, gu, dn), torch.zeros_like(x))


# ---- weights and checkpoints per rank -----------------------------------------------------------------------------
@pytest.mark.parametrize("preset", [*PRESETS, "tiny-qwen3-moe-fp8"])
def test_random_weights_of_a_rank_are_the_slice_and_nothing_more(preset, monkeypatch):
    """A rank draws the values the whole model holds for its experts, never a whole expert stack (every draw of a
    stacked tensor is one expert), and holds E / world experts per layer, and its rows of the lm_head."""
    from megadecode import weights as W

    cfg = preset_config(preset)
    full = random_weights(cfg)
    stacks = {s.shape for s in param_specs(cfg).values() if s.stacked}
    drawn = []
    real = W.random_tensor
    monkeypatch.setattr(W, "random_tensor", lambda spec, *a: drawn.append(spec.shape) or real(spec, *a))
    for world in (2, 4):
        for r in range(world):
            shard = ExpertShard(cfg.num_experts, world, r)
            mine = random_weights(cfg, shard=shard)
            for name, spec in param_specs(cfg).items():
                want = full[name][shard.lo:shard.hi] if spec.stacked else full[name]
                if name == "lm_head.weight":  # its rows (parallel/vocab.py)
                    want = shard_rows(want, VocabShard(cfg.vocab_size, world, r))
                assert mine[name].shape == want.shape and torch.equal(mine[name].view(torch.uint8),
                                                                      want.view(torch.uint8)), name
            held = sum(t.numel() * t.element_size() for t in mine.values())
            assert held == weight_bytes(cfg, 4, shard)["total"]
    assert drawn and not stacks & set(drawn)


def _recorded_reads(monkeypatch) -> list:
    reads = []
    real = _Reader.__call__

    def record(self, name, kind, rows=None):
        reads.append((name, rows))
        return real(self, name, kind, rows)

    monkeypatch.setattr(_Reader, "__call__", record)
    return reads


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_checkpoint_rank_reads_only_its_experts(layout, tiny_ckpt, tmp_path, monkeypatch):
    """Per-expert tensors of other ranks are never read; a stacked tensor is read as the rank's rows only."""
    from safetensors.torch import save_file

    if layout == "per-expert":
        ckpt = tiny_ckpt("tiny-qwen3-moe")
    else:  # transformers' own names: experts stacked in the file
        ckpt = tmp_path / "stacked"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(preset_hf_config("tiny-qwen3-moe")))
        save_file({n: t.contiguous() for n, t in random_weights(preset_config("tiny-qwen3-moe")).items()},
                  str(ckpt / "model.safetensors"))
    cfg, full = load_weights(ckpt)
    reads = _recorded_reads(monkeypatch)
    shard = ExpertShard(cfg.num_experts, 2, 1)
    _, mine = load_weights(ckpt, shard=shard)
    for name, spec in param_specs(cfg).items():
        want = full[name][shard.lo:shard.hi] if spec.stacked else full[name]
        if name == "lm_head.weight":  # its rows, read as a slice (parallel/vocab.py)
            v = VocabShard(cfg.vocab_size, 2, 1)
            want = shard_rows(want, v)
            assert ("lm_head.weight", (v.lo, v.hi)) in reads
        assert torch.equal(mine[name], want), name
    expert_reads = [(n, rows) for n, rows in reads if ".experts." in n]
    assert expert_reads
    if layout == "per-expert":
        assert all(shard.owns(int(n.split(".experts.")[1].split(".")[0])) for n, _ in expert_reads)
    else:
        assert all(rows == (shard.lo, shard.hi) for _, rows in expert_reads)


def test_checkpoint_missing_a_ranks_experts_names_the_rank(tiny_ckpt):
    ckpt = tiny_ckpt("tiny-qwen3-moe")
    ep_workers.strip_experts(ckpt, range(4, 8), layer=0)
    cfg = preset_config("tiny-qwen3-moe")
    load_weights(ckpt, shard=ExpertShard(cfg.num_experts, 2, 0))  # rank 0's experts are all there
    with pytest.raises(CheckpointError, match=r"missing 8 expert tensors for 'model\.layers\.0\.mlp\.experts\."
                                              r"gate_up_proj' \(rank 1 of 2 holds experts 4\.\.7\)"):
        load_weights(ckpt, shard=ExpertShard(cfg.num_experts, 2, 1))


# ---- the combine ----------------------------------------------------------------------------------------------------
def test_combine_mode_is_read_from_measurements(tmp_path, monkeypatch):
    monkeypatch.setattr(combine, "MODES_DIR", tmp_path)
    combine._modes_file.cache_clear()
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "world": {"2": {"N=3584": {"1": "all-gather", "8": "all-gather",
                                                             "64": "reduce-scatter"}}}}))
    try:
        ep = ExpertParallel(ExpertShard(896, 2, 0), device_name="NVIDIA H200")
        # the entry of the smallest measured batch >= the batch (backends/fused/kernels/tuning.py's rule), else the largest
        assert [ep.mode_for(b, 3584) for b in (1, 8, 9, 64, 500)] == ["all-gather"] * 2 + ["reduce-scatter"] * 3
        assert ep.mode_for(1, 2048) == "all-gather"  # no measurement for this width: the default
        assert ExpertParallel(ExpertShard(896, 4, 0), device_name="NVIDIA H200").mode_for(64, 3584) == "all-gather"
        assert ExpertParallel(ExpertShard(896, 2, 0), mode="reduce-scatter").mode_for(1, 3584) == "reduce-scatter"
        (tmp_path / "nvidia-h200.json").write_text(json.dumps({"world": {"2": {"N=1": {"1": "all-reduce"}}}}))
        combine._modes_file.cache_clear()
        with pytest.raises(ValueError, match="malformed combine-mode file"):
            ep.mode_for(1, 1)
    finally:
        combine._modes_file.cache_clear()


def test_one_rank_combine_is_the_identity_and_comm_off_skips_it():
    x = torch.randn(3, 5)
    assert ExpertParallel(ExpertShard(8, 1, 0)).combine(x) is x
    ep = ExpertParallel(ExpertShard(8, 2, 0))
    ep.comm = False
    assert ep.combine(x) is x


# ---- measuring: bench --ep, bench/ep_bench.py, the k3-ep preset ---------------------------------------------------
def test_bench_counts_a_ranks_own_experts():
    """Per-GPU bytes count the experts of the rank: at the first MoE layer (before the ranks' activations would
    differ without their combine) the two ranks' counts add up to one process's."""
    from megadecode import bench

    cfg = preset_config("tiny-qwen3-moe")
    tokens = torch.tensor([1, 2, 3, 4])

    def counts(parallel):
        shard = None if parallel is None else parallel.shard
        eng = Engine(cfg, random_weights(cfg, shard=shard), max_batch=4, max_seq_len=16, parallel=parallel)
        eng.lengths = [3] * 4
        return bench.distinct_experts(eng, tokens)

    ranks_ = []
    for r in range(2):
        par = ExpertParallel(ExpertShard(cfg.num_experts, 2, r))
        par.comm = False  # one process: no collective
        ranks_.append(counts(par))
    assert ranks_[0][0] + ranks_[1][0] == counts(None)[0] > 0


def test_bench_table_shows_communication_per_layer():
    from megadecode import bench

    row = {"preset": "k3-ep", "executor": "fused", "batch": 1, "context": 8, "ms_per_step": 10.0,
           "tokens_per_s": 100.0, "bytes_per_step": 30e9, "floor_ms": 6.5, "mbu": 0.65, "ep": 2,
           "comm_ms_per_layer": 0.0123, "comm_share": 0.0148}
    table = bench.format_table([row])
    assert "GB/GPU" in table.splitlines()[0] and "comm ms/layer" in table and "0.0123" in table and "1.5%" in table


def test_ep_bench_writes_the_modes_file_the_combine_reads(tmp_path, monkeypatch):
    import ep_bench

    monkeypatch.setattr(combine, "MODES_DIR", tmp_path)
    combine._modes_file.cache_clear()
    try:
        path = combine.modes_path("NVIDIA H200")
        ep_bench.merge_modes(path, "NVIDIA H200", 2, 3584, {1: "all-gather", 64: "reduce-scatter"}, [], "cmd")
        ep_bench.merge_modes(path, "NVIDIA H200", 2, 2048, {1: "reduce-scatter"}, [], "cmd")
        assert combine.measured_mode("NVIDIA H200", 2, 3584, 1) == "all-gather"
        assert combine.measured_mode("NVIDIA H200", 2, 3584, 33) == "reduce-scatter"
        assert combine.measured_mode("NVIDIA H200", 2, 2048, 1) == "reduce-scatter"
        assert combine.measured_mode("NVIDIA H200", 4, 3584, 1) is None
    finally:
        combine._modes_file.cache_clear()


def test_k3_ep_preset_outgrows_one_h200_and_fits_two():
    H200 = 141e9  # NVIDIA's H200 datasheet: 141 GB of HBM3e
    cfg = preset_config("k3-ep")
    assert cfg.num_experts == 896 and all(cfg.moe_layers) and cfg.num_layers >= 10
    assert cfg.hidden_size == 7168 and cfg.latent_size == 3584 and cfg.moe_intermediate_size == 3072
    from megadecode.cache import cache_bytes

    assert weight_bytes(cfg, 2)["total"] > H200
    per_gpu = weight_bytes(cfg, 2, ExpertShard(896, 2, 0))["total"] + cache_bytes(cfg, 65, 1100, torch.bfloat16)
    assert per_gpu < 0.85 * H200  # bench --batch 64 --context 1024: room left for activations and graph pools


@pytest.mark.parametrize("preset,world", [("k3-ep4", 4), ("k3-ep8", 8)])
def test_k3_ep4_and_ep8_presets_fit_their_gpus_and_not_half_as_many(preset, world):
    """Issue 18's presets: true K3 layers sized so that `world` H200s hold them and `world / 2` do not."""
    H200 = 141e9
    from megadecode.cache import cache_bytes

    cfg = preset_config(preset)
    assert cfg.num_experts == 896 and all(cfg.moe_layers) and cfg.hidden_size == 7168
    per_gpu = weight_bytes(cfg, 2, ExpertShard(896, world, 0))["total"] + cache_bytes(cfg, 65, 1100, torch.bfloat16)
    assert per_gpu < 0.85 * H200
    assert weight_bytes(cfg, 2, ExpertShard(896, world // 2, 0))["total"] > H200


def test_ep_model_reproduces_its_calibration_and_the_memory_bound():
    """bench/ep_model.py (docs/ep-model.md): one GPU at batch 1 is the measured k3-mini step by construction; the
    full K3 with a replicated trunk fits H200s only from 56 GPUs (the divisor of 896 past 1446 GB / 29 GB)."""
    import ep_model

    assert abs(ep_model.step(preset_config("k3-mini"), 1, 1, 1024)["ms"] - 3.73) < 0.05
    # --efficiency: the CuTe experts' one-GPU run (41aad87) calibrates it at its own 3.28 ms
    rows = json.loads((HERE.parent / "bench/results/k3-mini-nvidia-h200-fused-cute.json").read_text())["rows"]
    mbu = {r["batch"]: r["mbu"] for r in rows}
    assert abs(ep_model.step(preset_config("k3-mini"), 1, 1, 1024, mbu=mbu)["ms"] - rows[0]["ms_per_step"]) < 0.05
    full = ep_model.k3()
    fits = [G for G in (28, 32, 56, 64) if ep_model.step(full, G, 1, 1024)["fits"]]
    assert fits == [56, 64]
    assert ep_model.busiest_rank_experts(1, 1) == 16 and 2 <= ep_model.busiest_rank_experts(1, 16) <= 5


# ---- the command line ---------------------------------------------------------------------------------------------
def test_ep_not_dividing_the_experts_is_one_error_line(capsys):
    code = cli.main(["generate", "--model", "tiny-qwen3-moe", "--ep", "3", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("megadecode: error: --ep 3: ") and "(1, 2, 4, 8)" in err[0]


TORCHRUN_ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "LOCAL_RANK": "0"}


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_torchrun_world_size_must_equal_ep(monkeypatch, capsys, rank, printed):
    """Under torchrun every rank checks the same arguments; rank 0 alone reports (no duplicate lines)."""
    for k, v in {**TORCHRUN_ENV, "RANK": rank, "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    code = cli.main(["generate", "--model", "tiny-qwen3-moe", "--ep", "4", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    if printed:
        assert "megadecode: error: torchrun started 2 processes (WORLD_SIZE) but --ep is 4" in err
    else:
        assert err == ""


def test_more_ranks_per_node_than_gpus_is_an_error_every_rank_sees(monkeypatch):
    from megadecode.parallel import group

    for k, v in {**TORCHRUN_ENV, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks per node need 2 GPUs .* this node has 1"):
        group.init(2, "cuda", 60)


def test_executors_without_expert_parallelism_refuse_it():
    cfg = preset_config("tiny-qwen3-moe")
    shard = ExpertShard(cfg.num_experts, 2, 0)
    weights = random_weights(cfg, shard=shard)
    for executor in ("pyvm", "mega"):
        with pytest.raises(ValueError, match="no collective"):
            Engine(cfg, weights, executor=executor, parallel=ExpertParallel(shard))
    with pytest.raises(ValueError, match="compiled executor is not validated with expert parallelism"):
        Engine(cfg, weights, executor="compiled", parallel=ExpertParallel(shard))


def test_every_command_with_ranks_has_ep_flags():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for cmd in ("generate", "bench", "serve"):
        flags = {o for a in subs[cmd]._actions for o in a.option_strings}
        assert {"--ep", "--dist-timeout"} <= flags, cmd


def test_ranks_error_prefix(monkeypatch):
    monkeypatch.setattr(ranks, "_joined", False)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert ranks.error_prefix() == ""
    for k, v in {**TORCHRUN_ENV, "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    assert ranks.error_prefix() is None  # before the ranks connect: rank 0 reports the same error
    monkeypatch.setattr(ranks, "_joined", True)
    assert ranks.error_prefix() == "rank 1: "


def test_a_lost_peer_is_one_line_and_other_errors_keep_their_traceback(monkeypatch):
    monkeypatch.setattr(ranks, "_joined", True)
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29612. This is ...")
    assert ranks.peer_failure(gone).endswith("Connection closed by peer [127.0.0.1]:29612. This is ...")
    assert ranks.peer_failure(RuntimeError("shape mismatch")) is None  # a bug: the traceback stays
    monkeypatch.setattr(ranks, "_joined", False)
    assert ranks.peer_failure(gone) is None  # one process: nothing to blame on a peer


# ---- the launcher -------------------------------------------------------------------------------------------------
def _script(body: str) -> list[str]:
    return [sys.executable, "-c", "import os, sys, time\nr = int(os.environ['RANK'])\n" + body]


def test_launcher_sets_torchrun_variables_and_returns_zero(tmp_path):
    body = (f"open(os.path.join({str(tmp_path)!r}, 'r%d' % r), 'w').write("
            "' '.join(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR')))")
    assert launch.spawn([], 3, cmd=_script(body), grace_s=1) == 0
    assert [(tmp_path / f"r{r}").read_text() for r in range(3)] == [f"{r} {r} 3 127.0.0.1" for r in range(3)]


def test_launcher_stops_the_other_ranks_when_one_fails():
    t = time.monotonic()
    code = launch.spawn([], 2, cmd=_script("sys.exit(3) if r == 1 else time.sleep(120)"), grace_s=1)
    assert code == 3 and time.monotonic() - t < 15


def test_ep_tokens_compares_greedy_tokens_and_fails_on_a_difference(tmp_path, monkeypatch):
    """bench/ep_tokens.py (the GPU check of --ep N against one process): equal tokens pass, a difference fails with
    where it starts, an error is reported and fails."""
    import ep_tokens

    runs = {1: {"token_ids": [[1, 2, 3], [4, 5]]}, 2: {"token_ids": [[1, 2, 3], [4, 6]]}}
    monkeypatch.setattr(ep_tokens, "generate", lambda model, ex, ep, n, timeout_s: runs[min(ep, 2)])
    out = tmp_path / "t.json"
    monkeypatch.setattr(sys, "argv", ["ep_tokens.py", "--presets", "tiny-k3", "--executors", "fused", "--out", str(out)])
    assert ep_tokens.main() == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["equal"] is False and row["first_difference"] == [None, 1]
    runs[2] = {"token_ids": [[1, 2, 3], [4, 5]]}
    assert ep_tokens.main() == 0
    runs[2] = {"error": "rank 1: boom"}
    assert ep_tokens.main() == 1 and json.loads(out.read_text())["rows"][0]["error"] == "rank 1: boom"


def test_ep_tokens_reports_a_run_that_hangs(tmp_path, monkeypatch):
    """A generate run past its time limit is an error row (the check goes on), not a traceback; the row keeps the
    Python stacks the run printed on SIGUSR1, and the run's whole process group is stopped after them."""
    import subprocess

    import ep_tokens

    # a stand-in for the CLI that prints its stack on SIGUSR1 (as cli.main does) and starts a child (as the launcher
    # starts ranks) that ignores SIGUSR1, then hangs: both are stopped
    marker = tmp_path / "child_alive"
    child = (f"import pathlib, signal, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); time.sleep(6); "
             f"pathlib.Path(r'{marker}').write_text('1')")
    script = (f"import faulthandler, signal, subprocess, sys, time\n"
              f"faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
              f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              f"def waiting_for_the_other_rank():\n    time.sleep(60)\n"
              f"waiting_for_the_other_rank()\n")
    real = subprocess.Popen
    monkeypatch.setattr(ep_tokens.subprocess, "Popen",
                        lambda cmd, **kw: real([sys.executable, "-c", script], **kw))
    t = time.monotonic()
    got = ep_tokens.generate("tiny-k3", "fused", 2, 4, timeout_s=1)
    assert got["error"] == "did not finish in 1 s" and got["hung"] is True
    assert any("waiting_for_the_other_rank" in line for line in got["stderr_tail"])
    time.sleep(max(0.0, 7.5 - (time.monotonic() - t)))
    assert not marker.exists()  # the child was killed with its parent's group


def test_cli_prints_its_stacks_on_sigusr1_and_goes_on():
    """`kill -USR1` on a megadecode command prints every thread's Python stack and does not stop it (how a run that
    seems hung shows where it waits)."""
    import subprocess

    code = ("import os, signal; from megadecode import cli; cli.main(['--help']); "
            "os.kill(os.getpid(), signal.SIGUSR1); print('still running')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "still running" in p.stdout
    assert "Current thread" in p.stderr or "Thread 0x" in p.stderr


def test_ep_tokens_stops_after_a_hang(tmp_path, monkeypatch):
    import ep_tokens

    calls = []
    monkeypatch.setattr(ep_tokens, "generate", lambda model, ex, ep, n, timeout_s: calls.append(model) or (
        {"token_ids": [[1]]} if ep == 1 else {"error": "did not finish in 90 s", "hung": True}))
    out = tmp_path / "t.json"
    monkeypatch.setattr(sys, "argv", ["ep_tokens.py", "--presets", "tiny-k3,tiny-deepseek-v3", "--executors", "fused",
                                      "--out", str(out)])
    assert ep_tokens.main() == 1 and calls == ["tiny-k3", "tiny-k3"]  # the second preset is not run
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["error"] == "did not finish in 90 s" and rows[1]["error"] == "not run: tiny-k3 fused hung"


def test_generate_frees_the_engine_before_the_process_group_is_torn_down(monkeypatch, capsys):
    """A live CUDA graph that captured a collective keeps NCCL's teardown waiting forever (pytorch#115388; how
    `generate --ep 2` hung on two H200s): the engine must be gone when EPGroup.destroy runs."""
    import gc
    import weakref

    from megadecode import cli, ranks

    engines, seen = [], []

    class FakeGroup:
        def destroy(self):
            gc.collect()  # as EPGroup.destroy does
            seen.append([e() is None for e in engines])

    def agree(ep, fn, *a, **kw):
        out = fn(*a, **kw)
        engines.append(weakref.ref(out))
        return out

    monkeypatch.setattr(ranks, "join", lambda args: FakeGroup())
    monkeypatch.setattr(ranks, "device", lambda args, ep: "cpu")
    monkeypatch.setattr(ranks, "expert_parallel", lambda ep, cfg: None)
    monkeypatch.setattr(cli, "agree", agree)
    assert cli.main(["generate", "--model", "tiny-qwen3-moe", "--executor", "torch", "--greedy",
                     "--max-new-tokens", "3", "--token-ids", "256,7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]
    assert seen == [[True]]


def test_a_teardown_that_hangs_is_bounded(monkeypatch, capsys):
    """EPGroup.destroy gives NCCL's teardown DESTROY_TIMEOUT_S, then warns and returns False; the command then exits
    past it (cli.main, os._exit)."""
    from megadecode.parallel import group

    ep = group.EPGroup(rank=1, world=2, local_rank=1, backend="nccl", device=torch.device("cpu"), group=None,
                       control=None, timeout_s=1.0)
    monkeypatch.setattr(group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(group.dist, "destroy_process_group", lambda: time.sleep(30))
    monkeypatch.setattr(group, "_stuck", False)
    t = time.monotonic()
    assert ep.destroy(wait_s=0.5) is False and time.monotonic() - t < 5
    assert group.stuck_teardown()
    assert "rank 1: the process group's teardown did not finish in 0 s" in capsys.readouterr().err  # 0.5 s, as %.0f
    monkeypatch.setattr(group.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(group, "_stuck", False)
    assert ep.destroy(wait_s=5) is True and not group.stuck_teardown()


def test_serve_frees_its_server_before_the_process_group_is_torn_down(monkeypatch):
    """serve --ep N had the same teardown hang as generate (its engine's graphs alive at destroy): a rank's server
    must be gone when EPGroup.destroy runs."""
    import gc
    import weakref

    pytest.importorskip("uvicorn")  # the serve extra
    from megadecode import cli, ranks
    from megadecode.serve import main as serve_main

    servers, seen = [], []

    class Server:
        pass

    class FakeGroup:
        def destroy(self):
            gc.collect()
            seen.append([s() is None for s in servers])

    def build(args, ep, progress=None):
        s = Server()
        servers.append(weakref.ref(s))
        return s

    monkeypatch.setattr(ranks, "must_spawn", lambda n: False)
    monkeypatch.setattr(ranks, "leader", lambda: False)  # a follower rank: no socket, follow() then return
    monkeypatch.setattr(ranks, "join", lambda args: FakeGroup())
    monkeypatch.setattr(serve_main, "build_server", build)
    monkeypatch.setattr(serve_main, "follow", lambda server, ep: 0)
    argv = ["serve", "--model", "tiny-qwen3-moe", "--executor", "torch"]
    args = cli.build_parser().parse_args(argv)
    assert serve_main.cmd_serve(args, argv) == 0
    assert seen == [[True]]
