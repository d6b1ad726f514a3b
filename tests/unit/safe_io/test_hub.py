"""Hub ids through a hub cache the test builds (offline): models, tokenizers, datasets and their splits, slices
and data files; one download per node; the added-token vocabulary growth; the 8-bit optimizer's refusals."""

import pytest
import torch
from support.hub_cache import add_dataset, add_model, alpaca_records, chat_records, family_tokenizer
from support.scenarios import make_model

from ndparallel.config.reading import read_config
from ndparallel.data.sources import read_records
from ndparallel.data.spec import DatasetSpec
from ndparallel.data.templates import TEMPLATES, template_source
from ndparallel.data.tokenize import tokenize_records
from ndparallel.errors import ConfigError, DataError, ModelError, NdParallelError
from ndparallel.safe_io import hub
from ndparallel.train.run_inputs import build_run_optimizer, load_run_tokenizer
from ndparallel.weights.meta import model_config_for
from ndparallel.weights.vocab import fit_vocab, grow_rows, padded_vocab


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_a_hub_model_id_resolves_from_the_cache(cache, tmp_path):
    model = make_model("qwen3", vocab_size=320)
    snapshot = add_model(cache, "Qwen/Qwen3-8B", model.config, "qwen3", model=model)
    assert hub.model_dir("Qwen/Qwen3-8B") == snapshot
    assert model_config_for(base_model="Qwen/Qwen3-8B", model_shape=None, overrides={}).model_type == "qwen3"
    local = tmp_path / "Qwen" / "Qwen3-8B"  # an existing local path with the same name wins
    local.mkdir(parents=True)
    assert not hub.is_hub_id(str(local)) and hub.model_dir(str(local)) == local


def test_a_missing_hub_model_is_one_line_that_says_how_to_get_it(cache):
    with pytest.raises(
        ModelError,
        match=r"base_model 'org/absent' is not in the Hugging Face cache .* and "
        r"HF_HUB_OFFLINE is set; download it once \(`hf download org/absent`\)",
    ):
        hub.model_dir("org/absent")
    add_model(cache, "org/config-only", make_model("llama").config, "llama")
    with pytest.raises(ModelError, match="'org/config-only' is not in the Hugging Face cache"):
        hub.model_dir("org/config-only", weights=True)  # cached, but without its weights
    assert hub.model_dir("org/config-only", weights=False).is_dir()


def test_only_local_rank_zero_downloads_and_every_rank_gets_its_error():
    calls, barriers = [], []
    assert (
        hub.on_each_node(
            lambda download: calls.append(download) or "dir",
            local_rank=0,
            barrier=lambda: barriers.append(1),
            all_ok=lambda p: p,
        )
        == "dir"
    )
    assert (
        hub.on_each_node(
            lambda download: calls.append(download) or "dir",
            local_rank=3,
            barrier=lambda: barriers.append(1),
            all_ok=lambda p: p,
        )
        == "dir"
    )
    assert calls == [True, False] and barriers == [1, 1]

    def failing(download):
        raise ModelError("base_model 'x/y' is gated")

    with pytest.raises(NdParallelError, match="gated"):  # rank 0's error, raised on a rank that did not fetch
        hub.on_each_node(failing, local_rank=1, barrier=lambda: None, all_ok=lambda p: "base_model 'x/y' is gated")


def test_config_tokens_and_chat_template_by_name(cache):
    add_model(cache, "org/m", make_model("llama").config, "llama", tokenizer=family_tokenizer("llama"))
    cfg = read_config(
        {
            "base_model": "org/m",
            "datasets": [{"path": "d", "type": "chat_template"}],
            "chat_template": "chatml",
            "special_tokens": {"pad_token": "<|pad2|>"},
            "tokens": ["<tool>"],
        }
    ).config
    tokenizer, added = load_run_tokenizer(cfg)
    assert added == ["<|pad2|>", "<tool>"] and tokenizer.pad_token == "<|pad2|>"
    assert tokenizer.chat_template == TEMPLATES["chatml"]
    assert template_source("tokenizer_default_fallback_llama3", None, None) == TEMPLATES["llama3"]
    assert template_source("tokenizer_default", None, "mine") == "mine"
    (error,) = read_config({"base_model": "org/m", "datasets": [{"path": "d"}], "chat_template": "chatml2"}).errors
    assert "chat_template: 'chatml2' is not a chat template here; choose one of chatml" in error


