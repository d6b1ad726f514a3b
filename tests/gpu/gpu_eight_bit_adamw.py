"""8-bit AdamW (torchao's AdamW8bit, what optimizer: adamw_8bit / adamw_bnb_8bit / adamw_torch_8bit /
paged_adamw_8bit run) on CUDA, with sharded DTensor parameters. Needs torchao (carry the wheel).

One GPU (no torchrun):
    PYTHONPATH=src python3 tests/gpu/gpu_eight_bit_adamw.py --out $OUT
  1. the same 40 steps with fp32-state AdamW and with AdamW8bit (fp32 compute, FSDP2 on a 1-rank mesh, so
     the parameters are DTensors): both losses fall, the 8-bit mean loss of the last 10 steps is within 3%
     of AdamW's, and the optimizer state takes at most 30% of AdamW's bytes;
  2. a checkpoint round trip of the 8-bit state through torch.distributed.checkpoint (what ndparallel's
     checkpoints use): save after 20 steps, train 5 more; reload and train the same 5: the losses match.
  Writes $OUT/eight_bit_single.json.

Several GPUs:
    PYTHONPATH=src torchrun --nproc-per-node 2 tests/gpu/gpu_eight_bit_adamw.py --out $OUT --dp-shard 2 \
        --reference $OUT/eight_bit_single.json
  the 8-bit run on dp_shard x tp ranks (--tp 2 with 4 GPUs) against the one-GPU 8-bit losses of the same
  batches: every matrix row is 1024 values long, so each shard's 8-bit blocks are the full tensor's blocks and
  the losses agree to float32 reduction-order noise (rel 1e-4). Writes $OUT/eight_bit_<layout>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig

import ndparallel as ndp
from ndparallel.optim.adamw_8bit import build_adamw_8bit
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model

CONFIG = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    max_position_embeddings=512,
)
ROWS, SEQ, LR = 8, 256, 1e-3


def batches(steps: int, seed: int = 1):
    """Learnable synthetic rows: each row repeats one of 32 fixed 16-token phrases (the same on every rank)."""
    phrases = torch.randint(0, CONFIG["vocab_size"], (32, 16), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = phrases[torch.randint(0, 32, (ROWS,), generator=g)]
        yield rows.repeat(1, SEQ // 16)


def build(topo, kind: str):
    model = meta_model(LlamaConfig(**CONFIG))
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
    materialize(model, topo.device, weights_dir=None, seed=0)
    model.train()
    if kind == "adamw":
        optimizer = ndp.build_optimizer(model, lr=LR, weight_decay=0.0, betas=(0.9, 0.999))
    else:
        optimizer = build_adamw_8bit(
            model, lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device_type=topo.device.type
        )
    return model, optimizer


def train(model, optimizer, topo, data) -> list[float]:
    losses = []
    for ids in data:
        batch = ndp.prepare_batch(ids, topo)
        n = ndp.count_tokens(batch.num_tokens, topo)
        loss = ndp.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=n, topology=topo)
        loss.backward()
        ndp.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(ndp.reduce_loss(loss, topo).item())
    return losses


def state_bytes(optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                inner = (
                    [local]
                    if not hasattr(local, "__tensor_flatten__")
                    else [getattr(local, name) for name in local.__tensor_flatten__()[0]]
                )
                total += sum(t.numel() * t.element_size() for t in inner)
    return total


def single(out: Path, steps: int) -> dict:
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    result = {}
    for kind in ("adamw", "adamw_8bit"):
        model, optimizer = build(topo, kind)
        start = time.perf_counter()
        losses = train(model, optimizer, topo, batches(steps))
        torch.cuda.synchronize()
        result[kind] = {
            "losses": losses,
            "s_per_step": (time.perf_counter() - start) / steps,
            "state_bytes": state_bytes(optimizer),
        }
        print(
            f"{kind:10s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, optimizer state "
            f"{result[kind]['state_bytes'] / 2**20:.1f} MiB, {result[kind]['s_per_step'] * 1e3:.0f} ms/step",
            flush=True,
        )
    full, eight = result["adamw"], result["adamw_8bit"]
    # The mean of the last 10 steps: one step's loss swings by +-1 between batches on this data, so a
    # single final step compares batches, not optimizers (the first H200 run: 4.06 vs 4.30 at step 40,
    # 2.1% apart over the last 10 steps).
    last_full, last_eight = sum(full["losses"][-10:]) / 10, sum(eight["losses"][-10:]) / 10
    result["final_loss_rel_diff"] = abs(last_eight - last_full) / last_full
    result["state_ratio"] = eight["state_bytes"] / full["state_bytes"]
    try:
        result["resume_max_abs_diff"] = resume_check(topo)
    except Exception as exc:  # report it with the other numbers rather than lose them
        result["resume_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        result["resume_max_abs_diff"] = float("inf")
        print(f"checkpoint round trip failed: {result['resume_error']}", flush=True)
    checks = {
        "losses fall": eight["losses"][-1] < 0.85 * eight["losses"][0],
        "last-10-step mean loss within 3% of AdamW's": result["final_loss_rel_diff"] < 0.03,
        "state at most 30% of AdamW's": result["state_ratio"] <= 0.30,
        "resume matches": result["resume_max_abs_diff"] < 1e-5,
    }
    result["checks"] = checks
    print(
        f"last-10 mean loss rel diff {result['final_loss_rel_diff']:.4f}, state ratio {result['state_ratio']:.3f}, "
        f"resume max |diff| {result['resume_max_abs_diff']:.2e}",
        flush=True,
    )
    print("PASS" if all(checks.values()) else f"FAIL {[k for k, ok in checks.items() if not ok]}", flush=True)
    (out / "eight_bit_single.json").write_text(json.dumps(result, indent=1))
    return result


def resume_check(topo) -> float:
    """Save model + 8-bit optimizer after 20 steps, train 5; reload, train the same 5: the same losses?"""
    data = list(batches(25, seed=7))
    model, optimizer = build(topo, "adamw_8bit")
    train(model, optimizer, topo, data[:20])
    with tempfile.TemporaryDirectory() as folder:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        straight = train(model, optimizer, topo, data[20:])
        model2, optimizer2 = build(topo, "adamw_8bit")
        train(model2, optimizer2, topo, data[:1])  # creates the optimizer state to load into
        model_state, optim_state = get_state_dict(model2, optimizer2)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model2, optimizer2, model_state_dict=state["model"], optim_state_dict=state["optim"])
        resumed = train(model2, optimizer2, topo, data[20:])
    return max(abs(a - b) for a, b in zip(straight, resumed))


def parallel(out: Path, steps: int, dp_shard: int, tp: int, reference: Path | None) -> None:
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=dp_shard, tp_size=tp))
    model, optimizer = build(topo, "adamw_8bit")
    losses = train(model, optimizer, topo, batches(steps))
    result = {"layout": topo.layout.shape, "losses": losses}
    if reference is not None:
        expected = json.loads(reference.read_text())["adamw_8bit"]["losses"]
        result["max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    if topo.is_main:
        print(
            f"layout {topo.layout.shape}: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (
                f", max rel diff vs one GPU {result['max_rel_diff']:.2e} "
                f"({'PASS' if result['max_rel_diff'] < 1e-4 else 'FAIL'})"
                if reference
                else ""
            ),
            flush=True,
        )
        (out / f"eight_bit_dp{dp_shard}_tp{tp}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dp-shard", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--reference", type=Path)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        parallel(out, args.steps, args.dp_shard, args.tp, args.reference)
    else:
        single(out, args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
