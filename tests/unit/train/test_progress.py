"""Numbers a person reads (no 5.108e+04), and the out-of-memory line with the planner's advice. No processes."""

from pathlib import Path

import pytest

from ndparallel.config.reading import parse_config
from ndparallel.mesh.layout import Layout
from ndparallel.train.oom import oom_message
from ndparallel.train.progress import human_count, human_seconds, progress_fields, timing_line
from ndparallel.weights.meta import model_config_for


@pytest.mark.parametrize(
    "value, text",
    [
        (51081.2, "51.1k"),
        (950, "950"),
        (999_960, "1M"),
        (1_234_567, "1.23M"),
        (3.2e9, "3.2G"),
        (0.1234, "0.123"),
        (0, "0"),
        (12.0, "12"),
    ],
)
def test_human_count(value, text):
    assert human_count(value) == text


@pytest.mark.parametrize(
    "seconds, text", [(0.0004, "0 ms"), (0.612, "612 ms"), (4.7321, "4.73 s"), (23.3, "23.3 s"), (725, "12m05s")]
)
def test_human_seconds(seconds, text):
    assert human_seconds(seconds) == text


def test_progress_line_is_readable():
    record = {
        "step": 30,
        "loss": 2.34567,
        "grad_norm": 0.91234,
        "lr": 3e-4,
        "tokens_per_s": 51081.2,
        "tokens_per_s_per_device": 6385.15,
        "mfu": 0.477,
        "peak_memory_gib": 31.04,
        "step_time_s": 0.612,
        "data_s": 0.002,
        "fwd_bwd_s": 0.54,
        "optimizer_s": 0.06,
        "checkpoint_stall_s": 23.3,
    }
    fields = progress_fields(record)
    assert fields == {
        "loss": "2.3457",
        "grad_norm": "0.912",
        "lr": "3.00e-04",
        "tokens/s": "51.1k (6.39k/device)",
        "mfu": "47.7%",
        "mem": "31.0 GiB",
        "step": "612 ms",
    }
    assert timing_line(record) == "data 2 ms, fwd+bwd 540 ms, optimizer 60 ms; checkpoint stall 23.3 s"


def test_out_of_memory_line_names_step_layout_and_planner_advice(tmp_path):
    cfg = parse_config(
        {
            "model_shape": "8b",
            "datasets": [{"path": "x.jsonl"}],
            "sequence_len": 8192,
            "micro_batch_size": 4,
            "dp_shard_size": 8,
        }
    )
    config = model_config_for(base_model=None, model_shape="8b", overrides={})
    line = oom_message(
        step=12,
        rank=3,
        cfg=cfg,
        model_config=config,
        layout=Layout(dp_shard=8),
        used_gib=78.9,
        total_gib=79.6,
        snapshot=Path("/o/logs/memory-snapshot-rank3.pickle"),
    )
    assert "\n" not in line
    assert line.startswith(
        "step 12: CUDA out of memory on rank 3 (78.9 of 79.6 GiB in use) with dp_replicate 1 x "
        "dp_shard 8 x cp 1 x tp 1, micro_batch_size 4, sequence_len 8192, "
        "activation_checkpointing none. The planner suggests dp_replicate "
    )
    assert "activation_checkpointing=" in line and "set activation_checkpointing: full" in line
    assert line.endswith("; memory snapshot: /o/logs/memory-snapshot-rank3.pickle")


def test_a_save_that_waited_for_the_previous_one_says_so_and_the_fix():
    from types import SimpleNamespace

    from ndparallel.train.loop import save_line

    background = SimpleNamespace(async_save=True)
    quick = save_line(10, "step-10", background, 0.074, 0.0)
    assert quick == "step 10: checkpoint step-10 writing in the background (training paused 74 ms)"
    slow = save_line(20, "step-20", background, 26.4, 26.3)
    assert "26.3 s of it waiting for the previous checkpoint to finish writing" in slow and "raise save_steps" in slow
    assert "waiting" not in save_line(20, "step-20", SimpleNamespace(async_save=False), 26.4, 26.3)
