"""The catalogue of user mistakes: each one is a single line naming the setting and the fix, exit status 2,
no traceback, no hang, nothing overwritten — through ``ndparallel train`` on the ranks that would train.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml
from support.scenarios import make_model
from support.trainer_helpers import tiny_config
from transformers import GPT2Config

from ndparallel.cli import main
from ndparallel.testing.ranks import run_ranks

_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
}


def _train_in_rank(config_path: str, extra: list[str]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", config_path, *extra])
    return code, err.getvalue()


def _write(tmp: Path, config: dict) -> str:
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _jsonl(tmp: Path, name: str, records: list) -> str:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _model_dir(tmp: Path, *, weights: bool = True, config=None, **overrides) -> str:
    path = tmp / "model"
    if config is not None:
        config.save_pretrained(path)
    else:
        model = make_model("llama", **{"vocab_size": 320, **overrides})
        if weights:
            model.save_pretrained(path)
        else:
            model.config.save_pretrained(path)
    return str(path)


def _other_shape_weights(tmp: Path) -> str:
    """config.json says hidden 64, the safetensors hold a hidden-32 model."""
    path = Path(_model_dir(tmp))
    small = make_model(
        "llama", vocab_size=320, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4
    )
    for f in path.glob("*.safetensors"):
        f.unlink()
    small.save_pretrained(tmp / "small")
    for f in (tmp / "small").glob("*.safetensors"):
        f.rename(path / f.name)
    return str(path)


def _with_checkpoint(tmp: Path) -> dict:
    (tmp / "out" / "checkpoints" / "step-5").mkdir(parents=True)
    return {}


def _non_utf8(tmp: Path) -> str:
    folder = tmp / "texts"
    folder.mkdir()
    (folder / "good.txt").write_text("plain text\n")
    (folder / "bad.txt").write_bytes(b"valid start \xff\xfe broken")
    return str(folder)


# (id, world, config changes: dict or callable(tmp) -> dict, extra CLI args, expected text in the one error line)
CASES = [
    # --- config: names, types, ranges ----------------------------------------------------------------
    ("unknown-key", 1, {"learnig_rate": 1e-3}, [], "unknown setting 'learnig_rate'; did you mean 'learning_rate'?"),
    (
        "unknown-dataset-key",
        1,
        lambda t: {"datasets": [{"path": "x.jsonl", "typ": "completion"}]},
        [],
        "datasets[0].typ; did you mean 'type'?",
    ),
    ("wrong-type-lr", 1, {"learning_rate": "fast"}, [], "learning_rate: Input should be a valid number"),
    ("wrong-type-batch", 1, {"micro_batch_size": "two"}, [], "micro_batch_size: Input should be a valid integer"),
    (
        "negative-tp",
        1,
        {"tensor_parallel_size": -2},
        [],
        "tensor_parallel_size: Input should be greater than or equal to 1",
    ),
    (
        "zero-cp",
        1,
        {"context_parallel_size": 0},
        [],
        "context_parallel_size: Input should be greater than or equal to 1",
    ),
    ("zero-dp-shard", 1, {"dp_shard_size": 0}, [], "must be >= 1, -1 (fill the remaining ranks) or auto"),
    (
        "two-fill-sizes",
        1,
        {"dp_shard_size": -1, "tp_size": -1},
        [],
        "tp_size: Input should be greater than or equal to 1",
    ),
    ("negative-lr", 1, {"learning_rate": -0.1}, [], "learning_rate: Input should be greater than 0"),
    (
        "bad-scheduler",
        1,
        {"lr_scheduler": "onecycle"},
        [],
        "lr_scheduler: Input should be 'cosine', 'linear', 'constant' or 'constant_with_warmup'",
    ),
    (
        "bad-cp-method",
        1,
        {"cp_comm_strategy": "ulysses"},
        [],
        "cp_comm_strategy: Input should be 'allgather', 'ring' or",
    ),
    ("zero-timeout", 1, {"process_group_timeout_s": 0}, [], "process_group_timeout_s: Input should be greater than 0"),
    ("fsdp-wrap-zero", 1, {"fsdp_wrap": 0}, [], "fsdp_wrap"),
    ("fp16", 1, {"fp16": True}, [], "fp16 is not supported: set bf16: true"),
    ("model-twice", 1, {"base_model": "/models/x"}, [], "base_model and model_shape are both set"),
    ("lora-no-targets", 1, {"adapter": "lora"}, [], "adapter: lora needs lora_target_modules"),
    ("lora-without-adapter", 1, {"lora_target_linear": True}, [], "but adapter is not: add adapter: lora"),
    ("no-datasets", 1, {"datasets": []}, [], "datasets is empty"),
    ("bad-set", 1, {}, ["--set", "learning_rate"], "--set 'learning_rate' must look like key=value"),
    ("unknown-preset", 1, {"model_shape": "7b"}, [], "model_shape '7b' is not a preset; choose one of"),
    # --- layout against world size and model ----------------------------------------------------------
    ("product-not-world", 2, {"dp_shard_size": 2, "tensor_parallel_size": 2}, [], "= 4, but 2 processes were started"),
    (
        "more-processes-than-layout",
        4,
        {"dp_replicate_size": 1, "dp_shard_size": 1, "tensor_parallel_size": 2},
        [],
        "= 2, but 4 processes were started",
    ),
    (
        "fill-does-not-divide",
        3,
        {"dp_shard_size": -1, "tensor_parallel_size": 2},
        [],
        "does not divide the world size 3",
    ),
    (
        "tp-heads",
        3,
        {"dp_shard_size": 1, "tensor_parallel_size": 3},
        [],
        "tp_size=3 does not divide the model's attention heads (num_attention_heads=8)",
    ),
    (
        "tp-kv-heads",
        4,
        {
            "dp_shard_size": 1,
            "tensor_parallel_size": 4,
            "model_config_overrides": {"vocab_size": 320, "num_key_value_heads": 2},
        },
        [],
        "key/value heads (num_key_value_heads=2)",
    ),
    (
        "tp-intermediate",
        4,
        {
            "dp_shard_size": 1,
            "tensor_parallel_size": 4,
            "model_config_overrides": {"vocab_size": 320, "intermediate_size": 130},
        },
        [],
        "MLP intermediate size (intermediate_size=130)",
    ),
    (
        "cp-soft-capped-attention",
        2,
        {
            "dp_shard_size": 1,
            "context_parallel_size": 2,
            "model_shape": None,
            "model_config_overrides": {"model_type": "gemma2", "vocab_size": 320},
        },
        [],
        "cp_size=2 cannot split this model's attention: attention-logit soft-capping (attn_logit_softcapping=50.0)",
    ),
    (
        "cp-alltoall-heads",
        4,
        {
            "dp_shard_size": 1,
            "context_parallel_size": 4,
            "cp_comm_strategy": "alltoall",
            "model_config_overrides": {"vocab_size": 320, "num_attention_heads": 2, "num_key_value_heads": 2},
        },
        [],
        "cp_comm_strategy='alltoall' splits attention heads over cp_size x tp_size = 4",
    ),
    (
        "cp-sequence-too-short",
        8,
        {"dp_shard_size": 1, "context_parallel_size": 4, "tensor_parallel_size": 2, "sequence_len": 8},
        [],
        "sequence_len=8 is shorter than 2 x cp_size x tp_size = 16",
    ),
    (
        "reshard-not-divisor",
        2,
        {"dp_shard_size": 2, "reshard_after_forward": 3},
        [],
        "reshard_after_forward=3 must be a divisor of the FSDP shard size 2",
    ),
    # --- mixture-of-experts models and expert parallelism ------------------------------------------------
    (
        "ep-not-dividing-experts",
        2,
        {
            "dp_shard_size": 2,
            "expert_parallel_size": 2,
            "model_shape": None,
            "model_config_overrides": _MOE | {"num_experts": 3},
        },
        [],
        "expert_parallel_size=2 does not divide the model's 3 experts; choose expert_parallel_size from [1, 3]",
    ),
    (
        "ep-on-dense-model",
        2,
        {"dp_shard_size": 2, "expert_parallel_size": 2},
        [],
        "expert_parallel_size=2 needs a mixture-of-experts model, but llama has no experts",
    ),
    (
        "ep-not-dividing-ranks",
        2,
        {"dp_replicate_size": 2, "dp_shard_size": 1, "expert_parallel_size": 2},
        [],
        "expert_parallel_size=2 must divide dp_shard_size x cp_size x tp_size = 1 x 1 x 1 = 1",
    ),
    (
        "tokenizer-larger-than-vocab",
        1,
        {"model_config_overrides": {"vocab_size": 200}},
        [],
        "the tokenizer has 262 tokens but the model's vocab_size is 200",
    ),
    ("cuda-on-cpu-machine", 1, {"device": "cuda"}, [], "device: cuda, but this machine has no CUDA GPU"),
    # --- data -----------------------------------------------------------------------------------------
    (
        "missing-dataset",
        1,
        {"datasets": [{"path": "/nowhere/data.jsonl", "type": "completion"}]},
        [],
        "/nowhere/data.jsonl",
    ),
    (
        "empty-dataset",
        1,
        lambda t: {"datasets": [{"path": _jsonl(t, "empty.jsonl", []), "type": "completion"}]},
        [],
        "empty.jsonl",
    ),
    (
        "missing-field",
        1,
        lambda t: {"datasets": [{"path": _jsonl(t, "f.jsonl", [{"content": "hi"}]), "type": "completion"}]},
        [],
        "text",
    ),
    (
        "wrong-field-type",
        1,
        lambda t: {"datasets": [{"path": _jsonl(t, "g.jsonl", [{"text": 42}]), "type": "completion"}]},
        [],
        "text",
    ),
    ("bad-json-line", 1, lambda t: {"datasets": [{"path": str(_bad_json(t)), "type": "completion"}]}, [], "bad.jsonl"),
    (
        "alpaca-missing-output",
        1,
        lambda t: {"datasets": [{"path": _jsonl(t, "a.jsonl", [{"instruction": "x"}]), "type": "alpaca"}]},
        [],
        "output",
    ),
    (
        "unknown-dataset-type",
        1,
        lambda t: {"datasets": [{"path": _jsonl(t, "u.jsonl", [{"text": "x"}]), "type": "sharegpt_v9"}]},
        [],
        "sharegpt_v9",
    ),
    (
        "rows-too-long",
        1,
        lambda t: {
            "sample_packing": False,
            "long_rows": "error",
            "datasets": [{"path": _jsonl(t, "long.jsonl", [{"text": "x" * 500}] * 40), "type": "completion"}],
        },
        [],
        "longer than sequence_len=64",
    ),
    ("non-utf8-text", 1, lambda t: {"datasets": [{"path": _non_utf8(t), "type": "pretrain_files"}]}, [], "bad.txt"),
    ("dataset-smaller-than-batch", 1, {"micro_batch_size": 5000}, [], "micro_batch_size=5000"),
    ("missing-tokenizer", 1, {"tokenizer_config": "/nowhere/tokenizer"}, [], "/nowhere/tokenizer"),
    # --- model ----------------------------------------------------------------------------------------
    (
        "missing-model-dir",
        1,
        {"model_shape": None, "base_model": "/nowhere/model"},
        [],
        "base_model '/nowhere/model' is not a directory",
    ),
    (
        "config-without-weights",
        1,
        lambda t: {"model_shape": None, "base_model": _model_dir(t, weights=False)},
        [],
        "has a config but no *.safetensors weights",
    ),
    (
        "weights-of-another-shape",
        1,
        lambda t: {"model_shape": None, "base_model": _other_shape_weights(t)},
        [],
        "config.json and the weights disagree",
    ),
    (
        "unsupported-architecture",
        2,
        lambda t: {
            "model_shape": None,
            "dp_shard_size": 1,
            "tensor_parallel_size": 2,
            "base_model": _model_dir(t, config=GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4)),
        },
        [],
        "GPT2LMHeadModel does not have the decoder shape ndparallel parallelizes",
    ),
    # --- checkpoints and outputs ----------------------------------------------------------------------
    ("resume-without-checkpoint", 1, {"resume_from_checkpoint": "latest"}, [], "resume_from_checkpoint: latest, but"),
    (
        "resume-missing-path",
        1,
        {"resume_from_checkpoint": "/nowhere/step-3"},
        [],
        "resume_from_checkpoint '/nowhere/step-3' is not a directory",
    ),
    ("would-overwrite-checkpoints", 1, _with_checkpoint, [], "already holds checkpoints"),
]


def _bad_json(tmp: Path) -> Path:
    path = tmp / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "broken\n')
    return path


def test_catalogue_has_forty_cases():
    assert len({case[0] for case in CASES}) >= 40


@pytest.mark.parametrize("name, world, change, extra, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(tmp_path, name, world, change, extra, expected):
    config = tiny_config(tmp_path)
    config.update(change(tmp_path) if callable(change) else change)
    path = _write(tmp_path, config)
    before = sorted(p.name for p in (tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else []
    results = run_ranks(world, _train_in_rank, path, extra, timeout_s=120)
    code, err = results[0]
    lines = [line for line in err.splitlines() if line.startswith("ndparallel: error:")]
    assert code == 2, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err
    for other_code, other_err in results[1:]:  # the other ranks fail the same way, silently
        assert other_code == 2 and "Traceback" not in other_err
    after = sorted(p.name for p in (tmp_path / "out").rglob("*")) if (tmp_path / "out").exists() else []
    assert not (set(after) - set(before)) & {"metrics.jsonl", "latest", "COMPLETE"}, "a failed run wrote outputs"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("learning_rate: [1, 2\n", "is not valid YAML at line"),
        ("- just\n- a list\n", "must hold a mapping of settings, not a list"),
    ],
)
def test_unreadable_config_files(tmp_path, capsys, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    assert expected in capsys.readouterr().err


def test_missing_config_file(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
