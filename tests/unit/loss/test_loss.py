"""The chunked cross-entropy equals torch's, in value and gradient, for any chunking and dtype."""

import pytest
import torch
import torch.nn.functional as F

from ndparallel.loss.cross_entropy import cross_entropy_sum


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("chunk_rows", [1, 7, 4096])
def test_matches_torch_cross_entropy(dtype, tol, chunk_rows):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 50, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = -100
    got = cross_entropy_sum(logits, labels, chunk_rows=chunk_rows)
    got.backward(torch.tensor(0.7, dtype=got.dtype))
    ref_logits = logits.detach().double().requires_grad_()
    want = F.cross_entropy(ref_logits, labels, reduction="sum", ignore_index=-100)
    (want * 0.7).backward()
    assert abs(float(got) - float(want)) / float(want) < tol
    assert float((logits.grad.double() - ref_logits.grad).abs().max()) < tol * 10
    assert logits.grad.dtype == dtype


def test_all_ignored_rows_give_zero_loss_and_gradient():
    logits = torch.randn(4, 10, requires_grad=True)
    loss = cross_entropy_sum(logits, torch.full((4,), -100))
    loss.backward()
    assert float(loss) == 0.0 and float(logits.grad.abs().max()) == 0.0
