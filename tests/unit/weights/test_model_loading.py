"""Where loaded weights land. No processes (the layouts are in tests/multirank/test_import.py)."""

import torch
from support.scenarios import make_model

from ndparallel.models.decoder import decoder_parts
from ndparallel.parallel.activation_checkpoint import apply_activation_checkpointing
from ndparallel.quantized.linears import quantize_linears
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


def test_int8_codes_under_activation_checkpointing_are_the_checkpoints_weights(tmp_path):
    """A checkpoint wrapper's state_dict names drop its prefix; the loader once took every wrapped parameter
    for a persistent buffer and copied the checkpoint's float weights over the int8 codes (all zeros: an 8B
    with load_in_8bit and checkpointing trained nothing). The codes must be the plain rowwise absmax rounding
    of the checkpoint's weights, and every other parameter the checkpoint's value."""
    make_model("llama").save_pretrained(tmp_path)
    reference = make_model("llama").state_dict()
    model = meta_model(model_config_for(base_model=str(tmp_path), model_shape=None, overrides={}))
    parts = decoder_parts(model)
    quantize_linears(parts.layers, "int8", shards=1, dtype=torch.float32)
    apply_activation_checkpointing(parts, "full")
    materialize(model, torch.device("cpu"), weights_dir=str(tmp_path), seed=0)
    checked = 0
    for name, param in model.named_parameters():
        key = name.replace("_checkpoint_wrapped_module.", "")
        if param.dtype == torch.int8:
            weight = reference[key].float()
            scale = weight.abs().amax(dim=1, keepdim=True) / 127
            assert torch.equal(param, torch.round(weight / scale).to(torch.int8)), name
            checked += 1
        elif not key.endswith("weight_scale"):
            assert torch.equal(param, reference[key]), name
    assert checked == 7 * model.config.num_hidden_layers
