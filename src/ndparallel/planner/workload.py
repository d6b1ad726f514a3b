"""What is trained: sequence length, batch, precision, activation checkpointing, full or LoRA fine-tuning, and
the long-row memory features (fused loss, tiled MLP, activation offload)."""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.errors import ConfigError
from ndparallel.mesh.layout import CP_METHODS
from ndparallel.parallel.activation_checkpoint import MODES as AC_MODES

PRECISIONS = ("bf16", "fp32")
QUANTIZED_FORMATS = ("nf4", "int8", "fp8")
EIGHT_BIT_STATE_BYTES = 2 + 2 * 4 / 256
"""torchao's AdamW8bit per trained value: two 1-byte moments, each with an fp32 scale per block of 256."""
# Gradient sync under accumulation, named as the trainer's ``gradient_sync`` setting. 'every_micro_batch' (the
# default): FSDP reduce-scatters every micro-batch and keeps only its fp32 shard; replicas (dp_replicate)
# all-reduce once, on the last micro-batch. 'last_micro_batch': nothing is reduced until the last micro-batch;
# every FSDP unit keeps its full unsharded fp32 gradient in between. 'auto' lets the planner try both.
GRAD_SYNC_MODES = ("every_micro_batch", "last_micro_batch")
GRAD_SYNC = ("auto", *GRAD_SYNC_MODES)
# A long-row feature the planner may switch on: True / False as the run has it, or 'auto': off where the
# candidate fits without it, tried on a layout none of whose candidates fits (``plan.py``).
SWITCHES = (False, True, "auto")


