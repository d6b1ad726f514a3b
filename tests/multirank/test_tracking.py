"""What a user sees of a run: TensorBoard and W&B (offline, the real packages), rank 0 only, with the config
and layout recorded; per-step timing in metrics.jsonl; a CUDA-style out-of-memory as one line."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from support.trainer_helpers import tiny_config

from ndparallel.testing.ranks import RankFailure, run_ranks

TIMING = ("data_s", "fwd_bwd_s", "optimizer_s", "checkpoint_stall_s", "step_time_s")


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (LevelDB log format: 32 KiB blocks of chunks, each
    with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last), after a 7-byte
    ':W&B' file header."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tracking")
    mp = pytest.MonkeyPatch()
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        mp.setenv(name, str(tmp / "wandb-home"))
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    config = tiny_config(
        tmp,
        dp_shard_size=2,
        micro_batch_size=4,
        max_steps=4,
        save_steps=2,
        use_tensorboard=True,
        wandb_project="ndp-test",
        wandb_name="tiny-fsdp2",
        wandb_run_id="ndptest01",
        wandb_mode="offline",
        wandb_log_model="end",
        wandb_watch="gradients",
    )
    try:
        results = run_ranks(2, _train_and_compare_process_state, config)
    finally:
        mp.undo()
    return Path(config["output_dir"]), results


def _process_state() -> tuple:
    import logging
    import warnings

    import transformers

    return (
        list(warnings.filters),
        transformers.logging.get_verbosity(),
        logging.getLogger("torch.distributed.tensor._redistribute").level,
    )


def _train_and_compare_process_state(config: dict):
    """Train; and the host process's warning filters and log levels are the same after it as before."""
    from ndparallel.config.reading import parse_config
    from ndparallel.train.loop import run_training

    before = _process_state()
    result = run_training(parse_config(config))
    return result.records, before == _process_state()


def test_run_leaves_warning_filters_and_log_levels_as_they_were(tracked_run):
    _, results = tracked_run
    assert [same for _, same in results] == [True, True]  # rank 0 and rank 1 (which hid all warnings)


def test_tensorboard_gets_metrics_config_and_layout(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = tracked_run[0], tracked_run[1][0][0]
    assert len(list((out / "tensorboard").iterdir())) == 1  # rank 0 only
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert {"time/fwd_bwd_s", "time/checkpoint_stall_s", "throughput/tokens_per_s"} <= set(acc.Tags()["scalars"])
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    layout = acc.Tensors("layout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "wandb_project: ndp-test" in config and "dp_shard_size: 2" in config
    assert "world 2 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 1" in layout


def test_wandb_offline_run_has_metrics_config_layout_and_model(tracked_run):
    out, records = tracked_run[0], tracked_run[1][0][0]
    runs = list((out / "wandb").glob("offline-run-*-ndptest01"))
    assert len(runs) == 1 and not list((out / "wandb").glob("*run-*[!1]"))  # one run: rank 0 only
    parsed = wandb_records(next(runs[0].glob("*.wandb")))
    history = {}
    for r in parsed:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[items["_step"]] = items
    assert [(s, history[s]["train/loss"]) for s in sorted(history)] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records
    ]
    assert history[4]["time/checkpoint_stall_s"] > 0
    run = next(r.run for r in parsed if r.WhichOneof("record_type") == "run")
    assert run.display_name == "tiny-fsdp2" and run.project == "ndp-test" and run.run_id == "ndptest01"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["layout"]["dp_shard"] == 2 and config["wandb_name"] == "tiny-fsdp2"
    assert config["gradient_sync"] == "every_micro_batch"
    assert "rank 1: (r0, s1, c0, t0)" in config["layout_description"]
    artifacts = [r.artifact for r in parsed if r.WhichOneof("record_type") == "artifact"]
    assert [a.type for a in artifacts] == ["model"]  # wandb_log_model: end, the last checkpoint
    assert any(m.path == "COMPLETE" for a in artifacts for m in a.manifest.contents)


def test_metrics_time_each_phase(tracked_run):
    records = tracked_run[1][0][0]
    for r in records:
        assert all(isinstance(r[k], float) and r[k] >= 0 for k in TIMING), r
        # on CPU the phases are host time inside the step: they cannot add up to more than it
        assert r["data_s"] + r["fwd_bwd_s"] + r["optimizer_s"] <= r["step_time_s"] * 1.01
    assert [r["checkpoint_stall_s"] > 0 for r in records] == [False, True, False, True]  # save_steps: 2


def test_missing_tracker_package_is_one_clear_error(tmp_path, monkeypatch):
    import importlib.util

    from ndparallel.config.reading import parse_config
    from ndparallel.errors import ConfigError
    from ndparallel.train.tracking import check_trackers_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb_project is set, but wandb is not installed; pip install "):
        check_trackers_installed(parse_config(tiny_config(tmp_path, wandb_project="p")))


def _train_until_oom(config: dict):
    import ndparallel.train.loop as trainer
    from ndparallel.config.reading import parse_config

    real, calls = trainer.forward_backward, []

    def forward_backward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    trainer.forward_backward = forward_backward  # this forked rank's copy of the module only
    trainer.run_training(parse_config(config))


def test_out_of_memory_is_one_line_naming_step_and_layout(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _train_until_oom, tiny_config(tmp_path, dp_shard_size=2, micro_batch_size=4))
    last = str(info.value).strip().splitlines()[-1]
    assert last.startswith("ndparallel.train.oom.DeviceMemoryError: step 3: out of memory on rank ")
    assert "with dp_replicate 1 x dp_shard 2 x cp 1 x tp 1; lower micro_batch_size" in last
