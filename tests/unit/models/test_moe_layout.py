"""Expert parallelism in the layout, and what MoE models refuse, one line each, before any process starts."""

import json

import pytest
import torch
from support.paths import REPO
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, OlmoeConfig, Qwen3MoeConfig

from ndparallel import LayoutError, ParallelismConfig
from ndparallel.mesh.layout import Layout
from ndparallel.models.moe import moe_facts
from ndparallel.parallel.rules import model_problems


def test_ep_borrows_the_innermost_token_ranks():
    layout = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, expert_parallel_size=2).resolve(8)
    assert (layout.shape, layout.ep, layout.expert_dp_size) == ((2, 2, 1, 2), 2, 2)
    ep_groups, dp_groups = layout.expert_groups()
    assert ep_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp neighbours exchange tokens
    assert dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]  # same experts within a replica
    text = layout.describe()
    assert "expert parallel 2" in text and "ep (tokens all-to-all): [0,1] [2,3]" in text


def test_ep_over_all_token_ranks():
    layout = ParallelismConfig(dp_shard_size=2, cp_size=2, expert_parallel_size=4).resolve(4)
    assert layout.expert_groups() == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])


@pytest.mark.parametrize(
    "sizes, world, message",
    [
        (
            dict(dp_shard_size=4, expert_parallel_size=3),
            4,
            "expert_parallel_size=3 must divide dp_shard_size x cp_size x tp_size = 4 x 1 x 1 = 4",
        ),
        (dict(dp_replicate_size=2, dp_shard_size=1, expert_parallel_size=2), 2, "must divide dp_shard_size x cp_size"),
        (dict(expert_parallel_size=0), 8, "expert_parallel_size=0 must be a whole number >= 1"),
    ],
)
def test_bad_ep_sizes(sizes, world, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelismConfig(**sizes).resolve(world)


def _qwen3_moe(**kw):
    return Qwen3MoeConfig(
        **{
            **dict(
                hidden_size=64,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=8,
                num_experts=6,
                num_experts_per_tok=2,
                intermediate_size=90,
            ),
            **kw,
        }
    )


PROBLEMS = [
    # experts must split evenly over ep
    (
        _qwen3_moe(),
        Layout(dp_shard=4, ep=4),
        "expert_parallel_size=4 does not divide the model's 6 experts; choose expert_parallel_size from [1, 2, 3, 6]",
    ),
    # ep on a dense model
    (
        LlamaConfig(hidden_size=64, num_attention_heads=8),
        Layout(dp_shard=2, ep=2),
        "expert_parallel_size=2 needs a mixture-of-experts model, but llama has no experts",
    ),
    # latent attention: no tensor-parallel plan (transformers < 5.25), or one with a style ndparallel does not
    # implement (5.25: 'mla_kv_a_proj'); either way a line naming tp_size and the attention
    (
        DeepseekV3Config(n_routed_experts=8),
        Layout(tp=2),
        "tp_size=2: deepseek_v3's attention",
    ),
    # gathered-output attention styles are not implemented
    (OlmoeConfig(num_experts=8), Layout(tp=2), "olmoe's attention plan uses ['colwise_gather_output', 'rowwise_split"),
]


@pytest.mark.parametrize("config, layout, message", PROBLEMS)
def test_moe_problems_name_the_setting(config, layout, message):
    assert any(message in p for p in model_problems(layout, config)), list(model_problems(layout, config))


def test_moe_models_split_attention_only():
    # an MLP size tp does not divide is fine: MoE blocks are not split by tp (and a tp plan entry for the experts
    # no longer refuses the model, whatever tp is)
    assert list(model_problems(Layout(tp=2), _qwen3_moe(intermediate_size=91))) == []
    assert (
        list(
            model_problems(
                Layout(tp=2), GptOssConfig(num_local_experts=4, num_attention_heads=8, num_key_value_heads=4)
            )
        )
        == []
    )


def test_router_loss_follows_the_config():
    assert moe_facts(_qwen3_moe(output_router_logits=True, router_aux_loss_coef=0.01)).aux_loss_coef == 0.01
    assert moe_facts(_qwen3_moe(output_router_logits=False)).aux_loss_coef == 0.0  # as transformers: no loss
    assert moe_facts(DeepseekV3Config(n_routed_experts=8, output_router_logits=True)).aux_loss_coef == 0.0
    assert moe_facts(LlamaConfig()) is None
    assert moe_facts(_qwen3_moe(num_experts=0)) is None  # a dense Qwen3-MoE config


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "qwen2_moe", "deepseek_v3"])
def test_moe_shape_counts_the_built_model(family):
    """The planner's counts equal the parameters transformers builds (experts, shared experts, routers)."""
    from support.moe_scenarios import make_moe_model

    from ndparallel.models.moe import moe_blocks, moe_shape

    model = make_moe_model(family)
    shape = moe_shape(model.config)
    blocks = moe_blocks(model.model.layers)
    assert shape.moe_layers == len(blocks)
    for block in blocks:
        experts = sum(p.numel() for p in block.experts.parameters())
        router = sum(p.numel() for p in block.router.parameters())
        rest = sum(p.numel() for p in block.block.parameters()) - experts - router
        assert (experts, router, rest) == (
            shape.num_experts * shape.expert_params,
            shape.router_params,
            shape.shared_params,
        )


