"""The sharded path of 8-bit AdamW checked on CPU, without a GPU (needs torchao; not part of CI).

torchao's AdamW8bit compiles its update for CUDA; with torch.compiler.set_stance("force_eager") the same code
runs eagerly on CPU, slowly but exactly. A 1-layer Llama whose matrix rows are 256 values long is trained 3 steps
on FSDP2 over 2 gloo ranks and on 1 rank; the losses must agree to float32 reduction noise:

    PYTHONPATH=src:tests python3 tests/gpu/gpu_eight_bit_adamw_on_cpu.py      # ~20 s; measured max rel diff 5.8e-07
"""

from __future__ import annotations

import warnings

import torch

from ndparallel.testing.ranks import run_ranks


def train(shard: int):
    warnings.filterwarnings("ignore")
    torch.compiler.set_stance("force_eager")
    from torchao.optim import AdamW8bit
    from transformers import LlamaConfig

    import ndparallel as ndp
    from ndparallel.optim.build import decay_groups
    from ndparallel.weights.materialize import materialize
    from ndparallel.weights.meta import meta_model

    topo = ndp.Topology.build(ndp.ParallelismConfig(dp_shard_size=shard), device_type="cpu")
    model = meta_model(
        LlamaConfig(
            vocab_size=256,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
    )
    ndp.parallelize(model, topo, options=ndp.ParallelOptions(param_dtype=None))
    materialize(model, topo.device, weights_dir=None, seed=0)
    optimizer = AdamW8bit(decay_groups(model, 0.0), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        batch = ndp.prepare_batch(torch.randint(0, 256, (4, 32), generator=g), topo)
        n = ndp.count_tokens(batch.num_tokens, topo)
        loss = ndp.token_loss(model(**batch.model_inputs()).logits, batch.labels, num_tokens=n, topology=topo)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(ndp.reduce_loss(loss, topo).item())
    state = next(iter(optimizer.state.values()))["exp_avg"]
    return losses, f"{type(state).__name__} of {type(state.to_local()).__name__}"


if __name__ == "__main__":
    one, two = run_ranks(1, train, 1, timeout_s=600)[0], run_ranks(2, train, 2, timeout_s=600)[0]
    diff = max(abs(a - b) / abs(b) for a, b in zip(one[0], two[0]))
    print(f"1 rank {one}\n2 ranks {two}\nmax rel diff {diff:.2e}: {'PASS' if diff < 1e-5 else 'FAIL'}")
