"""What one decoder layer's backward holds beyond the kept activations, stage by stage, and where in the
backward the layers' kept inputs and finished gradients add up to the most (``memory.py``'s 'layer backward').

Notation as in ``activations.py``: n = b*s tokens of the rank, e bytes per compute element, h hidden, q =
heads x head_dim, kv = kv_heads x head_dim, i intermediate, t = tp. A layer's backward starts once
checkpointing has recomputed what it needs (``ActivationBytes.layer_recompute``: nothing without
checkpointing, the attention and MLP halves' tensors under full checkpointing). It then holds the most at
one of two stages:

MLP stage (the first: the MLP is the layer's last operation), beyond the recomputed tensors
    eager       the MLP's four forward tensors and two gradients at once: 6 e*i/t per token (the gradient
                of silu(gate) * up, then that of gate or up, before the four are freed); the gradient of
                the layer's output e*h/t (and its copy gathered over tp, e*h); down_proj's weight gradient,
                e*h*i/t once. Counted storage by storage on CPU (``measure.measure_step_peak``).
    compiled    7 e*i/t: the compiled backward computes the gradients of gate and up in one kernel while
                all four forward tensors are still held (H200, 1B, 131,072 tokens, full checkpointing,
                compiled, the fused loss: 42.50 GiB measured and predicted; with 6 e*i/t, 40.5).
    tiled       one tile of T tokens at a time: 6 e*i/t * T (7 compiled); the input gradients of the tiles
                already done, e*h/t * (n - T), wait to be joined when the last is done; the MLP weights'
                gradients, summed over the tiles, 3 e*h*i/t (CPU-counted).
attention stage
    the tensors its backward reads (``activations.attention_side``: input norm, q/k/v's input, rotated q
    and k, v, the output and the log-sum-exp; all of them under full checkpointing, what selective
    recomputes otherwise); the gradients of the residual stream e*h/t (gathered over tp: + e*h) and of the
    attention output e*q/t; and the flash kernel's backward buffers, counted from FlashAttention 2's
    backward (the kernel of packed rows and every CP method): a float32 dQ accumulator 4q/t, dQ e*q/t, and
    dK, dV per query head, 2e*q/t, summed into 2e*kv/t under grouped-query attention (else 2e*kv/t once);
    + CP's exchange buffers (``memory.cp_buffer_bytes``). With the MLP over tiles this stage is the larger
    one: on the H200 (1B, tiled, 15 layers offloaded, compiled) the model gives 25.30 GiB at 131,072 tokens
    (24.95 measured) and 74.65 at 1,048,576 (73.13); without the flash buffers, where the MLP stage would be
    the larger, 24.49 / 67.49.

Where in the backward: processing layer j (L-1 first, 0 last) frees its kept activations once done and
leaves its gradients (bf16 on the one-rank flat path, the reduced float32 shard under FSDP; nothing new
with accumulation, where they are added into existing ones); FSDP over one rank also frees the layer's
gathered copy then. With activation offload of the first K
layers, layer K-1's input is prefetched from the start of the backward, and each offloaded layer's input
comes back while the one above runs (``parallel/offload.py``): two inputs on the GPU, and the gradients
of the layers above. ``position_extra`` is the most, over j, of these relative to the first layer.
"""

from __future__ import annotations

from ndparallel.mesh.layout import Layout
from ndparallel.parallel.tiled_mlp import tile_count
from ndparallel.planner.activations import ActivationBytes, attention_side, mlp_tensors
from ndparallel.planner.shapes import ModelShape

# Per token, in units of e*i/t: the MLP tensors held at once in its backward (forward's four + gradients).
MLP_BACKWARD_WIDTH = {False: 6, True: 7}  # eager (CPU-counted), compiled (H200)


