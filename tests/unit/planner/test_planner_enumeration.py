"""Layout enumeration against an independent brute force, and the per-layout knobs. No processes."""

import itertools

import pytest

from ndparallel.mesh.layout import CP_METHODS
from ndparallel.planner.candidates import knob_choices, valid_layouts
from ndparallel.planner.shapes import PRESETS, ModelShape

# heads 12, kv heads 4, odd intermediate and vocabulary: many tp sizes fail, alltoall often fails.
ODD = ModelShape(vocab=32002, hidden=768, intermediate=2000, layers=4, heads=12, kv_heads=4, name="odd")


def brute_force(model: ModelShape, world: int, seq: int) -> set[tuple]:
    """Written from the rules, not from the planner's code: every 4-tuple of 1..world, checked by hand."""
    out = set()
    for r, s, c, t in itertools.product(range(1, world + 1), repeat=4):
        if r * s * c * t != world:
            continue
        if any(x % t for x in (model.heads, model.kv_heads, model.intermediate)):
            continue
        # The vocabulary splits like torch.chunk (ceil(V/t) rows a rank): the last rank must keep a row.
        if model.vocab - (t - 1) * -(-model.vocab // t) < 1:
            continue
        multiple = 2 * c * t if c > 1 else t
        if seq < multiple or seq % multiple:
            continue
        for method in CP_METHODS if c > 1 else ("allgather",):
            if method == "alltoall" and model.heads % (c * t):
                continue
            out.add((r, s, c, t, method))
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8, 12, 16, 24])
@pytest.mark.parametrize(
    "model, seq",
    [(PRESETS["llama-8b"], 8192), (PRESETS["llama-3b"], 131072), (PRESETS["tiny"], 64), (ODD, 96), (ODD, 30)],
)
def test_every_valid_layout_and_no_invalid_one(model, seq, world):
    got = [
        (lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, lay.cp_comm_strategy)
        for lay in valid_layouts(model, world, seq)
    ]
    assert len(got) == len(set(got)), "a layout is listed twice"
    assert set(got) == brute_force(model, world, seq)


def test_known_counts_and_exclusions():
    layouts = valid_layouts(PRESETS["llama-8b"], 8, 8192)
    # 20 ordered factorizations of 8 into four sizes; the 10 with cp > 1 come in three methods.
    assert len(layouts) == 10 + 10 * 3
    # llama-3b has 24 heads: tp 16 never divides them, alltoall with cp x tp = 16 neither.
    shapes = {(x.shape, x.cp_comm_strategy) for x in valid_layouts(PRESETS["llama-3b"], 16, 131072)}
    assert not any(shape[3] == 16 for shape, _ in shapes)
    assert ((1, 1, 16, 1), "alltoall") not in shapes and ((1, 1, 16, 1), "ring") in shapes
    # ODD's heads (12) and key/value heads (4) allow tp up to 4 (its vocabulary 32002 need not divide: the last
    # rank's share is smaller); 96 tokens split into 2*cp*tp parts up to 32 (cp 8 x tp 2, cp 4 x tp 4).
    odd = {x.shape for x in valid_layouts(ODD, 8, 96)}
    assert {(1, 2, 2, 2), (1, 1, 4, 2), (1, 1, 8, 1), (1, 2, 1, 4)} <= odd
    assert not any(shape[3] > 4 for shape in odd)
    # 30 tokens do not split into 2*cp chunks for any cp > 1.
    assert all(x.cp == 1 for x in valid_layouts(ODD, 8, 30))


def test_knobs_divide_rows_and_sync_only_matters_with_accumulation():
    both = ("every_micro_batch", "last_micro_batch")
    knobs = knob_choices(8, (1, 2, 3, 8), ("none", "full"), both)
    assert {k.micro_batch for k in knobs} == {1, 2, 8}  # 3 does not divide 8 rows
    for k in knobs:
        assert k.micro_batch * k.accumulation == 8
        assert k.gradient_sync == "every_micro_batch" if k.accumulation == 1 else k.gradient_sync in both
    assert len([k for k in knobs if k.micro_batch == 1]) == 4  # 2 modes x 2 sync policies
    assert knob_choices(3, (2, 4), ("none",), both) == []
    assert {k.gradient_sync for k in knob_choices(4, (1,), ("none",), ("last_micro_batch",))} == {"last_micro_batch"}
