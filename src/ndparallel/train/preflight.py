"""Cheap checks of what ``train`` would refuse only after its processes started (and, on a cluster, after
queueing and downloads): where ``output_dir`` lies and whether it can be written or already holds checkpoints,
and a sample of each dataset (empty files, binary files, records of the wrong shape, examples that cannot fit
``sequence_len``). ``validate`` runs them, and ``train`` before it starts any process.

Cheap means: no model, no full read of the data. Each dataset is sampled (its first records, about a MiB), so
a problem further into a file is still found by ``train``; what was not checked is said (``not_checked``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ndparallel.config.schema import TrainConfig
from ndparallel.data.hub_files import snapshot_patterns
from ndparallel.data.sources import sample_records
from ndparallel.data.tokenize import tokenize_records
from ndparallel.errors import NdParallelError
from ndparallel.safe_io import hub
from ndparallel.train.output_dir import check_output_dir, writable_dir_problem
from ndparallel.train.run_inputs import dataset_specs, load_run_tokenizer


@dataclass
class Preflight:
    problems: list[str] = field(default_factory=list)
    """One line each: what train would refuse, and the fix."""
    notes: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)

    def not_checked_line(self) -> str:
        items = ["the data beyond each dataset's first records (train reads it all)", *self.not_checked]
        return "not checked here: " + "; ".join(items)


def preflight(cfg: TrainConfig, *, tokenizer=None) -> Preflight:
    """Every cheap problem of ``cfg``; with ``tokenizer`` the sampled examples' lengths are checked too."""
    result = Preflight()
    result.problems += output_problems(cfg)
    _check_data(cfg, tokenizer, result)
    return result


def output_problems(cfg: TrainConfig) -> list[str]:
    """output_dir (and dataset_prepared_path): a directory that can be made and written, and no other run's
    checkpoints in the way (train's own rule, ``output_dir.check_output_dir``)."""
    problems = [
        problem
        for setting, path in (("output_dir", cfg.output_dir), ("dataset_prepared_path", cfg.dataset_prepared_path))
        if path is not None and (problem := writable_dir_problem(Path(path), setting))
    ]
    if not problems:
        try:
            check_output_dir(cfg, Path(cfg.output_dir))
        except NdParallelError as exc:
            problems.append(str(exc))
    return problems


def _check_data(cfg: TrainConfig, tokenizer, result: Preflight) -> None:
    specs = dataset_specs(cfg, template=getattr(tokenizer, "chat_template", None))
    names = [f"datasets[{i}]" for i in range(len(cfg.datasets))]
    names += [f"pretraining_dataset[{i}]" for i in range(len(cfg.pretraining_dataset or []))]
    fitting, sampled, every_record_read = [], [], True
    for name, spec in zip(names, specs):
        lengths, whole = _sample_lengths(name, spec, tokenizer, result)
        every_record_read &= whole
        if lengths is not None:
            fitting.append(_length_problem(name, spec.label, lengths, cfg, result))
            sampled += lengths
    if fitting and not any(fitting) and every_record_read:
        # a refusal only when the sample is all the data: a dataset's first examples may all be long and its
        # later ones fit (a folder of source files, sorted by name); each dataset's note says what was seen
        result.problems.append(_nothing_fits(cfg, sampled))
    elif tokenizer is None:
        result.not_checked.append("the examples' lengths (the tokenizer is not at hand)")


def _sample_lengths(name: str, spec, tokenizer, result: Preflight) -> tuple[list[int] | None, bool]:
    """Token lengths of ``spec``'s sampled examples (None when they could not be had or measured), and whether
    the sample holds every record of the dataset."""
    if hub.is_hub_id(spec.path) and not _hub_dataset_cached(spec):
        result.not_checked.append(f"{name} {spec.path!r} (a hub dataset not in the cache; train downloads it)")
        return None, False
    try:
        records, whole = sample_records(spec)
        if not records:
            if whole:
                result.problems.append(
                    f"{name}: {spec.label} holds no records (an empty file?); add data, or fix path:"
                )
            return None, whole
        if tokenizer is None:
            return None, whole
        return [len(e.input_ids) for e in tokenize_records(records, tokenizer, spec)], whole
    except NdParallelError as exc:
        result.problems.append(f"{name}: {exc}")
        return None, False


def _hub_dataset_cached(spec) -> bool:

    try:
        hub.dataset_dir(spec.path, revision=spec.revision, patterns=snapshot_patterns(spec), download=False)
        return True
    except NdParallelError:
        return False


def _length_problem(name: str, label: str, lengths: list[int], cfg: TrainConfig, result: Preflight) -> bool:
    """Whether any sampled example becomes a training example; a problem when long_rows: error would refuse."""
    policy, seq, shortest = cfg.long_rows_policy, cfg.sequence_len, cfg.min_sample_len
    too_long = [n for n in lengths if n > seq]
    if too_long and policy == "error":
        result.problems.append(
            f"{name}: {len(too_long)} of the first {len(lengths)} examples of {label} are longer than "
            f"sequence_len={seq} (longest {max(too_long)} tokens) and long_rows: error refuses them; raise "
            f"sequence_len, or set excess_length_strategy: truncate, drop or split"
        )
    kept = [n for n in lengths if n >= shortest and (n <= seq or policy in ("truncate", "split"))]
    if not kept:
        result.notes.append(
            f"{name}: none of the first {len(lengths)} examples of {label} fits (tokens {min(lengths)} to "
            f"{max(lengths)}; sequence_len={seq}, long_rows: {policy}, min_sample_len: {shortest})"
        )
    return bool(kept)


def _nothing_fits(cfg: TrainConfig, lengths: list[int]) -> str:
    seq, shortest = cfg.sequence_len, cfg.min_sample_len
    if min(lengths) > seq:
        why = f"all {len(lengths)} are longer than sequence_len={seq} (the shortest has {min(lengths)} tokens)"
    else:
        why = f"each is longer than sequence_len={seq} or shorter than min_sample_len={shortest}"
    return (
        f"no sampled example fits: {why}, and long_rows: {cfg.long_rows_policy} leaves them out, so train would "
        f"stop with no data; raise sequence_len, or set excess_length_strategy: truncate or split"
    )


def before_launch(cfg: TrainConfig) -> list[str]:
    """``train``'s checks before it starts processes: ``preflight`` with the tokenizer when it is at hand
    (a local one, or a hub one already in the cache: nothing is downloaded here)."""
    name = cfg.tokenizer_config or cfg.base_model
    tokenizer = None
    try:
        if hub.is_hub_id(name):
            hub.model_dir(name, revision=cfg.revision_of_model, weights=False, download=False)
        tokenizer = load_run_tokenizer(cfg)[0]
    except NdParallelError:
        pass  # the workers say why (a missing tokenizer is one of their checks)
    return preflight(cfg, tokenizer=tokenizer).problems
