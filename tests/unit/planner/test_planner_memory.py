"""Memory arithmetic of the planner on cases worked out by hand. No processes."""

import pytest

from ndparallel import ConfigError
from ndparallel.mesh.layout import Layout
from ndparallel.planner.activations import activation_bytes, layer_full, layer_none, layer_selective, loss_peak
from ndparallel.planner.memory import (
    GPU_WORKSPACE_BYTES,
    MOMENTS,
    estimate_memory,
    local_params,
    lora_params,
    memory_moments,
    reduce_bytes,
)
from ndparallel.planner.shapes import PRESETS, ModelShape
from ndparallel.planner.workload import Workload

L8B = PRESETS["llama-8b"]
SEQ = 8192


def _step(model, layout, work, **kw):
    """The optimizer-step moment: master weights, every gradient and the AdamW states."""
    return memory_moments(model, layout, work, **kw)["optimizer step"]


def test_llama_8b_parameter_and_state_totals():
    p = L8B.params
    assert abs(p - 8.03e9) / 8.03e9 < 1e-3
    one = _step(L8B, Layout(), Workload(seq_len=SEQ, global_batch_rows=1, single_rank_fsdp=True))
    assert round(one.master_params / 1e9, 1) == 32.1  # fp32 master weights
    assert round(one.grads / 1e9, 1) == 32.1  # fp32 gradients
    assert round(one.optimizer / 1e9, 1) == 64.2  # AdamW: two fp32 states
    assert one.allocated == 16 * p + GPU_WORKSPACE_BYTES  # nothing else is alive at the optimizer step


@pytest.mark.parametrize("single_rank_fsdp", [False, True])
def test_bf16_weights_and_8bit_adamw_hold_six_bytes_a_parameter(single_rank_fsdp):
    """bf16: full with optimizer: adamw_8bit: bf16 weights, bf16 gradients, two 1-byte moments with an fp32 scale
    per 256 values; no compute copies (the flat path computes with the weights themselves)."""
    p = L8B.params
    work = Workload(
        seq_len=SEQ, global_batch_rows=1, bf16_weights=True, eight_bit_optimizer=True, single_rank_fsdp=single_rank_fsdp
    )
    one = _step(L8B, Layout(), work)
    assert one.master_params == 2 * p and one.grads == 2 * p
    assert one.optimizer == pytest.approx((2 + 8 / 256) * p)
    assert one.working_params == 0.0
    assert one.allocated == pytest.approx((6 + 8 / 256) * p + GPU_WORKSPACE_BYTES)
    masters = _step(L8B, Layout(), Workload(seq_len=SEQ, global_batch_rows=1, eight_bit_optimizer=True))
    assert masters.master_params == 4 * p


def test_an_offloaded_embedding_leaves_the_gpu_untied_on_one_rank_only():
    """embedding_offload: the frozen table (vocabulary x hidden, bf16) is in host memory at every moment; a tied
    model (the 1B) and a sharded layout keep theirs."""
    table = 2 * L8B.vocab * L8B.hidden

    def peaks(model, layout, **kw):
        work = dict(seq_len=4096, global_batch_rows=layout.batch_size, lora_rank=16, activation_checkpointing="full")
        moments = [memory_moments(model, layout, Workload(**work, embedding_offload=on, **kw)) for on in (False, True)]
        return [{name: m.allocated for name, m in found.items()} for found in moments]

    on_gpu, on_host = peaks(L8B, Layout())
    assert all(on_gpu[name] - on_host[name] == pytest.approx(table) for name in on_gpu)
    tied_gpu, tied_host = peaks(PRESETS["llama-1b"], Layout())
    assert tied_gpu == tied_host
    sharded_gpu, sharded_host = peaks(L8B, Layout(dp_shard=2))
    assert sharded_gpu == sharded_host


def test_bf16_weights_are_for_bf16_full_fine_tunes():
    with pytest.raises(ConfigError, match="bf16 weights"):
        Workload(seq_len=SEQ, global_batch_rows=1, bf16_weights=True, lora_rank=16)


def test_the_flat_path_keeps_its_compute_copies_and_bf16_gradients_at_the_optimizer_step():
    # parallel/single_rank.py: the bf16 copies live for the whole run; the trainer's one micro-batch hands
    # AdamW the bf16 gradients, build_optimizer's default (master_grads) upcasts them into fp32 ones first.
    p = L8B.params
    trainer = _step(L8B, Layout(), Workload(seq_len=SEQ, global_batch_rows=1))
    assert trainer.working_params == 2 * p and trainer.grads == 2 * p
    assert trainer.allocated == 16 * p + GPU_WORKSPACE_BYTES
    master = _step(L8B, Layout(), Workload(seq_len=SEQ, global_batch_rows=1, master_grads=True))
    assert master.working_params == 2 * p and master.grads == 4 * p
    assert master.allocated == 18 * p + GPU_WORKSPACE_BYTES


