"""Pretrained weights from a local Hugging Face directory load into any layout (meta-device build, each rank
reads only its slices): the parallel model's logits equal transformers' own model on the same inputs."""

from __future__ import annotations

import pytest
import torch
from support.scenarios import make_model, world_size
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks
from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for

SEQ = 32


def _probe_ids():
    return torch.randint(1, 256, (4, SEQ), generator=torch.Generator().manual_seed(5))


def _parallel_logits(weights_dir: str, layout: dict):
    topo = ndp.Topology.build(ndp.ParallelismConfig(**layout))
    config = model_config_for(base_model=weights_dir, model_shape=None, overrides={})
    model = meta_model(config)
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
    materialize(model, topo.device, weights_dir=weights_dir, seed=0)
    batch = ndp.prepare_batch(_probe_ids(), topo)
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
    full = ndp.gather_logits(logits, topo)
    return full if topo.batch_rank == 0 else None


@pytest.mark.parametrize(
    "family, tied, layout, shard",
    [
        ("llama", False, dict(dp_shard_size=2, tp_size=2), "200KB"),
        ("qwen3", True, dict(dp_shard_size=1, cp_size=2, tp_size=2, cp_comm_strategy="ring"), None),
        ("mistral", False, dict(dp_replicate_size=2, dp_shard_size=2), "100KB"),
    ],
)
def test_hf_weights_load_into_layout(tmp_path, family, tied, layout, shard):
    source = make_model(family, tied=tied, seed=9)
    source.save_pretrained(tmp_path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = reference(input_ids=_probe_ids()).logits
    got = run_ranks(world_size(layout), _parallel_logits, str(tmp_path), layout)[0]
    rows = got.shape[0]
    diff = float((got - want[:rows]).abs().max() / want.abs().max())
    assert diff < 1e-5, f"logits differ by {diff:.2e}"
