"""What a compiled, checkpointed LoRA layer keeps from forward to backward, per base format (GPU).

    PYTHONPATH=src python benchmarks/diagnostics/quantized_checkpoint_memory_diag.py [--out DIR]

Why: on the H200 (2026-12-03) the 8B LoRA on int8 weights with full checkpointing peaked at 19.8 GiB when
the checkpointed layer was compiled whole, against ~10 GiB when only the layer inside the checkpoint was
compiled; a bf16 base moved by 0.4 GiB only. Saved tensors on CPU (tiny shapes) were the same for both
formats. This measures it where it happened: a stack of decoder layers of the 8B's width at 4,096 tokens,
LoRA r16 on every linear, one rank (the flat path), bf16 compute, full checkpointing, for each base format
(bf16, int8, nf4) eager and compiled: the bytes autograd saves during forward (by shape), the memory
allocated after forward, and the peak of the backward, each above the model's own memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

import ndparallel as ndp
from ndparallel.adapters.lora import LoraSpec
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

LAYERS = 4
SEQ = 4096


def lora_stack(base: str, compiled: bool, *, layers: int = LAYERS, seq: int = SEQ, fused_lora_mlp: bool = False):
    """(model, topology, batch, token count): ``layers`` decoder layers of the 8B's width on one rank, LoRA r16 on
    every linear over a ``base`` (bf16, int8, nf4) base, full checkpointing, one row of ``seq`` random tokens."""
    torch._dynamo.reset()
    config = model_config_for(
        base_model=None, model_shape="8b", overrides={"num_hidden_layers": layers}, max_position_embeddings=seq
    )
    model = meta_model(config)
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    options = ndp.ParallelOptions(
        activation_checkpointing="full",
        compile=compiled,
        quantized_base=None if base == "bf16" else base,
        fused_lora_mlp=fused_lora_mlp,
    )
    ndp.parallelize(model, topo, options=options, lora=LoraSpec(r=16, alpha=16, target_linear=True))
    materialize(model, topo.device, weights_dir=None, seed=0)
    ids = torch.randint(0, config.vocab_size, (1, seq), device=topo.device)
    batch = ndp.prepare_batch(topology=topo, input_ids=ids)
    return model, topo, batch, ndp.count_tokens(batch.num_tokens, topo)


def measure(base: str, compiled: bool) -> dict:
    model, topo, batch, n = lora_stack(base, compiled)
    row = {"base": base, "compiled": compiled, "layers": LAYERS, "seq": SEQ}
    for step in range(3):  # the last step is measured (compiled: after the warm-up compiles)
        saved: Counter = Counter()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.nn.Parameter):
                saved[(tuple(t.shape), str(t.dtype))] += t.untyped_storage().nbytes()
            return t

        torch.cuda.synchronize()
        base_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = ndp.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated() - base_bytes
        forward_peak = torch.cuda.max_memory_allocated() - base_bytes
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated() - base_bytes
        model.zero_grad(set_to_none=True)
    top = sorted(saved.items(), key=lambda kv: -kv[1])[:6]
    row.update(
        saved_mib=round(sum(saved.values()) / 2**20, 1),
        after_forward_mib=round(after_forward / 2**20, 1),
        forward_peak_mib=round(forward_peak / 2**20, 1),
        backward_peak_mib=round(backward_peak / 2**20, 1),
        model_mib=round(base_bytes / 2**20, 1),
        largest_saved=[[list(shape), dtype, round(b / 2**20, 1)] for (shape, dtype), b in top],
    )
    del model, loss
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--bases", default="bf16,int8,nf4")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for base in args.bases.split(","):
        for compiled in (False, True):
            try:
                rows.append(measure(base, compiled))
            except Exception as exc:  # one row's failure is a result too
                rows.append({"base": base, "compiled": compiled, "error": f"{type(exc).__name__}: {exc}"[:400]})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quantized_checkpoint_memory.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
