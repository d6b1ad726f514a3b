"""Family knowledge without processes: each feature the parity tests rely on matters, each family gets the
tensor-parallel plan it should, and ``ndparallel validate`` refuses what a family cannot do in one line."""

from __future__ import annotations

import pytest
import torch
import yaml
from support.scenarios import make_batches, make_model

import ndparallel as ndp
from ndparallel.cli import main
from ndparallel.models.decoder import decoder_parts

# (family, a config change that removes one feature). The parity tests (multirank/test_families.py) compare
# at 1e-5; each change below moves the first loss by far more, so a layout that dropped the feature (a
# soft cap skipped on a vocabulary slice, a multiplier lost, a sliding window ignored under CP) would fail.
FEATURES = [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"layer_types": ["full_attention", "full_attention"]}),
    ("gemma3", {"layer_types": ["full_attention", "full_attention"]}),
    ("phi3", {"sliding_window": None}),
    ("granite", {"embedding_multiplier": 1.0}),
    ("granite", {"residual_multiplier": 1.0}),
    ("granite", {"attention_multiplier": 8**-0.5}),
    ("granite", {"logits_scaling": 1.0}),
    ("cohere", {"logit_scale": 1.0}),
]


@torch.no_grad()
def _first_loss(model, mb) -> float:
    labels = ndp.shift_labels(mb["input_ids"], mb["position_ids"])
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("family, change", FEATURES, ids=[f"{f}-{next(iter(c))}" for f, c in FEATURES])
def test_family_feature_moves_the_loss(family, change):
    mb = make_batches(steps=1, micro=1, rows=4, seq=32, packed=True, seed=11)[0][0]
    with_feature = make_model(family)
    without = make_model(family, **change)
    without.load_state_dict(with_feature.state_dict())
    a, b = _first_loss(with_feature, mb), _first_loss(without, mb)
    assert abs(a - b) / a > 1e-3, f"{change} changes the loss by only {abs(a - b) / a:.1e}"


# (family, paths inside a layer -> our TP style, as models/families.py decides)
PLANS = [
    ("gemma3", {"self_attn.q_proj": "colwise", "self_attn.q_norm": "qk_norm", "self_attn.o_proj": "rowwise"}),
    # fused projections sliced by the global head count: split matmul, gathered output
    (
        "phi3",
        {
            "self_attn.qkv_proj": "colwise_gather",
            "self_attn.o_proj": "rowwise_split",
            "mlp.gate_up_proj": "colwise_gather",
            "mlp.down_proj": "rowwise_split",
        },
    ),
    # transformers gathers q/k/v for the all-head q/k norm; ours keeps heads split and reduces the norm
    ("olmo2", {"self_attn.q_proj": "colwise", "self_attn.q_norm": "feature_norm", "self_attn.o_proj": "rowwise"}),
    # per-head LayerNorm weights (heads, head_dim), missing from transformers' plan
    ("cohere", {"self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm", "mlp.gate_proj": "colwise"}),
    ("glm", {"self_attn.q_proj": "colwise", "mlp.gate_up_proj": "colwise_gather", "mlp.down_proj": "rowwise_split"}),
    # no plan in transformers: ours
    (
        "falcon",
        {
            "self_attention.query_key_value": "colwise_gather",
            "self_attention.dense": "rowwise_split",
            "mlp.dense_h_to_4h": "colwise",
            "mlp.dense_4h_to_h": "rowwise",
        },
    ),
]


@pytest.mark.parametrize("family, expected", PLANS, ids=[p[0] for p in PLANS])
def test_tensor_parallel_plan(family, expected):
    with torch.device("meta"):
        parts = decoder_parts(make_model(family))
    for path, style in expected.items():
        assert parts.layer_plan[path] == style, (path, parts.layer_plan)


def test_model_attention_kept_where_ndparallel_cannot_reproduce_it():
    with torch.device("meta"):
        assert "attn_logit_softcapping=2.0" in decoder_parts(make_model("gemma2")).own_attention
        assert "scaled_dot_product_attention" in decoder_parts(make_model("falcon")).own_attention
        assert decoder_parts(make_model("gemma3")).own_attention is None


# (model_config_overrides, sizes, world, the one line validate prints)
REFUSALS = [
    (
        {"model_type": "gemma2"},
        {"context_parallel_size": 2},
        2,
        "cp_size=2 cannot split this model's attention: attention-logit soft-capping (attn_logit_softcapping=50.0)",
    ),
    (
        {"model_type": "falcon"},
        {"context_parallel_size": 2},
        2,
        "Falcon calls scaled_dot_product_attention itself rather than through transformers' attention interface",
    ),
    ({"model_type": "falcon", "alibi": True}, {}, 1, "Falcon with alibi=True (Falcon-RW) is not supported"),
    ({"model_type": "falcon_mamba"}, {}, 1, "'falcon_mamba' is not supported: Falcon-Mamba is a state-space"),
    ({"model_type": "falcon_h1"}, {}, 1, "'falcon_h1' is not supported: Falcon-H1 runs Mamba-2 state-space mixers"),
    ({"model_type": "gemma3"}, {}, 1, "this Gemma 3 config is the multimodal model"),
    (
        {"model_type": "llama", "vocab_size": 5},
        {"tensor_parallel_size": 4},
        4,
        "tp_size=4 leaves the last tensor-parallel rank no vocabulary rows (vocab_size=5)",
    ),
]


@pytest.mark.parametrize("overrides, sizes, world, expected", REFUSALS, ids=[r[3][:40] for r in REFUSALS])
def test_validate_refuses_what_a_family_cannot_do(tmp_path, capsys, overrides, sizes, world, expected):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"model_config_overrides": overrides, "datasets": [{"path": str(data)}], "dp_shard_size": 1, **sizes}
        )
    )
    assert main(["validate", str(cfg), "--world-size", str(world)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err  # (a toy vocabulary may also be smaller than the default tokenizer: reported too)


def test_validate_accepts_a_vocabulary_tp_does_not_divide(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model_shape": "tiny",
                "model_config_overrides": {"vocab_size": 49155},
                "datasets": [{"path": str(data)}],
                "dp_shard_size": 1,
                "tensor_parallel_size": 2,
            }
        )
    )
    assert main(["validate", str(cfg), "--world-size", "2"]) == 0, capsys.readouterr().err
