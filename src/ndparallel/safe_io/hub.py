"""Hugging Face Hub ids (``org/name``) -> local directories, through huggingface_hub's cache.

A name that is an existing local path is used as it is. Any other ``org/name`` is a hub repository, read from
the hub cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub): ``HF_HUB_OFFLINE=1`` means the cache only, otherwise
missing files are downloaded (``HF_TOKEN`` for gated repositories). Both variables are read when called, so a
process that sets them after importing huggingface_hub is honoured.

Only data and safetensors are fetched: no ``*.bin``/``*.pt`` pickles, no ``*.py`` unless ``trust_remote_code``.

In a multi-process run ``on_each_node`` lets local rank 0 of every node download while the other ranks wait,
then every rank resolves from the cache without network.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ndparallel.errors import DataError, ModelError, NdParallelError
from ndparallel.safe_io import file_names

T = TypeVar("T")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template*",
]
MODEL_FILES = CONFIG_FILES + ["*.safetensors", "model.safetensors.index.json"]
CODE_FILES = ["*.py"]
DATA_FILES = [
    "*.parquet",
    "*.jsonl",
    "*.json",
    "*.arrow",
    "*.jsonl.zst",
    "*.jsonl.gz",
    "*.json.gz",
    "*.txt",
    "README.md",
]
_TRUE = {"1", "on", "yes", "true"}


def is_hub_id(name: str | None) -> bool:
    """True for ``org/name`` strings that are not an existing local path."""
    if not name or Path(name).expanduser().exists():
        return False
    return bool(HUB_ID.match(name)) and not name.startswith((".", "~"))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def model_dir(
    name: str,
    *,
    revision: str | None = None,
    weights: bool = True,
    trust_remote_code: bool = False,
    download: bool = True,
    setting: str = "base_model",
) -> Path:
    """The local directory of model ``name`` (a path, or a hub id fetched into the cache).

    ``weights``: the safetensors too (else config and tokenizer files only). ``download``: may use the
    network (unless offline); without it the files must be cached already.
    """
    local = Path(name).expanduser()
    if local.exists() or not is_hub_id(name):
        return local
    patterns = (MODEL_FILES if weights else CONFIG_FILES) + (CODE_FILES if trust_remote_code else [])
    cached = _snapshot(
        name, "model", revision, patterns, local_only=True, error=ModelError, setting=setting, quiet=True
    )
    if cached is not None and _complete(cached, weights):
        return cached
    if not download or offline():
        raise ModelError(not_cached(setting, name, revision, "model"))
    return _snapshot(name, "model", revision, patterns, local_only=False, error=ModelError, setting=setting)


def dataset_dir(
    name: str,
    *,
    revision: str | None = None,
    patterns: list[str] | None = None,
    download: bool = True,
    setting: str = "datasets",
) -> Path:
    """The local snapshot directory of hub dataset ``name`` holding (at least) the files of ``patterns``."""
    patterns = (patterns or DATA_FILES) + ["README.md"]
    cached = _snapshot(
        name, "dataset", revision, patterns, local_only=True, error=DataError, setting=setting, quiet=True
    )
    if cached is not None and any(
        p.is_file() and p.name != "README.md" and _matches(p.relative_to(cached), patterns) for p in cached.rglob("*")
    ):
        return cached
    if not download or offline():
        raise DataError(not_cached(setting, name, revision, "dataset"))
    return _snapshot(name, "dataset", revision, patterns, local_only=False, error=DataError, setting=setting)


def _matches(relative: Path, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(relative.as_posix(), p) or fnmatch.fnmatch(relative.name, p) for p in patterns)


def _complete(directory: Path, weights: bool) -> bool:
    """config.json there, and with ``weights`` every safetensors file (all shards the index names)."""
    if not (directory / "config.json").is_file():
        return False
    if not weights:
        return True
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return False
        files = [file_names.inside(directory, shard) for shard in shards]  # none outside the snapshot
        return all(f is not None and f.is_file() for f in files)
    return any(directory.glob("*.safetensors"))


def _snapshot(
    name: str,
    kind: str,
    revision: str | None,
    patterns: list[str],
    *,
    local_only: bool,
    error: type[NdParallelError],
    setting: str,
    quiet: bool = False,
) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{setting} {name!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return Path(
            snapshot_download(
                name,
                repo_type=kind,
                revision=revision,
                cache_dir=cache_dir(),
                allow_patterns=patterns,
                local_files_only=local_only or offline(),
            )
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        if quiet:
            return None
        unreachable = None if local_only or offline() else first_line(exc.__cause__ or exc)
        raise error(not_cached(setting, name, revision, kind, unreachable=unreachable)) from None
    except GatedRepoError:
        raise error(f"{where} is gated on the Hugging Face Hub: accept its terms on the hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise error(
            f"{where} is not a {kind} on the Hugging Face Hub (or it is private: set HF_TOKEN); check the "
            f"name, or give a local directory"
        ) from None
    except RevisionNotFoundError:
        raise error(f"{where}: the hub {kind} has no such revision; give a branch, tag or commit it has") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise error(not_cached(setting, name, revision, kind, unreachable=first_line(exc))) from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def not_cached(setting: str, name: str, revision: str | None, kind: str, *, unreachable: str | None = None) -> str:
    """The one line for a hub repository that is not in the cache, whoever finds it (validate, a rank that
    downloads, a rank that waits): why it cannot be had here, and how to get it."""
    rev = f" --revision {revision}" if revision else ""
    command = f"`hf download {name}{' --repo-type dataset' if kind == 'dataset' else ''}{rev}`"
    if offline():
        how, fix = "HF_HUB_OFFLINE is set", f"download it once ({command}), set HF_HOME to the cache that holds it"
    elif unreachable is not None:
        how = f"cannot be downloaded from here (the Hugging Face Hub cannot be reached: {unreachable})"
        fix = f"download it once where there is network ({command}) and set HF_HOME to that cache"
    else:
        how = "downloads are left to local rank 0 of each node, which did not fetch it"
        fix = f"download it once ({command}), set HF_HOME to the cache that holds it"
    where = f"{setting} {name!r} is not in the Hugging Face cache {str(cache_dir())!r}"
    return f"{where} and {how}; {fix}, or give a local directory"


def on_each_node(
    fetch: Callable[[bool], T],
    *,
    local_rank: int,
    barrier: Callable[[], None],
    all_ok: Callable[[str | None], str | None],
) -> T:
    """``fetch(download)`` on local rank 0 of every node first (download=True), then on the other ranks with
    the cache only. ``all_ok(error or None)`` returns the first rank's error to every rank, so that a failed
    download stops every rank with the same one-line error instead of a hang.
    """
    result, problem = None, None
    if local_rank == 0:
        try:
            result = fetch(True)
        except NdParallelError as exc:
            problem = str(exc)
    barrier()
    problem = all_ok(problem)
    if problem is not None:
        raise NdParallelError(problem)
    return result if local_rank == 0 else fetch(False)
