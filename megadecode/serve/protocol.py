"""The OpenAI request fields the server takes, checked one by one: anything wrong is an APIError (400 with an
OpenAI-style body naming the field), never an exception that reaches the engine. Taken (completions and chat):
model, prompt / messages, max_tokens (chat: max_completion_tokens too), temperature (0: greedy), top_p, logit_bias,
presence_penalty, frequency_penalty, seed, stop, stream, stream_options.include_usage, n (up to MAX_CHOICES choices,
sampled independently from one prefill of the prompt; with a seed, choice i draws as seed + i would alone); logprobs
(the sampled token's, with up to MAX_TOP_LOGPROBS most likely tokens beside it: completions' integer logprobs,
chat's logprobs true and top_logprobs); vLLM's extensions top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos and return_token_ids (each choice, or chunk, also carries its `token_ids`); `user` (an
end-user id: it changes nothing); structured output (`parse_guide`: response_format json_object / json_schema,
vLLM's guided_json / regex / choice / grammar and structured_outputs). Nothing is ignored: a field that asks for
what the server does not do (NEUTRAL: best_of > 1, tools, ...) is refused unless it holds its neutral value, and any
other field is refused as unknown (a null counts as absent).
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass

from ..engine import MAX_SEED
from ..sampling import GREEDY_BELOW, MAX_TOP_LOGPROBS, SamplingParams
from ..structured import GuideSpec
from .chat import ROLES, ChatError, chat_prompt

MAX_STOP = 16  # stop strings per request (OpenAI allows 4)
MAX_BIAS = 100.0  # logit_bias values: OpenAI's range [-100, 100]
MAX_BIASED = 1024  # logit_bias entries per request
MAX_REPETITION = 10.0  # repetition_penalty's upper bound (vLLM takes any > 0; past ~2 it only garbles)
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_CHOICES = 16  # n: choices per request (each a sequence: it takes a batch slot like a request)


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """A checked request, ready to become a Sequence."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stop_ids: frozenset[int]
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool = False
    min_tokens: int = 0
    top_logprobs: int = 0  # the most likely tokens reported beside each generated one (with logprobs)
    n: int = 1  # choices: sequences of the same prompt, sampled independently
    guide: GuideSpec | None = None  # structured output: what the text must match (structured.py)
    guide_key: str | None = None  # the field that asked for it (what a guide that does not compile names)

    def seed_of(self, choice: int) -> int | None:
        """Choice i's seed: seed + i (wrapping past MAX_SEED), so each choice draws what that seed draws alone."""
        return None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)


