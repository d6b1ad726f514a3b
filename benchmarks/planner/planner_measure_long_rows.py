"""The long-row memory features in the planner's measurements: CPU counts and H200 peaks (for planner_measure.py).

CPU (eager, counted storage by storage by ``ndparallel.testing.memory_probe``):

- ``FEATURE_CASES``: what forward keeps with the fused loss (lm_head's input gradient and its float32 weight
  gradient instead of the logits), the tiled MLP (no MLP tensor; the tiles' inputs), activation offload (the
  offloaded inputs leave the device), at world 1 and tp 2;
- ``FUSED_LOSS_CASES``: the fused loss's own peak through forward and backward, chunks of 256 rows;
- ``STEP_CASES``: one training step's whole peak on the one-rank flat path (the moments of
  ``planner/memory.py``: the loss, lm_head's backward, a layer's backward by stage and position), for a shape
  whose MLP is eight times its hidden size, so that a layer's backward is the peak.

H200 (``GPU_FILES``): the trainer's step with the features, 2026-12-03 (session 8, call 2): the longest packed
row (``bench_longest_row.py``: 1B, 4,096-token documents, full checkpointing, compiled, the fused loss alone,
and with the tiled MLP and 15 of 16 layers offloaded, at 131,072 and 1,048,576 tokens) and the fused loss
against the unfused at 4,096 x 2 tokens without checkpointing (``bench_train.py``). Not used: the
``ndparallel-cpu-offload`` row (FSDP2's CPU offload of weights and AdamW state, which the planner does not
model).
"""

from __future__ import annotations

import dataclasses
import json
import os

from ndparallel.planner.shapes import PRESETS, ModelShape
from ndparallel.testing.memory_probe import measure_activations, measure_fused_loss_peak, measure_step_peak
from ndparallel.testing.ranks import run_ranks

TINY = PRESETS["tiny"]
GQA = dataclasses.replace(TINY, kv_heads=4, name="tiny-gqa4")
# a layer's backward is the step's peak when the MLP is wide against the vocabulary
WIDE_MLP = ModelShape(
    vocab=128, hidden=64, intermediate=512, layers=4, heads=4, kv_heads=2, head_dim=16, name="tiny-wide-mlp"
)
SEQ, ROWS = 64, 2
SINGLE = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "cp_comm_strategy": "allgather"}
TP2 = {**SINGLE, "tp": 2}

