"""The benchmark scripts and the library example keep working (tiny shapes on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_bench_train_compares_the_paths_on_cpu():
    # Eager rows (compiling on 2 CPU cores takes minutes), in one process (a subprocess per peer, the GPU
    # default, costs an interpreter start each).
    out = _run(
        [
            "benchmarks/peers/bench_train.py",
            "--shape",
            "tiny",
            "--seq",
            "64",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--no-isolate",
            "--rows",
            "ndparallel-eager,fsdp2-eager,accelerate-eager,plain-eager",
        ]
    )
    rows = [line.split()[0] for line in out.splitlines()[-4:]]
    assert rows == ["ndparallel-eager", "fsdp2-eager", "accelerate-eager", "plain-eager"], out
    assert "failed" not in out, out


@pytest.mark.slow
def test_bench_cp_reports_each_method():
    out = _run(
        [
            "benchmarks/long_context/bench_cp.py",
            "--seqs",
            "128",
            "--cps",
            "1,2",
            "--methods",
            "ring,allgather",
            "--steps",
            "2",
            "--hidden",
            "64",
            "--layers",
            "1",
        ]
    )
    assert len([line for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))]) == 3, out


@pytest.mark.slow
def test_example_trains_on_a_layout():
    out = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "4",
            "examples/train_any_layout.py",
            "--dp-shard",
            "2",
            "--tp",
            "2",
            "--steps",
            "3",
            "--seq",
            "64",
        ]
    )
    assert "world 4 = dp_replicate 1 x dp_shard 2 x cp 1 x tp 2" in out and "step   2" in out, out


@pytest.mark.slow
def test_bench_moe_compares_expert_implementations(tmp_path):
    out = _run(
        [
            "benchmarks/components/bench_moe.py",
            "--tiny",
            "--device",
            "cpu",
            "--tokens",
            "64",
            "--iters",
            "1",
            "--steps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    impls = [line.split()[:2] for line in out.splitlines() if line.startswith(("block", "step"))]
    assert impls == [
        ["block", "eager"],
        ["block", "grouped_mm"],
        ["block", "ndparallel"],
        ["step", "ndparallel"],
        ["step", "eager"],
    ], out
    assert (tmp_path / "bench_moe.json").is_file()


@pytest.mark.slow
def test_bench_finetune_rows_train_the_same_problem(tmp_path):
    # Same weights, token rows in the same order, adapters' start and optimizer for every row: on a CPU in fp32
    # ours and its peer give the same loss at every step (LoRA on the base against HF + peft; QLoRA against
    # torchao's NF4 + peft). A row whose package or device is missing is recorded as skipped.
    rows = ["ours-lora", "hf-peft", "ours-qlora", "torchao-nf4-peft", "peft-bnb8", "ours-lora-fp8", "hf-full-adam8"]
    jsonl = tmp_path / "rows.jsonl"
    out = _run(
        ["benchmarks/peers/bench_finetune.py", "--shape", "tiny", "--seq", "128", "--steps", "3", "--warmup", "1"]
        + ["--device", "cpu", "--no-compile", "--rows", ",".join(rows), "--work", str(tmp_path), "--json", str(jsonl)]
    )
    records = {r["row"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert sorted(records) == sorted(rows), out
    for row in ("peft-bnb8", "hf-full-adam8"):  # bitsandbytes' kernels: CUDA only
        assert records[row]["status"] == "skipped" and "CUDA" in records[row]["why"], records[row]
    for ours, peer in (("ours-lora", "hf-peft"), ("ours-qlora", "torchao-nf4-peft")):
        a, b = records[ours], records[peer]
        assert a["status"] == b["status"] == "ok", (a, b)
        assert a["trainer_read_the_same_rows"], a
        assert len(a["losses"]) == len(b["losses"]) == 3, (a, b)
        assert abs(a["losses"][0] - b["losses"][0]) <= 1e-4, (a["losses"], b["losses"])
        assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= 1e-3, (a["losses"], b["losses"])
    # The NF4 base is another model: the comparison can tell models apart.
    assert abs(records["ours-qlora"]["losses"][0] - records["ours-lora"]["losses"][0]) > 1e-5
    assert "vs ours-lora [ac none]: max |dloss|" in out and "vs ours-qlora [ac none]: max |dloss|" in out, out
    # The FP8 base trains and is also set against the bf16 base it replaces (no Unsloth on a CPU).
    assert records["ours-lora-fp8"]["status"] == "ok" and len(records["ours-lora-fp8"]["losses"]) == 3
    assert "against the bf16 kind: loss vs ours-lora [ac none]: max |dloss|" in out, out
    fp8, bf16 = records["ours-lora-fp8"], records["ours-lora"]
    assert f"; speed {fp8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x ours-lora [ac none], peak " in out, out
