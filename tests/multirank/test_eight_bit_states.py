"""8-bit optimizer states (torchao's AdamW8bit) saved on one layout and read back on another
(``checkpoint/eight_bit.py``).

torchao quantizes a shard's state only where the shard has >= 4,096 values in whole 256-value blocks, so the
same parameter is quantized on one layout and plain on another, and even on some ranks of one layout and not on
others. Parameters chosen for each case (FSDP over two ranks splits rows):

- ``straddle`` (31, 256): 16 rows (4,096 values, quantized) on rank 0, 15 rows (3,840, plain) on rank 1;
- ``norm`` (4096,): quantized on one rank, plain (2,048) on each of two;
- ``matrix`` (64, 256): quantized everywhere, rows whole blocks (saved as codes: bitwise).

The states are compared as float values gathered whole against the states that were saved.
"""

from __future__ import annotations

import pytest

from ndparallel.testing.ranks import run_ranks

pytest.importorskip("torchao")

SHAPES = {"straddle": (31, 256), "norm": (4096,), "matrix": (64, 256)}


def _build(shard: bool):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ndparallel.optim.adamw_8bit import build_adamw_8bit

    class Params(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            for name, shape in SHAPES.items():
                self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=generator)))

        def forward(self, weights: dict):
            return sum((getattr(self, name) * w).sum() for name, w in weights.items())

    model = Params()
    if shard:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model, mesh=mesh)
    optimizer = build_adamw_8bit(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, device_type="cuda")
    return model, optimizer


def _states(model, optimizer) -> dict:
    """Every state as float values of the whole tensor, and whether this rank's shard is quantized."""
    from torch.distributed.tensor import DTensor

    from ndparallel.checkpoint.eight_bit import is_quantized

    out = {}
    for name, param in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[param][key]
            if isinstance(value, DTensor):
                local = value.to_local()
                plain = local.dequantize() if is_quantized(local) else local.float()
                whole = DTensor.from_local(
                    plain,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                ).full_tensor()
            else:
                whole = value.dequantize() if is_quantized(value) else value.float()
            out[f"{name}.{key}"] = (whole, is_quantized(value))
    return out


def _save(path: str, shard: bool) -> dict:
    import warnings

    import torch

    import ndparallel as ndp

    warnings.filterwarnings("ignore")
    torch.compiler.set_stance("force_eager")
    model, optimizer = _build(shard)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        weights = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
        model(weights).backward()
        optimizer.step()
        optimizer.zero_grad()
    ndp.Checkpointer(path, async_save=False).save(2, {"model": model, "optimizer": optimizer})
    return _states(model, optimizer)


def _load(path: str, shard: bool) -> dict:
    import warnings

    import torch

    import ndparallel as ndp

    warnings.filterwarnings("ignore")
    torch.compiler.set_stance("force_eager")
    model, optimizer = _build(shard)
    ndp.Checkpointer(path).load({"model": model, "optimizer": optimizer})
    return _states(model, optimizer)


def _compare(saved: dict, loaded: dict, bitwise: set[str]) -> None:
    for key, (expected, _) in saved.items():
        got = loaded[key][0]
        if key.split(".")[0] in bitwise:
            assert bool((got == expected).all()), key
        else:  # quantized again from values: a block's scale is recomputed
            assert float((got - expected).abs().max() / expected.abs().max()) <= 2e-2, key


def test_states_quantized_on_some_ranks_only_save_and_resume_on_the_same_layout(tmp_path):
    saved = run_ranks(2, _save, str(tmp_path), True)
    assert saved[0]["straddle.exp_avg"][1] and not saved[1]["straddle.exp_avg"][1]  # the ranks' forms differ
    loaded = run_ranks(2, _load, str(tmp_path), True)
    for rank in (0, 1):
        assert loaded[rank]["straddle.exp_avg"][1] == saved[rank]["straddle.exp_avg"][1]
        _compare(saved[0], loaded[rank], bitwise={"norm", "matrix"})


def test_states_resume_from_two_ranks_on_one(tmp_path):
    saved = run_ranks(2, _save, str(tmp_path), True)[0]
    loaded = run_ranks(1, _load, str(tmp_path), False)[0]
    assert loaded["norm.exp_avg"][1]  # plain on each of two ranks, quantized on one
    _compare(saved, loaded, bitwise={"matrix"})


def test_states_resume_from_one_rank_on_two(tmp_path):
    saved = run_ranks(1, _save, str(tmp_path), False)[0]
    assert saved["norm.exp_avg"][1]
    loaded = run_ranks(2, _load, str(tmp_path), True)
    assert not loaded[0]["norm.exp_avg"][1]
    _compare(saved, loaded[0], bitwise={"norm", "matrix"})  # quantized codes read as values into plain states


def _other_optimizer(path: str, save_eight_bit: bool) -> dict | str:
    """Save with one optimizer and load with the other (8-bit AdamW <-> torch's AdamW), on one rank."""
    import warnings

    import torch

    import ndparallel as ndp
    from ndparallel.errors import CheckpointError

    warnings.filterwarnings("ignore")
    torch.compiler.set_stance("force_eager")

    def build(eight_bit: bool):
        model, optimizer = _build(False)
        return (model, optimizer) if eight_bit else (model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    model, optimizer = build(save_eight_bit)
    model({name: torch.ones(shape) for name, shape in SHAPES.items()}).backward()
    optimizer.step()
    ndp.Checkpointer(path, async_save=False).save(1, {"model": model, "optimizer": optimizer})
    model2, optimizer2 = build(not save_eight_bit)
    try:
        ndp.Checkpointer(path).load({"model": model2, "optimizer": optimizer2})
    except CheckpointError as exc:
        return str(exc)
    return {"saved": _states(model, optimizer), "loaded": _states(model2, optimizer2)}


def test_an_8bit_checkpoint_into_another_optimizer_is_one_line(tmp_path):
    message = run_ranks(1, _other_optimizer, str(tmp_path), True)[0]
    assert "resume with optimizer: adamw_8bit" in message


def test_an_adamw_checkpoint_into_8bit_adamw_is_one_line(tmp_path):
    message = run_ranks(1, _other_optimizer, str(tmp_path), False)[0]
    assert "resume with the optimizer it was saved with" in message
