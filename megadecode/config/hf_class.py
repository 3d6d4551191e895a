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
"""

from __future__ import annotations

import dataclasses
import typing
from contextlib import contextmanager

from .fields import hf_field
from .model import ConfigError


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


def resolve(d: dict, class_name: str, required: tuple[str, ...] = ()) -> dict:
    """config.json `d` as transformers' `class_name` reads it: a dict of the class's attributes, each under every
    spelling of its name (so `num_experts` and `num_local_experts` both hold the value, whichever was written
    or left to the default), plus the raw fields the class does not know (our parsers read some, e.g.
    DeepSeek's `scoring_func`). Steps 1 and 2 of the module doc; the caller reads the result."""
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
