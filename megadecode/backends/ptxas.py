"""ptxas on a CuTe DSL kernel's PTX, from the host: the cubin and ptxas's report (registers, spills), for the
megakernel's co-residency and audit and the fused backend's CuTe kernels alike."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile


def _ptxas() -> tuple[str | None, bool]:
    """(path of a ptxas, whether it is triton's CUDA 12.8 one, which reads PTX ISA up to 8.7)."""
    ptxas = shutil.which("ptxas") or shutil.which("/usr/local/cuda/bin/ptxas")
    if ptxas:
        return ptxas, False
    try:
        import triton

        return shutil.which(f"{triton.__path__[0]}/backends/nvidia/bin/ptxas"), True
    except ImportError:
        return None, False


@functools.lru_cache(maxsize=4)
def assemble(ptx: str) -> tuple[bytes | None, str]:
    """ptxas -v on the kernel's PTX: (cubin, ptxas's report), or (None, why). A PTX ISA newer than the ptxas
    found (the DSL's bundled toolchain can be ahead of the machine's CUDA) is retried with the version that
    ptxas names: the instructions the kernel uses are older than either. Memoized by the PTX's text: ptxas takes
    ~35 s on the whole megakernel on a 2-core CPU, and the audit, the register count and the residency check each
    asked for the same assembly (every caller passes the PTX positionally: one cache key)."""
    ptxas, old = _ptxas()
    if ptxas is None:
        return None, "no ptxas found (PATH, /usr/local/cuda/bin, triton's)"
    if old:
        ptx = re.sub(r"^\.version [\d.]+", ".version 8.7", ptx, flags=re.M)
    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    for _ in range(2):
        with tempfile.TemporaryDirectory() as d:
            src = f"{d}/k.ptx"
            with open(src, "w") as f:
                f.write(ptx)
            r = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", f"{d}/k.cubin"], capture_output=True,
                               text=True, timeout=300)
            cubin = open(f"{d}/k.cubin", "rb").read() if r.returncode == 0 else None
        v = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", r.stderr)
        if v is None:
            break
        ptx = re.sub(r"^\.version [\d.]+", f".version {v.group(1)}", ptx, flags=re.M)
    report = r.stderr + r.stdout
    return cubin, report if cubin is not None else f"ptxas ({ptxas}) exit {r.returncode}: {report[-300:]}"
