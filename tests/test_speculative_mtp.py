"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (`--speculative mtp`, mtp.py,
speculative.MtpDrafter): the layer's tensors load by name from a checkpoint, its math is that of a straightforward
implementation (transformers' decoder layer under enorm / hnorm / eh_proj / shared_head written out here), its
drafts after rejections are those of a fresh layer fed the whole history, greedy output is the model's own, an MTP
layer that copies the model has every draft accepted, and a model without one is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from megadecode.checkpoint import CheckpointError, load_weights, make_checkpoint
from megadecode.engine import Engine, RequestError
from megadecode.mtp import MtpLayer
from megadecode.presets import preset_config, preset_hf_config
from megadecode.sampling import SamplingParams
from megadecode.speculative import Drafter, MtpDrafter, generate
from megadecode.step import Step
from megadecode.weights import mtp_specs, random_weights

MTP = "tiny-deepseek-v3-mtp"
CFG = preset_config(MTP)
P = f"model.layers.{CFG.num_layers}"  # the MTP layer
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 7], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _engine(weights=None, batch: int = 3, executor: str = "torch") -> Engine:
    return Engine(CFG, weights or random_weights(CFG, seed=1, mtp=True), executor=executor, max_batch=batch,
                  max_seq_len=96)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CFG.rms_norm_eps) * w


# ---- loading ------------------------------------------------------------------------------------------------------

def test_a_checkpoints_mtp_layer_loads_by_name_only_when_asked(tmp_path):
    """make_checkpoint writes the MTP layer as DeepSeek-V3's checkpoints hold it (experts per expert, spread over
    shards); load_weights skips it unless mtp=True, which reads it with random_weights(mtp=True)'s values; the
    MTP layer's copy of the embedding is skipped, its head is optional, a missing tensor is named."""
    ckpt = make_checkpoint(tmp_path / "c", MTP, seed=2, dtype=torch.float32, shard_bytes=200_000)
    names = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert f"{P}.mlp.experts.0.gate_proj.weight" in names and f"{P}.eh_proj.weight" in names
    _, plain = load_weights(ckpt)
    assert not any(n.startswith(P + ".") for n in plain)
    _, both = load_weights(ckpt, mtp=True)
    want = random_weights(CFG, seed=2, mtp=True)
    assert set(both) == set(want) and all(torch.equal(both[n], want[n]) for n in want)
    assert Engine.from_pretrained(str(ckpt)).mtp_weights is None
    assert set(Engine.from_pretrained(str(ckpt), mtp=True).mtp_weights) == set(mtp_specs(CFG))

    tensors = {n: t for f in sorted(ckpt.glob("*.safetensors")) for n, t in load_file(str(f)).items()}
    tensors[f"{P}.embed_tokens.weight"] = tensors.pop(f"{P}.shared_head.head.weight")  # a copy; no head of its own
    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_text((ckpt / "config.json").read_text())
    save_file(tensors, str(one / "model.safetensors"))
    _, got = load_weights(one, mtp=True)
    assert f"{P}.shared_head.head.weight" not in got and f"{P}.embed_tokens.weight" not in got
    engine = Engine(CFG, got, max_batch=1, max_seq_len=32)
    assert MtpDrafter(engine, 2).layer.head is engine.executor.weights["lm_head.weight"]

    del tensors[f"{P}.hnorm.weight"]
    save_file(tensors, str(one / "model.safetensors"))
    load_weights(one)  # the model alone does not read the MTP layer
    with pytest.raises(CheckpointError, match=f"missing tensor '{P}.hnorm.weight'"):
        load_weights(one, mtp=True)

    declared = make_checkpoint(tmp_path / "declared", "tiny-deepseek-v3", dtype=torch.float32)
    hf = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))  # as transformers writes
    load_weights(declared)
    with pytest.raises(CheckpointError, match=r"holds no MTP layer \(model.layers.3.\* tensors\), though its"):
        load_weights(declared, mtp=True)


