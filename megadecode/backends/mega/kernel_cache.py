"""The compiled megakernel kept on disk across processes, so that only the first process on a machine pays its
compile (~60 s on the H200; issue 40 item 5, the cold start).

nvidia-cutlass-dsl's own file cache never serves `cute.compile` (4.8.1's `cute.compile` turns it off itself), so
the runtime keeps its own: the launcher exported with the DSL's `export_to_c` (a C header and a host object that
holds the cubin) and loaded in a later process with `cute.runtime.load_module`, which links the object in-process
(no tracing, no C compiler). An entry lives in a directory named by `source_key`: a hash of every source file the
kernel is traced from (`SOURCES`, the kernel's import closure inside the package), the DSL's version, the
architecture and the compile options, so an edited kernel or another DSL never loads a stale binary. Beside the
object, `meta.json` holds the kernel's register count: the loaded launcher keeps no cubin, and the residency check
needs the count. An entry is written to a temporary directory and renamed into place, so a process never reads
half of one; a failed load is said in one line and the kernel compiled again.

The cache directory is `MEGADECODE_KERNEL_CACHE` (`off` turns the cache off), else
`$XDG_CACHE_HOME/megadecode/kernels`, else `~/.cache/megadecode/kernels`. Only CUDA launches are cached: without
a GPU the DSL cannot export (the object's link needs the CUDA runtime), and the CPU compiles are the tests' audits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from ...disk_cache import cache_root

PREFIX = "mega_step"  # the exported function's name
_PKG = Path(__file__).resolve().parents[2]  # megadecode/
# what the launcher is traced from: the loop, its opcode bodies and their device helpers, the row layout and limits,
# the launch's placeholder arguments (runtime.py) and the MXFP4 constants the expert bodies decode with
SOURCES = ("backends/mega/cute_kernel.py", "backends/mega/cute/*.py", "backends/mega/ops/*.py",
           "backends/mega/isa.py", "backends/mega/limits.py", "backends/mega/runtime.py", "backends/cute_device.py",
           "backends/cute_frag.py", "quant/mxfp4_frag.py", "quant/mxfp4.py")


def cache_dir() -> Path | None:
    """Where compiled launchers are kept; None when MEGADECODE_KERNEL_CACHE turns the cache off."""
    return cache_root("MEGADECODE_KERNEL_CACHE", "kernels")


def source_files() -> list[Path]:
    """The files of SOURCES, in a fixed order."""
    files = set()
    for pattern in SOURCES:
        found = sorted(_PKG.glob(pattern))
        if not found:
            raise FileNotFoundError(f"the megakernel's source {pattern} is missing from {_PKG}")
        files.update(found)
    return sorted(files)


def dsl_version() -> str:
    """The CuTe DSL's version: the module's own (a DSL put on the path without its package metadata, as the GPU
    machine's staged one is, has no distribution to ask), else the installed distribution's."""
    import cutlass

    version = getattr(cutlass, "__version__", None)
    return str(version) if version else metadata.version("nvidia-cutlass-dsl")


def source_key(options: str) -> str:
    """The cache key: sha256 of the DSL's version, the compile options (architecture included) and every source
    file's path and bytes."""
    h = hashlib.sha256()
    h.update(f"nvidia-cutlass-dsl {dsl_version()}\0{options}\0".encode())
    for f in source_files():
        h.update(str(f.relative_to(_PKG)).encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def say(message: str) -> None:
    print(f"megadecode: {message}", file=sys.stderr, flush=True)


def why(e: BaseException) -> str:
    """An exception in one line: its type and its message's last non-empty line (the DSL's run to many)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def load(root: Path, key: str):
    """(launcher, registers) from the entry of `key` under `root`, or None when there is none. A present entry that
    does not load is said in one line and removed, so that the compile that follows replaces it."""
    entry = root / key
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        if meta.get("key") != key:
            raise ValueError(f"meta.json names key {meta.get('key')!r}")
        registers = meta.get("registers")
        if not isinstance(registers, int) or not 0 < registers <= 255:
            raise ValueError(f"meta.json's register count {registers!r} is not 1..255")
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(entry / f"{PREFIX}.o"))
        fn = getattr(module, PREFIX)
    except Exception as e:  # noqa: BLE001 (any failure to load means: compile again)
        say(f"the cached megakernel in {entry} did not load ({why(e)}); compiling it again")
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return (module, fn), registers


def store(root: Path, key: str, compiled, registers: int | None) -> bool:
    """Export `compiled` into the entry of `key` (a temporary directory renamed into place); False, said in one
    line, when the export or the write fails (the compiled launcher still serves this process)."""
    if registers is None:
        say("the compiled megakernel has no register count; not cached")
        return False
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        compiled.export_to_c(str(tmp), PREFIX)
        if not (tmp / f"{PREFIX}.o").is_file():
            raise FileNotFoundError(f"the export wrote no {PREFIX}.o")
        (tmp / "meta.json").write_text(json.dumps({"key": key, "registers": int(registers),
                                                   "dsl": dsl_version()}) + "\n")
        try:
            os.rename(tmp, root / key)
        except OSError:
            if not (root / key).is_dir():  # not another process's entry landing first: a real failure
                raise
        return True
    except Exception as e:  # noqa: BLE001 (a cache that cannot be written costs the next process a compile)
        say(f"the compiled megakernel was not cached in {root} ({why(e)})")
        return False
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
