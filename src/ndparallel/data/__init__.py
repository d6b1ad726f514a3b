"""Data: local datasets -> tokenized, packed or padded, cached rows -> a resumable per-rank order."""

from ndparallel.data.sources import ChatRecord, InstructionRecord, Record, TextRecord, read_records
from ndparallel.data.spec import ALIASES, DATASET_TYPES, DatasetSpec
from ndparallel.data.tokenizer import BYTE_CHAT_TEMPLATE, byte_tokenizer, ensure_pad_token, load_tokenizer

__all__ = [
    "ChatRecord", "InstructionRecord", "Record", "TextRecord", "read_records",
    "ALIASES", "DATASET_TYPES", "DatasetSpec",
    "BYTE_CHAT_TEMPLATE", "byte_tokenizer", "ensure_pad_token", "load_tokenizer",
]
