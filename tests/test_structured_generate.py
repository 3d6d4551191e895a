"""Structured output in `generate` (Engine.generate's guides; the CLI's --guided-json / --guided-regex /
--guided-choice): every sequence matches its guide whatever the sampler draws, and a guide the flags get wrong is
one error line before any weight is built."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megadecode.engine import Engine, RequestError
from megadecode.presets import preset_config
from megadecode.sampling import SamplingParams
from megadecode.structured import Grammars, GuideSpec
from megadecode.tokenizer import ByteTokenizer
from megadecode.weights import random_weights
from test_cli import fails, run_json

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the serve extra)")

SCHEMA = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_guided_generation_matches_its_guide_for_every_sequence_and_sampler():
    cfg = preset_config("tiny-deepseek-v3")
    eng = Engine(cfg, random_weights(cfg, "cpu", torch.float32, 0), max_batch=3, max_seq_len=96)
    g = Grammars(ByteTokenizer(), cfg.vocab_size, tuple(cfg.eos_token_id))
    compiled = g.compile(GuideSpec("json_schema", json.dumps(SCHEMA)))
    tok = ByteTokenizer()
    prompts = [tok.encode("a"), tok.encode("bcd"), tok.encode("ef")]
    for sampling in (SamplingParams(greedy=True), SamplingParams(temperature=1.0), SamplingParams(temperature=1.5,
                                                                                                   top_k=20)):
        res = eng.generate(prompts, 40, sampling, seed=5, guides=[g.guide(compiled), None, g.guide(compiled)])
        for i in (0, 2):
            doc = json.loads(tok.decode(res.token_ids[i]))
            assert set(doc) == {"n", "ok"} and doc["n"] in (1, 22, 333) and isinstance(doc["ok"], bool), doc
            assert res.token_ids[i][-1] in cfg.eos_token_id  # ended by the grammar's stop token
    with pytest.raises(RequestError, match="cannot ignore EOS"):
        eng.generate(prompts, 4, guides=[g.guide(compiled)] * 3, stop_at_eos=False)
    with pytest.raises(RequestError, match="2 guides for 3 prompts"):
        eng.generate(prompts, 4, guides=[None, None])


def test_generate_cli_guided_flags(capsys, tmp_path):
    out = run_json(capsys, ["generate", "--json", "--guided-regex", "[0-9]{3}-[a-z]{2}", "--prompt", "x",
                            "--prompt", "yz", "--max-new-tokens", "12", "--seed", "2"])
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", t) for t in out["text"]), out["text"]
    out = run_json(capsys, ["generate", "--json", "--guided-choice", "yes", "--guided-choice", "no, never",
                            "--max-new-tokens", "12", "--temperature", "1.2"])
    assert out["text"][0] in ("yes", "no, never")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = run_json(capsys, ["generate", "--json", "--guided-json", str(schema), "--max-new-tokens", "30", "--greedy"])
    assert json.loads(out["text"][0])["n"] in (1, 22, 333)
    assert "cannot be compiled: Regex parsing error" in fails(capsys, ["generate", "--guided-regex", "(ab"])
    assert "neither JSON nor a readable file" in fails(capsys, ["generate", "--guided-json", str(tmp_path / "none")])
    assert "--guided-json: a JSON schema is an object" in fails(capsys, ["generate", "--guided-json", "[1]"])
    (tmp_path / "bad.json").write_text("{oops")
    assert "is not valid JSON" in fails(capsys, ["generate", "--guided-json", str(tmp_path / "bad.json")])
    assert "cannot be used with --ignore-eos" in fails(capsys, ["generate", "--guided-regex", "a", "--ignore-eos"])