def test_hub_expert_tensors_are_stacked_and_quantized_ones_refused():
    from ndparallel.errors import ModelError
    from ndparallel.models.moe_weights import hub_expert_tensor

    store = {
        f"m.layers.0.block_sparse_moe.experts.{e}.{w}.weight": torch.full((2, 3), 10.0 * e + i)
        for e in range(2)
        for i, w in enumerate(("w1", "w3", "w2"))
    }
    store["m.layers.0.block_sparse_moe.gate.weight"] = torch.ones(2, 3)
    gate_up = hub_expert_tensor("m.layers.0.mlp.experts.gate_up_proj", store.__contains__, store.__getitem__)
    assert gate_up.shape == (2, 4, 3) and gate_up[1, :2].eq(10).all() and gate_up[1, 2:].eq(11).all()  # [w1; w3]
    assert hub_expert_tensor("m.layers.0.mlp.experts.down_proj", store.__contains__, store.__getitem__)[1].eq(12).all()
    assert hub_expert_tensor("m.layers.0.mlp.gate.weight", store.__contains__, store.__getitem__).eq(1).all()
    assert hub_expert_tensor("m.layers.0.self_attn.q_proj.weight", store.__contains__, store.__getitem__) is None
    quantized = {"m.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(1)}
    with pytest.raises(ModelError, match="Mxfp4Config\\(dequantize=True\\)"):
        hub_expert_tensor("m.layers.0.mlp.experts.gate_up_proj", quantized.__contains__, quantized.__getitem__)


def test_moe_example_validates(tmp_path, capsys):
    """examples/qwen3-moe-expert-parallel.yaml against Qwen3-30B-A3B's config (no weights needed)."""

    from ndparallel.cli import main

    model = tmp_path / "qwen3-30b-a3b"
    Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        max_position_embeddings=40960,
    ).save_pretrained(model)
    from ndparallel.data.load_tokenizer import byte_tokenizer
    from ndparallel.data.templates import template_source

    tokenizer = byte_tokenizer()  # the repository's tokenizer carries Qwen3's chat template
    tokenizer.chat_template = template_source("qwen3", None, None)
    tokenizer.save_pretrained(model)
    data = tmp_path / "data.jsonl"
    chat = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    data.write_text(json.dumps({"messages": chat}) + "\n")  # the example's chat_template dataset (validate samples it)
    example = REPO / "examples" / "qwen3-moe-expert-parallel.yaml"
    code = main(
        [
            "validate",
            str(example),
            "--world-size",
            "8",
            "--set",
            f"base_model={model}",
            "--set",
            f"datasets.0.path={data}",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "expert parallel 8" in out.out and "ep (tokens all-to-all): [0,1,2,3,4,5,6,7]" in out.out
