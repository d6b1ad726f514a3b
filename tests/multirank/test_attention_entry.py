"""The attention function transformers calls after ``parallelize``: no (L x L) mask is built for
ndparallel's batches, and plain calls (a padding mask, packed position ids, a KV cache) give what the
model gave with transformers' own SDPA attention."""

from __future__ import annotations

import torch
from support.scenarios import make_model, reference_mask
from transformers import masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

import ndparallel as ndp
from ndparallel.testing.ranks import run_ranks


def _check_entry() -> dict:
    calls = []
    sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]

    def spy(**kwargs):  # this rank is a forked process: the change does not reach the test process
        calls.append(kwargs.get("attention_mask") is not None)
        return sdpa_mask(**kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = spy
    packed_checks = []
    find_packed = masking_utils.find_packed_sequence_indices

    def packed_spy(position_ids):  # transformers' check for packed documents (a device sync on CUDA)
        packed_checks.append(1)
        return find_packed(position_ids)

    masking_utils.find_packed_sequence_indices = packed_spy
    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=1))
    reference = make_model("mistral", sliding_window=24).eval()
    model = make_model("mistral", sliding_window=24).eval()
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (2, 64), generator=g)
    pos = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, 64)
    diffs = {}
    with torch.no_grad():
        calls.clear()
        batch = ndp.prepare_batch(ids, topo, position_ids=pos)
        got = model(**batch.model_inputs()).logits
        want = reference(**reference_mask({"input_ids": ids, "position_ids": pos}, window=24)).logits
        diffs["prepared packed batch"] = float((got - want).abs().max())
        diffs["masks built for it"] = len(calls)

        calls.clear()
        packed_checks.clear()
        whole = ndp.prepare_batch(ids, topo)  # whole rows: an all-ones mask transformers need not check
        got = model(**whole.model_inputs()).logits
        diffs["masks built or packing checks for whole rows"] = len(calls) + len(packed_checks)
        diffs["prepared whole rows"] = float((got - reference(input_ids=ids).logits).abs().max())
        calls.clear()
        model(input_ids=ids, attention_mask=torch.ones_like(ids))  # a caller's own all-ones mask: as before
        diffs["masks built for a caller's all-ones mask"] = len(calls)

        calls.clear()
        got = model(input_ids=ids, position_ids=pos).logits  # plain call, packed position ids, no mask
        diffs["plain packed call"] = float((got - want).abs().max())
        diffs["masks built for the plain packed call"] = len(calls)

        padding = torch.ones_like(ids)
        padding[1, 50:] = 0
        calls.clear()
        got = model(input_ids=ids, attention_mask=padding).logits
        want = reference(input_ids=ids, attention_mask=padding).logits
        diffs["plain padded call"] = float((got - want)[padding.bool()].abs().max())
        diffs["padding masks built"] = sum(calls)

        cached = model(input_ids=ids[:, :60], use_cache=True)  # decoding with a KV cache
        got = model(input_ids=ids[:, 60:], past_key_values=cached.past_key_values, use_cache=True).logits
        ref_cached = reference(input_ids=ids[:, :60], use_cache=True)
        want = reference(input_ids=ids[:, 60:], past_key_values=ref_cached.past_key_values, use_cache=True).logits
        diffs["KV-cache call"] = float((got - want).abs().max())
    return diffs


def test_no_mask_for_our_batches_and_plain_calls_unchanged():
    diffs = run_ranks(1, _check_entry)[0]
    assert diffs["masks built for it"] == 0, diffs
    assert diffs["masks built for the plain packed call"] == 0, diffs
    assert diffs["padding masks built"] >= 1, diffs
    assert diffs["masks built or packing checks for whole rows"] == 0, diffs
    assert diffs["masks built for a caller's all-ones mask"] >= 1, diffs
    names = ("prepared packed batch", "prepared whole rows", "plain packed call", "plain padded call", "KV-cache call")
    for name in names:
        assert diffs[name] < 1e-5, (name, diffs)
