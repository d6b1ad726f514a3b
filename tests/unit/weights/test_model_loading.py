"""Where loaded weights land. No processes (the layouts are in tests/multirank/test_import.py)."""

import torch
from support.scenarios import make_model

from ndparallel.weights.materialize import materialize
from ndparallel.weights.meta import meta_model, model_config_for


def test_offloaded_parameters_are_materialized_on_the_cpu(tmp_path):
    """cpu_offload: FSDP2 refuses offloaded parameters that are not on the CPU, so they must not be created
    on the training device; buffers (rotary tables) must be. The training device here is ``meta``, which
    stands in for a GPU on a CPU-only machine: whatever is not CPU is on it."""
    make_model("llama").save_pretrained(tmp_path)
    reference = make_model("llama").state_dict()
    model = meta_model(model_config_for(base_model=str(tmp_path), model_shape=None, overrides={}))
    materialize(model, torch.device("meta"), weights_dir=str(tmp_path), seed=0, offload_params=True)
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.equal(param, reference[name]), name
    buffers = dict(model.named_buffers())
    assert buffers and all(b.device.type == "meta" for b in buffers.values())