def test_flat_path_full_checkpointing_peaks_while_the_gradients_are_upcast_by_hand():
    # Llama-2-7B's layer shape, 16 layers, 4 x 4096 tokens, master_grads: at the end of backward the fp32
    # gradient buffer is allocated while every bf16 gradient and the logits still exist: master 4P + copies
    # 2P + AdamW 8P + bf16 gradients 2P + fp32 gradients 4P + logits. Measured on the H200: 66.24 GiB.
    shape = ModelShape.from_dict(
        {**PRESETS["llama-8b"].to_dict(), "intermediate": 11008, "kv_heads": 32, "vocab": 32000, "layers": 16}
    )
    work = Workload(seq_len=4096, global_batch_rows=4, master_grads=True, fused_loss=False)
    mem = estimate_memory(shape, Layout(), work, micro_batch=4, activation_checkpointing="full")
    assert mem.transient_kind == "end of backward"
    expected = 20 * shape.params + 2 * 4 * 4096 * 32000 + GPU_WORKSPACE_BYTES
    assert mem.allocated == pytest.approx(expected)
    assert mem.allocated / 2**30 == pytest.approx(66.237, abs=0.01)


def test_sharding_divides_by_tp_dp_shard_and_cp_but_not_dp_replicate():
    work = Workload(seq_len=SEQ, global_batch_rows=64)
    one = _step(L8B, Layout(), Workload(seq_len=SEQ, global_batch_rows=64, single_rank_fsdp=True))
    split = _step(L8B, Layout(dp_shard=8, cp=2, tp=2), work)
    replicated = _step(L8B, Layout(dp_replicate=2, dp_shard=8, cp=2, tp=2), work)
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
@pytest.mark.parametrize(
    "layout, tokens, per_token",
    [
        (Layout(), SEQ, 200_840),
        (Layout(tp=2), SEQ, 108_612),
        (Layout(cp=2, cp_comm_strategy="ring"), SEQ // 2, 209_032),
    ],
)
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
    # logits + their gradient (2 + 2 B per element); three float32 copies of one 2048-row chunk at once in
    # _chunk_grad (the upcast chunk, x - lse, its exp: 12 B per chunk element); 22 B per token, 4 per chunk row.
    assert loss_peak(L8B, Layout(), SEQ, 1, 2) == SEQ * v * 4 + 12 * 2048 * v + 22 * SEQ + 4 * 2048
    assert loss_peak(L8B, Layout(tp=2, cp=2), SEQ, 2, 2) == (
        8192 * (v / 2) * 4 + 12 * 2048 * (v / 2) + 22 * 8192 + 4 * 2048
    )
    # fp32: the upcast is a no-op, two temporaries
    assert loss_peak(L8B, Layout(), SEQ, 1, 4) == SEQ * v * 8 + 8 * 2048 * v + 22 * SEQ + 4 * 2048
    # fewer rows than a chunk: the chunk is the whole micro-batch
    assert loss_peak(L8B, Layout(), 1024, 1, 2) == 1024 * v * (4 + 12) + 26 * 1024
    # never the 14+ B per element of a float32 copy and softmax of the whole logits
    assert loss_peak(L8B, Layout(), 131072, 1, 2) < 4.2 * 131072 * v


def test_total_is_the_sum_of_the_items_at_the_moment_that_peaks():
    work = Workload(seq_len=SEQ, global_batch_rows=8, fused_loss=False)  # the model's logits, then the loss
    lay = Layout(dp_shard=8)
    moments = memory_moments(L8B, lay, work, micro_batch=1, activation_checkpointing="full")
    assert tuple(moments) == MOMENTS
    mem = estimate_memory(L8B, lay, work, micro_batch=1, activation_checkpointing="full")
    assert mem == max(moments.values(), key=lambda m: m.allocated)
    items = mem.items()
    parts = [v for k, v in items.items() if k not in ("allocated", "total")]
    assert items["total"] == pytest.approx(sum(parts))
    # The loss (logits + gradient + 12 B x 2048 rows x V) beats lm_head's backward (logits + gradient + 2 B x
    # V x h, h = 4096) and any layer's; no gradient has been reduced yet.
    assert mem.transient_kind == "loss"
    assert mem.transient == loss_peak(L8B, lay, SEQ, 1, 2)
    assert mem.grads == 0
    head = moments["head backward"]
    assert head.transient == 2 * 2 * SEQ * 128256 + 2 * 128256 * 4096
    retained = activation_bytes(L8B, lay, SEQ, 1, "full", fused_loss=False)
    assert mem.activations == retained.retained - retained.loss_saved
    # FSDP over 8: the last layer and lm_head's unit stay gathered after forward (bf16)
    assert mem.working_params == 2 * (L8B.layer_params() + 128256 * 4096 + 4096)
    step = moments["optimizer step"]
    assert step.activations == step.working_params == step.transient == 0
    assert step.grads == 4 * local_params(L8B, lay)


def test_world_1_keeps_every_bf16_copy_and_reduces_through_three_fp32_buffers():
    l1b = PRESETS["llama-1b"]
    work = Workload(seq_len=8192, global_batch_rows=1)
    loss = memory_moments(l1b, Layout(), work, activation_checkpointing="full")["loss"]
    assert loss.working_params == 2 * l1b.params  # parallel/fsdp.py: no resharding after forward on one rank
    # FSDP's reduction: fp32 input, the input / divide_factor temporary (one rank only) and the output
    assert reduce_bytes(1000, 1) == 12_000
    assert reduce_bytes(1000, 8) == 4_000 + 500
    # tp 2 alone is still one FSDP rank
    assert memory_moments(l1b, Layout(tp=2), work)["loss"].working_params == pytest.approx(
        2 * (l1b.split_params() / 2 + l1b.replicated_params())
    )


def test_3b_full_checkpointing_on_fsdp_over_one_rank_peaks_at_the_end_of_backward_by_hand():
    # Tied embedding: the root unit reduces last, once every layer's fp32 gradient exists, while the trainer
    # still holds the logits: master 4P + AdamW 8P + layers' gradients + logits + 3 fp32 copies of V x h.
    l3b = PRESETS["llama-3b"]
    p, vh = l3b.params, 128256 * 3072
    work = Workload(seq_len=8192, global_batch_rows=1, single_rank_fsdp=True, fused_loss=False)  # FSDP on one rank
    mem = estimate_memory(l3b, Layout(), work, activation_checkpointing="full")
    assert mem.transient_kind == "end of backward"
    expected = 16 * p - 4 * (vh + 3072) + 2 * 8192 * 128256 + 12 * (vh + 3072) + GPU_WORKSPACE_BYTES
    assert mem.allocated == pytest.approx(expected)


def test_gradients_exist_before_the_loss_only_when_every_micro_batch_reduces():
    work = Workload(seq_len=SEQ, global_batch_rows=64)
    lay = Layout(dp_shard=8)
    every = memory_moments(L8B, lay, work, micro_batch=1, accumulation=8, gradient_sync="every_micro_batch")["loss"]
    last = memory_moments(L8B, lay, work, micro_batch=1, accumulation=8, gradient_sync="last_micro_batch")["loss"]
    assert every.grads == pytest.approx(4 * local_params(L8B, lay)) and every.accumulated_grads == 0
    assert last.grads == 0 and last.accumulated_grads > 0


def test_the_loss_saves_the_logits_in_the_compute_dtype_not_a_softmax():
    for e in (2, 4):
        acts = activation_bytes(L8B, Layout(tp=2), SEQ, 1, "none", e, fused_loss=False)
        assert acts.loss_saved == SEQ * (e * 128256 / 2 + 14)


def test_accumulated_gradients_only_when_reducing_on_the_last_micro_batch():
    work = Workload(seq_len=SEQ, global_batch_rows=64)
    lay = Layout(dp_shard=8)
    once = estimate_memory(L8B, lay, work, micro_batch=1, accumulation=8, gradient_sync="last_micro_batch")
    every = estimate_memory(L8B, lay, work, micro_batch=1, accumulation=8, gradient_sync="every_micro_batch")
    single = estimate_memory(L8B, lay, work, micro_batch=8, accumulation=1, gradient_sync="last_micro_batch")
    assert every.accumulated_grads == 0 and single.accumulated_grads == 0
    assert once.accumulated_grads == pytest.approx(4 * L8B.params, rel=1e-3)  # unsharded fp32, tp 1: ~32 GB
    # the 8B case: the default mode keeps ~1/8 of that (the fp32 shard), the old mode all of it
    assert once.total - every.total == pytest.approx(4 * L8B.params - 4 * local_params(L8B, lay), rel=0.05)


def test_lora_keeps_no_gradients_or_optimizer_state_for_the_base():
    lay = Layout(dp_shard=8)
    full = _step(L8B, lay, Workload(seq_len=SEQ, global_batch_rows=8))
    lora = _step(L8B, lay, Workload(seq_len=SEQ, global_batch_rows=8, lora_rank=16))
    adapters = L8B.layers * L8B.lora_params_per_layer(16)
    assert lora_params(L8B, 16) == adapters
    # r * (in + out) over the 7 linears: hidden 7 times, q twice (q_proj out, o_proj in), kv twice, i three times
    assert adapters == 32 * 16 * (4096 * 9 + 1024 * 2 + 14336 * 3)
    assert lora.grads == pytest.approx(4 * adapters / 8)
    assert lora.optimizer == pytest.approx(8 * adapters / 8)
    # the frozen base is stored in bf16 (freeze.store_frozen_in), the adapters' masters in fp32
    assert lora.master_params == pytest.approx(2 * local_params(L8B, lay) + 4 * adapters / 8)
    static = lambda m: m.master_params + m.grads + m.optimizer  # noqa: E731
    assert static(lora) < static(full) / 7.5  # 2 bytes per base parameter instead of 16 (+ the adapters)


def test_lora_activations_drop_the_frozen_norms_copies_and_add_the_adapters():
    r, t, h, n = 16, 2, 4096, SEQ
    base = layer_none(L8B, Layout(tp=t), SEQ, 1, 2)
    lora = layer_none(L8B, Layout(tp=t), SEQ, 1, 2, r)
    # two norms lose their bf16 normalized copy (2h/t each); A outputs: 5 full, 2 sequence-split (o, down)
    assert lora - base == n * (-2 * 2 * h / t + 2 * r * (5 + 2 / t))
    a_none, b_none = (activation_bytes(L8B, Layout(), SEQ, 1, "none", 2, k, fused_loss=False) for k in (r, None))
    # + the head drops lm_head's input and the final norm's copy; the first layer's input norm keeps nothing
    assert a_none.head == b_none.head - 2 * 2 * h * n
    assert a_none.layers == 32 * a_none.per_layer - n * (4 * h + 4)


@pytest.mark.parametrize("fmt, per_value", [("nf4", 0.5 + 1 / 64 + 4 / 16384), ("int8", 1.0), ("fp8", 1.0)])
def test_a_quantized_base_stores_its_linears_as_codes(fmt, per_value):
    """QLoRA / 8-bit LoRA: the decoder linears' bytes drop from 2 (bf16) to the format's bytes per value (int8
    adds one bf16 scale per output row); nothing else changes at the optimizer step."""
    from ndparallel.planner.memory import quantized_saving

    base = Workload(seq_len=SEQ, global_batch_rows=1, lora_rank=16)
    quantized = Workload(seq_len=SEQ, global_batch_rows=1, lora_rank=16, quantized_base=fmt)
    weights = L8B.layers * L8B.layer_linear_weights()
    assert weights == 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
    scales = 2 * L8B.layers * L8B.layer_linear_rows() if fmt in ("int8", "fp8") else 0
    expected = weights * (2 - per_value) - scales
    assert L8B.layers * quantized_saving(L8B, quantized) == pytest.approx(expected)
    for layout in (Layout(), Layout(dp_shard=4)):  # one rank, and FSDP's shards and gathered copies
        drop = _step(L8B, layout, base).total - _step(L8B, layout, quantized).total
        assert drop == pytest.approx(expected / layout.fsdp_size)
    gathered = memory_moments(L8B, Layout(dp_shard=4), base)["loss"].working_params
    assert gathered - memory_moments(L8B, Layout(dp_shard=4), quantized)["loss"].working_params == pytest.approx(
        expected / L8B.layers
    )


def test_a_quantized_base_needs_lora():
    with pytest.raises(ConfigError, match="give --lora-rank"):
        Workload(seq_len=SEQ, global_batch_rows=1, quantized_base="nf4")
    with pytest.raises(ConfigError, match="must be one of nf4, int8, fp8"):
        Workload(seq_len=SEQ, global_batch_rows=1, lora_rank=8, quantized_base="fp4")


def test_what_compiled_layers_keep():
    """Compiled: each RMSNorm recomputes its fp32 input copy (4h per token), the MLP recomputes silu(gate)
    (e*i; full fine-tuning only), selective checkpointing drops down_proj's output (e*h); per token, bf16."""
    h, i = L8B.hidden, L8B.intermediate
    eager, compiled = layer_none(L8B, Layout(), SEQ, 1, 2), layer_none(L8B, Layout(), SEQ, 1, 2, compiled=True)
    assert eager - compiled == SEQ * (2 * 4 * h + 2 * i)
    lora = layer_none(L8B, Layout(), SEQ, 1, 2, 16) - layer_none(L8B, Layout(), SEQ, 1, 2, 16, compiled=True)
    assert lora == SEQ * 2 * 4 * h
    selective = layer_selective(L8B, Layout(), SEQ, 1, 2) - layer_selective(L8B, Layout(), SEQ, 1, 2, compiled=True)
    assert selective == SEQ * 2 * h
