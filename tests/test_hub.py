"""`--model ORG/NAME` through the local Hugging Face cache (laid out here in a temp dir, HF_HUB_CACHE), offline;
a clear one-line error naming the cache when the model is not there."""

from __future__ import annotations

import json

import pytest

from megadecode.checkpoint import make_checkpoint
from megadecode.cli import main
from megadecode.hub import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A hub cache holding `acme/tiny-moe` (a tiny-qwen3-moe checkpoint) as huggingface_hub lays it out."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-moe"
    make_checkpoint(repo / "snapshots" / COMMIT, "tiny-qwen3-moe")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were it to try the network, it would fail here
    return cache


def test_resolve_model(hub, tmp_path):
    assert resolve_model("acme/tiny-moe") == str(hub / "models--acme--tiny-moe" / "snapshots" / COMMIT)
    assert resolve_model("tiny-qwen3-moe") == "tiny-qwen3-moe"  # a preset
    (tmp_path / "acme" / "local").mkdir(parents=True)
    assert resolve_model(str(tmp_path / "acme" / "local")) == str(tmp_path / "acme" / "local")  # a directory first
    with pytest.raises(FileNotFoundError, match=f"nor in the local Hugging Face cache \\({hub}"):
        resolve_model("acme/absent")


def test_generate_a_cached_hub_model(hub, capsys):
    assert main(["generate", "--model", "acme/tiny-moe", "--token-ids", "256,1,2", "--greedy", "--json",
                 "--max-new-tokens", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ckpt = str(hub / "models--acme--tiny-moe" / "snapshots" / COMMIT)
    assert main(["generate", "--model", ckpt, "--token-ids", "256,1,2", "--greedy", "--json",
                 "--max-new-tokens", "4"]) == 0
    assert doc["model"] == "acme/tiny-moe" and doc["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_hub_model_not_in_the_cache_is_one_line_naming_the_cache(hub, capsys, command):
    if command == "serve":
        pytest.importorskip("uvicorn", reason="serve needs the serve stack")
    argv = [command, "--model", "acme/absent"] + (["--port", "0"] if command == "serve" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("megadecode: error: --model 'acme/absent' is neither a preset") and err.count("\n") == 1
    assert f"local Hugging Face cache ({hub}" in err and "hf download acme/absent" in err
