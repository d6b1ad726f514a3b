"""``embedding_offload``: the frozen input embedding in host memory (``parallel/host_embedding.py``).

A run with the table in host memory is the run without it, bit for bit (a gather is exact); its checkpoints
resume; the rules refuse what cannot work in one line, at validate and in ``parallelize``.
"""

from __future__ import annotations

import pytest
import torch
from support.trainer_helpers import SMALL_LORA, run_train, tiny_config

from ndparallel.errors import ConfigError
from ndparallel.parallel.host_embedding import HostEmbedding, embed_inputs, host_embedding_of
from ndparallel.parallel.rules import embedding_offload_problems

UNTIED = {"vocab_size": 320, "tie_word_embeddings": False}


def _config(tmp, name: str, **overrides) -> dict:
    base = dict(adapter="lora", **SMALL_LORA, max_steps=4, save_steps=2, model_config_overrides=UNTIED)
    return tiny_config(tmp, **{**base, "output_dir": str(tmp / name), **overrides})


def _losses(records: list[dict]) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]


def _eval_losses(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_embedding")
    evaluating = dict(activation_checkpointing="full", val_set_size=0.1, eval_steps=2)
    on_device = run_train(1, _config(tmp, "device", **evaluating))
    on_host = run_train(1, _config(tmp, "host", **evaluating, embedding_offload=True))
    return tmp, on_device, on_host


def test_a_run_with_the_embedding_in_host_memory_is_the_run_without_it(runs):
    _, on_device, on_host = runs
    assert [r[0] for r in _losses(on_host)] == [1, 2, 3, 4]
    assert _losses(on_host) == _losses(on_device)  # bitwise: losses and gradient norms
    assert _losses(on_host)[-1][1] < _losses(on_host)[0][1]
    assert len(_eval_losses(on_host)) == 2 and _eval_losses(on_host) == _eval_losses(on_device)


def test_its_checkpoint_resumes_exactly(runs):
    tmp, _, on_host = runs
    step2 = tmp / "host" / "checkpoints" / "step-2"
    config = _config(tmp, "resumed", activation_checkpointing="full", val_set_size=0.1, embedding_offload=True)
    resumed = _losses(run_train(1, {**config, "resume_from_checkpoint": str(step2)}))
    assert resumed == _losses(on_host)[2:]


def _trainer_table(config: dict) -> tuple[str, float, str]:
    from ndparallel.config.reading import parse_config
    from ndparallel.train.setup import setup

    embedding = setup(parse_config(config)).model.get_input_embeddings()
    return type(embedding).__name__, float(embedding.weight.std()), embedding.weight.device.type


def test_the_trainer_builds_the_table_in_host_memory_filled_from_the_meta_device(tmp_path):
    from ndparallel.testing.ranks import run_ranks

    name, std, device = run_ranks(1, _trainer_table, _config(tmp_path, "setup", embedding_offload=True))[0]
    assert (name, device) == ("HostEmbedding", "cpu")
    assert std == pytest.approx(0.02, rel=0.1)  # initialized as an embedding (normal, initializer_range)


def _tiny_lora_model(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=96, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _parallelized(tied: bool = False, **options):
    import ndparallel as ndp
    from ndparallel.adapters.lora import LoraSpec
    from ndparallel.parallel.options import ParallelOptions

    model = _tiny_lora_model(tied)
    topo = ndp.Topology.build(ndp.ParallelismConfig())
    lora = LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    opts = ParallelOptions(param_dtype=None, embedding_offload=True, **options)
    return ndp.parallelize(model, topo, options=opts, lora=lora), topo


def _one_rank_model() -> dict:
    model, topo = _parallelized()
    host = host_embedding_of(model)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    embedded = embed_inputs(model, {"input_ids": ids.to(topo.device), "use_cache": False}, ids)
    with torch.no_grad():
        through_ids = model(input_ids=ids, use_cache=False).logits
        through_embeds = model(**embedded).logits
    model.to(torch.float64)  # moving or casting the model leaves the table as it is
    return {
        "host": isinstance(host, HostEmbedding),
        "table_dtype": host.weight.dtype,
        "in_state_dict": "model.embed_tokens.weight" in model.state_dict(),
        "trainable": any(p.requires_grad for p in host.parameters()),
        "same_logits": torch.equal(through_ids, through_embeds),
        "keys": sorted(embedded),
    }


def test_parallelize_keeps_the_table_as_a_parameter_in_host_memory():
    from ndparallel.testing.ranks import run_ranks

    result = run_ranks(1, _one_rank_model)[0]
    assert result["host"] and result["in_state_dict"] and not result["trainable"]
    assert result["table_dtype"] == torch.float32  # not cast to float64 with the model
    assert result["same_logits"]  # the module's own forward (ids on the device) and inputs_embeds agree
    assert "input_ids" not in result["keys"] and "inputs_embeds" in result["keys"]


def _refused(**kwargs) -> str:
    try:
        _parallelized(**kwargs)
    except ConfigError as exc:
        return str(exc)
    return "not refused"


def test_parallelize_refuses_a_tied_embedding():
    from ndparallel.testing.ranks import run_ranks

    message = run_ranks(1, _refused, tied=True)[0]
    assert "ties its input embedding to lm_head" in message and "remove embedding_offload" in message


def test_the_rules_refuse_in_one_line_each():
    assert len(list(embedding_offload_problems(adapters=True))) == 0
    cases = {
        "needs adapter: lora or qlora": dict(adapters=False),
        "lora_modules_to_save": dict(adapters=True, embedding_trained=True),
        "cpu_offload": dict(adapters=True, cpu_offload=True),
        "is for one process (this run has 2": dict(adapters=True, world_size=2),
        "tie_word_embeddings": dict(adapters=True, tied=True),
        "more than a table lookup": dict(adapters=True, plain_lookup=False),
    }
    for words, kwargs in cases.items():
        (line,) = list(embedding_offload_problems(**kwargs))
        assert words in line and "\n" not in line


def test_the_config_refuses_a_full_fine_tune(tmp_path):
    from ndparallel.config.reading import parse_config

    with pytest.raises(ConfigError, match="embedding_offload .* needs adapter: lora or qlora"):
        parse_config(tiny_config(tmp_path, embedding_offload=True))


def test_qlora_with_the_embedding_in_host_memory_is_the_run_without_it(tmp_path):
    qlora = dict(adapter="qlora", load_in_4bit=True, max_steps=3, save_steps=10)
    on_device = run_train(1, _config(tmp_path, "qlora-device", **qlora))
    on_host = run_train(1, _config(tmp_path, "qlora-host", embedding_offload=True, **qlora))
    assert len(_losses(on_host)) == 3 and _losses(on_host) == _losses(on_device)
