"""The one autograd all-to-all (``parallel/comm.py``) that expert parallelism (rows of variable counts per peer)
and Ulysses context parallelism (equal slots) share: forward against a gather of every rank's input, backward
against the same exchange run in reverse, on 3 gloo ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ndparallel.parallel.comm import all_to_all
from ndparallel.testing.ranks import run_ranks

WORLD = 3


def _rows(rank: int, peer: int, count: int) -> torch.Tensor:
    """The rows rank ``rank`` sends to ``peer``: (count, 2), values naming both ends."""
    return torch.stack([torch.full((count,), 10.0 * rank + peer), torch.arange(count, dtype=torch.float32)], dim=1)


def _send_counts(rank: int) -> list[int]:
    return [(rank + peer) % 3 + 1 for peer in range(WORLD)]  # 1 to 3 rows, different per pair, none equal


def _variable_splits() -> bool:
    rank = dist.get_rank()
    send = _send_counts(rank)
    recv = [_send_counts(peer)[rank] for peer in range(WORLD)]
    x = torch.cat([_rows(rank, peer, n) for peer, n in enumerate(send)]).requires_grad_()
    out = all_to_all(x, None, send=send, recv=recv)
    expected = torch.cat([_rows(peer, rank, n) for peer, n in enumerate(recv)])
    weights = torch.arange(out.numel(), dtype=torch.float32).view_as(out) + rank
    (out * weights).sum().backward()
    # the gradient of each row sent comes back from the rank it went to, in the order sent
    back = []
    for peer, n in enumerate(send):
        offset = sum(_send_counts(p)[peer] for p in range(rank))  # rows earlier ranks sent to ``peer``
        peer_weights = torch.arange(sum(_send_counts(p)[peer] for p in range(WORLD)) * 2, dtype=torch.float32) + peer
        back.append(peer_weights.view(-1, 2)[offset : offset + n])
    return torch.equal(out.detach(), expected) and torch.equal(x.grad, torch.cat(back))


def _equal_slots() -> bool:
    rank = dist.get_rank()
    x = torch.stack([_rows(rank, peer, 2) for peer in range(WORLD)]).requires_grad_()  # (slot, 2, 2)
    out = all_to_all(x, None)
    expected = torch.stack([_rows(peer, rank, 2) for peer in range(WORLD)])
    out.backward(out.detach() * 2)  # the gradient of each slot is twice what it carried: back home, twice x
    return out.shape == x.shape and torch.equal(out.detach(), expected) and torch.equal(x.grad, 2 * x.detach())


def test_all_to_all_with_variable_counts_per_peer():
    assert all(run_ranks(WORLD, _variable_splits))


def test_all_to_all_with_equal_slots_is_its_own_inverse():
    assert all(run_ranks(WORLD, _equal_slots))
