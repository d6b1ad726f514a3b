"""Fine-tuning an 8B on one GPU: ours (``ndparallel train``) against the peers a user would pick, at their best,
on the same weights, token rows, adapters and optimizer (issue 35).

    # one H200, rows of 4,096 tokens, every row (a 10-minute call holds ~5 of them: split with --rows; a
    # later call with the same --json and --work, on the same machine, adds its rows to the summary)
    W=/tmp/ndp-bench-finetune
    python benchmarks/peers/bench_finetune.py --shape 8b --seq 4096 --ac none --json $W/finetune.jsonl \\
        --logs $OUT --rows ours-lora,unsloth-lora,hf-peft-liger-compile,ours-qlora,unsloth-qlora; cp $W/*.jsonl $OUT
    python benchmarks/peers/bench_finetune.py --shape 8b --seq 4096 --ac none --json $W/finetune.jsonl \\
        --logs $OUT --rows peft-bnb4,torchao-nf4-peft,ours-lora8,peft-bnb8; cp $W/*.jsonl $OUT
    python benchmarks/peers/bench_finetune.py --shape 8b --seq 4096 --ac full --json $W/finetune.jsonl \
        --logs $OUT --rows ours-full-adam8,unsloth-full-adam8,hf-full-adam8; cp $W/*.jsonl $OUT
    python benchmarks/peers/bench_finetune.py --shape qwen3-8b --seq 8192 --ac full --json $W/finetune.jsonl
    # CPU (the test): the rows that run without a GPU, fp32, eager
    python benchmarks/peers/bench_finetune.py --shape tiny --seq 128 --steps 3 --warmup 1 --device cpu \\
        --no-compile --rows ours-lora,hf-peft,ours-qlora,torchao-nf4-peft --work /tmp/ft --json /tmp/ft/rows.jsonl

Rows (``--rows``; each runs in a process of its own, ``finetune_rows.py``; one whose package is missing
prints ``skipped: <why>`` and the script goes on):

  ours-lora                LoRA r16 on every linear of the blocks, bf16 base      (kind bf16)
  ours-qlora               the same on an NF4 base (load_in_4bit)                  (kind nf4)
  ours-lora8               the same on an int8 base (load_in_8bit)                 (kind int8)
  ours-lora-fp8            the same on an FP8 base, FP8 products (load_in_fp8)     (kind fp8)
  ours-full-adam8          full fine-tune, 8-bit AdamW on bf16 weights (bf16: full) (kind full)
  ours-full-adam8-masters  the same on fp32 master weights (bf16: true): 4 bytes a parameter more
  ours-full-adam8-offload  ours-full-adam8 with cpu_offload (minutes a step at 8B: the optimizer runs on the CPU)
  unsloth-lora, unsloth-qlora, unsloth-lora-fp8, hf-peft-liger-compile, peft-bnb4, peft-bnb8, torchao-nf4-peft,
  unsloth-full-adam8, hf-full-adam8: the peers, built as ``finetune_peers.py`` says (the full fine-tunes with
  bitsandbytes' 8-bit AdamW on bf16 weights); hf-peft (HF + peft, no Liger, no compile) is an extra row.

  ours: ``--ac`` (none / selective / full) and ``--compile`` (each block) apply; the worker of ``ndparallel
  train`` runs the config written to the row's run directory (``runs/<row>-seq<N>/config.yaml``: rerun it
  with ``ndparallel train``). The peers: their recipe's gradient checkpointing (``--peer-ac none``: off),
  per-layer compile where their recipe compiles (``--no-peer-compile``: off).

The same for every row:
- weights: a random-init model of the shape (``--shape 8b``: ndparallel's preset; ``qwen3-8b``: Qwen3-8B's
  dims; ``tiny``: CPU), built once with ``--seed`` and saved under ``--work/models`` (safetensors, bf16 on a
  GPU, fp32 on a CPU, and the byte tokenizer's files); ours reads it as ``base_model``, peers with
  ``from_pretrained``;
- tokens: one token stream (the ASCII of the Python standard library's sources, byte tokenizer), cut into
  rows of ``--seq`` tokens, each row one document: the trainer's own data pipeline tokenizes and packs it
  once (``--work/data``) and the trainer reads that cache; the peers read the same rows in the trainer's
  order (``DataOrder``, ``--seed``) from ``rows.npz``. One document per row: every row trains the same causal
  problem, and no peer needs document masking (packed rows of many documents are not measured here);
- adapters: rank ``--lora-rank`` (16), alpha ``--lora-alpha`` (16), dropout 0, q/k/v/o/gate/up/down, A drawn
  as ours draws it (seeded by name), B zeros: every LoRA row starts from the same model and adapters;
- AdamW lr 2e-4 constant, betas (0.9, 0.999), eps 1e-8, no weight decay, clipping to 1.0, bf16 compute.

Recorded per row (printed; JSON lines to ``--json``): tokens/s over the steps after ``--warmup`` (compile and
allocator warm-up excluded), MFU (``finetune_common.step_flops``: a frozen base does forward and input
gradients only, 4 N T, the adapters 6 N_lora T, full fine-tune 6 N T, + attention; recomputation not
counted), peak allocated and reserved GPU memory, wall time from launch to the first step's end, the loss of
every step, the versions. The summary: each ours row's tokens/s over the best peer of its kind and whether
its peak allocated memory is at most that peer's; each row's loss against the kind's ours row: max |diff|
over the steps and at the last step, against the kind's bound (``finetune_common.KINDS``: bf16 0.05, nf4
0.10, int8 0.15). ``--budget-s``: no row starts after that many seconds, and a running row is stopped
there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import finetune_data
import yaml
from finetune_common import ALL_ROWS, DEFAULT_ROWS, OURS_ROWS, kind_of, shape_config, step_flops, versions
from finetune_report import print_summary, row_line

import ndparallel

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", help="8b, qwen3-8b, tiny, qwen3-tiny")
    p.add_argument("--seq", default="4096", help="tokens per row; a comma list runs each")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of tokens/s (compilation)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma list of: {', '.join(ALL_ROWS)}")
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none", help="ours' checkpointing")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="ours: each block")
    p.add_argument(
        "--offload",
        nargs="?",
        type=int,
        const=-1,
        default=None,
        help="ours, with --ac full: layer inputs in host memory (as many layers as it holds, or the first N)",
    )
    p.add_argument(
        "--fused-lora-mlp", action="store_true", help="ours' LoRA rows: fused_lora_mlp (adapters/lora_mlp.py)"
    )
    p.add_argument(
        "--embedding-offload",
        action="store_true",
        help="ours' adapter rows: the frozen input embedding in host memory (embedding_offload)",
    )
    p.add_argument("--peer-ac", choices=("recipe", "none"), default="recipe", help="peers' checkpointing")
    p.add_argument("--peer-compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--work", type=Path, default=Path("/tmp/ndp-bench-finetune"), help="weights, data, runs")
    p.add_argument("--json", type=Path, help="append one JSON line per row; its earlier rows join the summary")
    p.add_argument("--logs", type=Path, help="copy each row's log here (e.g. $OUT on the GPU machine)")
    p.add_argument("--budget-s", type=float, default=560.0, help="start no row after this; stop one running")
    p.add_argument("--min-row-s", type=float, default=45.0, help="start no row with less time than this left")
    args = p.parse_args(argv)
    args.work = args.work.resolve()  # the rows run in it (their cwd) and read absolute paths
    args.seqs = [int(s) for s in args.seq.split(",")]
    args.row_names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.row_names if r not in ALL_ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; use {', '.join(ALL_ROWS)}")
    return args


def child_env() -> dict[str, str]:
    """Every row's environment: the trainer launcher's defaults (expandable CUDA segments, one OpenMP
    thread), offline hubs, no launcher variables."""
    from ndparallel.launch import default_env

    env = default_env({k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", UNSLOTH_DISABLE_STATISTICS="1")
    # The ndparallel this process imported, whatever the rows' working directory (a relative PYTHONPATH).
    source = Path(ndparallel.__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_child(spec: dict, run_dir: Path, *, cwd: Path, timeout_s: float) -> tuple[dict, float]:
    """Run ``finetune_rows.py`` on ``spec`` in its own process group; (its result, launch time). A child still
    running after ``timeout_s`` is killed with its process group (compile workers included)."""
    spec_path = run_dir / "spec.json"
    spec["result"] = str(run_dir / "result.json")
    spec_path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    launched = time.time()
    with open(run_dir / "log.txt", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "finetune_rows.py"), str(spec_path)],
            cwd=cwd,  # --work: Unsloth writes its compiled cache (kept between rows, as torch's) in the cwd
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            return {"status": "error", "why": f"stopped after {timeout_s:.0f} s (--budget-s)"}, launched
        _kill_group(proc.pid)  # what the row left running (compile workers of a row that left by os._exit)
    result = Path(spec["result"])
    if not result.is_file():
        why = f"exit code {proc.returncode}, no result; see {run_dir / 'log.txt'}"
        return {"status": "error", "why": why}, launched
    return json.loads(result.read_text(encoding="utf-8")), launched


def _kill_group(pgid: int) -> None:
    """Kill the process group of a row this script started (its own session: nothing else is in it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ensure_model(args, *, timeout_s: float) -> Path:
    """The random-init checkpoint of ``--shape`` (built once per shape, dtype and seed)."""
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_dir = args.work / "models" / f"{args.shape}-{dtype}-seed{args.seed}"
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file():
        return model_dir
    shutil.rmtree(model_dir, ignore_errors=True)
    run_dir = args.work / "runs" / f"build-{args.shape}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = dict(row="build-model", shape=args.shape, model_dir=str(model_dir), seed=args.seed, dtype=dtype)
    started = time.perf_counter()
    outcome, _ = run_child({**spec, "device": args.device}, run_dir, cwd=args.work, timeout_s=timeout_s)
    if outcome["status"] != "ok":
        raise SystemExit(f"building the {args.shape} checkpoint failed: {outcome.get('why')} (log {run_dir})")
    print(f"built the {args.shape} checkpoint in {time.perf_counter() - started:.0f} s: {model_dir}", flush=True)
    return model_dir


def row_spec(args, row: str, *, seq: int, model_dir: Path, data, run_dir: Path) -> dict:
    spec = dict(row=row, model_dir=str(model_dir), rows_file=str(data.rows_file), seq=seq, steps=args.steps)
    spec.update(seed=args.seed, device=args.device, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha)
    spec.update(peer_ac=args.peer_ac == "recipe", peer_compile=args.peer_compile)
    if row in OURS_ROWS:
        spec["config"] = finetune_data.ours_config(
            args, row, seq=seq, model_dir=model_dir, data=data, output_dir=run_dir / "out"
        )
        (run_dir / "config.yaml").write_text(yaml.safe_dump(spec["config"], sort_keys=False), encoding="utf-8")
    return spec


def measure(args, row: str, outcome: dict, *, seq: int, launched: float) -> dict:
    """The JSON record of one row: its settings, then tokens/s, MFU, memory and losses when it ran."""
    kind = kind_of(row)
    record = dict(bench="finetune", row=row, kind=kind.name, shape=args.shape, seq=seq, micro_batch=args.micro_batch)
    record.update(steps=args.steps, warmup=args.warmup, device=args.device, status=outcome["status"])
    if row in OURS_ROWS:
        record.update(ac=args.ac, offload=args.offload, compile=args.compile)
        if args.fused_lora_mlp and OURS_ROWS[row].get("adapter"):
            record.update(fused_lora_mlp=True)
        if args.embedding_offload and OURS_ROWS[row].get("adapter"):
            record.update(embedding_offload=True)
    else:
        record.update(peer_ac=args.peer_ac, peer_compile=args.peer_compile)
    record.update(call=args.call, when=datetime.datetime.now().isoformat(timespec="seconds"), versions=versions())
    for key in ("why", "applied", "gpu", "peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib"):
        if key in outcome:
            record[key] = outcome[key]
    steps = outcome.get("steps") or []
    if outcome["status"] != "ok" or not steps:
        return record
    steady = steps[args.warmup :] if len(steps) > args.warmup else steps[1:] or steps
    seconds = sum(s["time_s"] for s in steady)
    record["tokens_per_s"] = sum(s["tokens"] for s in steady) / seconds
    flops = step_flops(
        shape_config(args.shape),
        kind="full" if kind.name == "full" else "lora",
        rows=args.micro_batch,
        seq=seq,
        lora_rank=args.lora_rank,
    )
    peak = outcome.get("peak_flops")
    record["mfu"] = flops * len(steady) / seconds / peak if peak else None
    record["first_step_s"] = outcome["first_step_at"] - launched if outcome.get("first_step_at") else None
    record["losses"] = [round(s["loss"], 5) for s in steps]
    return record


def run_rows(args, model_dir: Path, seq: int, started: float, out: list[dict]) -> bool:
    """Every asked row at ``seq``; False once the time budget stops the run."""
    data = finetune_data.prepare(args, seq=seq, model_dir=model_dir)
    for row in args.row_names:
        left = args.budget_s - (time.time() - started)
        if left < args.min_row_s:
            print(f"{row}: not started ({left:.0f} s of --budget-s left)", flush=True)
            return False
        run_dir = args.work / "runs" / f"{row}-seq{seq}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        spec = row_spec(args, row, seq=seq, model_dir=model_dir, data=data, run_dir=run_dir)
        outcome, launched = run_child(spec, run_dir, cwd=args.work, timeout_s=left)
        shutil.rmtree(run_dir / "out", ignore_errors=True)  # ours' output dir: its checkpoints are large
        record = measure(args, row, outcome, seq=seq, launched=launched)
        record["log"] = str(run_dir / "log.txt")
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "log.txt", args.logs / f"{args.shape}-{row}-seq{seq}.log")
        if row in OURS_ROWS and record["status"] == "ok":
            record["trainer_read_the_same_rows"] = finetune_data.trainer_used_cache(data)
        print(row_line(record), flush=True)
        out.append(record)
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    args.call = datetime.datetime.now().isoformat(timespec="seconds")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if v), flush=True)
    print("not installed: " + (", ".join(k for k, v in found.items() if not v) or "-"), flush=True)
    model_dir = ensure_model(args, timeout_s=args.budget_s)
    records: list[dict] = []
    for seq in args.seqs:
        if not run_rows(args, model_dir, seq, started, records):
            break
    print_summary(args, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
