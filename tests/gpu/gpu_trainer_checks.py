"""Trainer checks on one GPU through ``ndparallel train`` (run by hand; not part of the CPU suite).

    PYTHONPATH=src python3 tests/gpu/gpu_trainer_checks.py --out $OUT            # every check, ~6 minutes
    PYTHONPATH=src python3 tests/gpu/gpu_trainer_checks.py --out $OUT --only offload

offload: the same 1B-shaped run (5 steps, seq 2048) with and without ``cpu_offload: true``. Passes when the
offloaded run trains (FSDP2 accepts its CPU parameters), its losses follow the plain run's (bf16 compute:
relative difference <= 2e-2) and its peak GPU memory is lower.
oom: an 8B-shaped run that cannot fit one GPU (seq 16384, no activation checkpointing) with
``cuda_memory_snapshot: true``. Passes when it exits with status 2 and one line naming the step, the
layout and the planner's suggestion, and the memory snapshot file exists.
bf16_full: the same 1B-shaped run (30 steps, seq 2048, optimizer adamw_8bit) with bf16: true (fp32 masters) and
bf16: full (bf16 weights, stochastic rounding), then bf16: full resumed from its step-15 checkpoint. Passes when
the mean loss of the last 5 steps is within 2% of the fp32-master run's, the peak memory is lower, and the resumed
steps' losses are the uninterrupted run's to 1e-3 (relative; bitwise noted).
Results: $OUT/trainer_checks.json; one PASS/FAIL line per check.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

BASE = {
    "tokenizer_config": "byte",
    "datasets": [{"path": "stdlib:*.py", "type": "pretrain_files"}],
    "sample_packing": True,
    "micro_batch_size": 1,
    "learning_rate": 3.0e-4,
    "warmup_steps": 1,
    "logging_steps": 1,
    "overwrite_output_dir": True,
    "save_total_limit": 1,
}


def train(config: dict, out: Path, name: str) -> tuple[int, str, list[dict]]:
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    config = {**BASE, **config, "output_dir": str(run_dir / "run"), "dataset_prepared_path": str(out / "prepared")}
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "ndparallel.cli", "train", str(path), "--nproc-per-node", "1"],
        capture_output=True,
        text=True,
    )
    (run_dir / "stdout.txt").write_text(proc.stdout)
    (run_dir / "stderr.txt").write_text(proc.stderr)
    metrics = run_dir / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return proc.returncode, proc.stderr, records


def check_offload(out: Path, tiny: bool = False) -> dict:
    shape = {"model_shape": "1b", "sequence_len": 2048, "max_steps": 5}
    if tiny:  # a CPU try-out of the script itself
        shape = {"model_shape": "byte-tiny", "sequence_len": 128, "max_steps": 5, "device": "cpu"}
    code_plain, err_plain, plain = train(shape, out, "plain")
    code_off, err_off, off = train({**shape, "cpu_offload": True}, out, "offload")
    ok = code_plain == 0 and code_off == 0 and len(off) == len(plain) == 5
    diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(off, plain)) if ok else None
    result = {
        "exit_codes": [code_plain, code_off],
        "loss_rel_diff": diff,
        "peak_gib": [plain[-1]["peak_memory_gib"], off[-1]["peak_memory_gib"]] if ok else None,
        "step_s": [plain[-1]["step_time_s"], off[-1]["step_time_s"]] if ok else None,
        "stderr_tail": [err_plain[-500:], err_off[-500:]],
    }
    result["pass"] = bool(ok and diff <= 2e-2 and (tiny or result["peak_gib"][1] < result["peak_gib"][0]))
    return result


def check_oom(out: Path) -> dict:
    code, err, _ = train(
        {"model_shape": "8b", "sequence_len": 16384, "max_steps": 2, "bf16": True, "cuda_memory_snapshot": True},
        out,
        "oom",
    )
    lines = [line for line in err.splitlines() if line.startswith("ndparallel:")]
    snapshot = out / "oom" / "run" / "logs" / "memory-snapshot-rank0.pickle"
    ok = (
        code == 2
        and len(lines) == 1
        and "CUDA out of memory on rank 0" in lines[0]
        and "The planner suggests" in lines[0]
        and snapshot.is_file()
    )
    return {
        "exit_code": code,
        "error_lines": lines,
        "snapshot": str(snapshot) if snapshot.is_file() else None,
        "snapshot_mib": snapshot.stat().st_size / 2**20 if snapshot.is_file() else None,
        "pass": ok,
    }


def check_bf16_full(out: Path) -> dict:
    # two checkpoints kept: the one at step 15 (resumed below) and the last
    shape = {"model_shape": "1b", "sequence_len": 2048, "max_steps": 30, "optimizer": "adamw_8bit", "save_steps": 15}
    shape["save_total_limit"] = 2
    runs = {
        name: train({**shape, "bf16": bf16}, out, name) for name, bf16 in (("masters", True), ("bf16_full", "full"))
    }
    checkpoint = out / "bf16_full" / "run" / "checkpoints" / "step-15"
    runs["resumed"] = train(
        {**shape, "bf16": "full", "resume_from_checkpoint": str(checkpoint)}, out, "bf16_full_resumed"
    )
    (masters, full, resumed) = (runs[k][2] for k in ("masters", "bf16_full", "resumed"))

    def tail(records):
        return sum(r["loss"] for r in records[-5:]) / 5

    result = {
        "exit_codes": {k: v[0] for k, v in runs.items()},
        "stderr_tail": {k: v[1][-500:] for k, v in runs.items()},
    }
    trained = runs["masters"][0] == runs["bf16_full"][0] == 0 and len(masters) == len(full) == 30
    ok = trained
    if trained:  # the two precisions compared, whatever the resume did
        result.update(
            last5_loss={"masters": tail(masters), "bf16_full": tail(full)},
            last5_rel_diff=abs(tail(full) - tail(masters)) / tail(masters),
            peak_gib={"masters": masters[-1]["peak_memory_gib"], "bf16_full": full[-1]["peak_memory_gib"]},
            tokens_per_s={"masters": masters[-1].get("tokens_per_s"), "bf16_full": full[-1].get("tokens_per_s")},
            losses={"masters": [r["loss"] for r in masters], "bf16_full": [r["loss"] for r in full]},
        )
        ok = result["last5_rel_diff"] <= 2e-2 and result["peak_gib"]["bf16_full"] < result["peak_gib"]["masters"]
    if trained and runs["resumed"][0] == 0 and len(resumed) == 15:
        resumed_diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(resumed, full[15:]))
        result.update(
            resumed_rel_diff=resumed_diff,
            resumed_bitwise=[r["loss"] for r in resumed] == [r["loss"] for r in full[15:]],
        )
        ok = ok and resumed_diff <= 1e-3
    else:
        ok = False
    result["pass"] = bool(ok)
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=["offload", "oom", "bf16_full"])
    parser.add_argument("--tiny", action="store_true", help="offload check only, tiny shape on CPU")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks = {"offload": lambda o: check_offload(o, args.tiny), "oom": check_oom, "bf16_full": check_bf16_full}
    if args.tiny:
        checks = {"offload": checks["offload"]}
    results = {name: fn(out) for name, fn in checks.items() if args.only in (None, name)}
    (out / "trainer_checks.json").write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        shown = {k: v for k, v in r.items() if k not in ("pass", "stderr_tail")}
        print(f"{'PASS' if r['pass'] else 'FAIL'}  {name}: {json.dumps(shown)}", flush=True)
    return 0 if all(r["pass"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
