"""Training throughput: ndparallel against its peers at their best, with the same shapes, batch, AdamW,
gradient clipping and MFU formula for every row.

    python benchmarks/peers/bench_train.py --shape 1b --seq 4096 --micro-batch 2
    python benchmarks/peers/bench_train.py --shape 3b --seq 8192 --micro-batch 1 \\
        --rows ndparallel,ndparallel-fsdp,accelerate-compile,fsdp2-compile,ndparallel-fp8 \\
        --json $OUT/bench.jsonl --profile $OUT/profiles.txt
    torchrun --nproc-per-node 8 benchmarks/peers/bench_train.py --shape 8b --seq 8192 --tp 2 \
        --rows ndparallel,accelerate-compile
    python benchmarks/peers/bench_train.py --shape tiny --seq 128 --steps 3 --device cpu --rows ndparallel,fsdp2-eager

Rows (``--rows``, default ``ndparallel,accelerate-compile,fsdp2-compile``):

  ndparallel              per-block torch.compile, compiled fused loss (one rank: flat buffers, no FSDP)
                          and, as the trainer, ``build_optimizer(master_grads=False)`` (AdamW reads the bf16
                          gradients: no fp32 .grad)
  ndparallel-master-grads the same with fp32 gradients in the parameters' .grad (the library default) [extra]
  ndparallel-fsdp         the same, FSDP2 even on one rank (the path before the one-rank work) [extra]
  ndparallel-eager        no compile [extra]
  ndparallel-fp8[-all|-head|-rowwise]  fp8: true, tensorwise, the default rule; -all: every decoder
                          layer converted (lm_head and small linears bf16); -head: lm_head too;
                          -rowwise: the rowwise recipe, default rule [extra]
  accelerate-compile      PEER BEST: Accelerate 1.15 FSDP2 plugin (bf16 params, fp32 reduce) with its
                          regional compilation (TorchDynamoPlugin(use_regional_compilation=True): every
                          decoder layer and the other leaves compiled in place)
  fsdp2-compile           PEER BEST: plain PyTorch fully_shard per decoder layer + root, same mixed
                          precision, each decoder layer compiled in place (``layer.compile()``)
  accelerate-eager, fsdp2-eager   the peers without compile [extra]
  accelerate-compile-noreshard, fsdp2-compile-noreshard   the peers keeping gathered parameters from
                          forward to backward (reshard_after_forward=False: faster on one GPU, more
                          memory; ndparallel's FSDP path does this on one rank) [extra]
  plain-eager             one device, no FSDP: fp32 weights under bf16 autocast [extra]

Every row: the same Llama-shaped model (random init), the same synthetic full rows, AdamW (lr 1e-4,
weight decay 0.1, torch's fused kernel for the peers), clipping to norm 1.0, bf16 compute with fp32
master weights (fp32 on CPU). The peers use transformers' own loss (labels=input_ids).
MFU = tokens/s x FLOPs/token / (devices x 989 TFLOP/s), FLOPs/token = 6 x (non-embedding params +
lm_head) + the causal attention of a row per token (``ndparallel.step.flops``, as the trainer counts it).
``--warmup`` steps (compilation included) are not timed.

On one CUDA process each peer row runs in a subprocess of its own (``--isolate``, default on): its
memory, its compile caches and the global settings Accelerate changes (dynamo flags) stay out of the
other rows. The ndparallel rows run in this process, one after the other. Under torchrun every row
runs in-process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

import ndparallel as ndp
from ndparallel.models.presets import PRESETS
from ndparallel.step.flops import AttentionFlops, flops_per_token
from ndparallel.train.loop import forward_backward
from ndparallel.train.metrics import device_peak_flops
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

PEER_BEST = ("accelerate-compile", "fsdp2-compile")
DEFAULT_ROWS = "ndparallel,accelerate-compile,fsdp2-compile"
NDP_ROWS = {  # name -> ParallelOptions overrides
    "ndparallel": {"compile": True},
    "ndparallel-master-grads": {"compile": True, "master_grads": True},
    "ndparallel-unfused": {"compile": True, "fused_loss": False},  # the model's logits, then the loss
    "ndparallel-fsdp": {"compile": True, "single_rank_fsdp": True},
    "ndparallel-eager": {"compile": False},
    "ndparallel-fp8": {"compile": True, "fp8": {}},
    "ndparallel-fp8-all": {"compile": True, "fp8": {"keep_bf16_layers": ()}},
    "ndparallel-fp8-head": {"compile": True, "fp8": {"keep_bf16_layers": (), "keep_bf16_modules": ()}},
    "ndparallel-fp8-rowwise": {"compile": True, "fp8": {"recipe": "rowwise"}},
}
PEER_ROWS = {
    "accelerate-compile",
    "accelerate-compile-noreshard",
    "accelerate-eager",
    "fsdp2-compile",
    "fsdp2-compile-noreshard",
    "fsdp2-compile-liger",  # + Liger's RoPE, RMSNorm, SwiGLU and fused linear cross-entropy (liger-kernel)
    "fsdp2-eager",
    "plain-eager",
}


def synthetic(rows: int, seq: int, vocab: int, step: int) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1000 + step))


@dataclass
class Row:
    """A built benchmark row: ``phases(i)`` gives step i as [(phase name, fn)]."""

    phases: Callable[[int], list]
    tokens_per_step: int
    devices: int

    def step(self, i: int) -> None:
        for _, fn in self.phases(i):
            fn()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build_ndparallel_row(
    topo,
    config,
    *,
    seq: int,
    micro_batch: int,
    compile_: bool,
    ac: str = "none",
    fp32: bool = False,
    fsdp_wrap="block",
    single_rank_fsdp: bool = False,
    fp8=None,
    master_grads: bool = False,
    accumulation: int = 1,
    fused_loss: bool = True,
) -> Row:
    fp8_spec = None if fp8 is None else ndp.Fp8Spec(**fp8)
    options = ndp.ParallelOptions(
        fused_loss=fused_loss,
        param_dtype=None if fp32 else "bfloat16",
        activation_checkpointing=ac,
        compile=compile_,
        fsdp_wrap=fsdp_wrap,
        single_rank_fsdp=single_rank_fsdp,
        fp8=fp8_spec,
    )
    model = meta_model(config)
    ndp.parallelize(model, topo, options=options)
    materialize(model, topo.device, weights_dir=None, seed=0)
    model.train()
    opt = ndp.build_optimizer(model, lr=1e-4, weight_decay=0.1, master_grads=master_grads)
    trainable = [p for p in model.parameters() if p.requires_grad]
    rows = micro_batch * topo.layout.batch_size

    def phases(i: int) -> list:
        batches = [
            ndp.prepare_batch(synthetic(rows, seq, config.vocab_size, i * accumulation + k), topo)
            for k in range(accumulation)
        ]
        return [
            ("forward+backward", lambda: forward_backward(model, batches, topo, compiled_loss=compile_)),
            ("clip", lambda: ndp.clip_grad_norm_(trainable, 1.0, optimizer=opt)),
            ("optimizer+zero_grad", lambda: (opt.step(), opt.zero_grad(set_to_none=True))),
        ]

    return Row(phases=phases, tokens_per_step=accumulation * rows * seq, devices=topo.world_size)


def _hf_model(config, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def _hf_phases(
    forward, params: list, opt, clip, backward, *, rows: int, rank_rows: slice, seq: int, vocab: int, device
):
    """Step i of a peer: transformers' loss (labels=input_ids), backward, clip, optimizer step."""

    def phases(i: int) -> list:
        ids = synthetic(rows, seq, vocab, i)[rank_rows]
        if device.type == "cuda":  # pinned and asynchronous, as a DataLoader(pin_memory=True) gives them (and ours)
            ids = ids.pin_memory().to(device, non_blocking=True)
        return [
            ("forward+backward", lambda: backward(forward(input_ids=ids, labels=ids, use_cache=False).loss)),
            ("clip", lambda: clip(params, 1.0)),
            ("optimizer+zero_grad", lambda: (opt.step(), opt.zero_grad(set_to_none=True))),
        ]

    return phases