# (layout, checkpointing, features): GQA model, bf16, 2 rows of 64 tokens per rank
FEATURE_CASES = [
    (SINGLE, "none", {"fused_loss": True}),
    (TP2, "none", {"fused_loss": True}),
    (SINGLE, "none", {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    (TP2, "none", {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    (SINGLE, "selective", {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    (SINGLE, "full", {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    (SINGLE, "full", {"fused_loss": True, "activation_offload_layers": 1}),
]
# (vocab, tokens, precision): chunks of 256 rows, the last one partial
FUSED_LOSS_CASES = [(1024, 1000, "bf16"), (1024, 1000, "fp32"), (4096, 600, "bf16")]
# (seq, rows, checkpointing, features): WIDE_MLP, bf16, the fused loss unless said
STEP_CASES = [
    (2048, 1, "full", {}),
    (2048, 1, "full", {"fused_loss": False}),
    (2048, 1, "full", {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    (2048, 1, "full", {"tiled_mlp": True, "tiled_mlp_num_shards": 4, "activation_offload_layers": 3}),
    (2048, 1, "full", {"activation_offload_layers": 2}),
    (1024, 2, "none", {}),
    (1024, 2, "none", {"tiled_mlp": True, "tiled_mlp_num_shards": 4}),
    (1024, 2, "selective", {}),
]

GPU_FILES = {"longest": "h200_longest_row.jsonl", "fused": "h200_bench_fused_loss.jsonl"}
GPU_DATE, GPU_TORCH, GPU_TRANSFORMERS = "2026-12-03", "2.11.0+cu130", "5.17.0"


def _features(features: dict) -> dict:
    """Row keys: every feature said, the trainer's names."""
    return {
        "fused_loss": features.get("fused_loss", True),
        "tiled_mlp": features.get("tiled_mlp", False),
        **({"tiled_mlp_num_shards": features["tiled_mlp_num_shards"]} if "tiled_mlp_num_shards" in features else {}),
        "activation_offload_layers": features.get("activation_offload_layers", 0),
    }


def _measure_kwargs(features: dict) -> dict:
    keys = _features(features)
    return {
        "fused_loss": keys["fused_loss"],
        "tiled_mlp": keys["tiled_mlp"],
        "num_tiles": keys.get("tiled_mlp_num_shards"),
        "offload_layers": keys["activation_offload_layers"],
    }


def _suffix(features: dict) -> str:
    keys = _features(features)
    out = "-fused" if keys["fused_loss"] else "-unfused"
    out += f"-tiled{keys.get('tiled_mlp_num_shards', '')}" if keys["tiled_mlp"] else ""
    return out + (f"-offload{keys['activation_offload_layers']}" if keys["activation_offload_layers"] else "")


def _config(layout: dict) -> dict:
    return {f"{k}_size" if k != "cp_comm_strategy" else k: v for k, v in layout.items()}


def feature_rows() -> list[dict]:
    """activations_retained (and layer_retained) rows of ``FEATURE_CASES``."""
    rows = []
    for layout, mode, features in FEATURE_CASES:
        base = {
            "model": GQA.to_dict(),
            "layout": layout,
            "seq_len": SEQ,
            "micro_batch": ROWS,
            "activation_checkpointing": mode,
            "precision": "bf16",
            **_features(features),
        }
        world, kwargs = layout["tp"], _measure_kwargs(features)
        common = dict(seq_len=SEQ, micro_batch=ROWS, activation_checkpointing=mode, **kwargs)
        got = run_ranks(world, measure_activations, GQA, _config(layout), **common)[0]
        name = f"tiny-gqa4-{'t2' if layout['tp'] > 1 else 'single'}-{mode}-bf16{_suffix(features)}"
        rows.append({"case": name, **base, "quantity": "activations_retained", "measured_bytes": got["retained"]})
        deeper = dataclasses.replace(GQA, layers=GQA.layers + 2)
        more = run_ranks(world, measure_activations, deeper, _config(layout), **common)[0]
        per_layer = (more["retained"] - got["retained"]) / 2
        rows.append({"case": name + "-per-layer", **base, "quantity": "layer_retained", "measured_bytes": per_layer})
        print(f"{name}: {got['retained']} B retained, {per_layer:.0f} per layer", flush=True)
    return rows


def fused_loss_rows() -> list[dict]:
    """loss_peak rows of the fused loss (``FUSED_LOSS_CASES``)."""
    rows = []
    for vocab, tokens, precision in FUSED_LOSS_CASES:
        got = run_ranks(1, measure_fused_loss_peak, vocab=vocab, tokens=tokens, precision=precision)[0]
        model = dataclasses.replace(TINY, vocab=vocab, name=f"tiny-v{vocab}")
        rows.append(
            {
                "case": f"fused-loss-v{vocab}-n{tokens}-{precision}",
                "model": model.to_dict(),
                "layout": SINGLE,
                "seq_len": tokens,
                "micro_batch": 1,
                "precision": precision,
                "fused_loss": True,
                "chunk_rows": got["chunk_rows"],
                "quantity": "loss_peak",
                "measured_bytes": got["peak"],
            }
        )
        print(f"fused loss v{vocab} n{tokens} {precision}: {got['peak']} B", flush=True)
    return rows


def step_rows() -> list[dict]:
    """step_peak rows (``STEP_CASES``), one rank."""
    rows = []
    for seq, b, mode, features in STEP_CASES:
        kwargs = _measure_kwargs(features)
        got = run_ranks(
            1, measure_step_peak, WIDE_MLP, seq_len=seq, micro_batch=b, activation_checkpointing=mode, **kwargs
        )
        rows.append(
            {
                "case": f"step-{WIDE_MLP.name}-s{seq}-b{b}-{mode}-bf16{_suffix(features)}",
                "model": WIDE_MLP.to_dict(),
                "layout": SINGLE,
                "seq_len": seq,
                "micro_batch": b,
                "activation_checkpointing": mode,
                "precision": "bf16",
                **_features(features),
                "quantity": "step_peak",
                "measured_bytes": got[0]["peak"],
            }
        )
        print(f"{rows[-1]['case']}: {got[0]['peak']} B", flush=True)
    return rows


def _h200_row(case: str, seq: int, b: int, mode: str, peak_gib: float, features: dict, file: str) -> dict:
    return {
        "case": case,
        "model": PRESETS["llama-1b"].to_dict(),
        "layout": SINGLE,
        "seq_len": seq,
        "micro_batch": b,
        "activation_checkpointing": mode,
        "precision": "bf16",
        "compile": True,
        **_features(features),
        "quantity": "peak_allocated",
        "measured_bytes": peak_gib * 2**30,
        "device": "NVIDIA H200",
        "torch": GPU_TORCH,
        "transformers": GPU_TRANSFORMERS,
        "date": GPU_DATE,
        "source": f"benchmarks/results/{file}",
        "peak_reserved_bytes": None,
    }


def gpu_rows(results_dir: str) -> list[dict]:
    """peak_allocated rows of the H200 runs with the features (``GPU_FILES``; the trainer's step: the flat path,
    AdamW on the bf16 gradients)."""
    rows = []
    with open(os.path.join(results_dir, GPU_FILES["longest"])) as f:
        for r in (json.loads(line) for line in f if line.strip()):
            if not r.get("ok") or r["row"] not in ("ndparallel", "ndparallel-fused") or r["model"] != "1b":
                continue
            memory = r["row"] == "ndparallel"  # fused loss + tiled MLP + offload; '-fused': the fused loss alone
            features = {"tiled_mlp": True, "activation_offload_layers": r["offloaded_layers"]} if memory else {}
            case = f"h200-1b-s{r['tokens']}-b1-full-compiled{_suffix(features)}"
            rows.append(_h200_row(case, r["tokens"], 1, "full", r["peak_gib"], features, GPU_FILES["longest"]))
    with open(os.path.join(results_dir, GPU_FILES["fused"])) as f:
        run = json.loads(f.readline())
    for r in run["results"]:
        if r["row"] in ("ndparallel", "ndparallel-unfused"):
            features = {"fused_loss": r["row"] == "ndparallel"}
            seq, b = run["args"]["seq"], run["args"]["micro_batch"]
            case = f"h200-1b-s{seq}-b{b}-none-compiled{_suffix(features)}"
            rows.append(_h200_row(case, seq, b, run["args"]["ac"], r["peak_gib"], features, GPU_FILES["fused"]))
    return rows


GPU_TEXT = [
    "Rows with a `-fused`, `-unfused`, `-tiled` or `-offload` suffix (2026-12-03) are the trainer's step with the",
    "long-row features (`fused_loss`, `tiled_mlp`, `activation_offload_layers` on the row; every row before them",
    "says `fused_loss: false`, as the trainer then ran): `benchmarks/peers/bench_longest_row.py` on one packed row of",
    "4,096-token documents, full checkpointing, compiled, the fused loss alone or with the tiled MLP and the",
    "inputs of 15 of 16 layers in host memory (`results/h200_longest_row.jsonl`), and",
    "`benchmarks/peers/bench_train.py` at 4096 x 2 without checkpointing, fused and unfused",
    "(`results/h200_bench_fused_loss.jsonl`); AdamW on the bf16 gradients (the trainer's `master_grads=False`).",
    "They were held out: no coefficient was set from them",
    "except the compiled MLP backward's width (7 e*i/t, `planner/backward.py`), which the fused-only 131,072-token",
    "row decided between two counts (6: -4.7%, 7: -0.01%). Not used: the `ndparallel-cpu-offload` row (FSDP2's",
    "CPU offload of weights and AdamW state: 9.67 GiB at 131,072 tokens), which the planner does not model.",
]
GPU_ERRORS = [
    "With the tiled MLP and offload the planner is 1.4% (131,072 tokens) and 2.1% (1,048,576) high: it takes the",
    "largest moment over the layers of the backward, which with offload is the last offloaded layers' (two inputs",
    "on the GPU, fourteen layers' bf16 gradients made) at their attention backward, whose flash-kernel buffers",
    "are counted from FlashAttention 2's code (`planner/backward.py`), not measured; at the first layer of the",
    "backward the same count gives 23.71 / 73.06 GiB (-4.95% / -0.10%).",
]
CPU_TEXT = [
    "Long-row features (`planner_measure_long_rows.py`; suffixes as above): `-fused` rows keep lm_head's input",
    "gradient and its float32 weight gradient instead of the logits; `-tiled4` rows run the MLP over 4 tiles",
    "(selective checkpointing still caches the tiles' matmul outputs: nothing saved); `-offload1` keeps the first",
    "layer's input on the host (`activations_retained` counts the device only). `fused-loss-*` rows: the fused",
    "loss's peak through forward and backward (x and W given, chunks of 256 rows; the CPU's weight-gradient path:",
    "each chunk's bf16 product in a buffer kept across chunks, where CUDA makes a float32 one per chunk).",
    "`step-*` rows: one training step's peak on the one-rank flat path (`measure.measure_step_peak`: what the",
    "step's forward and backward create, bf16 gradients included) of `tiny-wide-mlp` (vocab 128, hidden 64, 4",
    "layers, 4 heads, 2 kv heads, intermediate 512), against the largest moment of `memory_moments` less what",
    "exists before the step; every one peaks in a layer's backward but the one without checkpointing (the loss).",
]
SCOPE = [
    "- Long-row features: validated on CPU to the byte (eager; selective checkpointing's layer backward 0.8% low)",
    "  and on the H200 (1B, compiled, one rank) to 0.1% for the fused loss and 2.1% with the tiled MLP and",
    "  offload. Not validated: the tiled MLP and offload under tp, cp or FSDP on a GPU; the attention backward's",
    "  flash buffers (FlashAttention 2's code), cuDNN's; the host side (pinned blocks of a power of two, as",
    "  `offload.host_bytes_per_layer` counts them); their time (`planner/perf.py` says what is assumed).",
]
