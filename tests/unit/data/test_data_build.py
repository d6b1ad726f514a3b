"""build_rows: tokenize once, cache atomically, reload without tokenizing; eval split; the distributed helper."""

import json
import os

import numpy as np
import pytest

import ndparallel.data.build as build_module
from ndparallel import DataError
from ndparallel.data.build import build_rows, build_rows_distributed
from ndparallel.data.load_tokenizer import byte_tokenizer
from ndparallel.data.spec import DatasetSpec

COLUMNS = ("input_ids", "labels", "position_ids", "attention_mask")


@pytest.fixture
def tokenizer():
    return byte_tokenizer()


@pytest.fixture
def calls(monkeypatch):
    """How many datasets were tokenized (build_rows tokenizes each dataset with one tokenize_records call)."""
    count = {"n": 0}
    original = build_module.tokenize_records

    def counting(records, tokenizer, spec=None):
        count["n"] += 1
        return original(records, tokenizer, spec)

    monkeypatch.setattr(build_module, "tokenize_records", counting)
    return count


def write_docs(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return DatasetSpec(str(path), "completion")


def same_rows(a, b):
    return all(np.array_equal(getattr(a, c), getattr(b, c)) for c in COLUMNS)


def test_second_build_loads_from_cache_without_tokenizing(tmp_path, tokenizer, calls):
    spec = write_docs(tmp_path / "a.jsonl", ["one", "two two", "three three three"])
    options = dict(seq_len=16, packing=True, cache_dir=tmp_path / "cache")
    train, evaluation = build_rows([spec], tokenizer, **options)
    assert calls["n"] == 1 and evaluation is None
    again, _ = build_rows([spec], byte_tokenizer(), **options)  # a new but identical tokenizer
    assert calls["n"] == 1
    assert same_rows(train, again) and isinstance(again.input_ids, np.memmap)
    assert train.num_real_tokens == len("one two two three three three") - 2 + 3  # bytes + 3 eos


@pytest.mark.parametrize("change", ["content", "mtime", "seq_len", "packing", "long_rows", "chat_template", "field"])
def test_any_change_of_the_inputs_rebuilds(tmp_path, tokenizer, calls, change):
    spec = write_docs(tmp_path / "a.jsonl", ["alpha", "beta"])
    options = dict(seq_len=8, packing=False, cache_dir=tmp_path / "cache", long_rows="truncate")
    build_rows([spec], tokenizer, **options)
    if change == "content":
        # A different size: a same-size rewrite within the filesystem's timestamp granularity (a few ms on
        # some) would keep size and mtime, which is the known blind spot of a (path, size, mtime) key.
        write_docs(tmp_path / "a.jsonl", ["alpha", "gamma"])
    elif change == "mtime":
        stat = os.stat(spec.path)
        os.utime(spec.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    elif change == "chat_template":
        tokenizer.chat_template = "{{ messages }}"
    elif change == "field":
        spec = DatasetSpec(spec.path, "completion", field="text")
    else:
        options[change] = {"seq_len": 9, "packing": True, "long_rows": "drop"}[change]
    build_rows([spec], tokenizer, **options)
    assert calls["n"] == 2
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_cache_files_are_written_atomically(tmp_path, tokenizer, calls, monkeypatch):
    spec = write_docs(tmp_path / "a.jsonl", ["some text"])
    cache = tmp_path / "cache"
    real_save = np.save
    saved = []

    def crash_on_the_third_file(path, array, **kwargs):
        saved.append(path)
        if len(saved) == 3:
            raise OSError(28, "No space left on device")
        real_save(path, array, **kwargs)

    monkeypatch.setattr(np, "save", crash_on_the_third_file)
    with pytest.raises(DataError, match="cannot write the data cache .*No space left on device.*cache_dir writable"):
        build_rows([spec], tokenizer, seq_len=32, packing=True, cache_dir=cache)
    assert list(cache.iterdir()) == []  # neither a half-written cache nor the temporary directory is left
    monkeypatch.setattr(np, "save", real_save)
    build_rows([spec], tokenizer, seq_len=32, packing=True, cache_dir=cache)
    (entry,) = cache.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["manifest.json"] + sorted(f"train.{c}.npy" for c in COLUMNS)
    # A cache damaged afterwards (a column deleted) is rebuilt, not trusted.
    (entry / "train.labels.npy").unlink()
    build_rows([spec], tokenizer, seq_len=32, packing=True, cache_dir=cache)
    assert calls["n"] == 3 and (entry / "train.labels.npy").is_file()


def test_datasets_are_concatenated_in_order(tmp_path, tokenizer):
    first = write_docs(tmp_path / "a.jsonl", ["a1", "a2"])
    second = write_docs(tmp_path / "b.jsonl", ["b1"])
    train, _ = build_rows([second, first], tokenizer, seq_len=4, packing=False, cache_dir=tmp_path / "c")
    assert [tokenizer.decode(row[:2]) for row in train.input_ids] == ["b1", "a1", "a2"]


def test_eval_split_is_deterministic_disjoint_and_complete(tmp_path, tokenizer):
    texts = [f"doc{i:02d}" for i in range(20)]
    spec = write_docs(tmp_path / "a.jsonl", texts)

    def split(seed, cache):
        train, evaluation = build_rows(
            [spec], tokenizer, seq_len=8, packing=False, cache_dir=tmp_path / cache, eval_fraction=0.25, seed=seed
        )
        names = lambda rows: [tokenizer.decode(row[:5]) for row in rows.input_ids]  # noqa: E731
        return names(train), names(evaluation)

    train, evaluation = split(0, "c1")
    assert len(evaluation) == 5 and sorted(train + evaluation) == texts
    assert train == sorted(train) and evaluation == sorted(evaluation)  # original order kept in each split
    assert split(0, "c2") == (train, evaluation)  # a fresh build (another cache) gives the same split
    assert split(1, "c1")[1] != evaluation


def test_exact_repeats_are_left_out_across_datasets_before_the_split(tmp_path, tokenizer, calls):
    first = write_docs(tmp_path / "a.jsonl", ["d0", "d1", "d0", "d2", "d1"])
    second = write_docs(tmp_path / "b.jsonl", ["d2", "d3", "d0"])
    options = dict(seq_len=4, packing=False, cache_dir=tmp_path / "c")
    names = lambda rows: [tokenizer.decode(row[:2]) for row in rows.input_ids]  # noqa: E731
    kept, _ = build_rows([first, second], tokenizer, deduplicate=True, **options)
    assert names(kept) == ["d0", "d1", "d2", "d3"]  # the first of each, in order
    everything, _ = build_rows([first, second], tokenizer, **options)  # off by default: another cache entry
    assert len(names(everything)) == 8 and calls["n"] == 4
    train, evaluation = build_rows([first, second], tokenizer, deduplicate=True, eval_fraction=0.5, **options)
    assert sorted(names(train) + names(evaluation)) == ["d0", "d1", "d2", "d3"]  # neither split repeats the other


def test_bad_options_are_refused(tmp_path, tokenizer):
    spec = write_docs(tmp_path / "a.jsonl", ["x", "y"])
    options = dict(seq_len=8, packing=True, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match=r"val_set_size=1.5 must be a fraction in \[0, 1\) or a whole number"):
        build_rows([spec], tokenizer, **options | {"eval_fraction": 1.5})
    with pytest.raises(DataError, match="eval_fraction=2 of 2 examples leaves no training example"):
        build_rows([spec], tokenizer, **options | {"eval_fraction": 2})
    with pytest.raises(DataError, match="eval_fraction=0.8 of 2 examples leaves no training example"):
        build_rows([spec], tokenizer, **options | {"eval_fraction": 0.8})
    with pytest.raises(DataError, match="datasets: is empty"):
        build_rows([], tokenizer, **options)
    with pytest.raises(DataError, match="1 of 2 examples are longer than sequence_len=2 "):
        build_rows(
            [write_docs(tmp_path / "b.jsonl", ["x", "long"])],
            tokenizer,
            seq_len=2,
            packing=False,
            cache_dir=tmp_path / "c",
        )


def test_dict_specs_are_accepted(tmp_path, tokenizer):
    write_docs(tmp_path / "a.jsonl", ["x"])
    train, _ = build_rows(
        [{"path": str(tmp_path / "a.jsonl"), "type": "text"}],
        tokenizer,
        seq_len=4,
        packing=True,
        cache_dir=tmp_path / "c",
    )
    assert train.input_ids[0, :2].tolist() == [ord("x"), 256]


def test_distributed_build_main_builds_others_wait_then_load(tmp_path, tokenizer, calls):
    spec = write_docs(tmp_path / "a.jsonl", ["shared"])
    options = dict(seq_len=8, packing=True, cache_dir=tmp_path / "cache")
    barriers = []
    with pytest.raises(DataError, match="no data cache at .* after the main process built it"):
        build_rows_distributed([spec], tokenizer, is_main=False, barrier=lambda: barriers.append("other"), **options)
    main_train, _ = build_rows_distributed(
        [spec], tokenizer, is_main=True, barrier=lambda: barriers.append("main"), **options
    )
    other_train, _ = build_rows_distributed(
        [spec], tokenizer, is_main=False, barrier=lambda: barriers.append("other"), **options
    )
    assert calls["n"] == 1 and same_rows(main_train, other_train)
    assert barriers == ["other", "main", "other"]


def test_distributed_main_reaches_the_barrier_even_when_it_fails(tmp_path, tokenizer):
    spec = DatasetSpec(str(tmp_path / "missing.jsonl"), "completion")
    barriers = []
    with pytest.raises(DataError, match="does not exist"):
        build_rows_distributed(
            [spec],
            tokenizer,
            is_main=True,
            barrier=lambda: barriers.append(1),
            seq_len=8,
            packing=True,
            cache_dir=tmp_path / "cache",
        )
    assert barriers == [1]


def test_mixed_types_end_to_end_train_exactly_the_answers(tmp_path, tokenizer):
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "add", "input": "1 1", "output": "2"}) + "\n")
    chat = tmp_path / "chat.jsonl"
    turns = [("human", "hi"), ("gpt", "yo"), ("human", "bye"), ("gpt", "ciao")]
    chat.write_text(json.dumps({"conversations": [{"from": who, "value": text} for who, text in turns]}))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "n.txt").write_text("note")
    specs = [
        DatasetSpec(str(alpaca), "alpaca"),
        DatasetSpec(str(chat), "chat_template"),
        DatasetSpec(str(tmp_path / "notes"), "pretrain_files"),
    ]
    train, _ = build_rows(specs, tokenizer, seq_len=64, packing=True, cache_dir=tmp_path / "c")
    trained = [tokenizer.decode(row[labels != -100]) for row, labels in zip(train.input_ids, train.labels)]
    assert "".join(trained) == "2<|endoftext|>yo<|end|>\nciao<|end|>\nnote<|endoftext|>"
