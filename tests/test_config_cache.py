"""Resolved configs kept on disk (config/hf_class.py `resolve`, megadecode/disk_cache.py): a config resolved once
is read back in a later process without transformers and equals the fresh resolution for every preset; the key
follows the dict, the class, the required fields and transformers' version; a rejected config, a damaged entry
and a value JSON cannot hold are never served from the cache. (The rest of the suite runs with the cache off:
conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megadecode.config import hf_class as H
from megadecode.config.model import ConfigError
from megadecode.presets import PRESETS, preset_config


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGADECODE_CONFIG_CACHE", str(tmp_path / "configs"))
    return tmp_path / "configs"


def test_every_preset_reads_back_equal_and_without_transformers(cache, monkeypatch):
    fresh = {p: preset_config(p) for p in PRESETS}  # resolved and written
    assert len(list(cache.iterdir())) >= 3
    built = H._class
    monkeypatch.setattr(H, "_class", lambda name: pytest.fail(f"transformers' {name} built on a cache hit"))
    assert {p: preset_config(p) for p in PRESETS} == fresh
    monkeypatch.setattr(H, "_class", built)
    monkeypatch.setenv("MEGADECODE_CONFIG_CACHE", "off")
    assert {p: preset_config(p) for p in PRESETS} == fresh  # the cache off: transformers again, the same configs


def test_a_later_process_does_not_import_transformers(cache):
    code = ("import sys; from megadecode.presets import preset_config; preset_config('tiny-deepseek-v3'); "
            "print('transformers' in sys.modules)")
    env = {**os.environ, "MEGADECODE_CONFIG_CACHE": str(cache)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], [r.stderr[-500:] for r in runs]


def test_the_key_follows_the_dict_the_class_the_required_fields_and_the_version(cache, monkeypatch):
    d = {"hidden_size": 64, "vocab_size": 100}
    k = H.cache_file(d, "Qwen3MoeConfig", ("hidden_size",))
    assert k == H.cache_file(dict(reversed(list(d.items()))), "Qwen3MoeConfig", ("hidden_size",))  # key order
    others = [H.cache_file({**d, "vocab_size": 101}, "Qwen3MoeConfig", ("hidden_size",)),
              H.cache_file(d, "DeepseekV3Config", ("hidden_size",)),
              H.cache_file(d, "Qwen3MoeConfig", ())]
    monkeypatch.setattr(H.metadata, "version", lambda name: "0.0.1")
    others.append(H.cache_file(d, "Qwen3MoeConfig", ("hidden_size",)))
    assert len({k, *others}) == 5
    assert H.cache_file({**d, "x": float("nan")}, "Qwen3MoeConfig", ()) is None  # not plain JSON: never kept
    assert H.cache_file({**d, "x": object()}, "Qwen3MoeConfig", ()) is None
    monkeypatch.setenv("MEGADECODE_CONFIG_CACHE", "off")
    assert H.cache_file(d, "Qwen3MoeConfig", ()) is None


def test_a_rejected_config_is_rejected_every_time_and_never_kept(cache, tiny_ckpt):
    from megadecode.config import config_from_hf

    d = json.loads((tiny_ckpt("tiny-qwen3-moe") / "config.json").read_text())
    d["num_attention_heads"] = "many"
    before = set(cache.iterdir()) if cache.exists() else set()  # (making the checkpoint resolved its preset)
    for _ in range(2):
        with pytest.raises(ConfigError, match="num_attention_heads"):
            config_from_hf(d)
    assert (set(cache.iterdir()) if cache.exists() else set()) == before


def test_a_damaged_entry_is_resolved_again_and_rewritten(cache, monkeypatch):
    fresh = preset_config("tiny-qwen3-moe")
    [entry] = [f for f in cache.iterdir() if f.name.startswith("Qwen3MoeConfig")][:1]
    good = entry.read_text()
    for damage in ("{not json", "[1, 2]"):
        entry.write_text(damage)
        assert preset_config("tiny-qwen3-moe") == fresh
        assert entry.read_text() == good


def test_encoding_keeps_integer_keys_and_tuples():
    v = {"id2label": {0: "A", 1: "B"}, "t": (1, [2, (3,)]), "s": {"__items__": 1}, "n": None, "f": 0.5}
    back = H._decode(json.loads(json.dumps(H._encode(v))))
    assert back == v and isinstance(back["t"], tuple) and list(back["id2label"]) == [0, 1]
