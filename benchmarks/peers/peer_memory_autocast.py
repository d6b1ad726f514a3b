"""Peak allocated memory of the step a published FSDP1 + autocast recipe ran, its unsharded part, on one GPU.

    python benchmarks/peers/peer_memory_autocast.py --layers 8,16 --out peer_memory.jsonl

The only published rows that report *allocated* peak memory for a sharded full fine-tune (ATorch's Llama-2-7B
FSDP table, `planner_heldout.py`) ran transformers' Llama under FSDP1 (fp32 flat parameters, no
MixedPrecision: torch.autocast to bf16, per-decoder-layer wrapping, ``limit_all_gathers``,
``use_orig_params``, ``forward_prefetch``), activation checkpointing of every decoder layer, transformers'
own loss, and torch's AdamW; rank 0 printed ``torch.cuda.max_memory_allocated()``. One GPU cannot run that
sharding: FSDP1 on a world of one switches to NO_SHARD (parameters never freed, gradients kept whole; a
first run of this script with FSDP1 showed it). So this runs the step without FSDP (not ATorch itself: its
wrappers are not reproduced), transformers' Llama with Llama-2-7B's layer shape and fewer layers (all 32 do
not fit unsharded), autocast to bf16, non-reentrant checkpointing of each decoder layer, AdamW, and
reports what FSDP would not divide by the number of GPUs:

- ``states_gib``: allocated when a step's forward starts (fp32 parameters and AdamW's two moments; the
  gradients were set to None): what FSDP divides by the number of ranks;
- ``peak_gib``: the peak of forward and backward (reset at the forward's start);
- ``grads_at_peak_gib``: decoder-layer gradients that exist at that peak (here whole; with N ranks 1/N),
  from the backward's trace: a hook on each layer's output gradient starts a new peak segment when that
  layer's backward starts, so the segment of the peak says how many layers' gradients exist (+- one);
- ``above_states_gib`` = peak - states - grads_at_peak: activations, autocast's casts, the loss and the
  gradients of embedding, norm and lm_head (FSDP1's root unit keeps those unsharded until backward ends).
  What FSDP1 adds on N GPUs: the root unit's fp32 parameters gathered for the whole step and up to two
  gathered decoder layers (``limit_all_gathers``); ``planner_heldout.py`` adds them by arithmetic.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

GIB = 2**30
LLAMA2_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000
)


def measure(layers: int, batch: int, seq: int, steps: int) -> dict:
    config = LlamaConfig(**LLAMA2_7B, num_hidden_layers=layers, max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)

    trace: list[tuple[int, int]] = []  # (allocated, peak since the previous point) at each layer's backward start

    def mark(_grad):
        trace.append((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()

    def on_layer_output(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(mark)

    for layer in model.model.layers:
        layer.register_forward_hook(on_layer_output)

    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    row = {}
    for step in range(steps):
        trace.clear()
        torch.cuda.synchronize()
        states = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        forward_peak = torch.cuda.max_memory_allocated()
        after_forward = torch.cuda.memory_allocated()
        loss.backward()
        torch.cuda.synchronize()
        trace.append((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))  # the embedding's backward
        after_backward = torch.cuda.memory_allocated()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # Segment k ends at trace[k]: segment 0 is the forward, the loss and lm_head's backward; segment k >= 1
        # is one decoder layer's backward, when the k - 1 layers after it hold their gradients (a world of one
        # keeps them whole; FSDP on N ranks keeps 1/N of them), give or take the layer being differentiated.
        peaks = [max(forward_peak, trace[0][1])] + [p for _, p in trace[1:]]
        k = max(range(len(peaks)), key=lambda i: peaks[i])
        grads = max(k - 1, 0) * layer_params * 4
        row = {
            "layers": layers,
            "batch": batch,
            "seq": seq,
            "step": step,
            "states_gib": round(states / GIB, 3),
            "forward_peak_gib": round(forward_peak / GIB, 3),
            "after_forward_gib": round(after_forward / GIB, 3),
            "peak_gib": round(peaks[k] / GIB, 3),
            "peak_segment": k,
            "after_backward_gib": round(after_backward / GIB, 3),
            "grads_at_peak_gib": round(grads / GIB, 3),
            "above_states_gib": round((peaks[k] - states - grads) / GIB, 3),
            "segment_peaks_gib": [round(p / GIB, 2) for p in peaks],
        }
        print(json.dumps(row), flush=True)
    del model, optimizer
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="8,16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="the last step is kept (AdamW's moments exist from step 2)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    meta = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    import transformers

    meta["transformers"] = transformers.__version__
    with open(args.out, "a") as f:
        for layers in (int(x) for x in args.layers.split(",")):
            f.write(json.dumps({**measure(layers, args.batch, args.seq, args.steps), **meta}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
