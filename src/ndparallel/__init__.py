"""ndparallel: one config, four parallel axes (dp_replicate x dp_shard x cp x tp) for transformers decoders.

Library use (the loop you would write, done right)::

    topo = ndparallel.Topology.build(ndparallel.ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2))
    model = ndparallel.parallelize(model, topo, options=ndparallel.ParallelOptions())
    opt = ndparallel.build_optimizer(model, lr=3e-4, weight_decay=0.1)
    batch = ndparallel.prepare_batch(global_ids, topo)              # this rank's rows and tokens
    n = ndparallel.count_tokens(batch.num_tokens, topo)              # global target tokens
    loss = ndparallel.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=n, topology=topo)
    loss.backward(); ndparallel.clip_grad_norm_(model.parameters(), 1.0, optimizer=opt); opt.step(); opt.zero_grad()
    ckpt = ndparallel.Checkpointer("out/checkpoints", async_save=True)      # resume on any layout:
    ckpt.save(step, {"model": model, "optimizer": opt}); ckpt.load({"model": model, "optimizer": opt})
"""

import importlib

from ndparallel.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LayoutError,
    ModelError,
    NdParallelError,
    NumericsError,
)

# The public names, imported on first use (PEP 562): ``import ndparallel`` and ``ndparallel train --help`` do
# not import torch.distributed's FSDP, transformers and what transformers imports (torchao, with its load
# warnings) until something needs them.
_LAZY = {
    "ndparallel.batching": ("IGNORE_INDEX", "Batch", "prepare_batch", "shift_labels"),
    "ndparallel.checkpoint": ("Checkpointer", "ModelState", "OptimizerState"),
    "ndparallel.layout": ("Layout",),
    "ndparallel.lora": ("LoraSpec",),
    "ndparallel.parallel.cp_layout": ("cp_gather", "cp_shard"),
    "ndparallel.parallel.float8": ("Fp8Spec",),
    "ndparallel.parallelism_config": ("ParallelismConfig", "TorchContextParallelConfig", "TorchTensorParallelConfig"),
    "ndparallel.parallelize": ("ParallelOptions", "parallelize"),
    "ndparallel.pretrained": ("load_pretrained", "save_pretrained"),
    "ndparallel.router_loss": ("router_aux_loss",),
    "ndparallel.step": (
        "build_optimizer",
        "clip_grad_norm_",
        "count_tokens",
        "gather_logits",
        "reduce_loss",
        "set_gradient_sync",
        "token_loss",
    ),
    "ndparallel.topology": ("Topology", "init_distributed"),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'ndparallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "prepare_batch",
    "shift_labels",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "LayoutError",
    "ModelError",
    "NdParallelError",
    "NumericsError",
    "Layout",
    "LoraSpec",
    "ParallelismConfig",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
    "cp_gather",
    "cp_shard",
    "ParallelOptions",
    "parallelize",
    "load_pretrained",
    "save_pretrained",
    "Fp8Spec",
    "router_aux_loss",
    "build_optimizer",
    "clip_grad_norm_",
    "count_tokens",
    "gather_logits",
    "reduce_loss",
    "set_gradient_sync",
    "token_loss",
    "Topology",
    "init_distributed",
    "Checkpointer",
    "ModelState",
    "OptimizerState",
]