def test_vocabulary_grows_to_a_multiple_of_64_and_tp_with_mean_rows():
    config = make_model("llama", vocab_size=262).config
    assert fit_vocab(config, 262, [], tp=2) == (None, None)
    vocab_from, note = fit_vocab(config, 264, ["<a>", "<b>"], tp=3)
    assert (vocab_from, config.vocab_size, padded_vocab(264, 3)) == (262, 384, 384)
    assert note.startswith("vocabulary: 2 token(s) added (<a>, <b>); embeddings grow from 262 to 384 rows")
    with pytest.raises(ConfigError, match="the tokenizer has 385 tokens but the model's vocab_size is 384; use"):
        fit_vocab(config, 385, [], tp=1)  # not tokens the config added: not the model's tokenizer
    full = torch.arange(12.0).reshape(4, 3)
    grown = grow_rows(full, (6, 3), 4)
    assert torch.equal(grown[:4], full) and torch.equal(grown[4], full.mean(0)) and torch.equal(grown[5], grown[4])
    assert grow_rows(full, (4, 3), None) is full and grow_rows(torch.ones(3), (6,), 4).shape == (3,)


def _spec(**settings) -> DatasetSpec:
    return DatasetSpec.from_dict({"type": "alpaca", **settings})


def test_hub_dataset_splits_by_file_names_and_slices(cache):
    records = alpaca_records(40)
    add_dataset(
        cache, "org/alpaca", {"data/train-00000.parquet": records[:30], "data/test-00000.parquet": records[30:]}
    )
    assert len(list(read_records(_spec(path="org/alpaca")))) == 30
    assert len(list(read_records(_spec(path="org/alpaca", split="test")))) == 10
    tenth = list(read_records(_spec(path="org/alpaca", split="train[:10%]")))
    assert [r.instruction for r in tenth] == [r["instruction"] for r in records[:3]]
    middle = list(read_records(_spec(path="org/alpaca", split="train[5:8]")))
    assert [r.output for r in middle] == [r["output"] for r in records[5:8]]
    with pytest.raises(DataError, match="no 'validation' split among its files"):
        list(read_records(_spec(path="org/alpaca", split="validation")))


def test_hub_dataset_card_configs_and_data_files(cache):
    card = (
        "---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n    path: small/*.jsonl\n"
        "- config_name: default\n  data_files: big/*.jsonl\n---\n# A card\n"
    )
    add_dataset(cache, "org/cards", {"small/a.jsonl": alpaca_records(3), "big/b.jsonl": alpaca_records(7)}, card)
    assert len(list(read_records(_spec(path="org/cards")))) == 7
    assert len(list(read_records(_spec(path="org/cards", name="small")))) == 3
    with pytest.raises(DataError, match="no configuration 'tiny' in its card"):
        list(read_records(_spec(path="org/cards", name="tiny")))
    pyarrow = pytest.importorskip("pyarrow")
    text = "".join(f'{{"text": "doc {i}"}}\n' for i in range(5)).encode()
    sink = pyarrow.BufferOutputStream()
    with pyarrow.CompressedOutputStream(sink, "zstd") as out:
        out.write(text)
    add_dataset(
        cache,
        "org/long",
        {"pretrain/rp_sub.jsonl.zst": sink.getvalue().to_pybytes(), "other/x.jsonl": [{"text": "no"}]},
    )
    docs = read_records(
        DatasetSpec.from_dict({"path": "org/long", "type": "completion", "data_files": ["pretrain/rp_sub.jsonl.zst"]})
    )
    assert [r.text for r in docs] == [f"doc {i}" for i in range(5)]


