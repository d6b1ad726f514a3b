"""Datasets -> cached training (and evaluation) rows.

``build_rows`` reads and tokenizes every dataset once, in order, splits off the evaluation examples,
packs or pads both splits and caches them (``cache.py``); the next call with the same inputs maps the
cached arrays without tokenizing. In a multi-process run use ``build_rows_distributed``: one process
builds, the others wait at a barrier and then map the same files.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from ndparallel.data.cache import (
    FORMAT_VERSION,
    cache_key,
    load_splits,
    save_splits,
    source_identity,
    tokenizer_identity,
)
from ndparallel.data.examples import ExampleStore
from ndparallel.data.load_tokenizer import ensure_pad_token
from ndparallel.data.packing import pack_examples, pad_examples
from ndparallel.data.rows import Rows
from ndparallel.data.sources import read_records
from ndparallel.data.spec import DatasetSpec
from ndparallel.data.tokenize import LONG_ROWS_POLICIES, fit_long_rows, tokenize_records
from ndparallel.errors import DataError

logger = logging.getLogger(__name__)

SpecLike = DatasetSpec | dict[str, Any]


@dataclass(frozen=True)
class _Options:
    """Everything besides the sources and the tokenizer that decides the rows (and so the cache key)."""

    seq_len: int
    packing: bool
    long_rows: str
    eval_fraction: float
    seed: int
    min_len: int
    eval_packing: bool
    token_budget: int | None
    deduplicate: bool

    @classmethod
    def of(
        cls,
        *,
        seq_len: int,
        packing: bool,
        long_rows: str | None = None,
        eval_fraction: float = 0.0,
        seed: int = 0,
        min_len: int = 1,
        eval_packing: bool | None = None,
        token_budget: int | None = None,
        deduplicate: bool = False,
    ) -> "_Options":
        """``build_rows``'s options with its defaults (the same for every process of a run)."""
        return cls(
            seq_len=seq_len,
            packing=packing,
            long_rows=long_rows or ("split" if packing else "error"),
            eval_fraction=eval_fraction,
            seed=seed,
            min_len=min_len,
            eval_packing=packing if eval_packing is None else eval_packing,
            token_budget=token_budget,
            deduplicate=deduplicate,
        )


def build_rows(
    specs: Sequence[SpecLike],
    tokenizer: PreTrainedTokenizerBase,
    *,
    seq_len: int,
    packing: bool,
    cache_dir: str | Path,
    long_rows: str | None = None,
    eval_fraction: float = 0.0,
    seed: int = 0,
    min_len: int = 1,
    eval_packing: bool | None = None,
    token_budget: int | None = None,
    deduplicate: bool = False,
    show_progress: bool = False,
) -> tuple[Rows, Rows | None]:
    """Training rows and evaluation rows (None when ``eval_fraction`` is 0), from the cache when possible.

    ``long_rows`` (``error`` / ``truncate`` / ``drop`` / ``split``) handles examples longer than ``seq_len``;
    unset, packing splits them and padding refuses them. Examples shorter than ``min_len`` tokens are left
    out. ``deduplicate``: an example whose token ids and labels repeat an earlier one is left out (Axolotl's
    ``dataset_exact_deduplication``), before the split, so neither split repeats itself or the other.
    ``eval_fraction`` of the examples (a fraction below 1, or a number of examples; at least one), chosen
    by a shuffle seeded with ``seed``, become the evaluation split before packing; ``eval_packing`` (default:
    ``packing``) says whether its rows are packed. ``token_budget``: stop reading the datasets (in order) once
    this many tokens are tokenized (a pretraining corpus read only as far as the steps need). A tokenizer
    without a pad token gets eos as pad token (``ensure_pad_token``): pad positions are masked, so the id does
    not matter. ``show_progress``: a bar per dataset while tokenizing (in a terminal; else a line each).
    """
    options = _Options.of(
        seq_len=seq_len,
        packing=packing,
        long_rows=long_rows,
        eval_fraction=eval_fraction,
        seed=seed,
        min_len=min_len,
        eval_packing=eval_packing,
        token_budget=token_budget,
        deduplicate=deduplicate,
    )
    specs, directory, inputs = _cache_location(specs, tokenizer, cache_dir, options)
    cached = load_splits(directory)
    if cached is None:
        save_splits(directory, _build(specs, tokenizer, options, show_progress), {"inputs": inputs})
        cached = load_splits(directory)
        if cached is None:
            raise DataError(f"the data cache {directory} was written but cannot be read back; check cache_dir's disk")
        logger.info("data cache written to %s", directory)
    else:
        logger.info("data loaded from cache %s", directory)
    return cached["train"], cached.get("eval")


def build_rows_distributed(
    specs: Sequence[SpecLike],
    tokenizer: PreTrainedTokenizerBase,
    *,
    is_main: bool,
    barrier: Callable[[], None],
    cache_dir: str | Path,
    show_progress: bool = False,
    **options,
) -> tuple[Rows, Rows | None]:
    """``build_rows`` on the main process only; every process waits at ``barrier`` and then maps the cache.
    ``options`` are ``build_rows``'s.

    ``is_main`` is global rank 0 when ``cache_dir`` is shared by all nodes, the local rank 0 of each node
    when it is on local disk. If the main process fails it still reaches the barrier (so nobody hangs) and
    re-raises; the others then report that the cache is missing.
    """
    if is_main:
        try:
            result = build_rows(specs, tokenizer, cache_dir=cache_dir, show_progress=show_progress, **options)
        finally:
            barrier()
        return result
    barrier()
    _, directory, _ = _cache_location(specs, tokenizer, cache_dir, _Options.of(**options))
    cached = load_splits(directory)
    if cached is None:
        raise DataError(
            f"no data cache at {directory} after the main process built it: it failed (see its error) or "
            f"cache_dir={str(cache_dir)!r} is not shared with this process; put cache_dir on a shared filesystem"
        )
    return cached["train"], cached.get("eval")