def build_fsdp2_row(
    topo, config, *, seq: int, micro_batch: int, compile_: bool, fp32: bool, reshard: bool = True, liger: bool = False
) -> Row:
    """Plain PyTorch FSDP2: fully_shard per decoder layer and the root, bf16 params / fp32 reduce. ``liger``:
    Liger's kernels patched into transformers' Llama first (its way of being used; this row runs in a process
    of its own)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)

    model = _hf_model(config, topo.device)
    mp = MixedPrecisionPolicy(param_dtype=None if fp32 else torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if compile_:
            layer.compile()
        fully_shard(layer, mesh=topo.fsdp, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=topo.fsdp, mp_policy=mp, reshard_after_forward=reshard)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=topo.device.type == "cuda")
    rows = micro_batch * topo.layout.batch_size
    mine = slice(topo.batch_rank * micro_batch, (topo.batch_rank + 1) * micro_batch)
    phases = _hf_phases(
        model,
        list(model.parameters()),
        opt,
        torch.nn.utils.clip_grad_norm_,
        torch.Tensor.backward,
        rows=rows,
        rank_rows=mine,
        seq=seq,
        vocab=config.vocab_size,
        device=topo.device,
    )
    return Row(phases=phases, tokens_per_step=rows * seq, devices=topo.world_size)


def build_accelerate_row(
    topo, config, *, seq: int, micro_batch: int, compile_: bool, fp32: bool, ac: str = "none", reshard: bool = True
) -> Row:
    """Accelerate's FSDP2 plugin (ParallelismConfig when tp > 1) with its regional compilation."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig, TorchDynamoPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _hf_model(config, topo.device)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[type(model.model.layers[0]).__name__],
        reshard_after_forward=reshard,
        activation_checkpointing=ac != "none",
        mixed_precision_policy=None
        if fp32
        else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    kwargs = {}
    if topo.layout.tp > 1 or topo.layout.dp_replicate > 1:
        kwargs["parallelism_config"] = ParallelismConfig(
            dp_replicate_size=topo.layout.dp_replicate, dp_shard_size=topo.layout.dp_shard, tp_size=topo.layout.tp
        )
    if compile_:
        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    accelerator = Accelerator(mixed_precision="no" if fp32 else "bf16", fsdp_plugin=plugin, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=topo.device.type == "cuda")
    model, opt = accelerator.prepare(model, opt)
    model.train()
    rows = micro_batch * topo.layout.batch_size
    mine = slice(topo.batch_rank * micro_batch, (topo.batch_rank + 1) * micro_batch)
    phases = _hf_phases(
        model,
        list(model.parameters()),
        opt,
        accelerator.clip_grad_norm_,
        accelerator.backward,
        rows=rows,
        rank_rows=mine,
        seq=seq,
        vocab=config.vocab_size,
        device=accelerator.device,
    )
    return Row(phases=phases, tokens_per_step=rows * seq, devices=topo.world_size)


