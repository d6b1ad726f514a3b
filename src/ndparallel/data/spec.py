"""What a dataset entry of the configuration says: where the data is and how to read it (Axolotl-style)."""

from __future__ import annotations

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


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: ``path`` (file, directory, glob or ``save_to_disk`` directory) and its ``type``.

    ``split`` picks a split of a saved ``DatasetDict`` (default: ``train``); ``field`` names the text column
    of a completion dataset (default ``text``) or the messages column of a chat dataset; ``name`` is only a
    label for messages and logs.
    """

    path: str
    type: str
    split: str | None = None
    field: str | None = None
    name: str | None = None

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
        return self.name or self.path

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
            raise DataError(f"dataset {settings.get('path', '?')}: missing {' and '.join(missing)}; every dataset "
                            f"entry needs path: and type:")
        return cls(**settings)
