"""The library API without the trainer: a local or hub model loads straight into a layout, trains, and the
live sharded model exports a Hugging Face directory (or a PEFT adapter) equal to a one-process run."""

from __future__ import annotations

import shutil

import pytest
import torch
from support.scenarios import (
    EPS,
    LR,
    WEIGHT_DECAY,
    assert_parity,
    make_batches,
    make_model,
    train_reference,
    world_size,
)
from transformers import AutoModelForCausalLM

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks

BATCHES = make_batches(steps=2, micro=1, rows=4, seq=32, pad=True)
PROBE = torch.randint(1, 256, (4, 32), generator=torch.Generator().manual_seed(5))


def _hub_cache(tmp_path, source):
    """A Hugging Face hub cache holding ``source`` as org/tiny at one commit (the cache's public layout)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return str(tmp_path / "hub")


def _train_and_export(name: str, layout: dict, out: str, cache_dir: str | None, lora=None) -> dict:
    topo = ndp.Topology.build(ndp.ParallelismConfig(**layout))
    model = ndp.load_pretrained(
        name,
        topo,
        options=ndp.ParallelOptions(param_dtype=None),
        lora=lora,
        cache_dir=cache_dir,
        local_files_only=cache_dir is not None,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = ndp.build_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    losses, norms = [], []
    for (mb,) in BATCHES:
        batch = ndp.prepare_batch(topology=topo, **mb)
        n = ndp.count_tokens(batch.num_tokens, topo)
        loss = ndp.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=n, topology=topo)
        loss.backward()
        norms.append(float(ndp.clip_grad_norm_(trainable, 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(ndp.reduce_loss(loss, topo)))
    model.eval()
    with torch.no_grad():
        logits = ndp.gather_logits(model(**ndp.prepare_batch(PROBE, topo).model_inputs()).logits, topo)
    if lora is None:
        ndp.save_pretrained(model, out, topo, dtype="float32")
    else:
        ndp.save_pretrained(model, out + "-adapter", topo, lora=lora, base_model=name)
        ndp.save_pretrained(model, out + "-merged", topo, lora=lora, merge_lora=True, dtype="float32")
    try:  # a second export into the same directory is refused on every rank, nothing overwritten
        ndp.save_pretrained(model, out if lora is None else out + "-merged", topo)
        refusal = None
    except ndp.NdParallelError as exc:
        refusal = str(exc)
    return {
        "losses": losses,
        "grad_norms": norms,
        "logits": logits if topo.batch_rank == 0 else None,
        "refusal": refusal,
    }


@pytest.mark.parametrize(
    "layout, from_hub",
    [
        (dict(dp_shard_size=2, tp_size=2), False),  # local directory, FSDP x TP
        (dict(dp_replicate_size=2, cp_size=2, dp_shard_size=1, cp_comm_strategy="ring"), True),  # hub id, DDP x CP
    ],
)
def test_load_train_export_equals_one_process(tmp_path, layout, from_hub):
    source = tmp_path / "source"
    make_model("llama", seed=9).save_pretrained(source, max_shard_size="200KB")  # sharded safetensors + index
    name, cache = ("org/tiny", _hub_cache(tmp_path, source)) if from_hub else (str(source), None)
    results = run_ranks(world_size(layout), _train_and_export, name, layout, str(tmp_path / "out"), cache)
    reference = train_reference(AutoModelForCausalLM.from_pretrained(source, attn_implementation="sdpa"), BATCHES)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    got = {**results[0], "weights": exported.state_dict()}
    assert_parity(reference, got)
    assert all("is not empty; choose a new directory" in r["refusal"] for r in results)


def test_lora_adapter_and_merged_exports_reproduce_the_live_model(tmp_path):
    from peft import PeftModel

    source = tmp_path / "source"
    make_model("qwen3", seed=3).save_pretrained(source)
    spec = ndp.LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    results = run_ranks(
        4, _train_and_export, str(source), dict(dp_shard_size=2, tp_size=2), str(tmp_path / "out"), None, lora=spec
    )
    live = results[0]["logits"]
    base = AutoModelForCausalLM.from_pretrained(source, attn_implementation="sdpa").eval()
    with torch.no_grad():
        before = base(input_ids=PROBE[: live.shape[0]]).logits
    assert float((before - live).abs().max() / live.abs().max()) > 1e-4  # the adapters trained
    adapted = PeftModel.from_pretrained(base, tmp_path / "out-adapter").eval()  # (adds them to ``base`` in place)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out-merged", attn_implementation="sdpa").eval()
    with torch.no_grad():
        for model in (adapted, merged):
            want = model(input_ids=PROBE[: live.shape[0]]).logits
            assert float((want - live).abs().max() / live.abs().max()) < 1e-5