def parse_json(body: bytes) -> dict:
    """The body as a JSON object: strict (no NaN or Infinity, which json.loads takes by default)."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")
    try:
        doc = json.loads(body, parse_constant=refuse)
    except (ValueError, RecursionError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise APIError(f"the request body must be a JSON object, got {type(doc).__name__}", code="invalid_json")
    return doc


def _int(doc: dict, key: str, default, lo: int, hi: int | None = None):
    v = doc.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(f"{key} must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        allowed = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise APIError(f"{key} must be {allowed}, got {v}", key)
    return v


def _number(doc: dict, key: str, default: float) -> float:
    v = doc.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(f"{key} must be a number, got {v!r}", key)
    return float(v)


def _bool(doc: dict, key: str, default: bool) -> bool:
    v = doc.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"{key} must be true or false, got {v!r}", key)
    return v


def _token_ids(v, key: str, vocab: int) -> list[int]:
    if not isinstance(v, list):
        raise APIError(f"{key} must be a list of token ids, got {type(v).__name__}", key)
    if not v:
        raise APIError(f"{key} is empty", key)
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int):
            raise APIError(f"{key} holds {t!r}, which is not a token id (an integer)", key)
        if not 0 <= t < vocab:
            raise APIError(f"{key} holds token id {t}, outside the vocabulary [0, {vocab})", key)
    return [operator.index(t) for t in v]


TAKEN = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
         "stream_options", "logprobs", "stop_token_ids", "ignore_eos", "return_token_ids", "user", "logit_bias",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "response_format",
         "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}
TAKEN_COMPLETION = TAKEN | {"prompt"}
TAKEN_CHAT = TAKEN | {"messages", "max_completion_tokens", "top_logprobs"}
# Fields of OpenAI's API (and vLLM's extensions) the server does not implement: taken only at the value that asks
# for nothing (what clients send by default), refused otherwise (top_logprobs: chat takes it; completions ask for
# alternatives with an integer `logprobs`).
NEUTRAL = {"best_of": (1,), "echo": (False,), "suffix": ("",), "top_logprobs": (0,),
           "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
           "include_stop_str_in_output": (False,), "use_beam_search": (False,),
           "skip_special_tokens": (True,), "bad_words": ([],)}


def _neutral(v, values: tuple) -> bool:
    """v is one of `values` (True is not 1, 1.0 is)."""
    return any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in values)


def _unsupported(doc: dict, chat: bool) -> None:
    taken = TAKEN_CHAT if chat else TAKEN_COMPLETION
    for key, v in doc.items():
        if key in taken or v is None:
            continue
        if key in NEUTRAL:
            if not _neutral(v, NEUTRAL[key]):
                raise APIError(f"{key}={v!r} is not supported by this server", key, code="unsupported")
            continue
        raise APIError(f"{key} is not supported by this server (an unknown field, or one it does not implement; "
                       f"it takes {', '.join(sorted(taken))})", key, code="unsupported")


def completion_prompt(doc: dict, tokenizer, vocab: int) -> list[int]:
    """`prompt`: a string, a list of token ids, or a list of one of those (one prompt per request)."""
    p = doc.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError("prompt is empty", "prompt")
        return tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise APIError(f"prompt holds {len(p)} prompts; this server takes one per request", "prompt",
                       code="unsupported")
    if isinstance(p, list):
        return _token_ids(p, "prompt", vocab)
    raise APIError(f"prompt must be a string or a list of token ids, got {type(p).__name__}", "prompt")


def chat_messages(doc: dict) -> list[dict]:
    msgs = doc.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        key = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{key} must be an object with a role and a content", key)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise APIError(f"{key}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{key}.role")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise APIError(f"{key}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               "supported", f"{key}.content")
            content = "".join(c["text"] for c in content)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise APIError(f"{key}.content must be a string or a list of text parts", f"{key}.content")
        out.append({"role": role, "content": content})
    return out


def _model(doc: dict, model: str, required: bool = True) -> None:
    if doc.get("model") is None:
        if required:
            raise APIError(f"model is missing; this server serves {model!r}", "model")
        return
    if doc.get("model") != model:  # 404, as OpenAI and vLLM answer
        raise APIError(f"model {doc.get('model')!r} is not served here; this server serves {model!r}", "model",
                       status=404, code="model_not_found")


def _only(doc: dict, taken: set[str], what: str) -> None:
    for key, v in doc.items():
        if key not in taken and v is not None:
            raise APIError(f"{key} is not taken by {what} (it takes {', '.join(sorted(taken))})", key,
                           code="unsupported")


def parse_tokenize(doc: dict, *, model: str, tokenizer) -> list[int]:
    """POST /tokenize (vLLM's): `prompt` (a string, tokenized as a completion's prompt is, or with
    add_special_tokens false without the BOS) or `messages` (through the chat template, as a chat request's);
    `model` optional, and when given, the served one."""
    _only(doc, {"model", "prompt", "messages", "add_special_tokens"}, "/tokenize")
    _model(doc, model, required=False)
    has_p, has_m = doc.get("prompt") is not None, doc.get("messages") is not None
    if has_p == has_m:
        raise APIError("give exactly one of prompt (a string) and messages", "prompt" if has_p else "messages")
    if has_m:
        if doc.get("add_special_tokens") is not None:
            raise APIError("add_special_tokens applies to a prompt; messages take the chat template's tokens",
                           "add_special_tokens")
        try:
            return chat_prompt(tokenizer, chat_messages(doc))
        except ChatError as e:
            raise APIError(str(e), "messages") from None
    p = doc["prompt"]
    if not isinstance(p, str):
        raise APIError(f"prompt must be a string, got {type(p).__name__}", "prompt")
    return tokenizer.encode(p, add_bos=_bool(doc, "add_special_tokens", True))


def parse_detokenize(doc: dict, *, model: str, vocab: int) -> list[int]:
    """POST /detokenize (vLLM's): `tokens`, ids in the vocabulary; `model` optional, and when given, the served one."""
    _only(doc, {"model", "tokens"}, "/detokenize")
    _model(doc, model, required=False)
    if doc.get("tokens") is None:
        raise APIError("tokens is missing (a list of token ids)", "tokens")
    return _token_ids(doc["tokens"], "tokens", vocab)


def _logit_bias(doc: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {token id (as a string, or an integer): bias in [-100, 100]}, added to the logits
    before every selection (greedy too), at most MAX_BIASED entries."""
    v = doc.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise APIError(f"logit_bias must be an object of token id -> bias, got {type(v).__name__}", "logit_bias")
    if len(v) > MAX_BIASED:
        raise APIError(f"logit_bias has {len(v)} entries; at most {MAX_BIASED}", "logit_bias")
    out = []
    for key, b in v.items():
        try:
            t = int(key)
        except (TypeError, ValueError):
            t = None
        if t is None or not 0 <= t < vocab:
            raise APIError(f"logit_bias: {key!r} is not a token id in the vocabulary [0, {vocab})", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_BIAS <= b <= MAX_BIAS:
            raise APIError(f"logit_bias[{key!r}] must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {b!r}",
                           "logit_bias")
        out.append((t, float(b)))
    return tuple(sorted(out))


def parse_request(doc: dict, *, chat: bool, model: str, tokenizer, vocab: int, max_seq_len: int,
                  eos_ids: tuple[int, ...]) -> Request:
    _model(doc, model)
    _unsupported(doc, chat)
    if chat:
        try:
            prompt = chat_prompt(tokenizer, chat_messages(doc))
        except ChatError as e:
            raise APIError(str(e), "messages") from None
    else:
        prompt = completion_prompt(doc, tokenizer, vocab)
    if not prompt:
        raise APIError("the prompt has no tokens", "messages" if chat else "prompt")
    room = max_seq_len - len(prompt)
    if room < 1:
        raise APIError(f"the prompt has {len(prompt)} tokens; this server's context is {max_seq_len} tokens, "
                       "which leaves no room for a completion", "messages" if chat else "prompt",
                       code="context_length_exceeded")
    key = "max_completion_tokens" if chat and doc.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(doc, key, room if chat else min(16, room), 1)
    if max_tokens > room:
        raise APIError(f"{key} is {max_tokens}, but the prompt has {len(prompt)} tokens and the context is "
                       f"{max_seq_len}: at most {room} new tokens fit", key, code="context_length_exceeded")
    temperature = _number(doc, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(f"temperature must be in [0, {MAX_TEMPERATURE}] (0: greedy), got {temperature}",
                       "temperature")
    top_p = _number(doc, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(doc, "top_k", 0, -1)  # vLLM's: -1 or 0, every token
    min_p = _number(doc, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise APIError(f"min_p must be in [0, 1], got {min_p}", "min_p")
    pen = {"logit_bias": _logit_bias(doc, vocab)}
    for key in ("presence_penalty", "frequency_penalty"):
        pen[key] = _number(doc, key, 0.0)
        if not -2 <= pen[key] <= 2:
            raise APIError(f"{key} must be in [-2, 2], got {pen[key]}", key)
    pen["repetition_penalty"] = _number(doc, "repetition_penalty", 1.0)
    if not 0 < pen["repetition_penalty"] <= MAX_REPETITION:
        raise APIError(f"repetition_penalty must be in (0, {MAX_REPETITION:g}] (1: none), got "
                       f"{pen['repetition_penalty']}", "repetition_penalty")
    params = SamplingParams(greedy=True, **pen) if temperature < GREEDY_BELOW else \
        SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), min_p=min_p, **pen)
    seed = _int(doc, "seed", None, 0, MAX_SEED)
    n = _int(doc, "n", 1, 1, MAX_CHOICES)
    stop = doc.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    stop_ids = doc.get("stop_token_ids")
    stop_ids = set(_token_ids(stop_ids, "stop_token_ids", vocab)) if stop_ids not in (None, []) else set()
    if not _bool(doc, "ignore_eos", False):
        stop_ids |= set(eos_ids)
    stream = _bool(doc, "stream", False)
    opts = doc.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIError("stream_options must be an object", "stream_options")
    include_usage = _bool(opts or {}, "include_usage", False)
    if chat:
        logprobs = _bool(doc, "logprobs", False)
        top = _int(doc, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    else:  # the sampled token's logprob and this many alternatives (0: none)
        top = _int(doc, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        logprobs, top = top is not None, top or 0
    min_tokens = _int(doc, "min_tokens", 0, 0, max_tokens)  # vLLM's: no EOS or stop id before this many tokens
    key, guide = parse_guide(doc) or (None, None)
    return Request(prompt, max_tokens, params, seed, tuple(stop), frozenset(stop_ids), stream, include_usage,
                   logprobs, _bool(doc, "return_token_ids", False), min_tokens, top, n, guide, key)


MAX_CHOICE = 256  # guided_choice: strings a request may list
GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's guided_<kind> fields, and structured_outputs' keys
MAX_GUIDE_CHARS = 1 << 16  # a schema's JSON text or a regex


def _schema(v, key: str) -> str:
    """A JSON schema given as an object or as its JSON text -> its JSON text."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise APIError(f"{key} must be a JSON schema (an object, or its JSON text)", key) from None
    if not isinstance(v, dict):
        raise APIError(f"{key} must be a JSON schema (an object, or its JSON text)", key)
    text = json.dumps(v)
    if len(text) > MAX_GUIDE_CHARS:
        raise APIError(f"{key} is {len(text)} characters of JSON; at most {MAX_GUIDE_CHARS}", key)
    return text


def _guide_of(kind: str, v, key: str) -> GuideSpec:
    if kind == "json":
        return GuideSpec("json_schema", _schema(v, key))
    if kind in ("regex", "grammar"):
        what = "regular expression" if kind == "regex" else "EBNF grammar"
        if not isinstance(v, str) or not v or len(v) > MAX_GUIDE_CHARS:
            raise APIError(f"{key} must be a non-empty {what} of at most {MAX_GUIDE_CHARS} characters", key)
        return GuideSpec(kind, v)
    if not isinstance(v, list) or not 0 < len(v) <= MAX_CHOICE or not all(isinstance(c, str) and c for c in v):
        raise APIError(f"{key} must be a list of 1 to {MAX_CHOICE} non-empty strings", key)
    return GuideSpec("choice", json.dumps(v))


def parse_guide(doc: dict) -> tuple[str, GuideSpec] | None:
    """Structured output, at most one way a request: OpenAI's `response_format` (text: none; json_object; json_schema
    with its `json_schema.schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or
    vLLM's newer `structured_outputs` object holding one of json / regex / choice / grammar. (the field that asked,
    the guide), or None."""
    found = []
    rf = doc.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            found.append(("response_format", GuideSpec("json_object")))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise APIError("response_format of type json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", GuideSpec("json_schema", _schema(js["schema"], "response_format"))))
        elif kind != "text":
            raise APIError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}", "response_format")
    for kind in GUIDED:
        if doc.get(f"guided_{kind}") is not None:
            found.append((f"guided_{kind}", _guide_of(kind, doc[f"guided_{kind}"], f"guided_{kind}")))
    so = doc.get("structured_outputs")
    if so is not None:
        given = [k for k in GUIDED if isinstance(so, dict) and so.get(k) is not None]
        if not isinstance(so, dict) or len(given) != 1 or set(so) - set(GUIDED):
            raise APIError(f"structured_outputs must hold exactly one of {', '.join(GUIDED)}", "structured_outputs")
        found.append(("structured_outputs", _guide_of(given[0], so[given[0]], f"structured_outputs.{given[0]}")))
    if len(found) > 1:
        raise APIError(f"one structured output guide a request, got {', '.join(k for k, _ in found)}", found[1][0])
    return found[0] if found else None
