"""The compiled megakernel on disk (backends/mega/kernel_cache.py) without a GPU: the key covers every file the
kernel is traced from and changes with any of them, the DSL's version and the options; an entry is stored by a
rename and loaded with its register count; a broken entry, a failed export and a lost race each end in one line
and a working launcher, never a crash. The DSL's export and load are stand-ins here (without the CUDA runtime
the export cannot link); tests/test_mega_gpu.py runs the real ones in two processes on the GPU."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from megadecode.backends.mega import kernel_cache as KC

pytest.importorskip("cutlass", reason="the megakernel needs nvidia-cutlass-dsl (the test extra installs it)")


def _module_file(pkg: Path, here: Path, node: ast.ImportFrom) -> list[Path]:
    """The package files a relative `from ... import ...` names (a module, or a package's __init__ and the
    submodules it imports by name)."""
    base = here.parent
    for _ in range(node.level - 1):
        base = base.parent
    target = base.joinpath(*node.module.split(".")) if node.module else base
    out = []
    if target.with_suffix(".py").is_file():
        out.append(target.with_suffix(".py"))
    elif (target / "__init__.py").is_file():
        out.append(target / "__init__.py")
        out += [target / f"{a.name}.py" for a in node.names if (target / f"{a.name}.py").is_file()]
    return out


def test_the_key_covers_the_kernels_import_closure():
    """Every package module the launcher's source reaches by import (cute_kernel.py, its bodies, their helpers,
    found by walking the imports from the loop and every body module), the opcode table and runtime.py (the
    launch's placeholder arguments) are files the key hashes: an edit to any of them never loads a stale binary."""
    pkg = KC._PKG
    hashed = set(KC.source_files())
    # the bodies (cute/*.py) are imported by name through the opcode table: walked from too
    seen, todo = set(), [pkg / "backends/mega/cute_kernel.py", *(pkg / "backends/mega/cute").glob("*.py")]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                todo += _module_file(pkg, f, node)
    # the opcode table itself (ops/*.py: each opcode's body and argument tables, read by the trace); what those
    # modules import for pyvm's semantics (pyvm_ops, the reference) runs in torch, never in the kernel
    seen |= set((pkg / "backends/mega/ops").glob("*.py"))
    # a package's __init__ of a docstring alone holds nothing the kernel is built from
    kernel_side = {f for f in seen if not (f.name == "__init__.py" and
                                           all(isinstance(n, ast.Expr) for n in ast.parse(f.read_text()).body))}
    missing = sorted(str(f.relative_to(pkg)) for f in kernel_side - hashed)
    assert not missing, f"files the kernel is built from but the cache key does not hash: {missing}"
    assert pkg / "backends/mega/runtime.py" in hashed


def _copy_sources(tmp_path: Path, monkeypatch) -> Path:
    root = tmp_path / "megadecode"
    for f in KC.source_files():
        dst = root / f.relative_to(KC._PKG)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst)
    monkeypatch.setattr(KC, "_PKG", root)
    return root


def test_the_key_changes_with_any_source_byte_the_options_and_the_dsl(tmp_path, monkeypatch):
    root = _copy_sources(tmp_path, monkeypatch)
    k0 = KC.source_key("--gpu-arch=sm_90a --keep-cubin")
    assert k0 == KC.source_key("--gpu-arch=sm_90a --keep-cubin")  # stable
    assert KC.source_key("--gpu-arch=sm_100a --keep-cubin") != k0
    for rel in ("backends/mega/cute/moe.py", "backends/mega/isa.py", "quant/mxfp4_frag.py"):
        f = root / rel
        text = f.read_bytes()
        f.write_bytes(text + b"\n# one more line\n")
        assert KC.source_key("--gpu-arch=sm_90a --keep-cubin") != k0, rel
        f.write_bytes(text)
    assert KC.source_key("--gpu-arch=sm_90a --keep-cubin") == k0
    import cutlass

    monkeypatch.setattr(cutlass, "__version__", "9.9.9")
    assert KC.source_key("--gpu-arch=sm_90a --keep-cubin") != k0
    monkeypatch.delattr(cutlass, "__version__")  # a DSL without the attribute: the distribution's version
    monkeypatch.setattr(KC.metadata, "version", lambda name: {"nvidia-cutlass-dsl": "4.0.0-dist"}[name])
    assert KC.dsl_version() == "4.0.0-dist"
    (root / "backends/mega/isa.py").unlink()
    with pytest.raises(FileNotFoundError, match="isa.py"):
        KC.source_key("x")


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MEGADECODE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert KC.cache_dir() == tmp_path / "megadecode" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert KC.cache_dir() == tmp_path / "home" / ".cache" / "megadecode" / "kernels"
    monkeypatch.setenv("MEGADECODE_KERNEL_CACHE", str(tmp_path / "k"))
    assert KC.cache_dir() == tmp_path / "k"
    for off in ("off", "0", "OFF", ""):
        monkeypatch.setenv("MEGADECODE_KERNEL_CACHE", off)
        assert KC.cache_dir() is None


