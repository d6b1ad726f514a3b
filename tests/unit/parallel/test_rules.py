"""Every rule of what composes has one home (``parallel/rules.py``): the config refuses a combination with the
same line ``parallelize`` would raise, one row per rule. No processes."""

import pytest
import torch
from transformers import LlamaConfig

import ndparallel as ndp
from ndparallel.adapters.lora import LoraSpec
from ndparallel.adapters.qat import QatSpec
from ndparallel.config.reading import config_errors
from ndparallel.mesh.layout import Layout
from ndparallel.parallel.rules import check_model, option_problems
from ndparallel.weights.meta import meta_model

BASE = {"model_shape": "tiny", "datasets": [{"path": "data.jsonl", "type": "completion"}]}
LORA = {"adapter": "lora", "lora_target_linear": True}
NO_OPTIONS = dict(lora=False, quantized_base=None, fp8=False, qat=None, unfrozen=False, tp=1)

RULES = [
    # config settings, the same as options, the line both give
    ({"load_in_4bit": True}, dict(quantized_base="nf4"), "load_in_4bit: true needs adapter: qlora"),
    ({"load_in_8bit": True}, dict(quantized_base="int8"), "load_in_8bit: true needs adapter: lora"),
    (
        {**LORA, "adapter": "qlora", "load_in_4bit": True, "tensor_parallel_size": 2},
        dict(lora=True, quantized_base="nf4", tp=2),
        "load_in_4bit with tensor_parallel_size > 1 is not supported",
    ),
    (
        {**LORA, "load_in_8bit": True, "fp8": True},
        dict(lora=True, quantized_base="int8", fp8=True),
        "load_in_8bit with fp8",
    ),
    ({**LORA, "fp8": True}, dict(lora=True, fp8=True), "fp8: true with adapter: lora is not supported"),
    (
        {**LORA, "unfrozen_parameters": ["^lm_head.weight$"]},
        dict(lora=True, unfrozen=True),
        "unfrozen_parameters with adapter: lora is not supported",
    ),
    (
        {"qat": {"weight_dtype": "int4"}, "tensor_parallel_size": 2},
        dict(qat=QatSpec(weight_dtype="int4"), tp=2),
        "qat with tensor_parallel_size > 1 is not supported",
    ),
    ({**LORA, "qat": {"weight_dtype": "int4"}}, dict(lora=True, qat=QatSpec(weight_dtype="int4")), "qat with adapter"),
]


@pytest.mark.parametrize("settings, options, line", RULES)
def test_the_config_and_the_options_give_the_same_line(settings, options, line):
    (first, *_) = list(option_problems(**{**NO_OPTIONS, **options}))
    assert first.startswith(line)
    assert any(first in error for error in config_errors({**BASE, **settings})), config_errors({**BASE, **settings})


def test_what_composes_says_nothing():
    assert list(option_problems(**NO_OPTIONS)) == []
    assert list(option_problems(**{**NO_OPTIONS, "lora": True, "quantized_base": "int8", "tp": 4})) == []


def test_parallelize_raises_the_rule_before_touching_the_model():
    model = meta_model(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
    topo = ndp.Topology.build(ndp.ParallelismConfig(), device_type="cpu")  # a one-rank group in this process
    try:
        options = ndp.ParallelOptions(unfrozen_parameters=("^lm_head.weight$",))
        with pytest.raises(ndp.ConfigError, match="unfrozen_parameters with adapter: lora is not supported"):
            ndp.parallelize(model, topo, options=options, lora=LoraSpec(r=2, target_modules=["q_proj"]))
        assert all(p.device == torch.device("meta") for p in model.parameters())
    finally:  # a group left behind is inherited by the forked ranks of later tests ("initialize ... twice")
        torch.distributed.destroy_process_group()


def test_a_model_that_does_not_split_is_refused_with_every_problem():
    config = LlamaConfig(hidden_size=384, num_attention_heads=6, num_key_value_heads=3, intermediate_size=100)
    with pytest.raises(ndp.LayoutError, match=r"tp_size=4 does not divide .* attention heads.*; tp_size=4"):
        check_model(Layout(tp=4), config)
