"""config.json read through transformers' own config class of its family (Qwen3MoeConfig, DeepseekV3Config,
KimiLinearConfig), so that every alias and default transformers knows is honoured: e.g. `num_local_experts`
for Qwen3-MoE's `num_experts` (what transformers 5 writes), `rope_parameters` for `rope_theta` +
`rope_scaling`, Kimi-Linear's `num_experts_per_token`. The class is built from the dict (no hub access, no
remote code); transformers is imported here, lazily, because it is slow to import.

Order of checks, so that every error names the config.json field the user wrote:
  1. ours, on the raw dict: the required fields (those that set the model's size) are present under one of the
     spellings the class accepts; values of the class's integer and number fields have that type
     (`check_types`: the class would reject them too, in its own words).
  2. transformers' class; any value it rejects is a ConfigError carrying its message.
  3. the family parser reads the resolved dict (`resolve`) with its typed readers, and ModelConfig checks the
     result (megadecode/config/model.py).

Importing transformers and building the class takes ~3 s (on the CPU, after torch), most of a preset's start.
A resolved dict is kept on disk (megadecode/disk_cache.py, kind `configs`, MEGADECODE_CONFIG_CACHE) under a hash
of the raw dict, the class, the required fields, transformers' version and this module's and fields.py's source,
so a later process with the same config and transformers reads it back without importing transformers. Only
what passed every check is kept (a rejected config is checked again each time), and only a dict that reads back
equal (`_encode`: integer keys and tuples survive; anything else not plain JSON is not kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from ..disk_cache import cache_root, write_text_atomic
from .fields import hf_field
from .model import ConfigError

_SOURCES = (Path(__file__), Path(__file__).with_name("fields.py"))  # what a resolved dict also depends on


def _class(name: str):
    import transformers

    return getattr(transformers, name)


def spellings(cls, key: str) -> tuple[str, ...]:
    """`key` and every other name the class reads the same attribute from (its attribute_map), key first."""
    amap = getattr(cls, "attribute_map", {}) or {}
    names = {key}
    for alias, canon in amap.items():
        if key in (alias, canon):
            names |= {alias, canon}
    return (key, *sorted(names - {key}))


def _kind(tp) -> type | None:
    """int or float for a field annotated as an integer / a number (optionally None), else None."""
    args = set(typing.get_args(tp)) or {tp}
    args.discard(type(None))
    if args == {int}:
        return int
    if float in args and args <= {int, float}:
        return float
    return None


def check_types(d: dict, cls) -> None:
    """Each value in `d` of a field the class annotates as an integer or a number must be one (None allowed
    where the class allows it): the error names the field as the user wrote it."""
    annotated = {f.name: _kind(f.type) for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    for key, value in d.items():
        if value is None:
            continue
        kind = next((annotated[n] for n in spellings(cls, key) if annotated.get(n)), None)
        if kind is not None:
            hf_field(d, key, type_=kind)


def check_required(d: dict, cls, required: tuple[str, ...]) -> None:
    for key in required:
        names = spellings(cls, key)
        if not any(d.get(n) is not None for n in names):
            alt = f" (or {', '.join(map(repr, names[1:]))})" if len(names) > 1 else ""
            raise ConfigError(f"config.json is missing the required field {key!r}{alt}")


@contextmanager
def _quiet_transformers():
    """transformers logs its own notes while building a config (e.g. special-token ids outside the vocabulary,
    which megadecode reports itself): silenced for the duration."""
    from transformers.utils import logging as tf_logging

    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)


def cache_file(d: dict, class_name: str, required: tuple[str, ...]) -> Path | None:
    """Where the resolved form of `d` is kept; None when the cache is off, transformers' version is unknown or
    `d` is not plain JSON."""
    root = cache_root("MEGADECODE_CONFIG_CACHE", "configs")
    if root is None:
        return None
    try:
        version = metadata.version("transformers")
        raw = json.dumps(d, sort_keys=True, allow_nan=False)
    except (metadata.PackageNotFoundError, TypeError, ValueError):
        return None
    h = hashlib.sha256(f"transformers {version}\0{class_name}\0{sorted(required)}\0{raw}\0".encode())
    for f in _SOURCES:
        h.update(f.read_bytes())
    return root / f"{class_name}-{h.hexdigest()[:32]}.json"


def _encode(v):
    """JSON for what a resolved dict holds: a dict with keys other than strings (transformers' `id2label` has
    ints) as {"__items__": [[key, value], ...]}, a tuple as {"__tuple__": [...]}; `_decode` reverses it."""
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and not ({"__items__", "__tuple__"} & set(v)):
            return {k: _encode(x) for k, x in v.items()}
        return {"__items__": [[_encode(k), _encode(x)] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {"__tuple__": [_encode(x) for x in v]}
    if isinstance(v, list):
        return [_encode(x) for x in v]
    return v


def _decode(v):
    if isinstance(v, dict):
        if set(v) == {"__items__"}:
            return {_decode(k): _decode(x) for k, x in v["__items__"]}
        if set(v) == {"__tuple__"}:
            return tuple(_decode(x) for x in v["__tuple__"])
        return {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def resolve(d: dict, class_name: str, required: tuple[str, ...] = ()) -> dict:
    """config.json `d` as transformers' `class_name` reads it: a dict of the class's attributes, each under every
    spelling of its name (so `num_experts` and `num_local_experts` both hold the value, whichever was written
    or left to the default), plus the raw fields the class does not know (our parsers read some, e.g.
    DeepSeek's `scoring_func`). Steps 1 and 2 of the module doc; the caller reads the result. Read back from the
    disk cache when this config was resolved before (`cache_file`)."""
    path = cache_file(d, class_name, required)
    if path is not None:
        try:
            cached = _decode(json.loads(path.read_text()))
            if isinstance(cached, dict):
                return cached
        except (OSError, ValueError, TypeError):  # absent, or damaged: resolved again and rewritten
            pass
    out = _resolve(d, class_name, required)
    if path is not None:
        try:
            text = json.dumps(_encode(out), sort_keys=True, allow_nan=False)
            if _decode(json.loads(text)) == out:  # kept only where it reads back equal (no objects)
                write_text_atomic(path, text)
        except (OSError, TypeError, ValueError):  # a cache that cannot be written costs the next start ~3 s
            pass
    return out


def _resolve(d: dict, class_name: str, required: tuple[str, ...]) -> dict:
    cls = _class(class_name)
    check_required(d, cls, required)
    check_types(d, cls)
    kwargs = {k: v for k, v in d.items() if k != "model_type"}
    try:
        with _quiet_transformers():
            c = cls(**kwargs)
    except Exception as e:  # noqa: BLE001 -- transformers' own checks (strict dataclass fields, rope, ...)
        msg = " ".join(str(e).split())
        raise ConfigError(f"config.json is rejected by transformers' {class_name}: {msg}") from None
    out = {**d, **c.to_dict()}
    for alias, canon in (getattr(cls, "attribute_map", {}) or {}).items():
        for n in (alias, canon):
            if hasattr(c, n):
                out[n] = getattr(c, n)
    return out
