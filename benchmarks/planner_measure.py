"""Measure what this implementation keeps in memory for small models on CPU and compare with the planner.

    PYTHONPATH=src python benchmarks/planner_measure.py            # ~2 minutes on 2 cores

Runs every case below on CPU processes (gloo, forked by tests/harness.py), writes the measurements to
src/ndparallel/planner/measurements.json (which the unit tests hold to 15%) and the measured-vs-predicted
table to benchmarks/planner_validation.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from harness import run_ranks  # noqa: E402

from ndparallel.planner.calibration import MEASUREMENTS_PATH, compare_to_measurements  # noqa: E402
from ndparallel.planner.measure import measure_activations, measure_loss_peak  # noqa: E402
from ndparallel.planner.shapes import PRESETS  # noqa: E402

TINY = PRESETS["tiny"]
# Grouped-query attention (8 query heads, 4 key/value heads): exercises K/V expansion in CP attention.
GQA = dataclasses.replace(TINY, kv_heads=4, name="tiny-gqa4")
# Qwen3's per-head q/k RMSNorm.
QWEN3 = dataclasses.replace(GQA, qk_norm=True, name="tiny-qwen3")
SEQ, ROWS = 64, 2


def L(r=1, s=1, c=1, t=1, method="allgather"):
    return {"dp_replicate": r, "dp_shard": s, "cp": c, "tp": t, "cp_comm_strategy": method}


# (model, layout, activation checkpointing, precision)
ACTIVATION_CASES = [
    (TINY, L(), "none", "bf16"),
    (TINY, L(), "selective", "bf16"),
    (TINY, L(), "full", "bf16"),
    (TINY, L(), "none", "fp32"),
    (GQA, L(), "none", "bf16"),
    (GQA, L(s=2), "none", "bf16"),
    (GQA, L(t=2), "none", "bf16"),
    (GQA, L(t=2), "selective", "bf16"),
    (GQA, L(t=2), "full", "bf16"),
    (GQA, L(c=2, method="allgather"), "none", "bf16"),
    (GQA, L(c=2, method="ring"), "none", "bf16"),
    (GQA, L(c=2, method="alltoall"), "none", "bf16"),
    (GQA, L(c=2, method="allgather"), "selective", "bf16"),
    (GQA, L(c=2, method="ring"), "selective", "bf16"),
    (GQA, L(c=2, method="alltoall"), "full", "bf16"),
    (GQA, L(c=4, method="ring"), "selective", "bf16"),
    (GQA, L(c=2, t=2, method="ring"), "none", "bf16"),
    (GQA, L(c=2, t=2, method="alltoall"), "none", "bf16"),
    (GQA, L(c=2, t=2, method="allgather"), "selective", "bf16"),
    (GQA, L(s=2, t=2), "selective", "bf16"),
    (QWEN3, L(), "none", "bf16"),
    (QWEN3, L(t=2), "none", "bf16"),
    (QWEN3, L(c=2, method="ring"), "selective", "bf16"),
]
# (vocab, tokens, tp, precision): one chunk (tokens <= loss.CHUNK_ROWS = 2048), a chunk and a bit, three chunks.
LOSS_CASES = [(4096, 256, 1, "bf16"), (4096, 256, 2, "bf16"), (4096, 256, 1, "fp32"), (4096, 256, 4, "bf16"),
              (1024, 2560, 1, "bf16"), (1024, 6144, 1, "bf16"), (1024, 6144, 2, "bf16"), (1024, 6144, 1, "fp32")]


def _name(model, layout, mode, precision) -> str:
    sizes = "x".join(f"{k[0] if k != 'dp_replicate' else 'r'}{v}" for k, v in layout.items()
                     if k != "cp_comm_strategy" and v > 1) or "single"
    method = f"-{layout['cp_comm_strategy']}" if layout["cp"] > 1 else ""
    return f"{model.name}-{sizes}{method}-{mode}-{precision}"


def _config(layout):
    return {"dp_replicate_size": layout["dp_replicate"], "dp_shard_size": layout["dp_shard"], "cp_size": layout["cp"],
            "tp_size": layout["tp"], "cp_comm_strategy": layout["cp_comm_strategy"]}


def measure_all() -> list[dict]:
    rows = []
    for model, layout, mode, precision in ACTIVATION_CASES:
        world = layout["dp_replicate"] * layout["dp_shard"] * layout["cp"] * layout["tp"]
        got = run_ranks(world, measure_activations, model, _config(layout), seq_len=SEQ, micro_batch=ROWS,
                        activation_checkpointing=mode, precision=precision)[0]
        base = {"model": model.to_dict(), "layout": layout, "seq_len": SEQ, "micro_batch": ROWS,
                "activation_checkpointing": mode, "precision": precision}
        name = _name(model, layout, mode, precision)
        rows.append({"case": name, **base, "quantity": "activations_retained", "measured_bytes": got["retained"]})
        if got["layer_saved"] is not None:
            rows.append({"case": name + "-layer", **base, "quantity": "layer_saved",
                         "measured_bytes": got["layer_saved"]})
        else:
            # Checkpointed layers hide their tensors from autograd hooks: measure one layer as the difference
            # between the same model with two more layers and this one.
            deeper = dataclasses.replace(model, layers=model.layers + 2)
            more = run_ranks(world, measure_activations, deeper, _config(layout), seq_len=SEQ, micro_batch=ROWS,
                             activation_checkpointing=mode, precision=precision)[0]
            rows.append({"case": name + "-per-layer", **base, "quantity": "layer_retained",
                         "measured_bytes": (more["retained"] - got["retained"]) / 2})
        print(f"{name}: {got['retained']} B retained", flush=True)
    for vocab, tokens, tp, precision in LOSS_CASES:
        got = run_ranks(tp, measure_loss_peak, vocab=vocab, tokens=tokens, precision=precision)[0]
        model = dataclasses.replace(TINY, vocab=vocab, name=f"tiny-v{vocab}")
        rows.append({"case": f"loss-v{vocab}-n{tokens}-tp{tp}-{precision}", "model": model.to_dict(), "layout": L(t=tp),
                     "seq_len": tokens, "micro_batch": 1, "precision": precision, "quantity": "loss_peak",
                     "measured_bytes": got["peak"]})
        print(f"loss tp{tp} {precision}: {got['peak'] / got['elements']:.2f} B per logit element", flush=True)
    return rows


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{_cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}",
        "device": "cpu (gloo)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write_report(rows: list[dict], env: dict, path: str) -> None:
    table = compare_to_measurements(rows)
    lines = [
        "# Planner memory model: measured vs predicted (CPU)",
        "",
        f"Date {env['date']}; machine {env['machine']}; {env['device']}; torch {env['torch']}; "
        f"transformers {env['transformers']}.",
        "",
        "Regenerate with `PYTHONPATH=src python benchmarks/planner_measure.py` (writes this file and",
        "`src/ndparallel/planner/measurements.json`). Models: `tiny` (hidden 64, 2 layers, 8 heads, 8 kv heads,",
        "intermediate 128, vocab 256), `tiny-gqa4` (the same with 4 kv heads) and `tiny-qwen3` (tiny-gqa4 with",
        "Qwen3's q/k norms); micro-batch 2 rows of 64",
        "tokens per data rank. Quantities (see `planner/calibration.py`): `activations_retained` = bytes alive after",
        "forward + loss (parameters excluded), `layer_saved` = bytes autograd saves in the last decoder layer",
        "without checkpointing, `layer_retained` = what one more checkpointed layer keeps (the difference",
        "between the model with 4 and with 2 layers), `loss_peak` = peak of the logits and the chunked",
        "cross-entropy through forward and backward (logits made by a 64-wide linear head and held by the caller",
        "through backward, as the trainer does; `n` = tokens on the rank, `v` = vocabulary).",
        "Layouts are r(eplicate) s(hard) c(p) t(p) sizes. A test holds every row to 15%.",
        "",
        "| case | quantity | measured B | predicted B | error |",
        "|---|---|---:|---:|---:|",
    ]
    for (case, predicted, measured, err), row in zip(table, rows):
        lines.append(f"| {case} | {row['quantity']} | {measured:,.0f} | {predicted:,.0f} | {err:+.1%} |")
    worst = max(abs(t[3]) for t in table)
    lines += [
        "", f"Largest relative error: {worst:.1%} over {len(table)} rows.", "",
        "## What this does and does not validate", "",
        "- Validated (CPU, eager, SDPA): every activation coefficient in `planner/activations.py` for all three",
        "  checkpointing modes, tp, all three CP methods and their compositions, bf16 and fp32; what the chunked",
        "  cross-entropy saves (the logits + 14 B per token) and its peak: logits + their gradient (2e bytes per",
        "  local logit element) + float32 temporaries of one or two 2048-row chunks (8 B per chunk element in",
        "  bf16, 4 in fp32, +4 for the previous chunk when there is more than one) + 18 B per token, for tp 1, 2",
        "  and 4 (bf16: 12 B per element within one chunk, 8 B at three chunks).",
        "- Not validated here: GPU kernels may save differently (cuDNN attention, the memory-efficient kernel's",
        "  padded log-sum-exp; allgather CP's mask goes to the memory-efficient kernel as a bf16 bias);",
        "  FSDP's gathered/unsharded buffers, gradient reduce buffers, the backward-workspace transient (and the",
        "  logits `train.forward_backward` holds through lm_head's and the layers' backward, counted there), the",
        "  allocator's fragmentation and the CUDA/NCCL overhead (2 GiB assumed); LoRA activations (peft is not",
        "  measured); throughput (efficiency 0.5, overlap 0.8, link speeds are assumptions). These need the",
        "  H200 runs: add `peak_allocated` rows to `measurements.json` (see `planner/calibration.py`).",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    rows = measure_all()
    env = environment()
    with open(MEASUREMENTS_PATH, "w") as f:
        description = ("CPU measurements of this implementation's activation and loss memory "
                       "(benchmarks/planner_measure.py); add GPU peak_allocated rows here.")
        json.dump({"description": description, "environment": env, "rows": rows}, f, indent=1)
        f.write("\n")
    write_report(rows, env, os.path.join(ROOT, "benchmarks", "planner_validation.md"))
    for case, predicted, measured, err in compare_to_measurements(rows):
        print(f"{case:55s} measured {measured:>12,.0f} predicted {predicted:>12,.0f} {err:+.1%}")


if __name__ == "__main__":
    main()
