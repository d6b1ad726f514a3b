"""The end summary reports the steady state (not the compiling first window, not the windows that saved) and
the wall time split by where it went; the setup phases say what they do and how long it took. No processes."""

import time

from ndparallel.config.reading import parse_config
from ndparallel.mesh.layout import Layout
from ndparallel.train.setup_progress import SetupProgress, run_summary
from ndparallel.train.summary import RunClock, summary_lines

H200 = 989e12


def record(step: int, stall: float = 0.0) -> dict:
    return {"step": step, "loss": 2.0, "tokens": step * 1000, "peak_memory_gib": 30.0, "checkpoint_stall_s": stall}


def test_steady_state_leaves_out_the_compiling_window_and_the_saves():
    """The issue's 60-step 1B run: steady windows at 52.6k tokens/s; the first window held compilation and the
    last the final save. The summary printed 43,874 tokens/s and the last window's 8.7% MFU."""
    clock = RunClock(started=time.perf_counter() - 100.0, setup_s=30.0, first_step_s=20.0, checkpoints_s=12.0)
    flops_per_s = 0.48 * H200  # 48% MFU on one device
    clock.window(record(10), tokens=100_000.0, seconds=25.0, flops=flops_per_s * 5)  # compilation
    for step in (20, 30, 40, 50):
        clock.window(record(step), tokens=526_000.0, seconds=10.0, flops=flops_per_s * 10)
    clock.window(record(60, stall=3.0), tokens=526_000.0, seconds=40.0, flops=flops_per_s * 4)  # the final save
    lines = summary_lines([record(10), record(60)], clock, devices=1, peak_flops=H200)
    steady = next(line for line in lines if line.startswith("steady state"))
    assert "steps 11-50" in steady and "52.6k tokens/s" in steady and "MFU 48.0%" in steady, steady
    wall = lines[-1]
    assert wall.startswith("wall time 100.0 s: setup 30.0 s, first step (compilation, warm-up) 20.0 s, checkpoints")


def test_one_window_says_it_includes_compilation():
    clock = RunClock()
    clock.window(record(3), tokens=3000.0, seconds=3.0, flops=1.0)
    lines = summary_lines([record(3)], clock, devices=2, peak_flops=None)
    assert any("one log window: it includes the first step's compilation" in line for line in lines)
    assert not any("MFU" in line for line in lines)  # no known peak: no MFU


def test_setup_phases_print_their_time_and_the_run_summary_comes_first():
    printed = []
    progress = SetupProgress(enabled=True, total=2, printer=printed.append)
    with progress.phase("tokenizing and packing the data") as found:
        found.detail = "12 rows"
    with progress.phase("building the model"):
        pass
    assert printed[0] == "setup 1/2: tokenizing and packing the data ..."
    assert printed[1].startswith("setup 1/2: done in ") and printed[1].endswith(" ms: 12 rows")
    assert printed[3].startswith("setup 2/2: done in ")
    silent = []
    with SetupProgress(enabled=False, printer=silent.append).phase("x"):
        pass
    assert silent == []  # ranks other than 0


def test_run_summary_names_lr_warmup_batch_and_saves():
    cfg = parse_config(
        {
            "model_shape": "tiny",
            "datasets": [{"path": "x.jsonl", "type": "completion"}],
            "learning_rate": 3e-4,
            "warmup_steps": 10,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "max_steps": 100,
            "save_steps": 25,
        }
    )
    line = run_summary(cfg, Layout(dp_shard=4, tp=2))
    assert "lr 0.0003 (cosine, warm-up 10 steps)" in line
    assert "batch 32 rows x 512 tokens per step (micro-batch 2 x accumulation 4 x 4 data-parallel rank(s))" in line
    assert "100 steps" in line and "checkpoints every 25 steps and at the end, the last 4 kept" in line
