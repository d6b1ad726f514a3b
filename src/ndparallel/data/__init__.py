"""Data: local datasets -> tokenized, packed or padded, cached rows -> a resumable per-rank order.

::

    from ndparallel.data.build import build_rows
    from ndparallel.data.sampler import DataOrder
    from ndparallel.data.spec import DatasetSpec
    from ndparallel.data.load_tokenizer import load_tokenizer

    tokenizer = load_tokenizer("byte")                       # or a local model directory
    specs = [DatasetSpec(path="data/chat.jsonl", type="chat_template")]
    train, evaluation = build_rows(specs, tokenizer, seq_len=2048, packing=True, cache_dir="cache/data",
                                   eval_fraction=0.01)
    order = DataOrder(len(train), rows_per_rank=4, batch_rank=topo.batch_rank, batch_ranks=B, seed=0)
    batches = iter(order)                                    # endless, epoch after epoch
    for step in range(max_steps):
        rows = train.batch(next(batches))                    # input_ids, labels, position_ids, attention_mask

Modules: ``load_tokenizer`` (the byte tokenizer, or one from a directory or the hub), ``spec`` / ``files`` /
``sources`` (reading records), ``tokenize`` (records -> examples with loss masks), ``examples`` (compact
storage), ``packing`` / ``rows`` (rows of seq_len tokens), ``cache`` / ``build`` (cached building),
``sampler`` (the order).

Layer: above ``safe_io`` (files and hub datasets) and ``loss`` (the ignored label); knows no model, mesh or
strategy (a rank's place comes in as numbers).
"""
