"""The longest packed row that trains on one GPU, its peak memory and throughput, and a peer's in the same run.

    python benchmarks/peers/bench_longest_row.py --model 1b --lengths 131072,262144,524288,1048576 --out r.jsonl
    python benchmarks/peers/bench_longest_row.py --model 1b --search 1048576 --out r.jsonl     # double, then bisect
    python benchmarks/peers/bench_longest_row.py --model 8b --lora --lengths 524288 --out r.jsonl
    python benchmarks/peers/bench_longest_row.py --model 1b --rows peer-liger --lengths 131072,262144 --out r.jsonl

Rows (each (row, length) in a process of its own, so an out-of-memory leaves nothing behind):
* ``ndparallel``: the trainer's step (``train/loop.forward_backward``, clip, AdamW) on one packed row of 4,096-token
  documents, full activation checkpointing, the fused loss, the MLP over sequence tiles, the layer inputs of
  as many layers as host memory holds offloaded, per-layer compile (``--eager`` to turn it off);
* ``ndparallel-tiled``: the same without offload (what offloading costs in time, and saves);
* ``ndparallel-fused``: the same without tiling or offload (what the fused loss alone reaches);
* ``ndparallel-cpu-offload``: the ``ndparallel`` row with the weights and AdamW state in host memory too
  (``cpu_offload``: FSDP2's CPU offload, the optimizer steps on the CPU);
* ``ndparallel-unfused``: no fused loss either (the model's logits, the previous default);
* ``peer-liger``: transformers' Llama with Liger's kernels (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy),
  gradient checkpointing and FSDP2 over the one GPU (bf16 parameters, fp32 reduction), one document per row
  (its SDPA attention cannot take packed rows without an (L x L) mask), so its step time grows with L squared:
  only its memory is comparable.

Each attempt runs one warm-up step (compilation) and ``--steps`` timed steps; peak memory is
``torch.cuda.max_memory_allocated`` over all of them. Memory does not depend on the document structure
(the varlen attention keeps no per-document state), so packed rows keep each step's attention linear.
``--search N``: lengths double from ``--start`` until one fails or exceeds N, then the gap is bisected to
``--resolution`` tokens. Results: one JSON line per attempt in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from ndparallel.testing.child_errors import failure_line

DOC = 4096


def _attempt(args, row: str, length: int) -> dict:
    """One (row, length) in a fresh process; its JSON line, or the reason it failed."""
    cmd = [sys.executable, __file__, "--one", row, str(length), "--model", args.model, "--steps", str(args.steps)]
    cmd += ["--lora"] if args.lora else []
    cmd += ["--eager"] if args.eager else []
    cmd += ["--offload-layers", str(args.offload_layers)] if args.offload_layers is not None else []
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"row": row, "tokens": length, "ok": False, "error": f"timeout after {args.timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        result = json.loads(lines[-1])
    else:
        oom = "OutOfMemory" in proc.stderr or "out of memory" in proc.stderr
        result = {"row": row, "tokens": length, "ok": False, "oom": oom, "error": failure_line(proc.stderr)}
        result["stderr_tail"] = proc.stderr[-3000:]  # the C++ stack of a CUDA error says which kernel
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def _search(args, row: str, emit) -> None:
    fits, fails, length = 0, None, args.start
    while length <= args.search:
        result = emit(_attempt(args, row, length))
        if not result["ok"]:
            fails = length
            break
        fits, length = length, length * 2
    while fails is not None and fits and fails - fits > args.resolution:
        mid = (fits + fails) // 2 // DOC * DOC
        if emit(_attempt(args, row, mid))["ok"]:
            fits = mid
        else:
            fails = mid
    emit({"row": row, "longest_fitting": fits, "first_failing": fails, "model": args.model, "lora": args.lora})


def _run_one(args, row: str, length: int) -> dict:
    """Inside the child: build the row, run warm-up + timed steps, return the measurements."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    step, tokens, offloaded = (_peer_step if row == "peer-liger" else _ndparallel_step)(args, row, length)
    times = []
    for i in range(args.steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = times[1:]
    step_s = sum(timed) / len(timed)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return {
        "row": row,
        "model": args.model,
        "lora": args.lora,
        "compile": not args.eager,
        "tokens": length,
        "ok": True,
        "peak_gib": round(peak, 2),
        "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "gib_per_1k_tokens": round(peak / (length / 1000), 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "step_s": round(step_s, 3),
        "first_step_s": round(times[0], 2),
        "offloaded_layers": offloaded,
    }


def _ndparallel_step(args, row: str, length: int):
    import torch

    import ndparallel as ndp
    from ndparallel.adapters.lora import LoraSpec
    from ndparallel.parallel.offload import host_memory_available, offload_layer_count
    from ndparallel.train.loop import forward_backward
    from ndparallel.weights.materialize import initialize_adapters, materialize
    from ndparallel.weights.meta import meta_model, model_config_for

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    config = model_config_for(base_model=None, model_shape=args.model, overrides={}, max_position_embeddings=length)
    memory = row in ("ndparallel", "ndparallel-cpu-offload", "ndparallel-tiled")
    offloaded = 0
    if memory and row != "ndparallel-tiled":  # as activation_offloading: true decides (train.offload_layers)
        offloaded = offload_layer_count(
            args.offload_layers,
            num_layers=config.num_hidden_layers,
            layer_bytes=length * config.hidden_size * 2,
            ranks_on_node=1,
            host_bytes=host_memory_available(),
        )
    options = ndp.ParallelOptions(
        activation_checkpointing="full",
        compile=not args.eager,
        fused_loss=row != "ndparallel-unfused",
        tiled_mlp=memory,
        activation_offload_layers=offloaded,
        cpu_offload=row == "ndparallel-cpu-offload",
    )
    lora = LoraSpec(r=16, alpha=32, target_linear=True) if args.lora else None
    model = meta_model(config)
    if options.cpu_offload:  # FSDP2 takes a one-rank unit's parameters as they are: their CPU storage first
        materialize(model, topo.device, weights_dir=None, seed=0, offload_params=True)
        ndp.parallelize(model, topo, options=options, lora=lora)
    else:
        ndp.parallelize(model, topo, options=options, lora=lora)
        materialize(model, topo.device, weights_dir=None, seed=0)
    if lora is not None:
        initialize_adapters(model, 0)
    model.train()
    opt = ndp.build_optimizer(model, lr=1e-5, weight_decay=0.0, master_grads=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    positions = (torch.arange(length) % DOC)[None]

    def step(i: int) -> None:
        ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(i))
        batch = ndp.prepare_batch(topology=topo, input_ids=ids, position_ids=positions)
        forward_backward(model, [batch], topo, compiled_loss=not args.eager)
        ndp.clip_grad_norm_(trainable, 1.0, optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, length, offloaded


def _peer_step(args, row: str, length: int):
    """transformers + Liger kernels + gradient checkpointing + FSDP2 on one GPU (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    from ndparallel.weights.meta import model_config_for

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("nccl")
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    config = model_config_for(base_model=None, model_shape=args.model, overrides={}, max_position_embeddings=length)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(i: int) -> None:
        ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(i)).cuda()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, length, 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b", help="a model_shape preset (1b, 3b, 8b)")
    p.add_argument("--lora", action="store_true", help="LoRA r16 on every linear of the blocks")
    p.add_argument("--rows", default="ndparallel", help="comma-separated: " + "ndparallel, ndparallel-fused, ...")
    p.add_argument("--lengths", default="", help="comma-separated row lengths to measure")
    p.add_argument("--search", type=int, default=0, help="find the longest fitting row up to this length")
    p.add_argument("--start", type=int, default=131072)
    p.add_argument("--resolution", type=int, default=65536)
    p.add_argument("--steps", type=int, default=1, help="timed steps after the warm-up step")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--offload-layers", type=int, default=None, help="default: as many as host memory holds")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default=None)
    p.add_argument("--one", nargs=2, metavar=("ROW", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_run_one(args, args.one[0], int(args.one[1]))), flush=True)
        return 0

    def emit(result: dict) -> dict:
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
        return result

    for row in args.rows.split(","):
        for length in [int(x) for x in args.lengths.split(",") if x]:
            emit(_attempt(args, row, length))
        if args.search:
            _search(args, row, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
