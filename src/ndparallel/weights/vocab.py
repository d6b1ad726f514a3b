"""Growing the vocabulary for tokens a config adds (``special_tokens``, ``tokens``), on every layout.

The embedding and output matrices grow to hold the new tokens, rounded up to a multiple of 64 and of
tensor_parallel_size (TP splits the vocabulary dim evenly). Each rank reads the full checkpoint tensor
(V_old, hidden), appends rows and keeps its slice, so the grown model is the same on every layout: new rows
are the mean of the existing rows, for the input embeddings and the output head alike (transformers samples
around that mean instead; a fixed value keeps runs comparable across layouts).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ndparallel.errors import ConfigError

VOCAB_MULTIPLE = 64


def padded_vocab(tokens: int, tp: int) -> int:
    """``tokens`` rounded up to a multiple of 64 and of ``tp``."""
    step = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-tokens // step) * step


def fit_vocab(model_config: Any, tokenizer_size: int, added: list[str], *, tp: int) -> tuple[int | None, str | None]:
    """Grow ``model_config.vocab_size`` when the tokenizer outgrew it by tokens the config added.

    Returns the vocabulary size the checkpoint has (None when nothing grows) and a one-line note for the user.
    A tokenizer larger than the model for any other reason is an error: it is not the model's tokenizer.
    """
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is None or tokenizer_size <= vocab:  # no vocabulary of its own (a multimodal wrapper): refused elsewhere
        return None, None
    if not added:
        raise ConfigError(
            f"the tokenizer has {tokenizer_size} tokens but the model's vocab_size is {vocab}; use the "
            f"model's own tokenizer or raise vocab_size"
        )
    grown = padded_vocab(tokenizer_size, tp)
    model_config.vocab_size = grown
    shown = ", ".join(added[:4]) + (" ..." if len(added) > 4 else "")
    note = (
        f"vocabulary: {len(added)} token(s) added ({shown}); embeddings grow from {vocab} to {grown} rows "
        f"(a multiple of {math.lcm(VOCAB_MULTIPLE, tp)}, so tensor_parallel_size {tp} divides it); new rows "
        f"start at the mean row"
    )
    return vocab, note


def grow_rows(full: torch.Tensor, shape: tuple[int, ...], vocab_from: int | None) -> torch.Tensor:
    """``full`` (vocab_from, hidden) from a checkpoint, grown to ``shape`` with mean rows when the vocabulary
    grew; any other tensor unchanged (a wrong shape is reported by the caller)."""
    if (
        vocab_from is None
        or full.dim() != 2
        or full.shape[0] != vocab_from
        or shape[0] <= vocab_from
        or tuple(full.shape[1:]) != tuple(shape[1:])
    ):
        return full
    mean = full.float().mean(dim=0, keepdim=True).to(full.dtype)
    return torch.cat([full, mean.expand(shape[0] - vocab_from, -1)], dim=0)
