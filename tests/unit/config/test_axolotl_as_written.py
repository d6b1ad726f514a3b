"""YAML as Axolotl users write it: unquoted ``save_strategy: no``, ``evals_per_epoch: 0``, the expert-parallel
plugin's layout, reasoning traces in chat data; one line for one bad value; warm-up longer than the run.
Through ``ndparallel validate`` in-process (no worker processes)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import Qwen3MoeConfig

from ndparallel import cli
from ndparallel.data.load_tokenizer import byte_tokenizer
from ndparallel.data.sources import read_records
from ndparallel.data.spec import DatasetSpec
from ndparallel.data.templates import template_source
from ndparallel.data.tokenize import tokenize_records
from ndparallel.loss.cross_entropy import IGNORE_INDEX

BASE = """\
model_shape: tiny
model_config_overrides:
  vocab_size: 320
tokenizer_config: byte
sequence_len: 128
datasets:
  - path: {data}
    type: completion
"""


def run_validate(tmp: Path, text: str, capsys, *args: str) -> tuple[int, str, str]:
    data = tmp / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(4)))
    config = tmp / "config.yaml"
    config.write_text(BASE.format(data=data) + text)
    code = cli.main(["validate", str(config), *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_save_strategy_no_unquoted_is_accepted(tmp_path, capsys):
    code, out, err = run_validate(tmp_path, "save_strategy: no\neval_strategy: no\n", capsys)  # YAML 1.1: false
    assert code == 0, err
    assert "checkpoints at the end only" in out or "config OK" in out


def test_evals_per_epoch_zero_means_no_evaluation(tmp_path, capsys):
    code, _, err = run_validate(tmp_path, "val_set_size: 0.25\nevals_per_epoch: 0\nsaves_per_epoch: 0\n", capsys)
    assert code == 0, err
    from ndparallel.config.reading import load_yaml, parse_config

    cfg = parse_config(load_yaml(tmp_path / "config.yaml"))
    assert cfg.eval_strategy == "no" and cfg.evals_per_epoch is None and cfg.saves_per_epoch is None


def test_one_bad_value_is_one_line(tmp_path, capsys):
    code, _, err = run_validate(tmp_path, "", capsys, "--set", "bf16=maybe")
    assert code == 2
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert problems == ["  - bf16: must be true or false, or 'auto' or 'full' (got 'maybe')"]


def test_warmup_longer_than_the_run_is_said(tmp_path, capsys):
    code, out, _ = run_validate(tmp_path, "max_steps: 10\nwarmup_steps: 50\n", capsys)
    assert code == 0  # a quick run with max_steps lowered is deliberate: said, not refused
    assert "warning: warmup_steps=50 is more than max_steps=10: the learning rate ends the run at 20%" in out


def test_the_expert_parallel_plugin_means_world_is_ep_times_dp_shard(tmp_path, capsys):
    """Axolotl's examples/expert_parallel: ``world size 4 minimum: expert_parallel_size x dp_shard_size``."""
    model = tmp_path / "moe"
    Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=320,
    ).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    text = (
        "plugins:\n  - axolotl.integrations.expert_parallel.ExpertParallelPlugin\n"
        "experts_implementation: grouped_mm\nexpert_parallel_size: 2\ndp_shard_size: 2\n"
    )
    code, out, err = run_validate(tmp_path, text, capsys, "--set", "model_shape=", "--set", f"base_model={model}")
    assert code == 0, err
    assert "world 4 = dp_replicate 1 x dp_shard 4 x cp 1 x tp 1" in out and "expert parallel 2" in out
    assert "Axolotl's world = expert_parallel_size 2 x dp_shard_size 2; here dp_shard_size 4" in out
    assert "config OK for 4 process(es)" in out


def chat_spec(tmp: Path, **keys) -> DatasetSpec:
    data = tmp / "chat.jsonl"
    turns = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "thinking": "Two and two make four."},
    ]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    return DatasetSpec(path=str(data), type="chat_template", thinking_key="thinking", **keys)


def test_reasoning_traces_are_rendered_and_trained(tmp_path):
    """template_thinking_key: the trace (field_thinking: thinking) reaches the template under the key it reads;
    Qwen3's template puts it in <think> before the answer, and it is trained with the answer."""
    tokenizer = byte_tokenizer()
    spec = chat_spec(tmp_path, chat_template=template_source("qwen3", None, None))
    example = next(tokenize_records(read_records(spec), tokenizer, spec))
    trained = tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])
    assert "<think>\nTwo and two make four.\n</think>\n\n4" in trained
    assert "What is 2+2?" not in trained


def test_a_trace_the_template_does_not_read_is_one_line_from_validate(tmp_path, capsys):
    chat_spec(tmp_path)  # writes chat.jsonl
    reads_trace = "{% for m in messages %}{{ m.role }}: {{ m.trace or '' }}{{ m.content }}\\n{% endfor %}"
    text = (
        f"  - path: {tmp_path / 'chat.jsonl'}\n    type: chat_template\n    field_thinking: thinking\n"
        f'chat_template: jinja\nchat_template_jinja: "{reads_trace}"\n'
    )
    code, _, err = run_validate(tmp_path, text, capsys)
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert code == 2 and len(problems) == 1
    assert "does not render it from the key 'reasoning_content'; set the dataset's template_thinking_key" in err
    fixed = text.replace("field_thinking: thinking\n", "field_thinking: thinking\n    template_thinking_key: trace\n")
    code, _, err = run_validate(tmp_path, fixed, capsys)
    assert code == 0, err
