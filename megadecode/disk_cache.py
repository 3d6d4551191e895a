"""Where megadecode keeps what it computes once per machine (the compiled megakernel, resolved model configs):
`$XDG_CACHE_HOME/megadecode/<kind>`, else `~/.cache/megadecode/<kind>`; each kind's environment variable names
another directory, or turns it off (`off`, `0`, `none`, `false`, `no` or empty). Entries are written whole or not
at all (a temporary file or directory renamed into place), so a reader never sees half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

OFF = ("off", "0", "none", "false", "no", "")


def cache_root(env: str, kind: str) -> Path | None:
    """The directory of one kind of entry; None when the environment variable `env` turns it off."""
    value = os.environ.get(env)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megadecode" / kind


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` by a temporary file in the same directory renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
