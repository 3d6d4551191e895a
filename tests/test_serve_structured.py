"""Structured output (megadecode/structured.py): guides compiled by xgrammar over the byte tokenizer and over a
checkpoint's own Hugging Face tokenizer, the mask the sampler applies, and the server's response_format /
guided_* fields through the real openai client, every output parsed and checked against its guide."""

from __future__ import annotations

import serve_stack  # noqa: F401 (first: skips this file without the serve stack)

import json
import re

import pytest
import torch

from megadecode.serve.server import Server
from megadecode.structured import GuideError, Grammars, GuideSpec, apply_guides
from megadecode.tokenizer import EOS_ID, ByteTokenizer
from serving import QWEN, Running, post, srv  # noqa: F401 (srv: a fixture)
from test_serve import write_hf_tokenizer

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (the serve extra)")

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                           "size": {"enum": [1, 2, 3]}},
          "required": ["color", "ok", "size"], "additionalProperties": False}


def valid(doc) -> bool:
    return (isinstance(doc, dict) and set(doc) == {"color", "ok", "size"} and doc["color"] in ("red", "green", "blue")
            and isinstance(doc["ok"], bool) and doc["size"] in (1, 2, 3) and not isinstance(doc["size"], bool))


def test_a_guide_masks_every_token_its_grammar_does_not_allow_and_ends_at_its_stop_token():
    g = Grammars(ByteTokenizer(), 259, (EOS_ID,))
    guide = g.guide(g.compile(GuideSpec("choice", json.dumps(["yes", "no"]))))
    logits = torch.randn(2, 259)
    out = apply_guides(logits, [guide, None])
    allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert allowed == sorted({ord("y"), ord("n")}) and torch.equal(out[1], logits[1])  # an unguided row is unchanged
    assert torch.isfinite(logits).all()  # a copy: the model's logits keep their values
    assert not guide.accept(ord("x"))  # not allowed
    for t in b"no":
        assert guide.accept(t)
    assert not guide.done
    assert torch.isfinite(apply_guides(logits, [guide])[0]).nonzero().flatten().tolist() == [EOS_ID]
    assert guide.accept(EOS_ID) and guide.done


@pytest.mark.parametrize("spec, match", [(GuideSpec("json_schema", '{"type": "objec"}'), 'Unsupported type "objec"'),
                                         (GuideSpec("regex", "(ab"), "parenthesis is not closed")])
def test_a_guide_that_does_not_compile_is_a_one_line_error_naming_the_problem(spec, match):
    with pytest.raises(GuideError, match=match) as e:
        Grammars(ByteTokenizer(), 259, (EOS_ID,)).compile(spec)
    assert "\n" not in str(e.value) and ".cc:" not in str(e.value)


def test_guided_requests_on_a_checkpoint_with_its_own_tokenizer_always_match(tiny_ckpt):
    """A byte-level BPE tokenizer of transformers' classes: a JSON schema (sampled at temperature 1, 8 choices from
    two seeds), a regex, a choice (streamed), json_object; every output parses and matches, ending by "stop"."""
    ckpt = tiny_ckpt(QWEN)
    write_hf_tokenizer(ckpt)
    r = Running(Server.build(str(ckpt), max_batch=4, max_seq_len=160))
    try:
        client = r.client()
        messages = [{"role": "user", "content": "Describe a ball."}]
        for seed in (0, 1):
            out = client.chat.completions.create(
                model=str(ckpt), messages=messages, max_tokens=80, temperature=1.0, seed=seed, n=4,
                response_format={"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}})
            for c in out.choices:
                assert c.finish_reason == "stop" and valid(json.loads(c.message.content)), c.message.content
        texts = set()
        for seed in range(4):
            out = client.completions.create(model=str(ckpt), prompt="Code:", max_tokens=20, temperature=1.0,
                                            seed=seed, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
            c = out.choices[0]
            assert c.finish_reason == "stop" and re.fullmatch("[0-9]{3}-[a-z]{2}", c.text), c.text
            texts.add(c.text)
        assert len(texts) > 1  # sampled, not a fixed string
        stream = client.completions.create(model=str(ckpt), prompt="Pick:", max_tokens=20, temperature=1.0, seed=3,
                                           stream=True, extra_body={"guided_choice": ["yes", "no", "maybe so"]})
        chunks = list(stream)
        assert "".join(ch.choices[0].text for ch in chunks) in ("yes", "no", "maybe so")
        assert chunks[-1].choices[0].finish_reason == "stop"
        out = client.chat.completions.create(model=str(ckpt), messages=messages, max_tokens=30, temperature=0,
                                             response_format={"type": "json_object"})
        c = out.choices[0]
        assert c.message.content.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
        # the server goes on unguided
        out = client.completions.create(model=str(ckpt), prompt="Hi", max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"
    finally:
        r.close()


def test_guides_on_the_byte_tokenizer_and_the_greedy_sampler(srv):
    out = srv.client().completions.create(model=QWEN, prompt="Hi", max_tokens=58, temperature=0,
                                          extra_body={"structured_outputs": {"json": SCHEMA}})
    assert out.choices[0].finish_reason == "stop" and valid(json.loads(out.choices[0].text))
    out = srv.client().completions.create(model=QWEN, prompt="Hi", max_tokens=58, temperature=0.7, seed=2,
                                          extra_body={"guided_json": json.dumps(SCHEMA)})
    assert valid(json.loads(out.choices[0].text))
    grammar = 'root ::= "sum(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(3):
        out = srv.client().completions.create(model=QWEN, prompt="Hi", max_tokens=20, temperature=1.0, seed=seed,
                                              extra_body={"guided_grammar": grammar})
        c = out.choices[0]
        assert c.finish_reason == "stop" and re.fullmatch(r"sum\([1-9][0-9]?(\+[1-9][0-9]?)?\)", c.text), c.text


@pytest.mark.parametrize("extra, param, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objec"}}}}, "response_format",
     'cannot be compiled: Unsupported type "objec"'),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"guided_regex": "(ab"}, "guided_regex", "cannot be compiled: .*parenthesis is not closed"),
    ({"guided_regex": ""}, "guided_regex", "non-empty regular expression"),
    ({"guided_choice": []}, "guided_choice", "list of 1 to 256 non-empty strings"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "must be a JSON schema"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one of"),
    ({"guided_grammar": "root ::= (("}, "guided_grammar", "cannot be compiled"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs.grammar", "non-empty EBNF grammar"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice",
     "one structured output guide a request"),
])
def test_a_bad_guide_is_a_400_naming_its_field(srv, extra, param, match):
    r = post(srv, {"model": QWEN, "prompt": "Hi", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err
    assert post(srv, {"model": QWEN, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_token_its_guide_refuses_ends_the_sequence_with_an_error_and_a_done_guide_with_stop():
    from megadecode.sequence import ERROR, STOP, Sequence

    g = Grammars(ByteTokenizer(), 259, (EOS_ID,))
    compiled = g.compile(GuideSpec("regex", "ab"))
    seq = Sequence(prompt=[1], max_tokens=10, stop_ids=frozenset({EOS_ID}), guide=g.guide(compiled))
    assert seq.append(ord("a"), 0.0) is None
    assert seq.append(ord("x"), 0.0) == ERROR and "not allowed by the request's structured output guide" in seq.error
    seq = Sequence(prompt=[1], max_tokens=10, stop_ids=frozenset(), guide=g.guide(compiled))  # ignore_eos
    assert [seq.append(t, 0.0) for t in (ord("a"), ord("b"), EOS_ID)] == [None, None, STOP]
