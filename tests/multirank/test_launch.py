"""The one-node launcher: no socket of the job listens beyond loopback; Ctrl-C stops every worker."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml
from support.trainer_helpers import layout_config, tiny_config


def _job(launcher: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(launcher.pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _listening(procs: list[psutil.Process]) -> set[tuple[str, int]]:
    found = set()
    for proc in procs:
        try:
            connections = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6: connections
            for conn in connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((conn.laddr.ip, conn.laddr.port))
        except psutil.Error:
            continue
    return found


def _steps_done(metrics: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=0)
    except (OSError, ValueError):
        return 0


def test_a_one_node_job_listens_on_loopback_only_and_ctrl_c_stops_it(tmp_path):
    config = layout_config(tiny_config(tmp_path, max_steps=400), s=2)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("GLOO_SOCKET_IFNAME", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ndparallel.cli", "train", str(path)],
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = Path(config["output_dir"]) / "metrics.jsonl"
    sockets, workers, private = set(), set(), set()
    deadline = time.monotonic() + 180
    while launcher.poll() is None and time.monotonic() < deadline and _steps_done(metrics) < 3:
        procs = _job(launcher)
        sockets |= _listening(procs)
        for proc in procs[1:]:
            try:
                workers.add(proc)
                private |= {Path(a).parent for a in proc.cmdline() if a.endswith("config.yaml")}
            except psutil.Error:
                continue
        time.sleep(0.2)
    assert launcher.poll() is None, launcher.stderr.read()[-3000:]
    assert len(workers) == 2 and sockets, "sampled while both workers ran (gloo listens on loopback)"
    wide = [(ip, port) for ip, port in sockets if not ipaddress.ip_address(ip.split("%")[0]).is_loopback]
    assert not wide, f"sockets of the job listen beyond loopback: {wide}"
    [folder] = private  # the resolved config and the rendezvous file: a directory only this user can enter
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700

    launcher.send_signal(signal.SIGINT)  # Ctrl-C: the launcher stops its workers and says so
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 1 and "stopped by SIGINT" in err, err[-3000:]
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    assert not folder.exists()