class FakeCompiled:
    """What store() uses of the DSL's compiled function: export_to_c(dir, name) writes the header and the object."""

    def __init__(self, payload=b"\x7fELF object", fail=None):
        self.payload, self.fail, self.calls = payload, fail, 0

    def export_to_c(self, where, name):
        self.calls += 1
        if self.fail:
            raise self.fail
        Path(where, f"{name}.h").write_text("/* header */\n")
        Path(where, f"{name}.o").write_bytes(self.payload)


class FakeModule:
    """What load_module returns: the exported function as an attribute; here it returns the object's bytes and its
    arguments."""

    def __init__(self, path):
        payload = Path(path).read_bytes()
        self.mega_step = lambda *args: (payload, args)


@pytest.fixture
def fake_load(monkeypatch):
    import cutlass.cute as cute

    loads = []

    def load_module(path):
        loads.append(path)
        if Path(path).read_bytes() == b"garbage":
            raise RuntimeError("\n  error: bad object file\n  note: more lines\n")
        return FakeModule(path)

    monkeypatch.setattr(cute.runtime, "load_module", load_module)
    return loads


def test_store_then_load_returns_the_function_and_its_register_count(tmp_path, fake_load, capsys):
    root = tmp_path / "cache"
    assert KC.load(root, "k1") is None  # no directory yet: a miss, nothing said
    assert KC.store(root, "k1", FakeCompiled(), 128)
    assert sorted(p.name for p in root.iterdir()) == ["k1"]  # no temporary directory left behind
    assert json.loads((root / "k1/meta.json").read_text())["registers"] == 128
    (module, fn), regs = KC.load(root, "k1")
    assert fn(7) == (b"\x7fELF object", (7,)) and regs == 128 and isinstance(module, FakeModule)
    assert KC.load(root, "k2") is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", ["object", "meta", "registers", "key", "no-object"])
def test_a_broken_entry_is_said_in_one_line_removed_and_missed(tmp_path, fake_load, capsys, damage):
    root = tmp_path / "cache"
    assert KC.store(root, "k1", FakeCompiled(), 96)
    entry = root / "k1"
    meta = json.loads((entry / "meta.json").read_text())
    if damage == "object":
        (entry / "mega_step.o").write_bytes(b"garbage")
    elif damage == "meta":
        (entry / "meta.json").write_text("{not json")
    elif damage == "registers":
        (entry / "meta.json").write_text(json.dumps({**meta, "registers": 0}))
    elif damage == "key":
        (entry / "meta.json").write_text(json.dumps({**meta, "key": "other"}))
    else:
        (entry / "mega_step.o").unlink()
    assert KC.load(root, "k1") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not load" in err[0] and "compiling it again" in err[0], err
    assert not entry.exists()


def test_a_failed_export_is_one_line_and_leaves_nothing(tmp_path, capsys):
    root = tmp_path / "cache"
    c = FakeCompiled(fail=RuntimeError("error: Error dumping object file\n  Failed to dump object file with PIC"))
    assert not KC.store(root, "k1", c, 128)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not cached" in err[0] and "PIC" in err[0], err
    assert list(root.iterdir()) == []
    assert not KC.store(root, "k1", FakeCompiled(), None)  # no register count: refused, the load would need it
    assert "no register count" in capsys.readouterr().err and list(root.iterdir()) == []