def build_plain_row(topo, config, *, seq: int, micro_batch: int, fp32: bool) -> Row:
    """One device, no FSDP: fp32 weights, bf16 autocast, fused AdamW."""
    model = _hf_model(config, topo.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=topo.device.type == "cuda")

    def forward(**inputs):
        with torch.autocast(topo.device.type, dtype=torch.bfloat16, enabled=not fp32):
            return model(**inputs)

    phases = _hf_phases(
        forward,
        list(model.parameters()),
        opt,
        torch.nn.utils.clip_grad_norm_,
        torch.Tensor.backward,
        rows=micro_batch,
        rank_rows=slice(None),
        seq=seq,
        vocab=config.vocab_size,
        device=topo.device,
    )
    return Row(phases=phases, tokens_per_step=micro_batch * seq, devices=1)


def build_row(name: str, args, topo, config) -> Row:
    common = dict(seq=args.seq, micro_batch=args.micro_batch)
    if name in NDP_ROWS:
        return build_ndparallel_row(
            topo,
            config,
            **common,
            ac=args.ac,
            fp32=args.fp32,
            fsdp_wrap=args.fsdp_wrap,
            accumulation=getattr(args, "accumulation", 1),
            **{"compile_": NDP_ROWS[name]["compile"], **{k: v for k, v in NDP_ROWS[name].items() if k != "compile"}},
        )
    if getattr(args, "accumulation", 1) != 1:
        raise SystemExit(f"--accumulation runs on the ndparallel rows only, not {name!r}")
    compile_ = "-compile" in name
    reshard = not name.endswith("-noreshard")
    if name.startswith("accelerate") and name in PEER_ROWS:
        return build_accelerate_row(
            topo, config, **common, compile_=compile_, fp32=args.fp32, ac=args.ac, reshard=reshard
        )
    if name.startswith("fsdp2") and name in PEER_ROWS:
        liger = name.endswith("-liger")
        return build_fsdp2_row(topo, config, **common, compile_=compile_, fp32=args.fp32, reshard=reshard, liger=liger)
    if name == "plain-eager":
        return build_plain_row(topo, config, **common, fp32=args.fp32)
    raise SystemExit(f"unknown row {name!r}; rows: {', '.join([*NDP_ROWS, *sorted(PEER_ROWS)])}")


