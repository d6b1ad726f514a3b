"""The data: dataset entries (Axolotl's layout and names), rows, packing, the evaluation split."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEQUENCE_LEN = 2**24
"""Sane maximum of sequence_len (a typo such as 1000000000 is one line at validate, not a MemoryError)."""


class DatasetConfig(BaseModel):
    """One entry of ``datasets`` (Axolotl's layout and names)."""

    model_config = ConfigDict(extra="forbid")
    path: str
    """A local file, directory, glob or ``datasets.save_to_disk`` directory, or a Hugging Face Hub dataset id
    (org/name, read from the hub cache; downloaded once per node unless HF_HUB_OFFLINE is set). ``stdlib:``
    names this Python's standard library source directory (the embedded default corpus)."""
    type: str = "completion"
    """completion (a text field), alpaca (instruction/input/output), chat_template (messages), pretrain_files
    (plain text files, one document each)."""
    split: str | None = None
    """Split to read (default train), with an optional slice as in datasets: train[:10%], train[100:200]."""
    field: str | None = None
    """Name of the text field for completion datasets (default: text)."""
    name: str | None = None
    """Configuration of a hub dataset (its README's configs), as in datasets.load_dataset(path, name)."""
    data_files: str | list[str] | None = None
    """Files (or glob patterns) of the dataset to read instead of all of them."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub dataset."""
    trust_remote_code: bool = False
    """Accepted for Axolotl configs; dataset loading scripts are never run (only data files are read)."""
    ds_type: str | None = None
    """File format when the extension does not say it (json, parquet, arrow, text)."""
    field_messages: str | None = None
    """chat_template: the column holding the messages (default: messages, or conversations)."""
    message_property_mappings: dict[str, str] | None = None
    """chat_template: which keys of a message hold the role and the content, e.g. {role: from, content: value}."""
    message_field_role: str | None = None
    """chat_template: older spelling of message_property_mappings.role."""
    message_field_content: str | None = None
    """chat_template: older spelling of message_property_mappings.content."""
    roles: dict[str, list[str]] | None = None
    """chat_template: dataset role names for each template role, e.g. {user: [human], assistant: [gpt]}."""
    roles_to_train: list[str] | None = None
    """chat_template: roles whose turns are trained (default: assistant)."""
    train_on_eos: Literal["turn"] | None = None
    """chat_template: a trained turn ends with its end-of-turn tokens, which are trained (Axolotl's 'turn')."""
    drop_system_message: bool = False
    """chat_template: leave system messages out."""
    chat_template: str | None = None
    """Chat template for this dataset (a name, tokenizer_default or jinja); default: the top-level one."""
    chat_template_jinja: str | None = None
    """Jinja source of this dataset's chat template."""
    field_thinking: str | None = None
    """chat_template: the key of a message holding its reasoning trace (default: reasoning_content)."""
    template_thinking_key: str | None = None
    """chat_template: the key the chat template reads the reasoning trace from (default: reasoning_content)."""

    @property
    def role_key(self) -> str | None:
        return (self.message_property_mappings or {}).get("role") or self.message_field_role

    @property
    def content_key(self) -> str | None:
        return (self.message_property_mappings or {}).get("content") or self.message_field_content


class PretrainingDatasetConfig(BaseModel):
    """One entry of ``pretraining_dataset``: text documents read in order, tokenized and packed as they come."""

    model_config = ConfigDict(extra="forbid")
    path: str
    """Hub dataset id or local path, as for datasets."""
    name: str | None = None
    split: str = "train"
    text_column: str = "text"
    type: str = "pretrain"
    """pretrain or completion: every token of text_column is trained."""
    field: str | None = None
    """Axolotl's datasets-style spelling of text_column."""
    data_files: str | list[str] | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    skip: int | None = Field(None, ge=0)
    """Documents to skip at the start."""


class DataSettings(BaseModel):
    """What is read, and how it becomes rows."""

    datasets: list[DatasetConfig] = Field(default_factory=list)
    """Training data sources."""
    pretraining_dataset: list[PretrainingDatasetConfig] | None = None
    """Text corpora read in order and packed (documents longer than sequence_len are split); needs max_steps."""
    dataset_prepared_path: str | None = None
    """Cache directory for tokenized data (default: output_dir/prepared)."""
    val_set_size: float = Field(0.0, ge=0)
    """Examples held out for evaluation: a fraction below 1, or a number of examples (0 disables eval)."""
    eval_sample_packing: bool | None = None
    """Pack the evaluation rows too (default: as sample_packing)."""
    sequence_len: int = Field(512, ge=8, le=MAX_SEQUENCE_LEN)
    """Tokens per row (at most 16,777,216)."""
    sample_packing: bool = False
    """Pack several documents into each row; positions restart per document and no token attends across a
    document boundary (exact, also under context parallelism)."""
    long_rows: Literal["drop", "truncate", "error", "split"] | None = None
    """Examples longer than sequence_len: drop (Axolotl's default), truncate, error, or split into pieces
    (pretraining_dataset's default). Axolotl's excess_length_strategy (raise = error) lands here."""
    min_sample_len: int = Field(2, ge=1)
    """Examples with fewer tokens are left out."""
    dataset_max_record_mb: float = Field(16.0, gt=0)
    """The largest record read, in MiB (a JSON line, a table row, a pretrain file): a larger one is an error
    naming it, as it would be read and tokenized whole before long_rows applies."""
    dataset_exact_deduplication: bool = False
    """Leave out every example whose tokens and labels repeat an earlier one (across all datasets), before the
    evaluation split: neither split repeats itself or the other."""
    train_on_inputs: bool = False
    """Also train on prompts (alpaca) and on every chat turn, not only on the answers."""
    curriculum_sampling: bool = False
    """Train on the rows in their dataset order every epoch (Axolotl's sequential sampler), instead of a
    seeded shuffle per epoch."""

    @field_validator("val_set_size")
    @classmethod
    def _whole_count(cls, value):
        if value >= 1 and value != int(value):
            raise ValueError("must be a fraction below 1 or a whole number of examples")
        return value

    @property
    def eval_packing(self) -> bool:
        return self.sample_packing if self.eval_sample_packing is None else self.eval_sample_packing

    @property
    def long_rows_policy(self) -> str:
        return self.long_rows or ("split" if self.pretraining_dataset else "drop")
