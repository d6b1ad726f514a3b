"""The ``ndparallel plan`` entry points and model inputs. No processes."""

import argparse
import json
import re

import pytest

from ndparallel import ConfigError
from ndparallel.planner.cli import add_plan_arguments, run_plan
from ndparallel.planner.shapes import PRESETS, ModelShape, load_model_shape


def run(argv, capsys):
    parser = add_plan_arguments(argparse.ArgumentParser(prog="ndparallel plan"))
    code = run_plan(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_and_exit_code(capsys):
    code, out, _ = run(["--model", "llama-8b", "--nodes", "2", "--seq-len", "131072", "--top", "3"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("llama-8b: 8.03B parameters on 2 x 8 NVIDIA H100 SXM 80GB (79.1 GiB), 8 rows x 131072")
    assert lines[1].startswith("kernel speeds: fractions of the datasheet peaks measured on our H200")
    assert lines[2].startswith("no --gpu given: assuming h100-sxm")  # the default is said, not silent
    assert "tok/s/GPU" in out and "#1:" in out


def test_gpu_preset_overrides_and_one_layout(capsys):
    code, out, _ = run(
        [
            "--model",
            "8b",
            "--gpu",
            "h200",
            "--layout",
            "1,8,1,1",
            "--seq-len",
            "8192",
            "--global-batch",
            "16",
            "--micro-batch-sizes",
            "2",
            "--activation-checkpointing",
            "selective",
            "--compile",
            "--fp8",
            "--json",
        ],
        capsys,
    )
    rows = json.loads(out)
    assert code == 0 and len(rows) == 1 and rows[0]["layout"]["dp_shard"] == 8 and rows[0]["fits"]
    code, out, _ = run(
        [
            "--model",
            "8b",
            "--gpu",
            "a100-40gb",
            "--memory-gib",
            "60",
            "--seq-len",
            "4096",
            "--global-batch",
            "8",
            "--top",
            "1",
        ],
        capsys,
    )
    assert "NVIDIA A100 SXM 40GB (60 GiB)" in out.splitlines()[0]
    assert "not a Hopper GPU" in out  # H200 fractions applied to another architecture: said so


def test_compile_fp8_and_sync_modes_change_the_estimate(capsys):
    base = [
        "--model",
        "llama-8b",
        "--gpu",
        "h100-sxm",
        "--layout",
        "2,4,1,1",
        "--seq-len",
        "4096",
        "--global-batch",
        "64",
        "--micro-batch-sizes",
        "2",
        "--activation-checkpointing",
        "full",
        "--json",
    ]

    def best(*extra):
        _, out, _ = run(base + list(extra), capsys)
        return json.loads(out)[0]

    plain, compiled, fp8 = best(), best("--compile"), best("--compile", "--fp8")
    assert plain["tokens_per_s_per_gpu"] < compiled["tokens_per_s_per_gpu"] < fp8["tokens_per_s_per_gpu"]
    sharded, unsharded = best("--gradient-sync", "every_micro_batch"), best("--gradient-sync", "last_micro_batch")
    assert sharded["accumulation"] == unsharded["accumulation"] == 4
    assert unsharded["memory_bytes"]["accumulated_grads"] > 0 == sharded["memory_bytes"]["accumulated_grads"]
    assert sharded["comm"]["fsdp"]["bytes"] > unsharded["comm"]["fsdp"]["bytes"]  # reduce-scatter x 4
    assert sharded["comm"]["dp_replicate"]["bytes"] == unsharded["comm"]["dp_replicate"]["bytes"]  # once


def test_json_output_parses(capsys):
    code, out, _ = run(
        [
            "--model",
            "tiny",
            "--gpus-per-node",
            "4",
            "--seq-len",
            "64",
            "--global-batch",
            "8",
            "--activation-checkpointing",
            "none",
            "--json",
        ],
        capsys,
    )
    rows = json.loads(out)
    assert code == 0 and rows and all(r["activation_checkpointing"] == "none" for r in rows)
    assert {
        r["layout"]["dp_replicate"] * r["layout"]["dp_shard"] * r["layout"]["cp"] * r["layout"]["tp"] for r in rows
    } == {4}


def test_nothing_fits_exits_1(capsys):
    code, out, _ = run(["--model", "llama-70b", "--gpus-per-node", "1", "--seq-len", "4096"], capsys)
    assert code == 1 and "does not fit: needs" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "nope", "--seq-len", "64"], "model='nope' is not a preset"),
        (["--model", "tiny", "--seq-len", "0"], "seq_len=0 must be"),
        (["--model", '{"hidden": 64', "--seq-len", "64"], "inline JSON does not parse"),
        (["--model", "tiny", "--seq-len", "64", "--memory-gib", "-1"], "memory_gib=-1.0 must be > 0"),
        (
            ["--model", "tiny", "--seq-len", "64", "--layout", "1,2,1,1"],
            "--layout 1,2,1,1 uses 2 GPUs but the cluster has 8",
        ),
        (["--model", "tiny", "--seq-len", "64", "--gpu", "a100-80gb", "--fp8"], "has no fp8 tensor cores"),
        (["--model", "tiny", "--seq-len", "64", "--precision", "fp32", "--fp8"], "fp8 matmuls need precision='bf16'"),
    ],
)
def test_bad_settings_exit_2_with_one_line(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_presets_have_the_published_sizes_under_both_names():
    names = ("llama-1b", "llama-3b", "llama-8b", "llama-70b", "llama-405b")
    sizes = {name: PRESETS[name].params / 1e9 for name in names}
    assert sizes == pytest.approx(
        {"llama-1b": 1.236, "llama-3b": 3.213, "llama-8b": 8.030, "llama-70b": 70.554, "llama-405b": 405.853}, abs=2e-3
    )
    assert load_model_shape("8b") == load_model_shape("llama-8b") == load_model_shape("LLAMA-8B") == PRESETS["llama-8b"]


def test_one_preset_table_for_model_shape_and_the_planner():
    from ndparallel.models.presets import PRESETS as TABLE
    from ndparallel.weights.meta import model_config_for

    for key in TABLE:
        config = model_config_for(base_model=None, model_shape=key, overrides={})
        assert ModelShape.from_hf_config(config).params == load_model_shape(key).params
        assert model_config_for(base_model=None, model_shape=f"llama-{key}", overrides={}).to_dict() == config.to_dict()


def test_model_from_hf_directory_inline_json_and_config_object(tmp_path):
    from transformers import Qwen3Config

    cfg = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_dir = load_model_shape(str(tmp_path))
    assert from_dir.params == PRESETS["llama-8b"].params and from_dir.head_dim == 128
    assert load_model_shape(json.dumps(cfg)).params == from_dir.params
    own = load_model_shape(json.dumps(PRESETS["tiny"].to_dict()))
    assert own == PRESETS["tiny"]
    qwen = ModelShape.from_hf_config(
        Qwen3Config(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=16,
        )
    )
    assert qwen.qk_norm and qwen.head_dim == 16 and qwen.q_dim == 128
    with pytest.raises(ConfigError, match="model config lacks hidden_size"):
        ModelShape.from_hf_config(
            {"vocab_size": 10, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 4}
        )


def test_load_in_4bit_and_8bit(capsys):
    """QLoRA / 8-bit LoRA plans: less memory and a dequantization part than a bf16 base; NF4 and FP8 refuse tp;
    an FP8 base's forward products at the FP8 rate make its linear part smaller than a bf16 base's."""
    common = ["--model", "llama-8b", "--gpu", "h200", "--gpus-per-node", "1", "--seq-len", "4096"]
    common += ["--global-batch", "1", "--lora-rank", "16", "--activation-checkpointing", "none", "--json"]
    rows = {}
    for flag in ("", "--load-in-4bit", "--load-in-8bit", "--load-in-fp8"):
        code, out, _ = run(common + ([flag] if flag else []), capsys)
        assert code == 0
        rows[flag] = json.loads(out)[0]
    memory = {flag: row["memory_bytes"]["total"] for flag, row in rows.items()}
    assert memory["--load-in-4bit"] < memory["--load-in-8bit"] == memory["--load-in-fp8"] < memory[""]
    linear = {flag: row["parts_s"]["linear"] for flag, row in rows.items()}
    assert linear["--load-in-fp8"] < linear["--load-in-8bit"] == linear[""]
    dequantize = {flag: row["parts_s"]["dequantize"] for flag, row in rows.items()}
    # NF4's one Triton kernel (2.5 bytes moved per value) costs less than int8's compiled dequantization
    assert dequantize[""] == 0 < dequantize["--load-in-4bit"] < dequantize["--load-in-8bit"]
    two_gpus = ["--model", "llama-8b", "--gpu", "h200", "--gpus-per-node", "2", "--seq-len", "4096", "--lora-rank", "8"]
    code, out, err = run(two_gpus + ["--load-in-4bit", "--layout", "1,1,1,2"], capsys)
    assert code == 2 and "NF4 base weights cannot be split by tensor parallelism" in err
    code, out, err = run(two_gpus + ["--load-in-fp8", "--layout", "1,1,1,2"], capsys)
    assert code == 2 and "FP8 base weights cannot be split by tensor parallelism" in err
    code, _, err = run(["--model", "llama-8b", "--seq-len", "4096", "--load-in-8bit"], capsys)
    assert code == 2 and "give --lora-rank" in err


def test_nothing_fits_says_so_first_with_what_would_fit(capsys):
    """The issue's case: a 70B on one node at 8192 tokens; the verdict comes before the table."""
    from ndparallel.cli import main

    assert main(["plan", "--model", "70b", "--nodes", "1", "--seq-len", "8192"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert re.match(r"nothing fits: 0 of 40 layouts of 8 GPUs hold llama-70b \(the leanest needs 1[34]\d GiB", first)
    assert "would fit: --nodes 2; LoRA (--lora-rank 16); 4-bit QLoRA (--lora-rank 16 --load-in-4bit)" in first


def test_hub_ids_and_moe_models_plan_as_train_reads_them(tmp_path, monkeypatch, capsys):
    """``--model Qwen/Qwen3-30B-A3B`` (a hub id, a mixture of experts) from the hub cache, as train reads it:
    30.5B parameters held, about 3.0B used per token."""
    from support.hub_cache import add_model
    from transformers import Qwen3MoeConfig

    from ndparallel.cli import main

    published = Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    add_model(tmp_path / "hub", "Qwen/Qwen3-30B-A3B", published, "qwen3")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "Qwen/Qwen3-30B-A3B", "--seq-len", "4096", "--top", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("Qwen3-30B-A3B: 30.53B parameters on 1 x 8") and "8 of 128 per token" in header
    shape = load_model_shape("Qwen/Qwen3-30B-A3B")
    assert shape.matmul_params() / 1e9 == pytest.approx(3.04, abs=0.01)  # what a token uses: the MFU's 6N