def test_an_fp8_checkpoints_mtp_layer_keeps_its_experts_fp8(tmp_path):
    hf = {**preset_hf_config("tiny-deepseek-v3-fp8"), "num_nextn_predict_layers": 1}
    cfg, w = load_weights(make_checkpoint(tmp_path / "fp8", hf, dtype=torch.bfloat16), mtp=True)
    assert w[f"{P}.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert w[f"{P}.self_attn.q_b_proj.weight"].dtype == torch.float32  # dequantized, as the model's
    engine = Engine(cfg, w, max_batch=1, max_seq_len=48)
    res = generate(engine, [PROMPTS[0]], 8, MtpDrafter(engine, 3), stop_at_eos=False)
    assert res.token_ids == engine.generate([PROMPTS[0]], 8, SamplingParams(greedy=True),
                                            stop_at_eos=False).token_ids


# ---- the layer's math ---------------------------------------------------------------------------------------------

def _straightforward(w: dict, tokens: list[int], hidden: torch.Tensor, head: torch.Tensor):
    """The MTP layer over positions 0..T-1 at once, written out: x = eh_proj([enorm(embed(next token)),
    hnorm(h)]), transformers' DeepseekV3DecoderLayer (MLA unabsorbed, causal, the model's rope; its MoE), then
    head(shared_head.norm(.)). Returns (layer output [T, D], logits [T, V])."""
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M

    d = preset_hf_config(MTP)
    hf = transformers.DeepseekV3Config(**{**{k: v for k, v in d.items() if k != "model_type"},
                                          "num_hidden_layers": CFG.num_layers + 1})
    hf._attn_implementation = "eager"
    hf._experts_implementation = "eager"
    layer = M.DeepseekV3DecoderLayer(hf, CFG.num_layers).eval()
    own = {n[len(P) + 1:]: t for n, t in w.items() if n.startswith(P + ".") and not n.startswith(
        tuple(f"{P}.{x}" for x in ("enorm", "hnorm", "eh_proj", "shared_head")))}
    layer.load_state_dict(own, strict=True)
    T = len(tokens)
    e = _rms(w["model.embed_tokens.weight"][torch.tensor(tokens)], w[f"{P}.enorm.weight"])
    x = torch.cat((e, _rms(hidden, w[f"{P}.hnorm.weight"])), -1) @ w[f"{P}.eh_proj.weight"].T
    pos = torch.arange(T)[None]
    rope = M.DeepseekV3RotaryEmbedding(hf)(x[None], pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=rope)[0]
    return out, _rms(out, w[f"{P}.shared_head.norm.weight"]) @ head.T


def test_the_mtp_layer_is_a_straightforward_implementations():
    """MtpLayer over 9 positions, as one segment and as a segment of 5 then one position at a time (its own
    cache), against the straightforward layer teacher-forced over all 9."""
    w = random_weights(CFG, seed=3, mtp=True)
    T = 9
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (T,), generator=gen).tolist()
    hidden = torch.randn(T, CFG.hidden_size, generator=gen) * 2
    want_h, want_logits = _straightforward(w, tokens, hidden, w[f"{P}.shared_head.head.weight"])
    layer = MtpLayer(CFG, w, w["lm_head.weight"], 2, 16)
    assert layer.head is w[f"{P}.shared_head.head.weight"]
    whole = Step(tokens=torch.tensor(tokens), positions=torch.arange(T), slots=torch.zeros(T, dtype=torch.long),
                 logit_rows=torch.arange(T), kv_len=T, segments=[(0, T, 0)])
    h, logits = layer(whole, hidden)
    torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    first = Step(tokens=torch.tensor(tokens[:5]), positions=torch.arange(5), slots=torch.ones(5, dtype=torch.long),
                 logit_rows=torch.tensor([4]), kv_len=5, segments=[(0, 5, 1)])
    got = [layer(first, hidden[:5])[1]]
    for t in range(5, T):
        one = Step(tokens=torch.tensor([tokens[t]]), positions=torch.tensor([t]), slots=torch.tensor([1]),
                   logit_rows=torch.tensor([0]), kv_len=t + 1)
        got.append(layer(one, hidden[t:t + 1])[1])
    torch.testing.assert_close(torch.cat(got), want_logits[4:], rtol=1e-4, atol=1e-4)


# ---- drafting -----------------------------------------------------------------------------------------------------

class Recording(Drafter):
    """An MtpDrafter whose every draft_many call is recorded: (sequences, slots, drafts)."""

    reads_hidden = True

    def __init__(self, inner: MtpDrafter):
        self.inner, self.calls, self.k = inner, [], inner.k

    def observe(self, pieces):
        self.inner.observe(pieces)

    def draft_many(self, seqs, slots=None):
        d = self.inner.draft_many(seqs, slots)
        self.calls.append(([list(q) for q in seqs], list(slots), d))
        return d


