"""`--steps N` as one rank of a distributed run: the sharded optimizer and the exact merge.

The step loop is `actscan.steps.loop.run_steps`, the same as in one process; this
rank's differences are `ShardedRanks`:

* the optimizer (torch AdamW/Adam/SGD) holds the FSDP2-sharded parameters (DTensors):
  each rank steps its shards, and its state (Adam's moments) is sharded the same way.
  Adam and SGD are elementwise, so the shards together equal the one-process update;
* each step's batch and the probe batch are the one-process global batches, each rank
  running its rows [r·B/N, (r+1)·B/N) (`runtime.split_rows`); a probe whose rows do not
  divide by N runs whole on every rank and only rank 0's figures count;
* the backward pass is FSDP's (`sharded_grads`): each rank's loss is its 1/N share of
  the global mean, gradients are summed by the reduce-scatter;
* every per-step figure is a sum over rows or over a parameter's elements (of squares,
  of |x|, counts) or a maximum, taken on the local rows and shards (`to_local()`), then
  one SUM and one MAX all-reduce per step carry all of them (`reduce`, called by
  `actscan.steps.figures.exchange`, which declares each figure's reduction); square
  roots and ratios are taken after. No per-module collective.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from actscan.distributed.runtime import DistRun, split_rows
from actscan.distributed.telemetry import note_steps
from actscan.errors import UsageError
from actscan.measure.inputs import Batch
from actscan.measure.recorder import first_tensor
from actscan.steps.loop import LocalRanks


def check_sharded(model: nn.Module) -> None:
    """Refuse steps on trainable parameters FSDP2 did not shard: a replica updated from
    this rank's gradient alone would drift apart from the other ranks' copies."""
    from torch.distributed.tensor import DTensor

    plain = [
        n for n, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
    ]
    if plain:
        raise UsageError(
            "--steps distributed needs every trainable parameter sharded by FSDP2 "
            f"(fully_shard); not sharded: {', '.join(plain[:3])}"
        )


class ShardedRanks(LocalRanks):
    """`LocalRanks` for one rank of `run` (see the module doc)."""

    def __init__(self, run: DistRun) -> None:
        self.run = run
        self.world_size = run.world_size
        # Wall times for telemetry (benchmarks): each step's two all-reduces, and the whole
        # loop (from here to the last `settle`, in run_steps' finally).
        self._start = time.perf_counter()
        self._reduce_ms: list[float] = []

    def local(self, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return t.to_local() if isinstance(t, DTensor) else t

    def counts(self, t: torch.Tensor) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(t, DTensor) or self.run.is_main  # a replica counts once

    def split(self, b: Batch) -> tuple[Batch, bool]:

        lead = b.token_ids if b.token_ids is not None else first_tensor((b.args, b.kwargs))
        rows = int(lead.shape[0]) if lead is not None and lead.dim() else 0
        n, r = self.run.world_size, self.run.rank
        if not rows or rows % n:  # the whole batch here; rank 0's figures count
            return b, self.run.is_main
        per = rows // n
        return split_rows(b, rows, r * per, (r + 1) * per), True

    def grads(
        self, loss: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        from actscan.distributed.fsdp import sharded_grads

        return sharded_grads(loss, list(params), self.world_size)

    def reduce(self, sums: torch.Tensor, maxima: torch.Tensor) -> None:
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        self._reduce_ms.append((time.perf_counter() - start) * 1e3)

    def settle(self, model: nn.Module) -> None:
        from actscan.distributed.fsdp import reshard_all

        reshard_all(model)
        note_steps((time.perf_counter() - self._start) * 1e3, self._reduce_ms)
