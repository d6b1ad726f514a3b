"""Save and resume a training state made of your own objects: sharded, atomic, reshardable, optionally
asynchronous. The trainer uses exactly this; so can your own loop::

    ckpt = ndparallel.Checkpointer("out/checkpoints", keep=3, async_save=True)
    states = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader}
    start = ckpt.load(states).step if ckpt.latest() else 0     # any layout, any world size
    for step in range(start, steps):
        ...                                                      # optimizer.step() etc.
        if (step + 1) % 100 == 0:
            ckpt.save(step + 1, states)                          # returns once the state is copied
    ckpt.close()                                                 # waits for the save in flight

Every rank calls ``save`` and ``load`` (collectives). Tensors go to torch.distributed.checkpoint shards
under their global shapes, so a checkpoint loads into any other layout; everything else is JSON (see
``codec``); loading trusts nothing it reads (see ``guard``).

Asynchronous saves (``async_save=True``): ``save`` copies the tensors to host memory (pinned on CUDA, in a
background thread) and returns; the files are written in a background thread, then the main rank
publishes the checkpoint (``store.publish``: ``latest`` moves only once every rank's files are written and
flushed). At most one save is in flight: the next ``save``, ``load`` or ``close`` waits for it and raises
its error on every rank. Until the copy is done, an optimizer of the state waits before stepping (a
step pre-hook); change other saved tensors only after ``wait_for_staging()``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ndparallel import _compat
from ndparallel.checkpoint import codec, loading, store
from ndparallel.checkpoint.loading import Restored
from ndparallel.checkpoint.states import adapt, optimizers_of
from ndparallel.errors import CheckpointError


@dataclass
class _InFlight:
    step: int
    name: str
    upload: Any  # Future of the background write
    staging: Any = None  # Future of the copy to host memory (None: already copied)
    published: threading.Event = field(default_factory=threading.Event)
    error: str | None = None  # set by the main rank's publication
    hooks: list = field(default_factory=list)


class Checkpointer:
    """Checkpoints of named objects under ``root`` (see the module docstring). A collective object."""

    def __init__(
        self,
        root: str | Path,
        *,
        keep: int | None = None,
        async_save: bool = False,
        rng: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        self.root = Path(root)
        self.keep, self.async_save, self.rng = keep, async_save, rng
        self._distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._distributed else 0
        self.world_size = dist.get_world_size() if self._distributed else 1
        # Checkpoint collectives get their own gloo group: background writes must not share a communicator
        # with training's collectives, and gloo moves the small planning messages on the host.
        self._group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self._distributed else None
        )
        self.lineage = uuid.uuid4().hex
        """This history's id in each index (the main rank's counts): pruning deletes only checkpoints of it.
        A fresh Checkpointer starts a new history; ``load`` continues the loaded checkpoint's."""
        self._stager = None
        self._in_flight: _InFlight | None = None
        self.last_publish_s: float | None = None
        self.stall_s = 0.0
        """Seconds training waited for the latest save: inside ``save`` plus optimizer steps held for the copy."""
        self.waited_for_previous_s = 0.0
        """Of the latest ``save``'s time, the seconds it waited for the save before it to finish writing."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def in_flight(self) -> bool:
        """Whether a save is still being written or published (this rank's view; no collective, no wait)."""
        flight = self._in_flight
        return flight is not None and not (flight.upload.done() and flight.published.is_set())

    def latest(self) -> Path | None:
        """The checkpoint ``root/latest`` names, or None."""
        self.wait()
        return store.latest(self.root)

    # -- save ------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        states: dict[str, Any],
        *,
        meta: dict | None = None,
        extra_files: Callable[[Path], None] | None = None,
    ) -> Path:
        """Checkpoint ``states`` as of ``step``; returns the directory it is (or will be) published as.

        ``meta``: JSON-able facts stored in ``index.json`` (read back by ``load``); ``extra_files(dir)``:
        called on the main rank to write more files into the checkpoint (a config, a tokenizer).
        """
        start = time.perf_counter()
        self.wait()  # at most one save in flight
        self.waited_for_previous_s = time.perf_counter() - start
        adapted = adapt(states)
        name = store.free_name(self.root, step)
        partial = self.root / f"{store.PARTIAL_PREFIX}{name}"
        error = None
        if self.is_main:
            try:
                store.new_partial(self.root, name)
            except (OSError, CheckpointError) as exc:
                error = loading.describe(exc)
        self._raise_if_any_failed(error, name)  # also the barrier: the directory exists for every rank
        skeletons, tensors = {}, {}
        for key, obj in adapted.items():
            skeletons[key], found = codec.split_state(key, obj.state_dict())
            tensors.update(found)
        per_rank = self._differing(skeletons)
        rank_file = {
            "format": store.FORMAT_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "rng": codec.rng_state() if self.rng else None,
            "states": skeletons,
        }
        store.write_atomic(partial / "ranks" / f"rank-{self.rank}.json", json.dumps(rank_file))
        if self.is_main and extra_files is not None:
            extra_files(partial)
        index = {
            "format": store.FORMAT_VERSION,
            "step": int(step),
            "world_size": self.world_size,
            "states": list(adapted),
            "per_rank": per_rank,
            "meta": meta or {},
            "lineage": self.lineage,
        }
        writer = dcp.FileSystemWriter(str(partial / "tensors"))
        if self.async_save:
            self._save_in_background(step, name, partial, index, tensors, writer, optimizers_of(adapted))
        else:
            self._save_now(name, partial, index, tensors, writer)
        self.stall_s = time.perf_counter() - start
        return self.root / name

    def _save_now(self, name: str, partial: Path, index: dict, tensors: dict, writer) -> None:
        error = None
        try:
            with warnings.catch_warnings():  # "saving in a single process" is the intent when not distributed
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.save(tensors, storage_writer=writer, process_group=self._group, no_dist=not self._distributed)
            if self.is_main:
                start = time.perf_counter()
                store.publish(partial, self.root, name, index, self.keep)
                self.last_publish_s = time.perf_counter() - start
        except (Exception, CheckpointException) as exc:
            error = loading.describe(exc)
        self._raise_if_any_failed(error, name)

    def _save_in_background(
        self, step: int, name: str, partial: Path, index: dict, tensors: dict, writer, optimizers: list
    ) -> None:
        if self._stager is None:  # kept across saves: its host buffers (pinned on CUDA) are reused
            self._stager = _compat.dcp_async_stager(pinned=torch.cuda.is_available() and torch.cuda.is_initialized())
        response = dcp.async_save(
            tensors,
            storage_writer=writer,
            process_group=self._group,
            async_stager=self._stager,
            no_dist=not self._distributed,
        )
        staging = getattr(response, "staging_completion", None)
        upload = getattr(response, "upload_completion", response)
        flight = _InFlight(step=step, name=name, upload=upload, staging=staging)
        if staging is not None and not staging.done():
            # Hooks stay until wait(): removing one while the optimizer iterates its hooks is an error.
            flight.hooks = [opt.register_step_pre_hook(lambda *_: self.wait_for_staging()) for opt in optimizers]
        if self.is_main:
            upload.add_done_callback(lambda fut: self._publish_when_written(fut, flight, partial, index))
        else:
            flight.published.set()
        self._in_flight = flight

    def _publish_when_written(self, upload, flight: _InFlight, partial: Path, index: dict) -> None:
        """Runs in the writer thread once the main rank's write finished (which follows every rank's)."""
        try:
            if upload.exception() is None:
                start = time.perf_counter()
                store.publish(partial, self.root, flight.name, index, self.keep)
                self.last_publish_s = time.perf_counter() - start
        except (Exception, CheckpointException) as exc:
            flight.error = loading.describe(exc)
        finally:
            flight.published.set()

    def wait_for_staging(self) -> None:
        """Block until the save in flight has copied the state (then the state may change again)."""
        flight = self._in_flight
        if flight is not None and flight.staging is not None and not flight.staging.done():
            start = time.perf_counter()
            try:
                flight.staging.result()
            except (Exception, CheckpointException):
                pass  # the write fails too; wait() reports it on every rank
            self.stall_s += time.perf_counter() - start

    def wait(self, *, raise_errors: bool = True) -> None:
        """Block until the save in flight is written and published; its failure raises on every rank."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        error = None
        for hook in flight.hooks:
            hook.remove()
        try:
            flight.upload.result()
        except (Exception, CheckpointException) as exc:
            error = loading.describe(exc)
        flight.published.wait()
        error = error or flight.error
        if raise_errors:
            self._raise_if_any_failed(error, flight.name)
        elif error:
            print(f"ndparallel: the checkpoint {flight.name} was not saved: {error}", flush=True)

    def close(self, *, raise_errors: bool = True) -> None:
        """Finish the save in flight and free the host buffers. ``raise_errors=False`` while another error
        is already on its way out (then a failed save is printed, not raised, and no collective is made)."""
        try:
            self.wait(raise_errors=raise_errors)
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_errors=exc_type is None)

    # -- load ------------------------------------------------------------------------------------
    def load(self, states: dict[str, Any], path: str | Path | None = None) -> Restored:
        """Restore ``states`` in place from ``path`` (a checkpoint directory; default: ``latest``)."""
        self.wait()
        if path is None:
            target = store.latest(self.root)
            if target is None:
                raise CheckpointError(f"no checkpoint to resume from: {str(self.root / 'latest')!r} does not exist")
        else:
            target = Path(path)
        restored = loading.load(
            target,
            adapt(states),
            rank=self.rank,
            world_size=self.world_size,
            rng=self.rng,
            process_group=self._group,
            distributed=self._distributed,
        )
        if restored.lineage:  # saves from here continue the loaded history (and keep-K prunes within it)
            self.lineage = restored.lineage
        return restored

    # -- small collectives on the checkpoint group -----------------------------------------------
    def _differing(self, skeletons: dict) -> list[str]:
        """The states whose non-tensor part differs between ranks (kept per rank; see ``loading``)."""
        if not self._distributed:
            return []
        names = list(skeletons)
        sums = [zlib.crc32(json.dumps(skeletons[n], sort_keys=True).encode()) for n in names]
        sums.append(zlib.crc32(json.dumps(names).encode()))  # the same states on every rank
        both = torch.tensor(sums + [-s for s in sums], dtype=torch.int64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self._group)
        high, low = both[: len(sums)], -both[len(sums) :]
        if high[-1] != low[-1]:
            raise CheckpointError("the ranks saved different sets of states; every rank must pass the same names")
        return [n for n, h, lo in zip(names, high.tolist(), low.tolist()) if h != lo]

    def _raise_if_any_failed(self, error: str | None, name: str) -> None:
        failed = error is not None
        if self._distributed:
            flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            failed = bool(flag.item())
        if failed:
            raise CheckpointError(
                f"saving the checkpoint {name} failed: {error or 'on another rank'}; the previous "
                f"checkpoint and 'latest' are unchanged"
            )
