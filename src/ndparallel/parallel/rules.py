"""Every rule of what composes: strategies with each other, and a model with a layout. The config's checks
(so ``validate`` and ``train``), ``parallelize`` and the planner ask here, and nowhere else.

- ``option_problems`` / ``check_options``: which strategies combine (quantized base weights need adapters and
  refuse fp8, NF4 refuses tensor parallelism, QAT trains the full weights alone, ``unfrozen_parameters`` and
  fp8 refuse LoRA);
- ``embedding_offload_problems``: where a frozen input embedding may wait in host memory;
- ``model_problems`` / ``check_model``: whether a model's shapes split over a layout (tp divides the heads
  and the MLP width, alltoall's head split, the family's and the mixture-of-experts refusals, a sequence
  long enough for every rank).

Each rule yields one line per problem, naming the settings as the config file spells them and the fix.
Layer: a strategy-level module (it reads ``mesh``, ``models``, ``quantized`` and ``adapters``); it takes plain
values, never the config.
"""

from __future__ import annotations

from typing import Any, Iterator

from ndparallel.adapters.qat import QatSpec, check_spec
from ndparallel.errors import ConfigError, LayoutError
from ndparallel.mesh.layout import Layout
from ndparallel.models.families import family_problems
from ndparallel.models.moe import is_moe_config, moe_problems
from ndparallel.quantized.linears import FORMATS


def check_options(**options: Any) -> None:
    """Raise ``ConfigError`` with the first of ``option_problems(**options)``."""
    for problem in option_problems(**options):
        raise ConfigError(problem)


def option_problems(
    *,
    lora: bool,
    quantized_base: str | None,
    fp8: bool,
    qat: QatSpec | None,
    unfrozen: bool,
    tp: int,
    bf16_weights: bool = False,
) -> Iterator[str]:
    """Why these strategies cannot be combined (nothing when they can). ``lora``: adapters are attached;
    ``quantized_base``: 'nf4', 'int8' or None; ``unfrozen``: ``unfrozen_parameters`` selects the trained
    weights; ``tp``: the tensor-parallel size; ``bf16_weights``: trainable weights stored in bf16, no float32
    masters (``bf16: full``)."""
    if bf16_weights:
        yield from _bf16_weights_problems(lora=lora, fp8=fp8, qat=qat is not None)
    if quantized_base is not None:
        yield from _quantized_problems(quantized_base, lora=lora, tp=tp, fp8=fp8)
    if qat is not None:
        yield from _qat_problems(qat, lora=lora, quantized=quantized_base is not None, fp8=fp8, tp=tp)
    if unfrozen and lora:
        yield (
            "unfrozen_parameters with adapter: lora is not supported: LoRA already freezes the base weights "
            "(train whole modules beside the adapters with lora_modules_to_save), or drop adapter for a "
            "full fine-tune of the listed weights"
        )
    if fp8 and lora and quantized_base is None:  # quantized base weights said so already
        yield (
            "fp8: true with adapter: lora is not supported (LoRA's adapters are far below FP8's useful size); "
            "for FP8 products on the frozen base set load_in_fp8: true and fp8: false"
        )


def _bf16_weights_problems(*, lora: bool, fp8: bool, qat: bool) -> Iterator[str]:
    """``bf16: full`` removes the float32 copy of a full fine-tune's weights; where that copy is small (adapters)
    or another recipe owns the weights' precision (FP8 training, QAT), it is refused rather than left untested."""
    if lora:
        yield (
            "bf16: full with adapter: lora is not supported: adapters' float32 copies are a few MB, and the base "
            "is stored in bf16 already; use bf16: true"
        )
    if fp8 or qat:
        yield f"bf16: full with {'fp8: true' if fp8 else 'qat'} is not supported; use bf16: true"


def _quantized_problems(fmt: str, *, lora: bool, tp: int, fp8: bool) -> Iterator[str]:
    """Frozen quantized base weights (``quantized/``): only adapters train on them, NF4 splits by rows only."""
    if fmt not in FORMATS:
        yield f"quantized_base={fmt!r} must be one of {sorted(FORMATS)} or None"
        return
    setting = FORMATS[fmt]
    if not lora:
        adapter, bits = ("qlora", 4) if fmt == "nf4" else ("lora", 8)
        yield (
            f"{setting}: true needs adapter: {adapter}: {bits}-bit base weights are frozen, so only adapters can "
            f"train; set adapter: {adapter}, or {setting}: false for a full fine-tune"
        )
    if fmt == "fp8" and tp > 1:
        yield (
            "load_in_fp8 with tensor_parallel_size > 1 is not supported (split FP8 weights would multiply in bf16, "
            "another run than one rank's); set tensor_parallel_size: 1 and shard with dp_shard_size, or use "
            "load_in_8bit"
        )
    if fmt == "nf4" and tp > 1:
        yield (
            "load_in_4bit with tensor_parallel_size > 1 is not supported (4-bit weights split by rows only); "
            "set tensor_parallel_size: 1 and shard with dp_shard_size, or use load_in_8bit"
        )
    if fp8:
        yield f"{setting} with fp8: true is not supported; set fp8: false"


