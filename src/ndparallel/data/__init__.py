"""Data: local datasets -> tokenized, packed or padded, cached rows -> a resumable per-rank order.

::

    tokenizer = load_tokenizer("byte")                       # or a local model directory
    specs = [DatasetSpec(path="data/chat.jsonl", type="chat_template")]
    train, evaluation = build_rows(specs, tokenizer, seq_len=2048, packing=True, cache_dir="cache/data",
                                   eval_fraction=0.01)
    order = DataOrder(len(train), rows_per_rank=4, batch_rank=topo.batch_rank, batch_ranks=B, seed=0)
    batches = iter(order)                                    # endless, epoch after epoch
    for step in range(max_steps):
        rows = train.batch(next(batches))                    # input_ids, labels, position_ids, attention_mask

Modules: ``tokenizer`` (byte tokenizer, loading), ``spec`` / ``files`` / ``sources`` (reading records),
``tokenization`` (records -> examples with loss masks), ``examples`` (compact storage), ``packing`` /
``rows`` (rows of seq_len tokens), ``cache`` / ``build`` (cached building), ``sampler`` (the order).
"""

from ndparallel.data.build import build_rows, build_rows_distributed, split_examples
from ndparallel.data.examples import IGNORE_INDEX, Example, ExampleStore
from ndparallel.data.packing import pack_examples, pad_examples
from ndparallel.data.rows import Rows
from ndparallel.data.sampler import DataOrder
from ndparallel.data.sources import ChatRecord, InstructionRecord, Record, TextRecord, read_records
from ndparallel.data.spec import ALIASES, DATASET_TYPES, DatasetSpec
from ndparallel.data.tokenization import (
    ALPACA_PROMPT,
    ALPACA_PROMPT_WITH_INPUT,
    LONG_ROWS_POLICIES,
    RecordTokenizer,
    fit_long_rows,
    tokenize_records,
)
from ndparallel.data.tokenizer import BYTE_CHAT_TEMPLATE, byte_tokenizer, ensure_pad_token, load_tokenizer

__all__ = [
    "build_rows",
    "build_rows_distributed",
    "split_examples",
    "IGNORE_INDEX",
    "Example",
    "ExampleStore",
    "pack_examples",
    "pad_examples",
    "Rows",
    "DataOrder",
    "ChatRecord",
    "InstructionRecord",
    "Record",
    "TextRecord",
    "read_records",
    "ALIASES",
    "DATASET_TYPES",
    "DatasetSpec",
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_WITH_INPUT",
    "LONG_ROWS_POLICIES",
    "RecordTokenizer",
    "fit_long_rows",
    "tokenize_records",
    "BYTE_CHAT_TEMPLATE",
    "byte_tokenizer",
    "ensure_pad_token",
    "load_tokenizer",
]
