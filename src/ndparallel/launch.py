"""One node's worker processes, started without any network listener.

``ndparallel train`` on one node starts its ranks here, not with torchrun's ``--standalone``: that
rendezvous store listens on every interface without authentication and torchrun's elastic agent unpickles
what it reads from it, so anyone who could reach the machine could run code as the training user. A
one-node job needs no network:

- the ranks meet through a ``FileStore`` (``topology.RENDEZVOUS_FILE_ENV`` names its file) in a private
  directory (mode 0700, removed at the end), which also holds the resolved config the workers read;
- gloo's and NCCL's own sockets are bound to the loopback interface (``GLOO_SOCKET_IFNAME`` and
  ``NCCL_SOCKET_IFNAME``, unless the user set them);
- the launcher watches its workers: when one exits with an error, the others get a moment to print their
  own line, then SIGTERM, then SIGKILL; SIGINT/SIGTERM sent to the launcher stop them the same way.

Several nodes go through torch.distributed.run (c10d rendezvous), whose store listens on the network by
design: see the README's security section.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ndparallel.mesh.topology import RENDEZVOUS_FILE_ENV

SETTLE_S = 3.0
"""After the first worker fails: how long the others may take to exit on their own (and print their line)."""
KILL_GRACE_S = 15.0
"""After SIGTERM: how long a worker may take before SIGKILL."""
POLL_S = 0.1


def loopback_interface() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def default_env(environ: dict[str, str]) -> dict[str, str]:
    """The workers' environment defaults (a user's own setting wins)."""
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    # Fewer fragmented blocks in PyTorch's CUDA allocator (reserved memory ran 10-36% above allocated
    # without it).
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


@contextmanager
def private_dir():
    """A fresh directory only this user can enter (``mkdtemp`` makes it 0700), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="ndparallel-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class Outcome:
    codes: list[int]
    """Each rank's exit code; < 0: ended by that signal (as ``subprocess`` reports it)."""
    interrupted_by: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped the launcher and its workers, if one did."""


class _StopRequest(threading.Event):
    signum: int | None = None


def run_local(worker_args: list[str], nproc: int, workdir: Path) -> Outcome:
    """Run ``python -m ndparallel_cli *worker_args`` as ranks 0..nproc-1 of one node and wait for them.

    ``workdir``: a private directory (``private_dir``) for the rendezvous file.
    """
    base = default_env(os.environ)
    base[RENDEZVOUS_FILE_ENV] = str(workdir / "rendezvous")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        base.setdefault(name, loopback_interface())
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        base.pop(name, None)  # a launcher's leftovers: these ranks meet through the file only
    command = [sys.executable, "-u", "-m", "ndparallel_cli", *worker_args]  # workers start fast and quiet too
    procs: list[subprocess.Popen] = []
    with _forwarded_signals() as stop_requested:
        try:
            for rank in range(nproc):
                env = {
                    **base,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    "GROUP_RANK": "0",
                }
                procs.append(subprocess.Popen(command, env=env))
            codes = _watch(procs, stop_requested)
            return Outcome(codes, stop_requested.signum)
        finally:
            _stop(procs, grace_s=KILL_GRACE_S)  # nothing outlives the launcher (normally all have exited)


def _watch(procs: list[subprocess.Popen], stop_requested: _StopRequest) -> list[int]:
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if stop_requested.is_set() or (failed_at is not None and now - failed_at > SETTLE_S):
            _stop(procs, grace_s=KILL_GRACE_S)
            return [p.wait() for p in procs]
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen], *, grace_s: float) -> None:
    """SIGTERM the workers still running, then SIGKILL those still there after ``grace_s``."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextmanager
def _forwarded_signals():
    """While the workers run, SIGINT and SIGTERM sent to the launcher stop them (and the launcher waits)."""
    stop = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        stop.signum = signum
        stop.set()

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
