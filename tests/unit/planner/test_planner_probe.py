"""``ndparallel plan --measure`` on the CPU (the same code times the GPU): a tiny shape, the cache. No processes."""

import argparse
import dataclasses

import pytest

from ndparallel.planner import probe
from ndparallel.planner.cli import add_plan_arguments, run_plan
from ndparallel.planner.hardware import Cluster
from ndparallel.planner.plan import plan
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload

TINY = dataclasses.replace(PRESETS["tiny"], kv_heads=4, name="tiny-gqa")


def test_measure_times_the_kernels_and_caches_them(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec, eff = probe.measure(TINY, tokens=128, device="cpu")
    assert spec.key == "measured" and spec.bf16_tflops > 0 and spec.hbm_gbps > 0
    assert 0 < eff.matmul <= 1.5 and 0 < eff.stream <= 1.5
    assert set(eff.attention) == set(eff.block_attention) == {TINY.head_dim}
    assert all(0 < x for pair in (*eff.attention.values(), *eff.block_attention.values()) for x in pair)
    assert "measured on cpu" in eff.source and probe.cache_path().is_file()

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached shape must not be measured again")

    monkeypatch.setattr(probe, "_measure", no_timing)
    assert probe.measure(TINY, tokens=128, device="cpu") == (spec, eff)
    with pytest.raises(AssertionError, match="must not be measured"):
        probe.measure(TINY, tokens=128, device="cpu", refresh=True)
    # the plan uses what was measured
    rows = plan(
        TINY,
        Cluster(nodes=1, gpus_per_node=1, gpu=spec, efficiency=eff, measured=True),
        Workload(seq_len=128, global_batch_rows=1, micro_batch_sizes=(1,)),
    )
    assert rows[0].tokens_per_s_per_gpu > 0


def test_half_rows_from_two_rates():
    # rate = 100 * L / (L + 1000): at 8000 and 2000 rows
    r_long, r_short = 100 * 8000 / 9000, 100 * 2000 / 3000
    assert probe._half_rows(r_long, r_short, 8000, 2000) == pytest.approx(1000)
    assert probe._half_rows(50, 60, 8000, 2000) is None  # shorter rows faster: no fit


def test_measure_without_a_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    parser = add_plan_arguments(argparse.ArgumentParser(prog="ndparallel plan"))
    code = run_plan(parser.parse_args(["--model", "tiny", "--seq-len", "64", "--measure"]))
    err = capsys.readouterr().err
    assert code == 2 and "--measure needs a CUDA GPU on this machine" in err and len(err.strip().splitlines()) == 1