def test_a_lost_race_keeps_the_first_entry(tmp_path, fake_load):
    root = tmp_path / "cache"
    assert KC.store(root, "k1", FakeCompiled(b"first"), 128)
    assert KC.store(root, "k1", FakeCompiled(b"second"), 128)  # another process landed first: fine, nothing torn
    assert sorted(p.name for p in root.iterdir()) == ["k1"]
    assert KC.load(root, "k1")[0][1]() == (b"first", ())


def test_compiled_launcher_stores_then_loads_and_recompiles_a_broken_entry(tmp_path, fake_load, monkeypatch,
                                                                           capsys):
    """runtime.compiled_launcher on a CUDA device (the compile a stand-in): the first process compiles and stores,
    the next loads with the stored register count and compiles nothing; a broken entry is compiled again and
    replaced; on the CPU and with the cache off nothing is stored."""
    from megadecode.backends.mega import runtime as R

    compiles = []

    class Compiled(FakeCompiled):
        class artifacts:
            CUBIN = None

    def compile_launcher(device, cache=True, ring=True):
        compiles.append(device)
        return Compiled()

    monkeypatch.setattr(R, "compile_launcher", compile_launcher)
    monkeypatch.setattr(R, "cubin_registers", lambda cubin: 120)
    monkeypatch.setenv("MEGADECODE_KERNEL_CACHE", str(tmp_path / "cache"))
    cuda = torch.device("cuda", 0)

    monkeypatch.setattr(R, "_COMPILED", None)
    first = R.compiled_launcher(cuda)
    assert first.source == "compiled" and first.registers == 120 and len(compiles) == 1
    assert "compiling the megakernel" in capsys.readouterr().err
    assert R.compiled_launcher(cuda) is first  # once per process
    ring_entry = set((tmp_path / "cache").iterdir())
    plain = R.compiled_launcher(cuda, ring=False)  # the other build: a compile and an entry of its own
    assert plain is not first and not plain.ring and first.ring and len(compiles) == 2
    (plain_entry,) = set((tmp_path / "cache").iterdir()) - ring_entry
    import shutil

    shutil.rmtree(plain_entry)  # the ring build's entry alone, as the test goes on
    capsys.readouterr()
    del compiles[1:]

    monkeypatch.setattr(R, "_COMPILED", None)  # the next process
    second = R.compiled_launcher(cuda)
    assert second.source == "cache" and second.registers == 120 and len(compiles) == 1
    assert R.launcher_registers(second) == 120 and capsys.readouterr().err == ""
    assert second(1, 2) == (b"\x7fELF object", (1, 2))  # the Launcher forwards to the loaded function

    [entry] = (tmp_path / "cache").iterdir()
    (entry / "mega_step.o").write_bytes(b"garbage")
    monkeypatch.setattr(R, "_COMPILED", None)
    third = R.compiled_launcher(cuda)
    assert third.source == "compiled" and len(compiles) == 2
    err = capsys.readouterr().err
    assert "did not load" in err and "compiling the megakernel" in err
    assert (entry / "mega_step.o").read_bytes() == b"\x7fELF object"  # replaced by the fresh export

    def no_key(options):
        raise ModuleNotFoundError("no DSL version")

    key = KC.source_key
    monkeypatch.setattr(KC, "source_key", no_key)  # no key: compiled, said in one line, nothing stored
    monkeypatch.setattr(R, "_COMPILED", None)
    assert R.compiled_launcher(cuda).source == "compiled" and len(compiles) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cache key could not be computed" in err[0] and "no DSL version" in err[0], err
    monkeypatch.setattr(KC, "source_key", key)

    for env, device in (("off", cuda), (str(tmp_path / "other"), torch.device("cpu"))):
        monkeypatch.setenv("MEGADECODE_KERNEL_CACHE", env)
        monkeypatch.setattr(R, "_COMPILED", None)
        assert R.compiled_launcher(device).source == "compiled"
    assert not (tmp_path / "other").exists()
