"""`megadecode <command> --ep N` outside torchrun: start the N ranks on this machine, as vLLM's
--tensor-parallel-size starts its workers. Each rank is `python -m megadecode <the same arguments>` with
torchrun's variables set (group.TORCHRUN_VARS; a free localhost port), so a rank runs exactly what it runs under
`torchrun --nproc-per-node N -m megadecode ...` (the way across nodes). Rank 0 keeps the terminal (stdin, stdout);
the other ranks print only their errors. When a rank exits with an error, the others are given GRACE_S to notice
(their next collective fails) and are then stopped: the command never waits for a rank that is gone. SIGTERM and
Ctrl-C reach every rank.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

GRACE_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], nprocs: int, *, cmd: list[str] | None = None, grace_s: float = GRACE_S,
          poll_s: float = 0.05) -> int:
    """Run `cmd + argv` (default `python -m megadecode argv`) as `nprocs` ranks; the exit code of the first rank that
    failed, else 0."""
    cmd = [sys.executable, "-m", "megadecode"] if cmd is None else cmd
    port = str(free_port())
    procs = []
    for r in range(nprocs):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([*cmd, *argv], env=env,
                                      stdin=None if r == 0 else subprocess.DEVNULL))
    code, failed_at = 0, None
    stopping = []  # SIGTERM to this process (a service manager stopping the command): passed on to the ranks
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.append(signal.SIGTERM))
    try:
        while [p.poll() for p in procs].count(None):  # poll every rank: it sets each returncode
            if stopping:
                _stop(procs, signal.SIGTERM, grace_s)
            elif failed_at is None:
                bad = next((p.returncode for p in procs if p.returncode not in (None, 0)), None)
                if bad is not None:
                    code, failed_at = bad, time.monotonic()
            elif time.monotonic() - failed_at > grace_s:
                _stop(procs, grace_s=grace_s)
            time.sleep(poll_s)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank (one process group); wait for them to stop
        _stop(procs, signal.SIGINT, grace_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    codes = [p.wait() for p in procs]
    code = code or next((c for c in codes if c), 0)
    return 128 - code if code < 0 else code  # a rank killed by signal s: 128 + s, as a shell reports it


def _stop(procs, sig=signal.SIGTERM, grace_s: float = GRACE_S) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
