"""Memory arithmetic of the planner on cases worked out by hand. No processes."""

import pytest

from ndparallel.layout import Layout
from ndparallel.planner.activations import activation_bytes, layer_full, layer_none, layer_selective, loss_peak
from ndparallel.planner.memory import estimate_memory, local_params
from ndparallel.planner.shapes import PRESETS
from ndparallel.planner.workload import Workload

L8B = PRESETS["llama-8b"]
SEQ = 8192


def test_llama_8b_parameter_and_state_totals():
    p = L8B.params
    assert abs(p - 8.03e9) / 8.03e9 < 1e-3
    one = estimate_memory(L8B, Layout(), Workload(seq_len=SEQ, global_batch_rows=1))
    assert round(one.master_params / 1e9, 1) == 32.1      # fp32 master weights
    assert round(one.grads / 1e9, 1) == 32.1              # fp32 gradients
    assert round(one.optimizer / 1e9, 1) == 64.2          # AdamW: two fp32 states


def test_sharding_divides_by_tp_dp_shard_and_cp_but_not_dp_replicate():
    work = Workload(seq_len=SEQ, global_batch_rows=64)
    one = estimate_memory(L8B, Layout(), work)
    split = estimate_memory(L8B, Layout(dp_shard=8, cp=2, tp=2), work)
    replicated = estimate_memory(L8B, Layout(dp_replicate=2, dp_shard=8, cp=2, tp=2), work)
    for field in ("master_params", "grads", "optimizer"):
        ratio = getattr(one, field) / getattr(split, field)
        assert ratio == pytest.approx(32, rel=2e-3)  # norms stay whole under tp: slightly less than 32x
        assert getattr(replicated, field) == getattr(split, field)
    # exactly: linears, embedding and head split 32 ways, norms 16 ways (tp keeps them whole)
    expected = L8B.split_params() / 32 + L8B.replicated_params() / 16
    assert local_params(L8B, Layout(dp_shard=8, cp=2, tp=2)) == expected
    assert split.master_params == 4 * expected