def _fresh_drafts(engine: Engine, seq: list[int], k: int, hidden: torch.Tensor | None = None) -> list[int]:
    """The MTP layer's greedy drafts after `seq` from scratch: the model's hidden states of seq[:-1] (`hidden`, or
    a fresh prefill's), a fresh layer fed them with each position's next token, then chained k - 1 steps."""
    w = engine.executor.weights
    layer = MtpLayer(CFG, {**engine.mtp_weights, "model.embed_tokens.weight": w["model.embed_tokens.weight"]},
                     w["lm_head.weight"], 1, engine.max_seq_len)
    n = len(seq) - 1
    if hidden is None:
        out = []
        engine.prefill([seq[:-1]], hidden=out)
        hidden = out[0]
    h, logits = layer(Step(tokens=torch.tensor(seq[1:]), positions=torch.arange(n), slots=torch.zeros(n).long(),
                           logit_rows=torch.tensor([n - 1]), kv_len=n, segments=[(0, n, 0)]), hidden[:n])
    out, h = [int(logits.argmax())], h[-1:]
    for r in range(1, k):
        h, logits = layer(Step(tokens=torch.tensor(out[-1:]), positions=torch.tensor([n - 1 + r]),
                               slots=torch.tensor([0]), logit_rows=torch.tensor([0]), kv_len=n + r), h)
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_with_mtp_drafts_is_the_models_own_and_drafts_follow_the_history(k):
    """Three sequences batched, 30 tokens: the tokens of Engine.generate. Random weights: most drafts are rejected,
    so each step overwrites the layer's cache entries of the rejected drafts; each recorded draft equals a fresh
    layer's from the whole history."""
    engine = _engine()
    want = engine.generate(PROMPTS, 30, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    rec = Recording(MtpDrafter(engine, k))
    res = generate(engine, PROMPTS, 30, rec, stop_at_eos=False)
    assert res.token_ids == want
    assert res.drafted > res.accepted
    checked = 0
    for seqs, _, drafts in rec.calls[1::7]:  # a few steps, every sequence of each
        for q, d in zip(seqs, drafts):
            assert d == _fresh_drafts(_engine(batch=1), q, k)[:len(d)] and len(d) == k, q
            checked += 1
    assert checked >= 9


def test_drafts_after_any_accepted_lengths_are_a_fresh_layers():
    """The observe / draft contract driven by hand, two slots interleaved: a sequence's kept positions arrive in
    chunks of 1 to 5 (a verify step's last token and accepted drafts) with the model's hidden states there, each
    draft_many writing the chained positions past them (written over by the next chunk); after each chunk the
    drafts are a fresh layer's from the whole history."""
    engine = _engine(batch=2)
    drafter = MtpDrafter(engine, 4)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 256, (60,), generator=gen).tolist() for _ in range(2)]
    hidden = []
    engine.prefill(seqs, hidden=hidden)  # causal: every position's hidden state as a verify step would give it
    H = hidden[0].view(2, 60, -1)
    n = [7, 3]  # prompt lengths + the first token
    drafter.observe([(s, 0, H[s, :n[s] - 1], torch.tensor(seqs[s][1:n[s]])) for s in (0, 1)])
    chunks = iter([1, 3, 5, 2, 1, 4, 1, 1, 5, 3, 2, 2])
    for _ in range(6):
        got = drafter.draft_many([seqs[0][:n[0]], seqs[1][:n[1]]], [0, 1])
        for s in (0, 1):
            assert got[s] == _fresh_drafts(engine, seqs[s][:n[s]], 4, H[s]), (s, n[s])
        m = [next(chunks), next(chunks)]
        drafter.observe([(s, n[s] - 1, H[s, n[s] - 1:n[s] - 1 + m[s]], torch.tensor(seqs[s][n[s]:n[s] + m[s]]))
                         for s in (0, 1)])
        n = [n[s] + m[s] for s in (0, 1)]
    assert drafter.draft_many([seqs[0][:n[0] - 1]], [0]) == [[]]  # not the length the slot's last chunk left


