"""8-bit AdamW's settings as built for a model (torchao's AdamW8bit; its update is compiled for the GPU, run
eagerly here): bf16 weights (``bf16: full``) are updated with stochastic rounding, so updates far below a bf16
step still move the weights by the right amount on average."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ndparallel.errors import ConfigError
from ndparallel.optim.adamw_8bit import build_adamw_8bit

pytest.importorskip("torchao")

LR = 1e-4  # a bf16 step at |w| in [1, 2) is 2^-7: rounded to nearest, every update of this size is lost


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(256, 64, bias=False)  # 16,384 values: over torchao's 4,096, so its states are 8-bit
    with torch.no_grad():
        model.weight.uniform_(1.0, 1.9)
    return model.to(dtype)


def _mean_step_along_minus_grad(dtype: torch.dtype) -> tuple[torch.optim.Optimizer, float]:
    model = _model(dtype)
    optimizer = build_adamw_8bit(model, lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device_type="cuda")
    before = model.weight.detach().float().clone()
    model.weight.grad = torch.randn(model.weight.shape).sign().to(dtype)
    with torch.compiler.set_stance("force_eager"):
        optimizer.step()
    moved = (before - model.weight.detach().float()) * model.weight.grad.float()  # AdamW's first step: lr * sign
    return optimizer, float(moved.mean())


def test_bf16_weights_round_stochastically_and_keep_small_updates():
    optimizer, mean = _mean_step_along_minus_grad(torch.bfloat16)
    assert optimizer.bf16_stochastic_round
    # unbiased: the mean move is lr (16k draws of steps of 2^-7 or 2^-8 at probability ~lr/step: ~5% noise)
    assert mean == pytest.approx(LR, rel=0.15)


def test_float32_weights_round_to_nearest():
    optimizer, mean = _mean_step_along_minus_grad(torch.float32)
    assert not optimizer.bf16_stochastic_round
    assert mean == pytest.approx(LR, rel=1e-3)


def test_refused_off_cuda_in_one_line():
    with pytest.raises(ConfigError, match="optimizer: adamw_8bit .* needs a CUDA GPU"):
        model = _model(torch.float32)
        build_adamw_8bit(model, lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device_type="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_step_is_torchaos_step(dtype):
    """Our step (one compiled update built once, ``_compat.adamw_8bit_class``) against torchao's own step on the
    same weights, gradients and random stream: the same weights and 8-bit states, bit for bit, over three steps
    (with weight decay, on a matrix, a vector under 4,096 values and a bf16 stochastic rounding draw)."""
    from torchao.optim import AdamW8bit

    from ndparallel import _compat

    def run(cls) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(64, 256).to(dtype)), nn.Parameter(torch.randn(256).to(dtype))]
        optimizer = cls(params, lr=torch.tensor(1e-3), weight_decay=0.1, bf16_stochastic_round=dtype == torch.bfloat16)
        generator = torch.Generator().manual_seed(1)
        with torch.compiler.set_stance("force_eager"):
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=generator).to(dtype)
                optimizer.step()
        states = [s for p in params for s in (optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
        return [p.detach().clone() for p in params] + [s.dequantize() if hasattr(s, "codes") else s for s in states]

    ours, theirs = run(_compat.adamw_8bit_class()), run(AdamW8bit)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(ours, theirs))
    assert not torch.equal(ours[0], run(lambda *a, **k: AdamW8bit(*a, **{**k, "weight_decay": 0.0}))[0])
