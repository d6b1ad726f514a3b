"""The trainer with ``optimizer: adamw_8bit`` (torchao's AdamW8bit) and ``bf16: full`` (bf16 weights, no fp32
masters): training, checkpoints of the 8-bit states, exact resume, resume on another layout and precision.

torchao compiles its update for CUDA and ndparallel refuses 8-bit AdamW on a CPU; here the ranks run it eagerly
(``torch.compiler.set_stance("force_eager")``, the same code) with the device check told it is on a GPU, so the
trainer's own path (build, clipping, checkpoint save and load, schedule) runs end to end. The GPU check of the
numbers over 30 steps is ``tests/gpu/gpu_trainer_checks.py --only bf16_full``.
"""

from __future__ import annotations

import pytest
from support.trainer_helpers import tiny_config

from ndparallel.testing.ranks import run_ranks

pytest.importorskip("torchao")


def _train(config: dict) -> list[tuple[int, float, float]]:
    import warnings

    import torch

    import ndparallel.train.run_inputs as run_inputs

    warnings.filterwarnings("ignore")
    torch.compiler.set_stance("force_eager")
    build = run_inputs.build_adamw_8bit
    run_inputs.build_adamw_8bit = lambda model, **kw: build(model, **{**kw, "device_type": "cuda"})
    from ndparallel.config.reading import parse_config
    from ndparallel.train.loop import run_training

    records = run_training(parse_config(config)).records
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


# rows of 256 values: every 8-bit state of a matrix is whole blocks per row, on one rank or split by rows over two,
# which the checkpoint keeps as codes and scales (bitwise; see checkpoint/states.OptimizerState)
SHAPE = {"vocab_size": 320, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 32}


def _config(tmp, name: str, **overrides) -> dict:
    base = dict(optimizer="adamw_8bit", device="cpu", max_steps=4, save_steps=2, overwrite_output_dir=True)
    base["model_config_overrides"] = SHAPE
    return tiny_config(tmp, **{**base, "output_dir": str(tmp / name), **overrides})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eight_bit")
    return tmp, run_ranks(2, _train, _config(tmp, "full", bf16="full", dp_shard_size=2))[0]


def test_bf16_full_trains_and_resumes_exactly_from_its_8bit_states(uninterrupted):
    tmp, records = uninterrupted
    assert [r[0] for r in records] == [1, 2, 3, 4]
    assert records[-1][1] < records[0][1]
    step2 = tmp / "full" / "checkpoints" / "step-2"
    resumed = run_ranks(
        2, _train, _config(tmp, "resumed", bf16="full", dp_shard_size=2, resume_from_checkpoint=str(step2))
    )
    assert resumed[0] == records[2:]  # bitwise: the 8-bit states come back as the same codes, the RNG as it was


def test_a_bf16_full_checkpoint_resumes_on_one_rank_with_fp32_masters(uninterrupted):
    tmp, records = uninterrupted
    step2 = tmp / "full" / "checkpoints" / "step-2"
    # same global batch (16 rows) on one rank: two micro-batches of 8
    config = _config(
        tmp, "masters", bf16=True, dp_shard_size=1, gradient_accumulation_steps=2, resume_from_checkpoint=str(step2)
    )
    resumed = run_ranks(1, _train, config)[0]
    assert [r[0] for r in resumed] == [3, 4]
    for (_, loss, _), (_, expected, _) in zip(resumed, records[2:]):
        assert loss == pytest.approx(expected, rel=5e-3)  # bf16 weights against fp32 masters from the same start


