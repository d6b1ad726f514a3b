"""ndparallel: one config, four parallel axes (dp_replicate x dp_shard x cp x tp) for transformers decoders.

Library use (the loop you would write, done right)::

    topo = ndparallel.Topology.build(ndparallel.ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2))
    model = ndparallel.parallelize(model, topo, options=ndparallel.ParallelOptions())
    opt = ndparallel.build_optimizer(model, lr=3e-4, weight_decay=0.1)
    batch = ndparallel.prepare_batch(global_ids, topo)              # this rank's rows and tokens
    n = ndparallel.count_tokens(batch.num_tokens, topo)              # global target tokens
    loss, outputs = ndparallel.model_loss(model, batch.model_inputs(), batch.labels, num_tokens=n, topology=topo)
    loss.backward(); ndparallel.clip_grad_norm_(model.parameters(), 1.0, optimizer=opt); opt.step(); opt.zero_grad()
    ckpt = ndparallel.Checkpointer("out/checkpoints", async_save=True)      # resume on any layout:
    ckpt.save(step, {"model": model, "optimizer": opt}); ckpt.load({"model": model, "optimizer": opt})
"""

from ndparallel.adapters.lora import LoraSpec
from ndparallel.checkpoint.checkpointer import Checkpointer
from ndparallel.checkpoint.states import ModelState, OptimizerState
from ndparallel.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    LayoutError,
    ModelError,
    NdParallelError,
    NumericsError,
)
from ndparallel.mesh.layout import Layout
from ndparallel.mesh.parallelism_config import (
    ParallelismConfig,
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from ndparallel.mesh.topology import Topology, init_distributed
from ndparallel.optim.build import build_optimizer
from ndparallel.optim.clipping import clip_grad_norm_
from ndparallel.parallel.apply import parallelize
from ndparallel.parallel.float8 import Fp8Spec
from ndparallel.parallel.options import ParallelOptions
from ndparallel.parallel.sequence import cp_gather, cp_shard
from ndparallel.step.batching import IGNORE_INDEX, Batch, prepare_batch, shift_labels
from ndparallel.step.gradient_sync import set_gradient_sync
from ndparallel.step.router_loss import router_aux_loss
from ndparallel.step.token_loss import count_tokens, gather_logits, model_loss, reduce_loss, token_loss
from ndparallel.weights.pretrained import load_pretrained, save_pretrained

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
    "model_loss",
    "reduce_loss",
    "set_gradient_sync",
    "token_loss",
    "Topology",
    "init_distributed",
    "Checkpointer",
    "ModelState",
    "OptimizerState",
]
