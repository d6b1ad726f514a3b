"""The token rows of ``bench_finetune.py``, the same for every row, and ours' trainer config.

One token stream (the ASCII of the Python standard library's sources, one document of exactly
rows x seq byte-tokenizer tokens, its eos included) becomes ``rows`` rows of ``seq`` tokens through the
trainer's own pipeline (``long_rows: split`` cuts the document into pieces of ``seq``, each piece one row,
positions from 0): ``prepare`` builds them into the trainer's data cache, with the same arguments the trainer
passes (``train/setup.py``), so the trainer later finds the cache instead of building again
(``trainer_used_cache`` checks it). The peers read the first ``steps`` batches in the trainer's order
(``DataOrder`` with the run's seed) from ``rows.npz``: input_ids and labels, (steps, micro_batch, seq).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from finetune_common import CLIP_NORM, LEARNING_RATE, OURS_ROWS


@dataclass(frozen=True)
class Data:
    stream: Path
    """The one text document."""
    prepared: Path
    """The trainer's data cache (``dataset_prepared_path``)."""
    rows_file: Path
    """The peers' rows (``rows.npz``)."""


def ours_config(args, row: str, *, seq: int, model_dir: Path, data: Data, output_dir: Path) -> dict:
    """The trainer config of ours' ``row``: the common settings, then the row's own (``OURS_ROWS``).
    ``max_steps`` is one more than measured (``finetune_rows.py`` says why); one log line per step."""
    config = {
        "base_model": str(model_dir),
        "datasets": [{"path": str(data.stream), "type": "pretrain_files"}],
        "dataset_prepared_path": str(data.prepared),
        "sequence_len": seq,
        "sample_packing": True,
        "long_rows": "split",
        "val_set_size": 0,
        "micro_batch_size": args.micro_batch,
        "max_steps": args.steps + 1,
        "learning_rate": LEARNING_RATE,
        "lr_scheduler": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": CLIP_NORM,
        "torch_compile": args.compile,
        "activation_checkpointing": args.ac,
        "activation_offloading": args.ac == "full" and args.offload is not None,
        "seed": args.seed,
        "logging_steps": 1,
        "save_steps": 100 * (args.steps + 1),
        "export_hf": False,
        "use_tensorboard": False,
        "output_dir": str(output_dir),
        "overwrite_output_dir": True,
        "device": args.device,
    }
    if args.ac == "full" and args.offload is not None and args.offload > 0:
        config["activation_offload_layers"] = args.offload  # the first N layers (1: compiled as offload compiles)
    settings = dict(OURS_ROWS[row])
    if settings.get("adapter"):
        config.update(lora_r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0, lora_target_linear=True)
        config.update(fused_lora_mlp=args.fused_lora_mlp, embedding_offload=args.embedding_offload)
    else:
        settings.pop("adapter")
    config.update(settings)
    return config


def write_stream(path: Path, chars: int) -> None:
    """``chars`` ASCII characters of the standard library's sources, in sorted file order (kept when it
    exists: the data cache's key holds the file's modification time)."""
    if path.is_file() and path.stat().st_size == chars:
        return
    pieces, total = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = source.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        # ASCII only (one byte, one token); "<|" never starts a special token's text.
        text = text.encode("ascii", errors="ignore").decode("ascii").replace("<|", "< |")
        pieces.append(text)
        total += len(text)
        if total >= chars:
            break
    if total < chars:
        raise SystemExit(f"the standard library's sources hold {total:,} ASCII characters, fewer than {chars:,}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(pieces)[:chars], encoding="ascii")


def trainer_rows(cfg):
    """The training rows exactly as ``ndparallel train`` builds them for ``cfg`` (one process)."""
    from ndparallel.data.build import build_rows
    from ndparallel.train.run_inputs import load_run_tokenizer, row_arguments

    tokenizer, _ = load_run_tokenizer(cfg)
    global_rows = cfg.micro_batch_size * cfg.gradient_accumulation_steps  # one process
    specs, arguments = row_arguments(cfg, tokenizer, global_rows=global_rows, output_dir=Path(cfg.output_dir))
    train, _ = build_rows(specs, tokenizer, **arguments)
    return train


def prepare(args, *, seq: int, model_dir: Path) -> Data:
    """The stream, the trainer's cache and the peers' rows for rows of ``seq`` tokens."""
    from ndparallel.config.reading import parse_config
    from ndparallel.data.sampler import DataOrder

    rows = (args.steps + 2) * args.micro_batch  # an epoch longer than the trainer's steps + 1
    folder = args.work / "data" / f"seq{seq}-rows{rows}"
    data = Data(stream=folder / "stream.txt", prepared=folder / "prepared", rows_file=folder / "rows.npz")
    write_stream(data.stream, rows * seq - 1)  # + the eos: rows x seq tokens
    cfg = parse_config(ours_config(args, "ours-lora", seq=seq, model_dir=model_dir, data=data, output_dir=folder))
    train = trainer_rows(cfg)
    full = bool(np.all(train.attention_mask)) and bool((train.position_ids == np.arange(seq)).all())
    if len(train) != rows or not full:
        raise SystemExit(f"expected {rows} full rows of one document each, the trainer's pipeline gave {train!r}")
    order = DataOrder(rows, rows_per_rank=args.micro_batch, batch_rank=0, batch_ranks=1, seed=cfg.seed)
    batches = iter(order)
    picked = np.stack([np.asarray(next(batches)) for _ in range(args.steps)])  # (steps, micro_batch) row indices
    np.savez(data.rows_file, input_ids=train.input_ids[picked], labels=train.labels[picked])
    return data


def trainer_used_cache(data: Data) -> bool:
    """True when the data cache still holds one set of rows: the trainer read ``prepare``'s, not its own."""
    return len([p for p in data.prepared.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 1