def test_graph_executor_and_sampling_run_with_mtp_drafts():
    engine = _engine(executor="graph")
    want = engine.generate(PROMPTS, 16, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    assert generate(engine, PROMPTS, 16, MtpDrafter(engine, 3), stop_at_eos=False).token_ids == want
    res = generate(engine, PROMPTS, 16, MtpDrafter(engine, 3), SamplingParams(temperature=0.8), seed=3,
                   stop_at_eos=False)
    assert [len(t) for t in res.token_ids] == [16] * 3


def _bigram_weights() -> dict[str, torch.Tensor]:
    """A model whose layers add nothing (attention and MLP outputs zero): its hidden state is its token's
    embedding and its next token a function f of the current one. Its MTP layer the same: eh_proj keeps the
    (normed) embedding of the next token alone, its decoder layer adds nothing, its head the model's. The draft
    after token t + 1 is f(token[t + 1]), the model's own next token: every draft is right."""
    w = random_weights(CFG, seed=4, mtp=True)
    D = CFG.hidden_size
    for n, t in w.items():
        if n.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            t.zero_()
    w[f"{P}.enorm.weight"].fill_(1.0)
    w[f"{P}.eh_proj.weight"].copy_(torch.cat((torch.eye(D), torch.zeros(D, D)), 1))
    w[f"{P}.shared_head.norm.weight"].copy_(w["model.norm.weight"])
    w[f"{P}.shared_head.head.weight"].copy_(w["lm_head.weight"])
    return w


def test_an_mtp_layer_that_copies_the_model_has_every_draft_accepted():
    engine = _engine(_bigram_weights())
    want = engine.generate(PROMPTS, 24, SamplingParams(greedy=True), stop_at_eos=False).token_ids
    res = generate(engine, PROMPTS, 24, MtpDrafter(engine, 3), stop_at_eos=False)
    assert res.token_ids == want
    assert res.drafted > 0 and res.accepted == res.drafted
    assert res.tokens_per_step > 3.5  # 23 tokens after the first in 6 or 7 steps of 4


# ---- refusals -----------------------------------------------------------------------------------------------------

def test_a_model_without_an_mtp_layer_is_refused_in_one_line(capsys):
    from test_cli import fails

    plain = preset_config("tiny-deepseek-v3")
    with pytest.raises(RequestError, match="needs a model with a multi-token-prediction layer"):
        MtpDrafter(Engine(plain, random_weights(plain), max_batch=1, max_seq_len=32), 3)
    with pytest.raises(RequestError, match="tiny-qwen3-moe: the MTP drafter needs a model with a multi-token"):
        Engine.from_pretrained("tiny-qwen3-moe", mtp=True)
    with pytest.raises(RequestError, match="holds no MTP layer weights"):
        MtpDrafter(Engine(CFG, random_weights(CFG), max_batch=1, max_seq_len=32), 3)
    two = {**preset_hf_config(MTP), "num_nextn_predict_layers": 2}
    from megadecode.config import config_from_hf

    with pytest.raises(RequestError, match="runs one MTP layer; this model has 2"):
        MtpDrafter(Engine(config_from_hf(two), random_weights(CFG, mtp=True), max_batch=1, max_seq_len=32), 3)
    err = fails(capsys, ["generate", "--model", "tiny-deepseek-v3", "--speculative", "mtp", "--max-new-tokens", "4"])
    assert "--speculative mtp: the MTP drafter needs a model with a multi-token-prediction layer" in err
    assert "this deepseek_v3 model has none" in err


def test_mtp_drafts_from_the_command_line(capsys):
    from megadecode.cli import main

    argv = ["generate", "--model", MTP, "--prompt", "Hello", "--max-new-tokens", "12", "--greedy", "--json"]
    assert main(argv + ["--speculative", "mtp", "--num-draft-tokens", "2"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["speculative"]["drafter"] == "mtp" and spec["speculative"]["drafted"] > 0


def test_drafts_need_the_slots():
    engine = _engine(batch=1)
    with pytest.raises(ValueError, match="give draft_many `slots`"):
        MtpDrafter(engine, 2).draft_many([[1, 2, 3]])


def test_eh_proj_reads_the_embedding_first():
    """A check of the concatenation order on its own: with eh_proj = [I, 0] the layer's input is the normed
    embedding of the next token, whatever the hidden state."""
    w = _bigram_weights()
    layer = MtpLayer(CFG, w, w["lm_head.weight"], 1, 8)
    step = Step(tokens=torch.tensor([5]), positions=torch.tensor([0]), slots=torch.tensor([0]),
                logit_rows=torch.tensor([0]), kv_len=1)
    a, _ = layer(step, torch.randn(1, CFG.hidden_size))
    b, _ = layer(step, torch.randn(1, CFG.hidden_size))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, F.normalize(w["model.embed_tokens.weight"][5:6], dim=-1) * CFG.hidden_size ** 0.5,
                               rtol=1e-4, atol=1e-4)
