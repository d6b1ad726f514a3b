"""Faults: a killed rank, a job killed while saving, non-finite losses, 16 ranks, a long run's memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from support.scenarios import max_rel_diff
from support.trainer_helpers import layout_config, losses, run_train, tiny_config

from ndparallel.errors import NumericsError
from ndparallel.testing.ranks import RankFailure, run_ranks


def _metrics(path: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a resumed run appends, so the last record of a step wins."""
    records = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records


def _worker_with_rank(launcher: subprocess.Popen, rank: int) -> psutil.Process | None:
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "ndparallel_cli" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_killed_rank_ends_the_job_and_resume_reproduces_the_run(tmp_path, parity_record):
    config = layout_config(tiny_config(tmp_path, max_steps=10, save_steps=2, process_group_timeout_s=60), s=2, t=2)
    reference = run_train(4, {**config, "output_dir": str(tmp_path / "reference")})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ndparallel.cli", "train", str(path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = Path(config["output_dir"]) / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (metrics.exists() and max(_metrics(metrics), default=0) >= 5):
        time.sleep(0.2)
    victim = _worker_with_rank(launcher, 1)
    assert victim is not None, "no worker with RANK=1"
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    launcher.wait(timeout=120)
    to_exit = time.monotonic() - killed_at
    assert launcher.returncode != 0
    assert to_exit < 60, f"the job took {to_exit:.1f} s to end after a rank was killed"
    parity_record({"kill_to_exit_s": to_exit})
    latest = (Path(config["output_dir"]) / "checkpoints" / "latest").read_text()
    resumed = subprocess.run(
        [sys.executable, "-m", "ndparallel.cli", "train", str(path), "--resume", "latest"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = _metrics(metrics)
    start = int(latest.split("-")[1])
    assert [after[s]["loss"] for s in range(start + 1, 11)] == losses(reference)[start:]


def _save_crash(config: dict, crash_point: str):
    """Train; during the save of the last step die (like SIGKILL) at ``crash_point`` (on the rank publishing)."""
    from ndparallel.checkpoint import store
    from ndparallel.config.reading import parse_config
    from ndparallel.train.loop import run_training

    real_publish, real_write = store.publish, store.write_atomic

    def dying_publish(partial, root, name, index, keep):
        if name == "step-6" and crash_point == "shards":  # every rank's shards are written
            os._exit(137)
        return real_publish(partial, root, name, index, keep)

    def dying_write(path, text):
        if (crash_point == "complete" and path.name == "COMPLETE" and "step-6" in str(path)) or (
            crash_point == "latest" and path.name == "latest" and text == "step-6"
        ):
            os._exit(137)
        return real_write(path, text)

    store.publish, store.write_atomic = dying_publish, dying_write
    run_training(parse_config(config))


@pytest.mark.parametrize("crash_point", ["shards", "complete", "latest"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, crash_point):
    config = layout_config(tiny_config(tmp_path, max_steps=6, save_steps=3), s=2)
    with pytest.raises(RankFailure):
        run_ranks(2, _save_crash, config, crash_point, timeout_s=120)
    root = Path(config["output_dir"]) / "checkpoints"
    assert (root / "latest").read_text() == "step-3"
    assert not (crash_point != "latest" and (root / "step-6").exists())
    # The previous checkpoint resumes and finishes the run like an uninterrupted one.
    resumed = run_train(2, {**config, "resume_from_checkpoint": "latest"})
    reference = run_train(2, {**config, "output_dir": str(tmp_path / "reference")})
    assert losses(resumed) == losses(reference)[3:]
    assert not list(root.glob(".partial-*")), "the next save removes an interrupted one"


def _train_expecting(config: dict):
    from ndparallel.config.reading import parse_config
    from ndparallel.train.loop import run_training

    try:
        result = run_training(parse_config(config))
        return {"records": result.records}
    except NumericsError as exc:
        return {"error": str(exc)}


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    config = layout_config(tiny_config(tmp_path, max_steps=4, save_steps=2), s=2)
    run_train(2, config)
    diverging = {
        **config,
        "resume_from_checkpoint": "latest",
        "learning_rate": 1e9,
        "max_grad_norm": 0,
        "max_steps": 10,
        "save_steps": 1,
        "logging_steps": 3,
    }
    results = run_ranks(2, _train_expecting, diverging)
    message = results[0]["error"]
    assert all("error" in r for r in results), "every rank stops"
    step = int(message.split()[1].rstrip(":"))
    assert step >= 5 and "training stopped; the last good checkpoint is" in message
    root = Path(config["output_dir"]) / "checkpoints"
    latest = int((root / "latest").read_text().split("-")[1])
    assert latest < step, "no checkpoint holds the non-finite update"
    assert f"step-{latest}" in message


def test_nan_policy_skip_finishes_with_finite_weights(tmp_path):
    from safetensors.torch import load_file

    from ndparallel.weights.export import export_checkpoint

    config = layout_config(
        tiny_config(
            tmp_path,
            max_steps=5,
            learning_rate=1e9,
            max_grad_norm=0,
            nan_policy="skip",
            warmup_steps=0,
            lr_scheduler="constant",
        ),
        s=2,
    )
    records = run_ranks(2, _train_expecting, config)[0]["records"]
    assert records[-1]["skipped_steps"] >= 1
    export_checkpoint(config["output_dir"], tmp_path / "hf", dtype="float32")
    weights = load_file(next((tmp_path / "hf").glob("*.safetensors")))
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow
def test_sixteen_ranks_train_like_one(tmp_path, parity_record):
    config = tiny_config(tmp_path, max_steps=3, micro_batch_size=16)
    single = run_train(1, {**config, "output_dir": str(tmp_path / "single")})
    sixteen = run_train(
        16,
        {**layout_config(config, r=2, s=2, c=2, t=2, method="ring"), "output_dir": str(tmp_path / "sixteen")},
        timeout_s=400,
        pg_timeout_s=300,
    )
    diff = max_rel_diff(losses(sixteen), losses(single))
    parity_record({"loss": diff})
    assert diff < 1e-5


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _long_run(config: dict):
    """Run the trainer and sample this process's resident memory every 25 steps."""
    import ndparallel.train.loop as train_module
    from ndparallel.config.reading import parse_config

    samples = []
    real = train_module.forward_backward

    def sampled(model, micro, topo, **kwargs):
        result = real(model, micro, topo, **kwargs)
        samples.append(_rss_mib())
        return result

    train_module.forward_backward = sampled
    train_module.run_training(parse_config(config))
    return samples


@pytest.mark.slow
def test_long_run_memory_stays_flat(tmp_path, parity_record):
    config = layout_config(
        tiny_config(tmp_path, max_steps=300, save_steps=50, logging_steps=25, save_total_limit=2), s=2
    )
    samples = run_ranks(2, _long_run, config, timeout_s=600)[0]
    warm, end = samples[60], samples[-1]  # after the first saves and allocator warm-up
    growth = end - warm
    parity_record({"rss_growth_mib": growth})
    print(f"resident memory: step 60 {warm:.0f} MiB, step 300 {end:.0f} MiB, growth {growth:.1f} MiB")
    assert growth < 40, f"memory grew {growth:.1f} MiB over 240 steps with saves"