def run_row(name: str, args, topo, config) -> dict:
    """Build, warm up, time and (optionally) profile one row in this process."""
    _reset(topo.device)
    start = time.perf_counter()
    try:
        row = build_row(name, args, topo, config)
        for i in range(args.warmup):
            row.step(i)
        _sync(topo.device)
        ready_s = time.perf_counter() - start
        _reset_peak(topo.device)
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            row.step(i)
        _sync(topo.device)
        seconds = (time.perf_counter() - t0) / args.steps
        result = {
            "row": name,
            "s_per_step": seconds,
            "tokens_per_step": row.tokens_per_step,
            "devices": row.devices,
            "peak_gib": _peak_gib(topo.device),
            "setup_and_warmup_s": ready_s,
        }
        if args.profile and name in args.profile_rows.split(",") and topo.is_main:
            _profile(row, name, args, topo)
        del row
    except Exception as exc:  # report, keep the other rows
        result = {"row": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    _reset(topo.device)
    return result


def _profile(row: Row, name: str, args, topo) -> None:
    """Append profile_step's report of 3 steps of ``row`` to ``args.profile`` (a failure is reported there)."""
    from profile_step import profile_steps

    device = torch.cuda.get_device_name() if topo.device.type == "cuda" else "cpu"
    title = f"{name}: {args.shape} seq {args.seq} x {args.micro_batch}, {device}, torch {torch.__version__}"
    try:
        report = profile_steps(row.phases(10_000), steps=3, title=title)
    except Exception as exc:
        report = f"== {title}\nprofile failed: {type(exc).__name__}: {str(exc)[:300]}"
    with open(args.profile, "a") as f:
        f.write(report + "\n\n")


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def run_isolated(name: str) -> dict:
    """The row in a fresh Python process (same arguments); its result comes back through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        env = {**os.environ, "MASTER_PORT": str(_free_port())}
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child-row", name, "--child-out", out]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"row": name, "error": f"subprocess exited with {proc.returncode}"}
        with open(out) as f:
            return json.load(f)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_env() -> None:
    """A run without torchrun: the variables torchrun would set (Accelerate reads them), on a free port."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def setup(args, device_type: str):
    """Process group, topology and the model config of the run."""
    one_process_env()
    ndp.init_distributed(device_type=device_type)
    topo = ndp.Topology.build(
        ndp.ParallelismConfig(
            dp_replicate_size=args.dp_replicate,
            dp_shard_size=args.dp_shard,
            cp_size=args.cp,
            tp_size=args.tp,
            cp_comm_strategy=args.cp_method,
        ),
        device_type=device_type,
    )
    config = model_config_for(base_model=None, model_shape=args.shape, overrides={}, max_position_embeddings=args.seq)
    return topo, config


def report(results: list[dict], args, topo, config) -> None:
    fpt = flops_per_token(config) + AttentionFlops(config).of_row(args.seq) / args.seq  # whole one-document rows
    peak = device_peak_flops(topo.device)
    name = torch.cuda.get_device_name() if topo.device.type == "cuda" else "cpu"
    print(
        f"\n{args.shape} seq {args.seq} x micro-batch {args.micro_batch} x accumulation {args.accumulation}, "
        f"layout {topo.layout.shape} "
        f"(dp_replicate, dp_shard, cp, tp), ac {args.ac}, {name}, torch {torch.__version__}"
    )
    print(f"{'row':24s} {'tokens/s':>10s} {'/device':>9s} {'MFU':>7s} {'peak GiB':>9s} {'ndp÷row':>8s}  kind")
    base = next((r for r in results if r["row"] == "ndparallel" and "error" not in r), None)
    for r in results:
        kind = "peer best" if r["row"] in PEER_BEST else "ours" if r["row"] == "ndparallel" else "extra"
        if "error" in r:
            print(f"{r['row']:24s} failed: {r['error']}")
            continue
        r["tokens_per_s"] = r["tokens_per_step"] / r["s_per_step"]
        r["tokens_per_s_per_device"] = r["tokens_per_s"] / r["devices"]
        r["mfu"] = r["tokens_per_s_per_device"] * fpt / peak if peak else None
        ratio = (
            f"{base['tokens_per_s_per_device'] / r['tokens_per_s_per_device']:7.3f}x"
            if base and "tokens_per_s" in base
            else "     n/a"
        )
        mfu = f"{r['mfu'] * 100:6.1f}%" if r["mfu"] else "    n/a"
        print(
            f"{r['row']:24s} {r['tokens_per_s']:10.0f} {r['tokens_per_s_per_device']:9.0f} {mfu} "
            f"{r['peak_gib']:9.2f} {ratio}  {kind}"
        )
    if args.json:
        import accelerate
        import transformers

        with open(args.json, "a") as f:
            f.write(
                json.dumps(
                    {
                        "args": {k: v for k, v in vars(args).items() if not k.startswith("child")},
                        "device": name,
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "accelerate": accelerate.__version__,
                        "results": results,
                    }
                )
                + "\n"
            )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="rows per data-parallel rank")
    p.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches per optimizer step (ndparallel rows only)"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma list; see the module docstring")
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp-method", default="allgather")
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--fsdp-wrap", default="block")
    p.add_argument("--fp32", action="store_true", help="no mixed precision (CPU default)")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="peers in subprocesses (default: on for one CUDA process)",
    )
    p.add_argument("--json", help="append the results as one JSON line to this file")
    p.add_argument("--profile", help="append profile_step reports of the --profile-rows to this file")
    p.add_argument("--profile-rows", default="ndparallel,ndparallel-fsdp")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--child-row", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.fp32 = args.fp32 or device_type == "cpu"
    topo, config = setup(args, device_type)
    if args.child_row:
        result = run_row(args.child_row, args, topo, config)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
        return 0
    isolate = args.isolate if args.isolate is not None else (device_type == "cuda" and topo.world_size == 1)
    results = []
    for name in (r for r in args.rows.split(",") if r):
        if isolate and name not in NDP_ROWS:
            results.append(run_isolated(name))
        elif topo.layout.cp > 1 and name not in NDP_ROWS:
            results.append({"row": name, "error": "the peers have no context parallelism here"})
        else:
            results.append(run_row(name, args, topo, config))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(results[-1])}", flush=True)
    if topo.is_main:
        report(results, args, topo, config)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
