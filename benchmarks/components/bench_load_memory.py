"""Peak host and device memory per rank while loading a Hugging Face checkpoint straight into a layout.

    python benchmarks/components/bench_load_memory.py make /tmp/llama8b-2l --layers 2      # 8B-shaped, 2 layers, bf16
    torchrun --nproc-per-node 8 benchmarks/components/bench_load_memory.py load /tmp/llama8b-2l --dp-shard 4 --tp 2
    torchrun --nproc-per-node 2 benchmarks/components/bench_load_memory.py load /tmp/llama8b-2l --dp-shard 2
    --whole-tensors

``make`` writes a checkpoint with Llama 3 8B's dimensions (hidden 4096, MLP 14336, vocab 128256, untied)
and ``--layers`` decoder layers (32 for the real size; fewer keep disk and time small: the largest
tensors, the 128256 x 4096 embedding and head, are the same), random bf16 weights, one file per layer.
``load`` builds the model on the meta device, parallelizes it and fills it with ``materialize`` (each
rank reads only its slice of each tensor, casts it on the host, copies it to its device);
``--whole-tensors`` instead reads each tensor whole and slices it on the device (the previous loader,
for comparison). Reported per rank: the host's resident set before loading and its peak during loading
(sampled every 2 ms), and on GPUs the peak allocated device memory during loading beside what the
shards keep.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

import ndparallel as ndp
from ndparallel.weights.materialize import materialize, restore_buffers
from ndparallel.weights.meta import meta_model, model_config_for
from ndparallel.weights.safetensors_reader import SafetensorsReader
from ndparallel.weights.shards import copy_shard

SHAPE = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
    rope_theta=500000.0,
)


def make(directory: Path, layers: int) -> None:
    from safetensors.torch import save_file

    config = model_config_for(base_model=None, model_shape=None, overrides={**SHAPE, "num_hidden_layers": layers})
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    g = torch.Generator().manual_seed(0)
    for name, param in meta_model(config).named_parameters():
        file = f"layer-{name.split('.')[2]}.safetensors" if ".layers." in name else f"{name.split('.')[-2]}.safetensors"
        groups.setdefault(file, {})[name] = (torch.randn(param.shape, generator=g) * 0.02).to(torch.bfloat16)
    weight_map = {}
    for file, tensors in groups.items():
        save_file(tensors, str(directory / file))
        weight_map.update({name: file for name in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    print(f"wrote {directory}: {sum(f.stat().st_size for f in directory.glob('*.safetensors')) / 2**30:.2f} GiB")


class PeakRSS:
    """Samples this process's resident set size in a thread (glibc frees late: the peak is what counts)."""

    def __enter__(self):
        self.proc, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def _load_whole_tensors(model, directory: str, device: torch.device) -> None:
    """The previous loader: each tensor read whole, moved to the device in the parameter's dtype, sliced."""
    from safetensors import safe_open

    from ndparallel import _compat

    model.to_empty(device=device)
    files = SafetensorsReader(directory).files
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = _compat.canonical_name(name)
            with safe_open(files[key], framework="pt") as f:
                copy_shard(param, f.get_tensor(key))
        restore_buffers(model, device)


def load(directory: Path, args) -> None:
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=args.dp_shard, tp_size=args.tp))
    model = meta_model(model_config_for(base_model=str(directory), model_shape=None, overrides={}))
    ndp.parallelize(model, topo, options=ndp.ParallelOptions())
    on_cuda = topo.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(topo.device)
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    with PeakRSS() as rss:
        if args.whole_tensors:
            _load_whole_tensors(model, str(directory), topo.device)
        else:
            materialize(model, topo.device, weights_dir=str(directory), seed=0)
    seconds = time.perf_counter() - start
    kept = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    row = {
        "rank": topo.rank,
        "host_rss_before_gib": before / 2**30,
        "host_peak_during_load_gib": rss.peak / 2**30,
        "host_peak_minus_before_gib": (rss.peak - before) / 2**30,
        "shards_kept_gib": kept / 2**30,
        "seconds": seconds,
    }
    if on_cuda:
        row["device_peak_gib"] = torch.cuda.max_memory_allocated(topo.device) / 2**30
    rows = [None] * topo.world_size
    torch.distributed.all_gather_object(rows, row)
    if topo.is_main:
        print(
            f"{'whole tensors' if args.whole_tensors else 'slices only'}; layout {topo.layout.shape} "
            f"(dp_replicate, dp_shard, cp, tp); {directory}"
        )
        for r in rows:
            print("  " + " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        print(json.dumps(rows))
    torch.distributed.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["make", "load"])
    p.add_argument("directory", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dp-shard", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--whole-tensors", action="store_true")
    args = p.parse_args()
    if args.action == "make":
        make(args.directory, args.layers)
    else:
        load(args.directory, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