def _round_trip(tmp: str, in_features: int) -> dict:
    import warnings

    import torch

    import ndparallel as ndp
    from ndparallel.optim.adamw_8bit import build_adamw_8bit

    warnings.filterwarnings("ignore")
    torch.compiler.set_stance("force_eager")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(in_features, 8192 // in_features, bias=False))
        optimizer = build_adamw_8bit(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device_type="cuda")
        return model, optimizer

    model, optimizer = build()
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        model[0].weight.grad = torch.randn(model[0].weight.shape, generator=generator)
        optimizer.step()
    ndp.Checkpointer(tmp, async_save=False).save(2, {"model": model, "optimizer": optimizer})
    model2, optimizer2 = build()
    ndp.Checkpointer(tmp).load({"model": model2, "optimizer": optimizer2})
    saved, loaded = optimizer.state[model[0].weight], optimizer2.state[model2[0].weight]
    out = {"types": {type(loaded[k]).__name__ for k in ("exp_avg", "exp_avg_sq")}}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = (
            torch.equal(saved[key].codes, loaded[key].codes) and torch.equal(saved[key].scale, loaded[key].scale),
            float(
                (saved[key].dequantize() - loaded[key].dequantize()).abs().max() / saved[key].dequantize().abs().max()
            ),
        )
    return out


def test_8bit_states_whose_rows_are_whole_blocks_come_back_bitwise(tmp_path):
    result = run_ranks(1, _round_trip, str(tmp_path), 256)[0]
    assert result["types"] == {"OptimState8bit"}
    assert result["exp_avg"][0] and result["exp_avg_sq"][0]


def test_other_8bit_states_come_back_quantized_again(tmp_path):
    # rows of 64 values: saved as float32 values, quantized again on load (a block's scale is recomputed)
    result = run_ranks(1, _round_trip, str(tmp_path), 64)[0]
    assert result["types"] == {"OptimState8bit"}
    for key in ("exp_avg", "exp_avg_sq"):
        assert result[key][1] <= 2e-2, result


def _reshard_through(tmp, records: list, name: str, **layout) -> None:
    """The dp_shard 2 checkpoint at step 2 resumed on four ranks of ``layout`` for steps 3-6, whose step-4 checkpoint
    then resumes on one rank with two micro-batches: losses within bf16's and stochastic rounding's reach of the
    runs they continue."""
    step2 = tmp / "full" / "checkpoints" / "step-2"
    wide = _config(tmp, name, bf16="full", dp_shard_size=2, max_steps=6, resume_from_checkpoint=str(step2), **layout)
    on_wide = run_ranks(4, _train, wide)[0]
    assert [r[0] for r in on_wide] == [3, 4, 5, 6]
    for (_, loss, _), (_, expected, _) in zip(on_wide, records[2:]):
        assert loss == pytest.approx(expected, rel=5e-3)
    step4 = tmp / name / "checkpoints" / "step-4"
    one = _config(
        tmp, f"{name}-one", bf16="full", dp_shard_size=1, gradient_accumulation_steps=2, max_steps=6,
        resume_from_checkpoint=str(step4),
    )  # fmt: skip
    on_one = run_ranks(1, _train, one)[0]
    assert [r[0] for r in on_one] == [5, 6]
    for (_, loss, _), (_, expected, _) in zip(on_one, on_wide[2:]):
        assert loss == pytest.approx(expected, rel=5e-3)


def test_8bit_states_reshard_through_tensor_parallelism(uninterrupted):
    """dp_shard 2 x tp 2: FSDP over TP-split weights, rowwise splits whose rows are not whole 256-value blocks (so
    those states go as values, and saved codes are read whole)."""
    _reshard_through(*uninterrupted, "tp", tensor_parallel_size=2)


def test_lora_with_8bit_adamw_resumes_on_another_layout(tmp_path):
    """Adapters' states (lora_B's rows are r values: never whole blocks) saved on dp_shard 2, resumed on one rank."""
    lora = dict(adapter="lora", lora_r=16, lora_alpha=16, lora_target_linear=True, learning_rate=1e-3, max_steps=4)
    two = run_ranks(2, _train, _config(tmp_path, "lora", dp_shard_size=2, **lora))[0]
    step2 = tmp_path / "lora" / "checkpoints" / "step-2"
    one = _config(
        tmp_path, "lora-one", dp_shard_size=1, gradient_accumulation_steps=2, resume_from_checkpoint=str(step2), **lora
    )
    resumed = run_ranks(1, _train, one)[0]
    assert [r[0] for r in resumed] == [3, 4] and two[-1][1] < two[0][1]
    for (_, loss, _), (_, expected, _) in zip(resumed, two[2:]):
        assert loss == pytest.approx(expected, rel=1e-4)  # fp32 adapters: one rank reduces as two do, nearly


def test_8bit_states_reshard_through_context_parallelism(uninterrupted):
    """dp_shard 2 x cp 2: FSDP over the dp_shard x cp ranks."""
    _reshard_through(*uninterrupted, "cp", context_parallel_size=2)
