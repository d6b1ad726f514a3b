"""Quantization-aware training (Axolotl's qat:): torchao fake-quantized linear layers on one rank and on
dp_replicate 2 x dp_shard 2 x cp 2 (ring), against the same run written with transformers + torch + torchao's
own QAT prepare step; fake_quant_after_n_steps; refused where torchao cannot simulate the scheme."""

from __future__ import annotations

import pytest
from support.scenarios import make_model, max_rel_diff
from support.trainer_helpers import assert_runs_match, layout_config, losses, plain_reference, run_train, tiny_config

from ndparallel.config.reading import parse_config

INT8_INT4 = {"activation_dtype": "int8", "weight_dtype": "int4", "group_size": 32}
# Fake quantization rounds: a ~1e-7 difference between our document attention and the reference's masked
# SDPA moves a few values across a rounding step, so the reference agrees less closely than without QAT
# (measured, int8/int4, 4 steps: loss 7.9e-6, grad norm 7.9e-5). Our layouts against each other stay at
# ~1e-6 (measured 1.9e-7 / 1.3e-6), and the same run without QAT is 3.0e-3 away in loss.
REF_TOL = 5e-4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qat")
    # tied embeddings: the fake-quantized head must keep sharing the embedding's weight
    make_model("llama", seed=7, vocab_size=320, tied=True).save_pretrained(tmp / "base")
    config = tiny_config(tmp, base_model=str(tmp / "base"), model_shape=None, model_config_overrides={}, max_steps=4)
    return tmp, config


@pytest.mark.slow
def test_qat_trains_like_plain_torchao_qat_on_every_layout(base, parity_record):
    tmp, config = base
    qat = {**config, "qat": INT8_INT4}
    single = run_train(1, {**qat, "output_dir": str(tmp / "single")})
    parallel_config = {**layout_config(qat, r=2, s=2, c=2, method="ring"), "output_dir": str(tmp / "par")}
    parallel = run_train(8, parallel_config)
    ref = plain_reference(layout_config(parallel_config))
    assert_runs_match([single], ref, parity_record, tol=REF_TOL)
    assert_runs_match(
        [parallel], {"losses": losses(single), "grad_norms": [r["grad_norm"] for r in single]}, parity_record
    )
    # the comparison can tell: without fake quantization the run ends elsewhere
    assert max_rel_diff(plain_reference(config)["losses"], ref["losses"]) > 4 * REF_TOL


@pytest.mark.slow
def test_fake_quantization_starts_after_n_steps(base, parity_record):
    tmp, config = base
    late = {**config, "qat": {**INT8_INT4, "fake_quant_after_n_steps": 2}, "output_dir": str(tmp / "late")}
    records = run_train(2, {**layout_config(late, s=2), "output_dir": str(tmp / "late")})
    ref = plain_reference(late)
    assert_runs_match([records], ref, parity_record, tol=REF_TOL)
    plain = plain_reference(config)["losses"]
    assert max_rel_diff(losses(records)[:2], plain[:2]) < 1e-5  # steps 1-2 train the plain model
    assert max_rel_diff(losses(records)[2:], plain[2:]) > 1e-4


@pytest.mark.slow
def test_mxfp4_qat_matches_torchao_on_one_rank(base, parity_record):
    tmp, config = base
    mx = {**config, "qat": {"activation_dtype": "mxfp4", "weight_dtype": "mxfp4"}, "max_steps": 2}
    records = run_train(1, {**mx, "output_dir": str(tmp / "mx")})
    assert_runs_match([records], plain_reference(mx), parity_record, tol=REF_TOL)


@pytest.mark.parametrize(
    "qat, extra, message",
    [
        ({"activation_dtype": "nvfp4", "weight_dtype": "nvfp4", "group_size": 16}, {}, "needs a Blackwell GPU"),
        ({"activation_dtype": "fp8", "weight_dtype": "fp8"}, {}, "rounds the gradients to float8"),
        ({"weight_dtype": "int8"}, {}, "is not a torchao QAT scheme"),
        (INT8_INT4, {"tensor_parallel_size": 2}, "qat with tensor_parallel_size > 1 is not supported"),
        (INT8_INT4, {"adapter": "lora", "lora_target_linear": True}, "QAT trains the full weights"),
        ({**INT8_INT4, "group_size": 48}, {}, None),  # valid config; refused when the model is built (below)
    ],
)
def test_unsupported_schemes_are_one_line_errors(tmp_path, qat, extra, message):
    config = {**tiny_config(tmp_path), "qat": qat, **extra}
    if message is None:
        parse_config(config)
        return
    with pytest.raises(ValueError, match=message):
        parse_config(config)


def test_a_group_size_that_does_not_divide_a_layer_names_it():
    from ndparallel.adapters.qat import QatSpec, apply_qat
    from ndparallel.errors import ConfigError

    with pytest.raises(ConfigError, match="has 64 input features, not a multiple of group_size 48"):
        apply_qat(make_model("llama", vocab_size=320), QatSpec("int4", "int8", group_size=48))
