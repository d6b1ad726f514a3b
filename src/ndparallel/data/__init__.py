"""Data: local datasets -> tokenized, packed or padded, cached rows -> a resumable per-rank order."""

from ndparallel.data.tokenizer import BYTE_CHAT_TEMPLATE, byte_tokenizer, ensure_pad_token, load_tokenizer

__all__ = ["BYTE_CHAT_TEMPLATE", "byte_tokenizer", "ensure_pad_token", "load_tokenizer"]