@dataclass(frozen=True)
class Workload:
    """One training step's shape and numerics.

    ``precision='bf16'`` is ndparallel's default mixed precision: bf16 compute and gathered weights, fp32
    master weights, fp32 gradients (reduced in fp32) and fp32 AdamW states (``bf16_weights``: bf16 weights and
    gradients; ``eight_bit_optimizer``: 8-bit states). ``'fp32'`` computes in fp32.
    """

    seq_len: int
    global_batch_rows: int | None = None
    """Rows of seq_len tokens per optimizer step (give this or global_batch_tokens)."""
    global_batch_tokens: int | None = None
    """Tokens per optimizer step; rows = ceil(tokens / seq_len)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Rows per data rank per forward/backward to consider; the rest of a rank's rows are accumulated."""
    precision: str = "bf16"
    activation_checkpointing: str = "auto"
    """'none', 'full', 'selective', or 'auto' to consider all three."""
    lora_rank: int | None = None
    """LoRA rank r: base weights frozen (stored in the compute dtype, as ``freeze.store_frozen_in`` keeps them,
    without gradients or optimizer state), adapters on all seven linears of each layer."""
    cp_methods: tuple[str, ...] = CP_METHODS
    """CP methods to consider when cp > 1."""
    gradient_sync: str = "auto"
    """With gradient accumulation: 'every_micro_batch' (reduce-scatter every micro-batch, replicas all-reduce on the
    last), 'last_micro_batch' (reduce on the last micro-batch only; full fp32 gradients kept), 'auto' tries both."""
    compile: bool = False
    """torch.compile of each decoder layer and of the loss (the trainer's ``compile`` option)."""
    fp8: bool = False
    """float8 matmuls (tensorwise scales) in the decoder layers' linears; lm_head stays bf16."""
    doc_len: int | None = None
    """Packed rows of documents this long on average (attention does not cross documents); None: each row
    is one sequence of seq_len tokens."""
    single_rank_fsdp: bool = False
    """A world of one rank wrapped in FSDP2 (``ParallelOptions.single_rank_fsdp``). By default one rank runs the
    engine's flat path (``parallel/single_rank.py``): no FSDP copies, ``FlatAdamW`` with clipping folded in."""
    quantized_base: str | None = None
    """LoRA on quantized frozen base weights (needs ``lora_rank``): 'nf4' (``load_in_4bit``, QLoRA) or 'int8'
    (``load_in_8bit``): the decoder blocks' linear weights stored as ``ndparallel.quantized`` stores them and
    dequantized in every pass that reads them. None: the base in the compute dtype."""
    master_grads: bool = False
    """On that flat path, fp32 gradients in the parameters' ``.grad`` (``build_optimizer``'s default, for a user's
    own loop). False is the trainer's: AdamW reads the bf16 gradients where autograd left them."""
    fused_loss: bool = True
    """lm_head and the cross-entropy fused over chunks of rows (``loss/fused.py``; the trainer's
    ``fused_cross_entropy``, on by default): no (tokens x vocabulary) logits are held. False: the model's logits go
    to the chunked cross-entropy (``loss/cross_entropy.py``), as every measurement before 2026-12-03 ran."""
    tiled_mlp: bool | str = "auto"
    """Each dense MLP over sequence tiles, one tile's (tokens x intermediate) tensors at a time
    (``parallel/tiled_mlp.py``; the trainer's ``tiled_mlp``): True, False, or 'auto' (tried where nothing fits)."""
    tiled_mlp_num_shards: int | None = None
    """Tiles per MLP call (``tiled_mlp_num_shards``); None: ``tiled_mlp.tile_count``'s choice from the row."""
    activation_offload: bool | str = "auto"
    """The inputs full checkpointing keeps, of the first layers, wait in pinned host memory (``parallel/offload.py``;
    the trainer's ``activation_offloading``): True, False, or 'auto' (tried where nothing fits). Full checkpointing
    only."""
    bf16_weights: bool = False
    """The trained weights stored in bf16 with no fp32 copy (``bf16: full``, ``ParallelOptions.master_dtype``):
    2 bytes a parameter, bf16 gradients (still reduced through fp32 temporaries), no compute copies."""
    eight_bit_optimizer: bool = False
    """AdamW's two moments as 8-bit codes with an fp32 scale per 256 values (torchao's AdamW8bit,
    ``optimizer: adamw_8bit``): EIGHT_BIT_STATE_BYTES a trained parameter instead of 8."""
    embedding_offload: bool = False
    """The frozen input embedding in pinned host memory (``parallel/host_embedding.py``, the trainer's
    ``embedding_offload``): its table leaves the GPU. LoRA on one GPU, untied embeddings (elsewhere it is ignored:
    the rules refuse the run)."""
    activation_offload_layers: int | None = None
    """How many first layers offload (``activation_offload_layers``); None: as many as the host memory of
    ``Cluster.host_memory_gib`` holds, all but the last (``offload.offload_layer_count``'s rule)."""

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError(f"seq_len={self.seq_len!r} must be a whole number of tokens >= 1")
        if (self.global_batch_rows is None) == (self.global_batch_tokens is None):
            raise ConfigError("give exactly one of global_batch_rows or global_batch_tokens (e.g. --global-batch 64)")
        for name in ("global_batch_rows", "global_batch_tokens", "lora_rank", "doc_len", "tiled_mlp_num_shards"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
        if not self.micro_batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.micro_batch_sizes):
            raise ConfigError(f"micro_batch_sizes={self.micro_batch_sizes!r} must be whole numbers >= 1, e.g. 1,2,4")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.activation_checkpointing not in (*AC_MODES, "auto"):
            raise ConfigError(
                f"activation_checkpointing={self.activation_checkpointing!r} must be one of "
                f"{', '.join((*AC_MODES, 'auto'))}"
            )
        bad = [m for m in self.cp_methods if m not in CP_METHODS]
        if bad or not self.cp_methods:
            raise ConfigError(f"cp_methods={self.cp_methods!r} must be a non-empty subset of {', '.join(CP_METHODS)}")
        if self.gradient_sync not in GRAD_SYNC:
            raise ConfigError(f"gradient_sync={self.gradient_sync!r} must be one of {', '.join(GRAD_SYNC)}")
        if self.quantized_base is not None:
            if self.quantized_base not in QUANTIZED_FORMATS:
                raise ConfigError(
                    f"quantized_base={self.quantized_base!r} must be one of {', '.join(QUANTIZED_FORMATS)} or None"
                )
            if not self.lora_rank:
                raise ConfigError(
                    "a quantized base (load_in_4bit / load_in_8bit / load_in_fp8) trains LoRA adapters only: give "
                    "--lora-rank"
                )
        if self.bf16_weights and (self.precision != "bf16" or self.lora_rank):
            raise ConfigError(
                "bf16 weights (bf16: full) are for bf16 full fine-tunes: drop --lora-rank, or bf16_weights"
            )
        if self.fp8 and self.precision != "bf16":
            raise ConfigError("fp8 matmuls need precision='bf16' (mixed precision); drop --fp8 or use bf16")
        self._check_features()

    def _check_features(self) -> None:
        for name in ("tiled_mlp", "activation_offload"):
            if getattr(self, name) not in SWITCHES:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true, false or 'auto'")
        layers = self.activation_offload_layers
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
            raise ConfigError(f"activation_offload_layers={layers!r} must be a whole number >= 0")
        if self.activation_offload is True and "full" not in self.ac_modes:
            raise ConfigError(
                "activation offload moves the layer inputs that full activation checkpointing keeps: plan "
                "activation_checkpointing full (or auto)"
            )

    @property
    def master_bytes(self) -> int:
        """Bytes a trained weight is stored in, and its sharded gradient."""
        return 2 if self.bf16_weights else 4

    @property
    def optimizer_state_bytes(self) -> float:
        return EIGHT_BIT_STATE_BYTES if self.eight_bit_optimizer else 8.0

    @property
    def rows(self) -> int:
        if self.global_batch_rows is not None:
            return self.global_batch_rows
        return -(-self.global_batch_tokens // self.seq_len)

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.rows * self.seq_len

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and gathered weights."""
        return 2 if self.precision == "bf16" else 4

    @property
    def attended_keys(self) -> int:
        """Keys a query attends to at most: the document length of packed rows, else the row."""
        return min(self.doc_len, self.seq_len) if self.doc_len else self.seq_len

    @property
    def gradient_sync_modes(self) -> tuple[str, ...]:
        return GRAD_SYNC_MODES if self.gradient_sync == "auto" else (self.gradient_sync,)

    @property
    def ac_modes(self) -> tuple[str, ...]:
        return AC_MODES if self.activation_checkpointing == "auto" else (self.activation_checkpointing,)

    @property
    def tiled_mlp_modes(self) -> tuple[bool, ...]:
        """Tiling settings to try on a layout: the run's, or off and then on ('auto')."""
        return (False, True) if self.tiled_mlp == "auto" else (bool(self.tiled_mlp),)

    @property
    def offload_modes(self) -> tuple[bool, ...]:
        """Offload settings to try on a layout: the run's, or off and then on ('auto', with full checkpointing)."""
        if self.activation_offload == "auto":
            return (False, True) if "full" in self.ac_modes else (False,)
        return (bool(self.activation_offload),)
