"""LoRA on 8-bit base weights (load_in_8bit + adapter: lora): int8 codes with one scale per row, on one rank
and on dp_shard 2 x cp 2 x tp 2 (ring), against the same run written with transformers + torch + peft on
the weights' int8 values; resumed on other layouts; the layer itself against a plain dequantized linear."""

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
from ndparallel.quantized import int8

EIGHT_BIT = {"adapter": "lora", "load_in_8bit": True, **SMALL_LORA}


@pytest.fixture(scope="module")
def eight_bit_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora8")
    # qwen2: attention biases on q/k/v (the frozen bias path); 4 key/value heads (tp 2 divides them)
    config, parallel_config, single, parallel = train_one_and_many(
        tmp, make_model("qwen2", seed=5, vocab_size=320), layout=dict(s=2, c=2, t=2, method="ring"), **EIGHT_BIT
    )
    return tmp, config, parallel_config, single, parallel


@pytest.mark.slow
def test_eight_bit_lora_matches_plain_peft_on_int8_weights(eight_bit_runs, parity_record):
    _, _, parallel_config, single, parallel = eight_bit_runs
    ref = plain_reference(layout_config(parallel_config))  # world 1: one data rank reads the global batch
    assert_runs_match([single, parallel], ref, parity_record)
    assert parallel[-1]["loss"] < parallel[0]["loss"]
    # the comparison can tell: the same run on the unquantized weights ends elsewhere
    unquantized = plain_reference({**layout_config(parallel_config), "load_in_8bit": False})
    assert max_rel_diff(unquantized["losses"], ref["losses"]) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"s": 4}, {"r": 2, "t": 2}], ids=["dp_shard_4", "dp_replicate_2_tp_2"])
def test_eight_bit_checkpoint_resumes_on_another_layout(eight_bit_runs, layout):
    """The checkpoint holds adapters and optimizer state only; the int8 base is rebuilt from base_model."""
    tmp, config, _, _, parallel = eight_bit_runs
    resumed = resume_at_step_2(tmp, config, layout)
    assert [r["step"] for r in resumed] == [3, 4]
    assert max_rel_diff(losses(resumed), losses(parallel)[2:]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_a_dequantized_linear_with_no_weight_gradient(dtype):
    torch.manual_seed(0)
    dense = torch.nn.Linear(48, 24, bias=True)
    codes, scale = int8.quantize_rowwise(dense.weight, scale_dtype=dtype)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    quantized = torch.nn.Linear(48, 24, bias=True)
    quantized.load_state_dict(dense.state_dict())
    int8.to_int8(quantized, scale_dtype=dtype)
    quantized.bias.requires_grad_(False)
    assert isinstance(quantized, int8.Int8Linear) and torch.equal(quantized.weight, codes)
    assert quantized.weight.dtype == torch.int8
    # the plain way: the weight's int8 value in the compute dtype
    plain = (codes.to(dtype) * scale.to(dtype)[:, None]).clone().requires_grad_(False)
    x = torch.randn(3, 5, 48, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = quantized.to(dtype)(x)  # float parameters (scales, bias) in the compute dtype, as under FSDP; codes stay int8
    y_ref = torch.nn.functional.linear(x_ref, plain, dense.bias.detach().to(dtype))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    assert quantized.weight.grad is None and quantized.weight_scale.grad is None
    # and it is close to the unquantized layer (one part in ~2 x 127 of each row's largest value)
    err = (plain.float() - dense.weight.detach()).abs().max(dim=1).values / dense.weight.detach().abs().max(
        dim=1
    ).values
    assert float(err.max()) <= (1 / 254 if dtype == torch.float32 else 1 / 254 + 2**-8)


def test_a_row_of_zeros_quantizes_to_zeros():
    codes, scale = int8.quantize_rowwise(torch.zeros(2, 8), scale_dtype=torch.float32)
    assert not codes.any() and torch.isfinite(scale).all()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"adapter": None, "lora_target_linear": False}, "load_in_8bit: true needs adapter: lora"),
        ({"export_hf": True}, "export_hf with load_in_8bit is not supported"),
        ({"load_in_4bit": True, "adapter": "qlora"}, "load_in_4bit and load_in_8bit are both true"),
    ],
)
def test_unsupported_combinations_are_one_line_errors(tmp_path, overrides, message):
    config = {**tiny_config(tmp_path), **EIGHT_BIT, **overrides}
    with pytest.raises(ValueError) as info:
        parse_config(config)
    assert message in str(info.value)
