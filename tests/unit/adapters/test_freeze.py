"""unfrozen_parameters: which weights Axolotl's patterns select (adapters/freeze.py), on meta-device models."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

from ndparallel import ConfigError
from ndparallel.adapters.freeze import apply_trainable, compile_patterns, describe_trainable, select_trainable
from ndparallel.config.reading import parse_config


def meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def llama(tied=False):
    return meta(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=12,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
        )
    )


def mixtral():
    config = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    return meta(config)


def test_patterns_match_the_start_of_names_with_literal_periods():
    (pattern,) = compile_patterns(["model.layers.1.mlp"])
    assert pattern.match("model.layers.1.mlp.up_proj.weight")
    assert not pattern.match("model.layers.1xmlp.up_proj.weight")  # a period is a period
    assert not pattern.match("x.model.layers.1.mlp")  # matched at the start, as re.match
    (escaped,) = compile_patterns([r"^lm_head\.weight$"])  # periods already escaped stay as written
    assert escaped.match("lm_head.weight") and not escaped.match("lm_head_weight")


def test_selection_is_axolotls_prefix_match():
    model = llama()
    chosen = select_trainable(model, ["^lm_head.weight$", "model.layers.1[01].self_attn"])
    layers = {name.split(".")[2] for name in chosen if name.startswith("model.layers.")}
    assert layers == {"10", "11"} and "lm_head.weight" in chosen
    assert not any("mlp" in name or "embed" in name for name in chosen)
    apply_trainable(model, chosen)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == chosen
    assert describe_trainable(model).startswith("unfrozen_parameters: 9 of 111 weight tensors train")


def test_a_tied_head_trains_with_its_embedding():
    model = llama(tied=True)
    chosen = select_trainable(model, ["^lm_head.weight$"])
    assert chosen == {"lm_head.weight", "model.embed_tokens.weight"}
    apply_trainable(model, chosen)
    assert model.model.embed_tokens.weight.requires_grad and model.lm_head.weight is model.model.embed_tokens.weight


def test_published_mixtral_names_select_the_stacked_experts_and_router():
    model = mixtral()
    # as Axolotl's Mixtral examples write them (the checkpoint's names; transformers 5 calls the block `mlp`)
    chosen = select_trainable(
        model, ["model.layers.[12].block_sparse_moe.gate", "model.layers.2.block_sparse_moe.experts"]
    )
    assert chosen == {
        "model.layers.1.mlp.gate.weight",
        "model.layers.2.mlp.gate.weight",
        "model.layers.2.mlp.experts.gate_up_proj",
        "model.layers.2.mlp.experts.down_proj",
    }
    assert "model.layers.0.mlp.experts.down_proj" in select_trainable(model, ["model.layers.0.mlp.experts.down_proj"])


def test_some_experts_of_a_stacked_tensor_is_an_error():
    with pytest.raises(
        ConfigError, match=r"some of the 8 expert weights stacked in model.layers.0.mlp.experts.gate_up"
    ):
        select_trainable(mixtral(), [r"model.layers.0.block_sparse_moe.experts.[01]\."])
    with pytest.raises(ConfigError, match="one stacked tensor trains whole"):
        select_trainable(mixtral(), ["model.layers.0.block_sparse_moe.experts.\\d+.w1"])  # gate without up


def test_mistakes_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"'model.layer.1' match\(es\) no weight of this model.*names look like"):
        select_trainable(llama(), ["^lm_head", "model.layer.1"])
    with pytest.raises(ConfigError, match=r"trains only the rows \[:32000\] of a tensor"):
        compile_patterns(["^model.embed_tokens.weight$[:32000]"])
    with pytest.raises(ConfigError, match="is not a regular expression"):
        compile_patterns(["model.layers.(1"])


def test_config_reading():
    base = {"model_shape": "tiny", "datasets": [{"path": "d.jsonl", "type": "completion"}]}
    assert parse_config({**base, "unfrozen_parameters": []}).unfrozen_parameters is None  # empty: nothing set
    with pytest.raises(ConfigError, match="unfrozen_parameters with adapter: lora is not supported"):
        parse_config({**base, "unfrozen_parameters": ["^lm_head"], "adapter": "lora", "lora_target_linear": True})