def _cache_location(specs, tokenizer, cache_dir, options: _Options):
    """Checked specs, the cache directory of these inputs, and the inputs themselves (for the manifest)."""
    specs = [spec if isinstance(spec, DatasetSpec) else DatasetSpec.from_dict(spec) for spec in specs]
    if not specs:
        raise DataError("datasets: is empty; list at least one dataset with path: and type:")
    if options.long_rows not in LONG_ROWS_POLICIES:
        raise DataError(f"long_rows={options.long_rows!r} is not a policy; use one of {', '.join(LONG_ROWS_POLICIES)}")
    fraction = options.eval_fraction
    if not isinstance(fraction, (int, float)) or fraction < 0 or (fraction >= 1 and fraction != int(fraction)):
        raise DataError(
            f"val_set_size={fraction!r} must be a fraction in [0, 1) or a whole number of examples; "
            f"e.g. 0.05 keeps 5% for evaluation"
        )
    seq_len = options.seq_len
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise DataError(f"sequence_len={seq_len!r} must be a whole number >= 1; fix sequence_len")
    ensure_pad_token(tokenizer)  # before the identity is taken: it includes the pad id
    chosen = dict(
        seq_len=seq_len,
        packing=bool(options.packing),
        long_rows=options.long_rows,
        eval_fraction=float(fraction),
        seed=int(options.seed),
        min_len=int(options.min_len),
        eval_packing=bool(options.eval_packing),
        token_budget=options.token_budget,
    )
    if options.deduplicate:  # only when set: caches written before this option keep their key
        chosen["deduplicate"] = True
    inputs = {
        "format_version": FORMAT_VERSION,
        "sources": [source_identity(spec) for spec in specs],
        "tokenizer": tokenizer_identity(tokenizer),
        "options": chosen,
    }
    return specs, Path(cache_dir).expanduser() / cache_key(inputs), inputs


def _build(specs, tokenizer, options: _Options, show_progress: bool = False) -> dict[str, Rows]:
    """Tokenize all datasets in order (up to the token budget), leave out repeats if asked, fit the lengths,
    split, then pack or pad each split."""
    pad_id = ensure_pad_token(tokenizer)
    budget = options.token_budget
    examples = ExampleStore()
    for spec in specs:
        before = len(examples)
        with _tokenizing_bar(spec.label, show_progress, lambda: len(examples) - before) as bar:
            for example in tokenize_records(read_records(spec), tokenizer, spec):
                examples.append(example)
                bar.update(1)
                if budget is not None and examples.num_tokens >= budget:
                    break
        logger.info("dataset %s: %d examples", spec.label, len(examples) - before)
        if budget is not None and examples.num_tokens >= budget:
            break
    if options.deduplicate:
        examples = without_repeats(examples)
    seq_len, min_len = options.seq_len, options.min_len
    examples = fit_long_rows(examples, seq_len, options.long_rows, min_len=min_len)
    if not len(examples):
        raise DataError(
            f"no example of {min_len} to sequence_len={seq_len} tokens is left (long_rows={options.long_rows}); "
            f"raise sequence_len, or set long_rows (excess_length_strategy) to truncate or split"
        )
    train, evaluation = split_examples(examples, options.eval_fraction, options.seed)
    splits = {"train": (pack_examples if options.packing else pad_examples)(train, seq_len, pad_id)}
    if evaluation is not None:
        splits["eval"] = (pack_examples if options.eval_packing else pad_examples)(evaluation, seq_len, pad_id)
    return splits


@contextlib.contextmanager
def _tokenizing_bar(label: str, show: bool, count: Callable[[], int]):
    """A tqdm bar counting examples in a terminal; elsewhere one closing line per dataset (logs, CI)."""
    from tqdm.auto import tqdm

    in_terminal = show and sys.stderr.isatty()
    with tqdm(desc=f"tokenizing {label}", unit=" examples", disable=not in_terminal, dynamic_ncols=True) as bar:
        yield bar
    if show and not in_terminal:
        print(f"  tokenized {label}: {count():,} examples", flush=True)


def without_repeats(examples: ExampleStore) -> ExampleStore:
    """``examples`` without those whose token ids and labels repeat an earlier example's (order kept)."""
    seen: set[bytes] = set()
    keep = []
    for index, example in enumerate(examples):
        digest = hashlib.sha256(example.input_ids.tobytes() + example.labels.tobytes()).digest()
        if digest not in seen:
            seen.add(digest)
            keep.append(index)
    if len(keep) < len(examples):
        logger.warning(
            "dataset_exact_deduplication: %d of %d examples repeat an earlier one and are left out",
            len(examples) - len(keep),
            len(examples),
        )
        return examples.subset(keep)
    return examples


def split_examples(examples: ExampleStore, fraction: float, seed: int) -> tuple[ExampleStore, ExampleStore | None]:
    """(train, eval): ``round(fraction * n)`` examples (at least one; ``fraction`` >= 1 is a count) picked by a
    seeded shuffle go to eval.

    Both splits keep the examples' original order.
    """
    if fraction == 0:
        return examples, None
    total = len(examples)
    count = int(fraction) if fraction >= 1 else max(1, round(fraction * total))
    if count >= total:
        raise DataError(
            f"eval_fraction={fraction} of {total} examples leaves no training example; lower eval_fraction or add data"
        )
    chosen = np.zeros(total, dtype=bool)
    chosen[np.random.default_rng(seed).permutation(total)[:count]] = True
    return examples.subset(np.flatnonzero(~chosen)), examples.subset(np.flatnonzero(chosen))
