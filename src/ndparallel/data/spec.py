"""What a dataset entry of the configuration says: where the data is and how to read it (Axolotl-style)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any

from ndparallel.errors import DataError

# Canonical type -> what a record holds. Axolotl's names first; ALIASES maps the short names onto them.
DATASET_TYPES = {
    "completion": "records with a text field (`field:`, default 'text'); every token is trained",
    "alpaca": "records with instruction, optional input, and output; only the output is trained",
    "chat_template": "records with a messages list of {role, content} (or ShareGPT conversations of "
    "{from, value}); only assistant turns are trained",
    "pretrain_files": "plain text files, each file one document; every token is trained",
}
ALIASES = {"text": "completion", "instruction": "alpaca", "chat": "chat_template", "text_files": "pretrain_files"}


SPLIT_PART = re.compile(r"^\s*([\w.\-]+)\s*(?:\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\])?\s*$")


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: ``path`` (file, directory, glob, ``save_to_disk`` directory or hub dataset id) and its ``type``.

    ``split`` picks a split (of a saved ``DatasetDict``, or of a hub dataset by its file names / README
    configs), optionally sliced as in ``datasets``: ``train[:10%]``, ``train[100:200]``, ``train+test``.
    ``field`` names the text column of a completion dataset (default ``text``) or the messages column of a
    chat dataset; ``name`` is a hub dataset's configuration. The chat options (``role_key``, ``content_key``,
    ``roles``, ``roles_to_train``, ``drop_system_message``, ``chat_template`` source, ``template_kwargs``, the
    reasoning-trace keys) and ``train_on_inputs`` decide which tokens are trained; all of them are part of the
    data cache's key.
    """

    path: str
    type: str
    split: str | None = None
    field: str | None = None
    name: str | None = None
    data_files: tuple[str, ...] | None = None
    revision: str | None = None
    ds_type: str | None = None
    role_key: str | None = None
    content_key: str | None = None
    roles: dict[str, list[str]] | None = None
    roles_to_train: tuple[str, ...] = ("assistant",)
    drop_system_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    train_on_inputs: bool = False
    skip: int = 0
    thinking_key: str = "reasoning_content"
    """chat_template: the message key holding a reasoning trace (Axolotl's field_thinking)."""
    template_thinking_key: str = "reasoning_content"
    """chat_template: the key the chat template reads it from (Axolotl's template_thinking_key)."""
    max_record_bytes: int | None = None
    """The largest record read (None: dataset_max_record_mb's default); not part of the data cache's key: it
    changes no row, a larger record is an error."""

    @property
    def split_parts(self) -> list[tuple[str, str | None, str | None]]:
        """``split`` as (name, start, stop) parts; bounds are ints or percents as written, None when open."""
        parts = []
        for text in (self.split or "train").split("+"):
            match = SPLIT_PART.match(text)
            if match is None:
                raise DataError(
                    f"dataset {self.label}: split={self.split!r} is not a split name with an optional "
                    f"slice, e.g. train, train[:10%], train[100:200]; fix split:"
                )
            parts.append(match.groups())
        return parts

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise DataError(f"datasets: path={self.path!r} must be a file, directory or glob pattern; set path:")
        if self.type not in DATASET_TYPES and self.type not in ALIASES:
            valid = ", ".join([*DATASET_TYPES, *(f"{a} (= {c})" for a, c in ALIASES.items())])
            raise DataError(f"dataset {self.path}: type={self.type!r} is not a dataset type; use one of: {valid}")

    @property
    def kind(self) -> str:
        """The canonical type (aliases resolved)."""
        return ALIASES.get(self.type, self.type)

    @property
    def label(self) -> str:
        """How messages refer to this dataset."""
        return self.path + (f" ({self.name})" if self.name else "")

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> DatasetSpec:
        """A spec from one ``datasets:`` entry of a config; unknown keys are an error, not ignored."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise DataError(
                f"dataset {settings.get('path', '?')}: unknown setting(s) {', '.join(unknown)}; "
                f"a dataset entry takes {', '.join(sorted(known))}"
            )
        missing = [key for key in ("path", "type") if key not in settings]
        if missing:
            raise DataError(
                f"dataset {settings.get('path', '?')}: missing {' and '.join(missing)}; every dataset "
                f"entry needs path: and type:"
            )
        for key in ("data_files", "roles_to_train"):
            if isinstance(settings.get(key), str):
                settings = {**settings, key: (settings[key],)}
            elif isinstance(settings.get(key), list):
                settings = {**settings, key: tuple(settings[key])}
        return cls(**settings)