def tile_tokens(m: ModelShape, layout: Layout, seq: int, b: int, num_tiles: int | None = None) -> float:
    """Tokens of the rank in one MLP tile (``tiled_mlp.tile_count`` cuts each rank's sequence shard, then the
    MLP gathers the tile over tp): b rows x the largest tile."""
    local = -(-(seq // layout.cp) // layout.tp)
    tiles = tile_count(local, hidden=m.hidden, intermediate=m.intermediate, num_tiles=num_tiles)
    return b * -(-local // tiles) * layout.tp


def mlp_stage(
    m: ModelShape,
    layout: Layout,
    seq: int,
    b: int,
    e: int,
    acts: ActivationBytes,
    *,
    compiled: bool,
    tiled: bool,
    selective: bool = False,
    lora_rank: int | None = None,
    num_tiles: int | None = None,
) -> float:
    """Bytes beyond the kept activations at the layer's MLP backward (module docstring)."""
    t, h, i = layout.tp, m.hidden, m.intermediate
    n = b * (seq // layout.cp)
    width = MLP_BACKWARD_WIDTH[compiled] * e * i / t
    grad_out = e * h * n / t + (e * h * n if t > 1 else 0)
    if not tiled:  # the recompute (or the kept activations) already hold the MLP's forward tensors
        held = width - mlp_tensors(m, t, e, frozen=bool(lora_rank), compiled=compiled)
        weights = 0 if lora_rank else e * h * i / t
        # eager selective: down_proj's cached output, which the recompute never reaches (it stops at the
        # last tensor backward needs), is still held
        cached = e * h * n if selective and not compiled else 0
        return acts.layer_recompute + held * n + grad_out + weights + cached
    tile = tile_tokens(m, layout, seq, b, num_tiles)
    done = e * h * max(n - tile, 0) / t
    weights = 0 if lora_rank else 3 * e * h * i / t
    tile_grad_out = e * h * tile if t > 1 else 0  # the tile's MLP output gradient, gathered over tp
    return acts.layer_recompute + width * tile + e * h * n / t + tile_grad_out + done + weights


def attention_stage(
    m: ModelShape,
    layout: Layout,
    seq: int,
    b: int,
    e: int,
    acts: ActivationBytes,
    mode: str,
    *,
    compiled: bool,
    lora_rank: int | None = None,
    cp_buffers: float = 0.0,
) -> float:
    """Bytes beyond the kept activations at the layer's attention backward (module docstring)."""
    t, h, q, kv = layout.tp, m.hidden, m.q_dim, m.kv_dim
    n = b * (seq // layout.cp)
    if mode == "full":
        recomputed = attention_side(m, layout, seq, b, e, lora_rank, compiled)
    else:  # none: all kept; selective: at most what it recomputes for the whole layer
        recomputed = acts.layer_recompute
    grads = e * h / t + (e * h if t > 1 else 0) + e * q / t
    per_head = 2 * e * (q if m.kv_heads != m.heads else kv) / t
    summed = 2 * e * kv / t if m.kv_heads != m.heads else 0
    flash = 4 * q / t + e * q / t + per_head + summed
    return recomputed + n * (grads + flash) + cp_buffers


def position_extra(layers: int, offloaded: int, per_layer: float, grad_per_layer: float) -> float:
    """Most bytes, over the layers of the backward, of the kept inputs and finished gradients beyond what the
    kept activations were at its start (``offloaded`` first layers' inputs on the host; ``grad_per_layer``:
    what a finished layer leaves, less any copy it frees; module docstring)."""
    first_kept = offloaded  # layers offloaded..layers-1 keep their activations on the GPU

    def extra(j: int) -> float:
        done = layers - 1 - j
        if j >= first_kept:
            return (per_layer if offloaded else 0.0) + done * (grad_per_layer - per_layer)
        kept_freed = (layers - first_kept) * per_layer
        return -kept_freed + per_layer * (2 if j >= 1 else 1) + done * grad_per_layer

    points = {layers - 1, max(first_kept, 0), 1, 0}
    return max(extra(j) for j in points if 0 <= j < layers)