def test_chat_mappings_roles_and_train_on_inputs(cache):
    add_dataset(cache, "org/chat", {"data/train.parquet": chat_records(2)})
    tokenizer = family_tokenizer("qwen3")
    spec = DatasetSpec.from_dict(
        {
            "path": "org/chat",
            "type": "chat_template",
            "field": "conversations",
            "role_key": "from",
            "content_key": "value",
            "chat_template": TEMPLATES["chatml"],
        }
    )
    (first, _) = tokenize_records(read_records(spec), tokenizer, spec)
    text = tokenizer.decode(first.input_ids)
    assert (
        text == "<|im_start|>user\nQuestion 0: what is 0 plus 0?<|im_end|>\n<|im_start|>assistant\nIt is 0.<|im_end|>\n"
    )
    trained = tokenizer.decode([t for t, label in zip(first.input_ids, first.labels) if label != -100])
    assert trained == "It is 0.<|im_end|>\n"
    every = DatasetSpec.from_dict(
        {
            **{k: getattr(spec, k) for k in ("path", "type", "field", "role_key", "content_key", "chat_template")},
            "train_on_inputs": True,
        }
    )
    (first, _) = tokenize_records(read_records(every), tokenizer, every)
    assert all(label != -100 for label in first.labels)


def test_eight_bit_adamw_is_refused_where_it_cannot_run(monkeypatch):
    model = make_model("llama")
    cfg = read_config({"model_shape": "tiny", "datasets": [{"path": "d"}], "optimizer": "adamw_bnb_8bit"}).config
    with pytest.raises(ConfigError, match=r"optimizer: adamw_bnb_8bit \(8-bit AdamW\) needs a CUDA GPU"):
        build_run_optimizer(model, cfg, "cpu")
    for name in ("torchao", "torchao.optim"):  # as if torchao were not installed
        monkeypatch.setitem(__import__("sys").modules, name, None)
    with pytest.raises(ConfigError, match=r"needs torchao \(8-bit AdamW for sharded parameters\): pip install"):
        build_run_optimizer(model, cfg, "cuda")
    plain = read_config({"model_shape": "tiny", "datasets": [{"path": "d"}], "optimizer": "adamw_torch"}).config
    assert isinstance(build_run_optimizer(model, plain, "cpu"), torch.optim.AdamW)


def test_missing_hub_inputs_are_one_consistent_line_each_and_the_layout_still_shows(tmp_path, monkeypatch, capsys):
    """No HF_HUB_OFFLINE and no reachable Hub: the model (not again for its tokenizer) and the dataset each say
    the same thing, once; validate still prints the layout. With HF_HUB_OFFLINE=1 they say that instead."""
    from huggingface_hub import constants

    from ndparallel.cli import main

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    config = tmp_path / "config.yaml"
    config.write_text("base_model: org/absent-model\ndatasets:\n  - path: org/absent-data\n    type: alpaca\n")
    for offline, reason in (
        (None, "cannot be downloaded from here (the Hugging Face Hub cannot be reached"),
        ("1", "HF_HUB_OFFLINE is set; download it once"),
    ):
        if offline:
            monkeypatch.setenv("HF_HUB_OFFLINE", offline)
        assert main(["validate", str(config)]) == 2
        out = capsys.readouterr()
        problems = [line for line in out.err.splitlines() if line.startswith("  - ")]
        assert len(problems) == 2, problems
        assert problems[0].startswith("  - base_model 'org/absent-model' is not in the Hugging Face cache")
        assert problems[1].startswith("  - datasets[0].path 'org/absent-data' is not in the Hugging Face cache")
        assert all(reason in line for line in problems), problems
        assert "world 1 = dp_replicate 1 x dp_shard 1 x cp 1 x tp 1" in out.out
        assert "the model against the layout and the tokenizer (its config is not at hand)" in out.out


def test_the_rank_that_downloads_says_why_it_could_not(tmp_path, monkeypatch):
    """Local rank 0 of a node tries the download; when the Hub cannot be reached it says so (it used to repeat
    "downloads are left to local rank 0", which is itself)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelError) as raised:
        hub.model_dir("org/absent-model", download=True)
    message = str(raised.value)
    assert "cannot be downloaded from here (the Hugging Face Hub cannot be reached" in message
    assert "left to local rank 0" not in message and "\n" not in message