def _qat_problems(spec: QatSpec, *, lora: bool, quantized: bool, fp8: bool, tp: int) -> Iterator[str]:
    """Quantization-aware training (``adapters/qat.py``) fake-quantizes the full weights of every linear layer."""
    if lora or quantized:
        yield "qat with adapter / load_in_4bit / load_in_8bit is not supported: QAT trains the full weights"
    if fp8:
        yield "qat with fp8: true is not supported (both change the linear layers); keep one"
    if tp > 1:
        yield (
            "qat with tensor_parallel_size > 1 is not supported (fake quantization scales whole rows and "
            "groups that tensor parallelism splits); shard with dp_shard_size instead"
        )
    try:
        check_spec(spec)
    except ConfigError as exc:
        yield str(exc)


def embedding_offload_problems(
    *,
    adapters: bool,
    embedding_trained: bool = False,
    cpu_offload: bool = False,
    world_size: int | None = None,
    tied: bool | None = None,
    plain_lookup: bool = True,
) -> Iterator[str]:
    """Why the input embedding cannot wait in host memory (``parallel/host_embedding.py``): it must be frozen, on
    one process, and not lm_head's weight too. Unknown facts (None) are checked where they are known."""
    if not adapters:
        yield (
            "embedding_offload keeps a frozen input embedding in host memory: it needs adapter: lora or qlora (a full "
            "fine-tune trains the embedding); remove embedding_offload"
        )
    elif embedding_trained:
        yield (
            "embedding_offload with the input embedding in lora_modules_to_save: a trained embedding stays on the "
            "GPU; remove one of them"
        )
    if cpu_offload:
        yield "embedding_offload with cpu_offload: every weight is in host memory already; remove embedding_offload"
    if world_size is not None and world_size > 1:
        yield (
            f"embedding_offload is for one process (this run has {world_size}, over which FSDP shards the "
            f"embedding already); remove embedding_offload"
        )
    if not plain_lookup:
        yield (
            "embedding_offload: this model's input embedding computes more than a table lookup (e.g. a scale); "
            "remove embedding_offload"
        )
    if tied:
        yield (
            "embedding_offload: this model ties its input embedding to lm_head (tie_word_embeddings), whose weight "
            "the loss reads on the GPU; remove embedding_offload"
        )


def check_model(layout: Layout, model_config: Any, *, seq_len: int | None = None) -> None:
    """Raise ``LayoutError`` if the model's shapes cannot be split this way (all problems at once)."""
    problems = list(model_problems(layout, model_config, seq_len=seq_len))
    if problems:
        raise LayoutError("; ".join(problems))


def model_problems(layout: Layout, model_config: Any, *, seq_len: int | None = None) -> Iterator[str]:
    """Why ``model_config``'s shapes cannot be split over ``layout`` (nothing when they can)."""
    yield from _head_problems(model_config)
    yield from moe_problems(model_config, tp=layout.tp, cp=layout.cp, ep=layout.ep)
    yield from _tp_split_problems(layout.tp, model_config)
    heads = getattr(model_config, "num_attention_heads", None)
    t, c = layout.tp, layout.cp
    if c > 1 and layout.cp_comm_strategy == "alltoall" and heads is not None and heads % (c * t):
        yield (
            f"cp_comm_strategy='alltoall' splits attention heads over cp_size x tp_size = {c * t}, "
            f"which does not divide num_attention_heads={heads}; use cp_comm_strategy='allgather' or 'ring', "
            f"or sizes whose product divides {heads}"
        )
    # What the model's family cannot do on these sizes (e.g. soft-capped attention under cp).
    yield from family_problems(model_config, tp=t, cp=c)
    if seq_len is not None and seq_len < layout.seq_multiple:
        yield (
            f"sequence_len={seq_len} is shorter than 2 x cp_size x tp_size = {layout.seq_multiple} tokens, "
            f"so some ranks would hold no tokens; use a longer sequence or smaller cp/tp"
        )


def _head_problems(model_config: Any) -> Iterator[str]:
    """Grouped-query attention shares each key/value head among a whole number of query heads; transformers does
    not check it, and a run would divide by zero inside attention (a crash of the process, not an error)."""
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        yield (
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} (each key/value head "
            f"serves a whole number of query heads); fix the model's config (model_config_overrides)"
        )


def _tp_split_problems(t: int, model_config: Any) -> Iterator[str]:
    """The shapes tensor parallelism splits: attention heads, key/value heads and the MLP width."""
    if t == 1:
        return
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    splits = {
        "num_attention_heads": ("attention heads", heads),
        "num_key_value_heads": ("key/value heads", kv_heads),
        # a mixture-of-experts model's MLPs are not split by tp (each tp rank runs them on its tokens)
        "intermediate_size": (
            "MLP intermediate size",
            None if is_moe_config(model_config) else getattr(model_config, "intermediate_size", None),
        ),
    }
    for attr, (what, value) in splits.items():
        if value is not None and value % t:
            divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]
            yield f"tp_size={t} does not divide the model's {what} ({attr}={value}); choose tp_size from {divisors}"
