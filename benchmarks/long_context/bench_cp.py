"""Context parallelism: per-rank activation memory and step time against sequence length, cp = 1, 2, 4.

    python benchmarks/long_context/bench_cp.py                      # CPU: launches torchrun for each cp, prints a table
    python benchmarks/long_context/bench_cp.py --seqs 1024,4096 --cps 1,2,4 --methods ring,allgather,alltoall

Activation memory is counted exactly, device-independently: the bytes of every distinct storage autograd
saves for backward during one forward (``torch.autograd.graph.saved_tensors_hooks``), per rank, split into
the whole model and the attention calls alone. Step time is one forward + backward of a small Llama
(median of the timed steps). On a GPU the same script reports the same counts plus wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def _saved_bytes(fn):
    """Run ``fn`` and return (result, bytes of distinct storages saved for backward)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def worker(args) -> None:
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ndparallel as ndp

    cp = int(os.environ.get("WORLD_SIZE", "1"))
    results = []
    for method in args.methods.split(","):
        topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1, cp_size=cp, cp_comm_strategy=method))
        for seq in (int(s) for s in args.seqs.split(",")):
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=256,
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=args.layers,
                num_attention_heads=8,
                num_key_value_heads=4,
                max_position_embeddings=seq,
            )
            model = AutoModelForCausalLM.from_config(config)
            ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
            ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
            attention_bytes = 0
            name = model.config._attn_implementation
            real = ALL_ATTENTION_FUNCTIONS[name]

            def counting(*a, **k):  # the attention call alone: what it saves for backward
                nonlocal attention_bytes
                out, n = _saved_bytes(lambda: real(*a, **k))
                attention_bytes += n
                return out

            times = []
            for step in range(args.steps):
                batch = ndp.prepare_batch(ids, topo)
                if topo.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if step == 0:  # count once, with the counting attention registered
                    AttentionInterface.register(name, counting)
                    logits, total = _saved_bytes(lambda: model(**batch.model_inputs()).logits)
                    AttentionInterface.register(name, real)
                else:
                    logits = model(**batch.model_inputs()).logits
                logits.float().sum().backward()
                if topo.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            # The attention's own saves are counted by the inner hook only: add them to the total.
            results.append(
                {
                    "cp": cp,
                    "method": method if cp > 1 else "-",
                    "seq": seq,
                    "activation_mib": (total + attention_bytes) / 2**20,
                    "attention_mib": attention_bytes / 2**20,
                    "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
                }
            )
            model = None  # free it before the next length
        if cp == 1:
            break  # one method is enough without cp
    if topo.is_main:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    torch.distributed.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="512,1024,2048,4096")
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--methods", default="allgather,ring,alltoall")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    out = args.out or tempfile.mktemp(suffix=".jsonl")
    for cp in (int(c) for c in args.cps.split(",")):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={cp}",
            __file__,
            "--worker",
            "--seqs",
            args.seqs,
            "--methods",
            args.methods,
            "--hidden",
            str(args.hidden),
            "--layers",
            str(args.layers),
            "--steps",
            str(args.steps),
            "--out",
            out,
        ]
        subprocess.run(
            cmd,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    rows = [json.loads(line) for line in open(out)]
    print(
        f"{'cp':>3s} {'method':>10s} {'seq':>6s} {'activations MiB/rank':>21s} {'attention MiB/rank':>19s} "
        f"{'step s':>7s}"
    )
    for r in sorted(rows, key=lambda r: (r["seq"], r["cp"], r["method"])):
        print(
            f"{r['cp']:3d} {r['method']:>10s} {r['seq']:6d} {r['activation_mib']:21.1f} {r['attention_mib']:19.1f} "
            f"{r['step_s']:7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
