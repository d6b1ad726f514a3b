"""Which files of a hub dataset snapshot a spec reads: ``data_files``, or its split.

A split's files come from the dataset card's ``configs`` (the YAML header of README.md: ``data_files`` per
split, ``name`` choosing the config), or else from the hub's naming convention: a file belongs to a split when
a directory or a ``-``/``_``/``.``-separated word of its path is the split's name (``data/train-0000.parquet``,
``test/part.jsonl``, ``valid.json``); with no such word anywhere, every file is ``train``.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import yaml

from ndparallel.data.spec import DatasetSpec
from ndparallel.errors import DataError
from ndparallel.safe_io import bounded_yaml
from ndparallel.safe_io.hub import dataset_dir

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".jsonl.zst", ".jsonl.gz", ".json.gz")
SPLIT_WORDS = {
    "train": {"train", "training"},
    "validation": {"validation", "valid", "val", "dev"},
    "test": {"test", "testing", "eval", "evaluation"},
}


def is_data_file(path: Path) -> bool:
    return path.name.endswith(DATA_SUFFIXES)


def snapshot_patterns(spec: DatasetSpec) -> list[str] | None:
    """What to fetch of the repository: the ``data_files`` patterns (and their directories), or all data."""
    if not spec.data_files:
        return None
    return [pattern for item in spec.data_files for pattern in (item, f"{item}/*", f"{item}/**/*")]


def hub_files(spec: DatasetSpec) -> list[Path]:
    """The local files (in the hub cache) of ``spec``'s hub dataset, for its split, in a stable order."""
    root = dataset_dir(
        spec.path, revision=spec.revision, patterns=snapshot_patterns(spec), setting=f"datasets path {spec.path}"
    )
    files = sorted(p for p in root.rglob("*") if p.is_file() and is_data_file(p))
    relative = {p: p.relative_to(root).as_posix() for p in files}
    if spec.data_files:
        chosen = [p for p in files if _matches(relative[p], spec.data_files)]
        where = f"data_files {list(spec.data_files)}"
    else:
        chosen, where = _split_files(spec, root, files, relative)
    if not chosen:
        raise DataError(
            f"dataset {spec.label}: no data file of the hub dataset matches {where}; fix data_files: or split:"
        )
    return chosen


def _matches(relative: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(relative, p) or relative.startswith(p.rstrip("/") + "/") for p in patterns)


def _split_files(spec: DatasetSpec, root: Path, files: list[Path], relative: dict[Path, str]):
    names = [name for name, _, _ in spec.split_parts]
    configured = _card_configs(root)
    if configured:
        config = _pick_config(spec, configured)
        chosen = []
        for name in names:
            patterns = config.get(name)
            if patterns is None:
                raise DataError(
                    f"dataset {spec.label}: its card lists splits {', '.join(config)}, not {name!r}; fix split:"
                )
            chosen += [p for p in files if _matches(relative[p], tuple(patterns)) and p not in chosen]
        return chosen, f"split {spec.split or 'train'}"
    if spec.name:
        raise DataError(f"dataset {spec.label}: name={spec.name!r} but its card lists no configs; remove name:")
    by_split = {split: [p for p in files if _words(relative[p]) & words] for split, words in SPLIT_WORDS.items()}
    if not any(by_split.values()):
        by_split = {"train": files}
    chosen = []
    for name in names:
        if name not in by_split or not by_split[name]:
            present = ", ".join(s for s, fs in by_split.items() if fs)
            raise DataError(f"dataset {spec.label}: no {name!r} split among its files (splits: {present}); fix split:")
        chosen += [p for p in by_split[name] if p not in chosen]
    return chosen, f"split {spec.split or 'train'}"


def _words(relative: str) -> set[str]:
    return set(re.split(r"[/._\-\s]+", relative.lower()))


def _card_configs(root: Path) -> dict[str, dict[str, list[str]]]:
    """config name -> split -> file patterns, from README.md's YAML header (empty when it has none)."""
    card = root / "README.md"
    if not card.is_file():
        return {}
    text = card.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return {}
    try:
        header = bounded_yaml.load(text.split("---", 2)[1], source=f"{card}'s header", error=DataError) or {}
    except yaml.YAMLError:
        return {}
    if not isinstance(header, dict):
        return {}
    configs = {}
    for entry in header.get("configs") or []:
        if not isinstance(entry, dict):
            continue
        files = entry.get("data_files")
        if isinstance(files, (str, list)) and all(
            isinstance(f, str) for f in ([files] if isinstance(files, str) else files)
        ):
            splits = {"train": [files] if isinstance(files, str) else list(files)}
        else:
            splits = {}
            for item in files or []:
                paths = item.get("path", [])
                splits[str(item.get("split", "train"))] = [paths] if isinstance(paths, str) else list(paths)
        configs[str(entry.get("config_name", "default"))] = splits
    return configs


def _pick_config(spec: DatasetSpec, configured: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    name = spec.name or ("default" if "default" in configured or len(configured) != 1 else next(iter(configured)))
    if name not in configured:
        raise DataError(
            f"dataset {spec.label}: no configuration {name!r} in its card (configs: "
            f"{', '.join(configured)}); set name: to one of them"
        )
    return configured[name]
