"""LoRA on 4-bit NF4 (QLoRA), 8-bit int8 and bf16 base weights through the trainer, on one GPU.

Each row is one ``ndparallel train`` run in its own process (the trainer smoke config with another model
shape, adapter and compile setting): random-init weights of the shape (quantized when loaded, as a hub
checkpoint would be), packed rows of the Python standard library's sources, the byte tokenizer. Printed
per row: tokens/s over the logged steps after the first window, peak allocated memory, the wall time from
launch to the first logged step (build + quantize + compile), and the losses logged.

    python3 benchmarks/components/bench_qlora.py --shape 8b --seq 4096 --steps 20 --out results/
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ndparallel.testing.child_errors import failure_line

ROWS = {
    "lora": ["adapter=lora"],
    "qlora": ["adapter=qlora", "load_in_4bit=true"],
    "lora8": ["adapter=lora", "load_in_8bit=true"],
}


def run_row(name: str, compile_: bool, args, out: Path) -> dict:
    output_dir = Path("/tmp") / f"ndp-bench-qlora-{name}-{int(compile_)}"
    sets = ROWS[name] + [
        f"model_shape={args.shape}",
        "lora_target_linear=true",
        f"lora_r={args.rank}",
        f"sequence_len={args.seq}",
        f"micro_batch_size={args.micro_batch}",
        f"max_steps={args.steps}",
        f"logging_steps={args.log_every}",
        f"torch_compile={str(compile_).lower()}",
        "export_hf=false",
        f"save_steps={args.steps * 10}",
        "learning_rate=2e-4",
        f"output_dir={output_dir}",
        "overwrite_output_dir=true",
    ]
    command = [sys.executable, "-m", "ndparallel.cli", "train", "benchmarks/gpu_sessions/gpu_trainer_smoke.yaml"]
    for item in sets:
        command += ["--set", item]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = out / f"bench_qlora_{name}_{'compile' if compile_ else 'eager'}.log"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    row = {"row": name, "compile": compile_, "shape": args.shape, "seq": args.seq, "rc": proc.returncode}
    metrics = output_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        shutil.rmtree(output_dir, ignore_errors=True)
        row["error"] = failure_line(proc.stderr)
        return row
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    shutil.rmtree(output_dir, ignore_errors=True)  # its checkpoints: the machine's disk holds few of them
    steady = records[1:] or records
    row.update(
        tokens_per_s=sum(r["tokens_per_s"] for r in steady) / len(steady),
        peak_memory_gib=max(r["peak_memory_gib"] for r in records),
        losses=[round(r["loss"], 4) for r in records],
        wall_s=round(wall, 1),
        quantized_line=next(
            (ln for ln in proc.stdout.splitlines() if ln.startswith(("load_in_4bit:", "load_in_8bit:"))), None
        ),
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", default="qlora,lora")
    parser.add_argument("--compile", default="0,1", help="comma list of 0/1")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "bench_qlora.jsonl"
    for compile_ in [c == "1" for c in args.compile.split(",")]:
        for name in args.rows.split(","):
            row = run_row(name, compile_, args, args.out)
            print(json.dumps(row), flush=True)
            with open(results, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
