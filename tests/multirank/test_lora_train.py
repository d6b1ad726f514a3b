"""A YAML with Axolotl's LoRA fields trains on 2x2x2 like one process; the adapter loads in peft; export merges."""

from __future__ import annotations

import pytest
import torch
from support.scenarios import make_model, max_rel_diff
from support.trainer_helpers import assert_runs_match, layout_config, losses, plain_reference, run_train, tiny_config
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks

PROBE = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(4))

LORA = {
    "adapter": "lora",
    "lora_r": 4,
    "lora_alpha": 8,
    "lora_dropout": 0.0,
    "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base_dir = tmp / "base"
    make_model("llama", vocab_size=320, seed=5).save_pretrained(base_dir)
    config = tiny_config(
        tmp,
        base_model=str(base_dir),
        model_shape=None,
        model_config_overrides={},
        learning_rate=1e-2,
        save_steps=6,
        **LORA,
    )
    single = run_train(1, {**config, "output_dir": str(tmp / "single")})
    parallel_config = {**layout_config(config, s=2, c=2, t=2, method="ring"), "output_dir": str(tmp / "par")}
    parallel = run_train(8, parallel_config)
    return tmp, base_dir, parallel_config, single, parallel


def test_lora_yaml_on_2x2x2_matches_one_process(lora_runs, parity_record):
    _, _, _, single, parallel = lora_runs
    diff = max_rel_diff(losses(parallel), losses(single))
    parity_record({"loss": diff})
    assert diff < 1e-5
    assert parallel[-1]["loss"] < parallel[0]["loss"]


def test_lora_trainer_matches_plain_peft(lora_runs, parity_record):
    """The trainer (world 1 and 2x2x2) against the same LoRA run written with transformers + torch + peft."""
    _, _, parallel_config, single, parallel = lora_runs
    ref = plain_reference(layout_config(parallel_config))  # world 1: one data rank reads the global batch
    assert_runs_match([single, parallel], ref, parity_record)


def _logits(config: dict, checkpoint: str):
    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    run = setup(
        parse_config({**config, "resume_from_checkpoint": checkpoint, "output_dir": config["output_dir"] + "-x"})
    )
    batch = ndp.prepare_batch(PROBE, run.topo)
    with torch.no_grad():
        logits = ndp.gather_logits(run.model(**batch.model_inputs()).logits, run.topo)
    return logits, run.topo.batch_rank


def test_adapter_loads_in_peft_and_merge_exports(lora_runs, tmp_path):
    from peft import PeftModel

    tmp, base_dir, config, _, _ = lora_runs
    adapter = tmp / "par" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        want = peft_model(input_ids=PROBE).logits
    results = run_ranks(8, _logits, config, str(tmp / "par" / "checkpoints" / "step-6"))
    for logits, batch_rank in results:
        rows = slice(batch_rank * 4, batch_rank * 4 + 4)
        assert float((logits - want[rows]).abs().max() / want.abs().max()) < 1e-5
    # the adapter changed the model
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=PROBE).logits
    assert float((plain - want).abs().max()) > 1e-3

    from ndparallel.cli import main

    merged_dir = tmp_path / "merged"
    assert main(["export", str(tmp / "par"), str(merged_dir), "--merge-lora", "--dtype", "float32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        got = merged(input_ids=PROBE).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    # without --merge-lora the export is a peft adapter directory
    adapter_dir = tmp_path / "adapter"
    assert main(["export", str(tmp / "par"), str(adapter_dir)]) == 0
    assert (adapter_dir / "adapter_model.safetensors").is_file()


def test_a_run_whose_gradient_is_zero_says_so_once(tmp_path, capfd):
    """Base weights that cut every gradient (here a head of zeros: the logits cannot depend on anything) train
    nothing; the first log line's grad_norm 0 is said in words, once. A healthy run says nothing."""
    healthy = make_model("llama", vocab_size=320, seed=5)
    broken = make_model("llama", vocab_size=320, seed=5)
    with torch.no_grad():
        broken.lm_head.weight.zero_()
    said = {}
    for name, model in (("healthy", healthy), ("broken", broken)):
        model.save_pretrained(tmp_path / name)
        config = tiny_config(
            tmp_path, base_model=str(tmp_path / name), model_shape=None, model_config_overrides={}, max_steps=2,
            output_dir=str(tmp_path / f"out-{name}"), **LORA,
        )  # fmt: skip
        records = run_train(1, config)
        said[name] = (
            [r["grad_norm"] for r in records],
            capfd.readouterr().out.count("the gradient norm is exactly 0"),
        )
    assert said["broken"] == ([0.0, 0.0], 1)
    assert said["healthy"][1] == 0 and all(norm > 0 for norm in said["healthy"][0])
