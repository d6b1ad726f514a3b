"""The ``ndparallel plan`` entry points and model inputs. No processes."""

import argparse
import json

import pytest

from ndparallel import ConfigError
from ndparallel.planner import ModelShape, add_plan_arguments, load_model_shape, run_plan
from ndparallel.planner.shapes import PRESETS


def run(argv, capsys):
    parser = add_plan_arguments(argparse.ArgumentParser(prog="ndparallel plan"))
    code = run_plan(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_and_exit_code(capsys):
    code, out, _ = run(["--model", "llama-8b", "--nodes", "2", "--seq-len", "131072", "--top", "3"], capsys)
    assert code == 0
    assert out.splitlines()[0].startswith("llama-8b: 8.03B parameters on 2 x 8 GPUs (80 GiB), 8 rows x 131072")
    assert "tok/s/GPU" in out and "#1:" in out


def test_json_output_parses(capsys):
    code, out, _ = run(["--model", "tiny", "--gpus-per-node", "4", "--seq-len", "64", "--global-batch", "8",
                        "--activation-checkpointing", "none", "--json"], capsys)
    rows = json.loads(out)
    assert code == 0 and rows and all(r["activation_checkpointing"] == "none" for r in rows)
    assert {r["layout"]["dp_replicate"] * r["layout"]["dp_shard"] * r["layout"]["cp"] * r["layout"]["tp"]
            for r in rows} == {4}


def test_nothing_fits_exits_1(capsys):
    code, out, _ = run(["--model", "llama-70b", "--gpus-per-node", "1", "--seq-len", "4096"], capsys)
    assert code == 1 and "does not fit: needs" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope", "--seq-len", "64"], "model='nope' is not a preset"),
    (["--model", "tiny", "--seq-len", "0"], "seq_len=0 must be"),
    (["--model", "{\"hidden\": 64", "--seq-len", "64"], "inline JSON does not parse"),
    (["--model", "tiny", "--seq-len", "64", "--memory-gib", "-1"], "device_memory_gib=-1.0 must be > 0"),
])
def test_bad_settings_exit_2_with_one_line(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_presets_have_the_published_sizes():
    sizes = {name: PRESETS[name].params / 1e9 for name in ("llama-1b", "llama-3b", "llama-8b", "llama-70b")}
    assert sizes == pytest.approx({"llama-1b": 1.236, "llama-3b": 3.213, "llama-8b": 8.030, "llama-70b": 70.554},
                                  abs=2e-3)


def test_model_from_hf_directory_inline_json_and_config_object(tmp_path):
    from transformers import Qwen3Config

    cfg = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_dir = load_model_shape(str(tmp_path))
    assert from_dir.params == PRESETS["llama-8b"].params and from_dir.head_dim == 128
    assert load_model_shape(json.dumps(cfg)).params == from_dir.params
    own = load_model_shape(json.dumps(PRESETS["tiny"].to_dict()))
    assert own == PRESETS["tiny"]
    qwen = ModelShape.from_hf_config(Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                                 head_dim=16))
    assert qwen.qk_norm and qwen.head_dim == 16 and qwen.q_dim == 128
    with pytest.raises(ConfigError, match="model config lacks hidden_size"):
        ModelShape.from_hf_config({"vocab_size": 10, "num_hidden_layers": 1, "num_attention_heads": 1,
                                   "intermediate_size": 4})