# Per token of one GPU, bytes, worked out from the formulas in activations.py for Llama-8B
# (h 4096, q 4096, kv 1024, 32 heads, i 14336), bf16:
#   none, no tp/cp: 16h+8 + 4q+4kv+4n + 8i                     = 200,840
#   none, tp 2:     (12h+8)/2 + 4h + (4q+4kv+4n)/2 + 8i/2       = 108,612
#   none, cp 2 ring (per local token): 12h+8 + 4h + 6q+4kv+4n + 8i = 209,032
#   selective:      2h + 2(q+2kv) + 4h + 4i + 2q+4n             = 102,528
#   full:           2h                                          = 8,192
@pytest.mark.parametrize("layout, tokens, per_token", [
    (Layout(), SEQ, 200_840),
    (Layout(tp=2), SEQ, 108_612),
    (Layout(cp=2, cp_comm_strategy="ring"), SEQ // 2, 209_032),
])
def test_layer_activations_by_hand(layout, tokens, per_token):
    assert layer_none(L8B, layout, SEQ, 1, 2) == tokens * per_token


def test_checkpointing_modes_by_hand():
    assert layer_selective(L8B, Layout(), SEQ, 1, 2) == SEQ * 102_528
    assert layer_full(L8B, Layout(), SEQ, 1, 2) == SEQ * 8_192
    # micro-batch rows and fp32 scale linearly where the formula says so
    assert layer_full(L8B, Layout(), SEQ, 4, 4) == 4 * 2 * SEQ * 8_192


def test_allgather_cp_keeps_the_whole_rows_kv_and_a_mask():
    lay = Layout(cp=2, cp_comm_strategy="allgather")
    ring = Layout(cp=2, cp_comm_strategy="ring")
    s = SEQ // 2
    # allgather vs ring differ only in attention: local (2eq+4n) vs (e(3q+2kv)+4n), plus K/V of the whole row
    # expanded to the query heads (GQA 32/8): 2*e*q per token of the row, an s x S bf16 mask and the index.
    local = s * (2 * 2 * 4096 + 4 * 32) - s * (2 * (3 * 4096 + 2 * 1024) + 4 * 32)
    extra = SEQ * 2 * 2 * 4096 + 2 * s * SEQ + 8 * SEQ
    assert layer_none(L8B, lay, SEQ, 1, 2) - layer_none(L8B, ring, SEQ, 1, 2) == local + extra


def test_loss_peak_is_the_logits_their_gradient_and_float32_chunk_temporaries():
    v = 128256
    # 8192 tokens = 4 chunks of 2048 rows: logits + their gradient (2 + 2 B per element); the previous chunk's
    # float32 result, the current chunk upcast and shifted (3 x 4 B per chunk element); 18 B per token.
    assert loss_peak(L8B, Layout(), SEQ, 1, 2) == SEQ * v * 4 + 12 * 2048 * v + 18 * SEQ
    assert loss_peak(L8B, Layout(tp=2, cp=2), SEQ, 2, 2) == 8192 * (v / 2) * 4 + 12 * 2048 * (v / 2) + 18 * 8192
    # fp32: no upcast copy
    assert loss_peak(L8B, Layout(), SEQ, 1, 4) == SEQ * v * 8 + 8 * 2048 * v + 18 * SEQ
    # one chunk: no previous chunk. Two: the first chunk's two copies, or the first's result + the second's two
    assert loss_peak(L8B, Layout(), 1024, 1, 2) == 1024 * v * (4 + 8) + 18 * 1024
    assert loss_peak(L8B, Layout(), 2048 + 64, 1, 2) == 2112 * v * 4 + 8 * 2048 * v + 18 * 2112
    assert loss_peak(L8B, Layout(), 2048 + 1536, 1, 2) == 3584 * v * 4 + (4 * 2048 + 8 * 1536) * v + 18 * 3584
    # never the 14+ B per element of a float32 copy and softmax of the whole logits
    assert loss_peak(L8B, Layout(), 131072, 1, 2) < 4.2 * 131072 * v


def test_total_is_the_sum_of_the_items_and_the_largest_transient():
    work = Workload(seq_len=SEQ, global_batch_rows=8)
    lay = Layout(dp_shard=8)
    mem = estimate_memory(L8B, lay, work, micro_batch=1, activation_checkpointing="full")
    items = mem.items()
    parts = [v for k, v in items.items() if k not in ("allocated", "total")]
    assert items["total"] == pytest.approx(sum(parts))
    # The loss (logits + gradient + 12 B x 2048 rows x V) and lm_head's backward (logits + gradient + 6 B
    # x V x h, h = 4096) come out the same but for the loss's 18 B per token; both beat any layer's backward.
    assert mem.transient_kind == "loss"
    assert mem.transient == loss_peak(L8B, lay, SEQ, 1, 2)
    head = 2 * 2 * SEQ * 128256 + 6 * 128256 * 4096
    assert mem.transient - head == 18 * SEQ
    retained = activation_bytes(L8B, lay, SEQ, 1, "full")
    assert mem.activations == retained.retained - retained.loss_saved


def test_the_loss_saves_the_logits_in_the_compute_dtype_not_a_softmax():
    for e in (2, 4):
        acts = activation_bytes(L8B, Layout(tp=2), SEQ, 1, "none", e)
        assert acts.loss_saved == SEQ * (e * 128256 / 2 + 14)


def test_accumulated_gradients_only_when_reducing_on_the_last_micro_batch():
    work = Workload(seq_len=SEQ, global_batch_rows=64)
    lay = Layout(dp_shard=8)
    once = estimate_memory(L8B, lay, work, micro_batch=1, accumulation=8, grad_sync="last")
    every = estimate_memory(L8B, lay, work, micro_batch=1, accumulation=8, grad_sync="every")
    single = estimate_memory(L8B, lay, work, micro_batch=8, accumulation=1, grad_sync="last")
    assert every.accumulated_grads == 0 and single.accumulated_grads == 0
    assert once.accumulated_grads == pytest.approx(4 * L8B.params, rel=1e-3)  # unsharded fp32, tp 1


def test_lora_keeps_no_gradients_or_optimizer_state_for_the_base():
    lay = Layout(dp_shard=8)
    full = estimate_memory(L8B, lay, Workload(seq_len=SEQ, global_batch_rows=8))
    lora = estimate_memory(L8B, lay, Workload(seq_len=SEQ, global_batch_rows=8, lora_rank=16))
    adapters = L8B.layers * L8B.lora_params_per_layer(16)
    # r * (in + out) over the 7 linears: hidden 7 times, q twice (q_proj out, o_proj in), kv twice, i three times
    assert adapters == 32 * 16 * (4096 * 9 + 1024 * 2 + 14336 * 3)
    assert lora.grads == pytest.approx(4 * adapters / 8)
    assert lora.optimizer == pytest.approx(8 * adapters / 8)
    assert lora.master_params == pytest.approx(2 * local_params(L8B, lay) + 4 * adapters / 8)
    static = lambda m: m.master_params + m.grads + m.optimizer  # noqa: E731
    assert static(lora) < static(full) / 7   # 2 bytes per base parameter instead of 16
