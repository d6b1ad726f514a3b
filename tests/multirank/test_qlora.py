"""QLoRA (load_in_4bit + adapter: qlora): 4-bit NF4 base weights sharded by FSDP2, on one rank and on
dp_replicate 2 x dp_shard 2 x cp 2, against the same run written with transformers + torch + peft on the
weights' 4-bit values; resumed on another layout; refused clearly where it cannot run."""

from __future__ import annotations

import pytest
import torch
from support.scenarios import make_model, max_rel_diff
from support.trainer_helpers import (
    SMALL_LORA,
    assert_runs_match,
    layout_config,
    losses,
    plain_reference,
    resume_at_step_2,
    tiny_config,
    train_one_and_many,
)

from ndparallel.config.reading import parse_config
from ndparallel.errors import ConfigError
from ndparallel.quantized.linears import quantize_linears

# hidden 256, 8 heads of 32, one key/value head: q/o (4 scale groups of 64 x 256 values), gate/up/down (8)
# are 4-bit; k/v (32 x 256: half a group) stay fp32, on every layout
SHAPE = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=1)
QLORA = {"adapter": "qlora", "load_in_4bit": True, **SMALL_LORA}


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qlora")
    model = make_model("llama", seed=5, num_hidden_layers=2, **SHAPE)
    config, parallel_config, single, parallel = train_one_and_many(
        tmp, model, layout=dict(r=2, s=2, c=2, method="ring"), **QLORA
    )
    return tmp, config, parallel_config, single, parallel


@pytest.mark.slow
def test_qlora_matches_plain_peft_on_four_bit_weights(qlora_runs, parity_record):
    _, _, parallel_config, single, parallel = qlora_runs
    ref = plain_reference(layout_config(parallel_config))  # world 1: one data rank reads the global batch
    assert_runs_match([single, parallel], ref, parity_record)
    assert parallel[-1]["loss"] < parallel[0]["loss"]
    # the comparison can tell: the same run on the unquantized weights ends elsewhere
    unquantized = plain_reference({**layout_config(parallel_config), "adapter": "lora", "load_in_4bit": False})
    assert max_rel_diff(unquantized["losses"], ref["losses"]) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"s": 4}, {"r": 2}], ids=["dp_shard_4", "dp_replicate_2"])
def test_qlora_checkpoint_resumes_on_another_layout(qlora_runs, layout):
    """The checkpoint holds adapters and optimizer state only; the 4-bit base is rebuilt from base_model.
    dp_replicate 2 alone leaves nothing to shard: FSDP leaves the 4-bit weights whole on each rank."""
    tmp, config, parallel_config, _, parallel = qlora_runs
    resumed = resume_at_step_2(tmp, config, layout)
    assert [r["step"] for r in resumed] == [3, 4]
    assert max_rel_diff(losses(resumed), losses(parallel)[2:]) < 1e-5


def test_the_report_names_four_bit_and_kept_weights():
    report = quantize_linears(_meta_layers(), "nf4", shards=2, dtype=torch.float32, prefix="model.layers")
    line = report.line()
    assert line.startswith("load_in_4bit: 10 of 14 linear weights of the decoder blocks in NF4"), line
    assert "unquantized: 4 (not whole scale groups of 16384 values)" in line and "97.0% of their values" in line


def test_a_layout_that_would_cut_a_scale_group_is_refused_naming_the_weight():
    with pytest.raises(ConfigError, match=r"layers.0.self_attn.q_proj.weight \(\(256, 256\): 4 scale group"):
        quantize_linears(_meta_layers(), "nf4", shards=8, dtype=torch.float32, prefix="model.layers")


def _meta_layers():
    from transformers import LlamaConfig

    from ndparallel.weights.meta import meta_model

    return meta_model(LlamaConfig(num_hidden_layers=2, **SHAPE)).model.layers


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"tensor_parallel_size": 2}, "load_in_4bit with tensor_parallel_size > 1 is not supported"),
        ({"adapter": None, "lora_target_linear": False}, "load_in_4bit: true needs adapter: qlora"),
        ({"load_in_4bit": False}, "adapter: qlora needs load_in_4bit: true"),
        ({"export_hf": True}, "export_hf with load_in_4bit is not supported"),
    ],
)
def test_unsupported_combinations_are_one_line_errors(tmp_path, overrides, message):
    config = {**tiny_config(tmp_path), **QLORA, **overrides}
    with pytest.raises((ConfigError, ValueError)) as info:
        parse_config(config)
    assert message in str(info.value)
