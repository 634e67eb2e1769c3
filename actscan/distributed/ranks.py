"""The profile pass as one rank of a distributed run: `ShardedPass` is the `LocalPass`
strategy the spine takes when `torch.distributed` runs it (its rows of every batch, FSDP's
sharded backward, the exact merge of the recorder, the sharded optimizer for the steps)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from actscan.distributed.fsdp import check_supported, local_grad, reshard_all, sharded_grads
from actscan.distributed.merge import merge_recorder, merge_state, sharded_moments
from actscan.distributed.runtime import DistRun, shard_source
from actscan.distributed.steps import ShardedRanks, check_sharded
from actscan.measure.inputs import InputSource
from actscan.measure.model_inputs import batch_size
from actscan.measure.profile import Grads, LocalPass, PassSpec

__all__ = ["ShardedPass"]


class ShardedPass(LocalPass):
    """`LocalPass` for one rank of `run`: its rows of every global batch, FSDP's backward
    (the recorder reads the local shards of the reduced gradients), the recorder's sums
    and the parameters' moments merged exactly across ranks, and the sharded optimizer
    (`ShardedRanks`) for the steps."""

    sharded = True

    def __init__(self, run: DistRun) -> None:
        self.run = run
        self.world_size = run.world_size
        self.backend = run.backend
        self.is_main = run.is_main
        self.merge = merge_recorder
        self.merge_state = merge_state

    def check(self, model: nn.Module, spec: PassSpec, steps: int, source: InputSource) -> None:
        check_supported(spec.dtype, model_dtype=spec.model_dtype)
        self.rows_of(source)  # a batch that does not divide by the ranks: refused now
        if steps:  # the sharded optimizer steps FSDP2's shards (distributed/steps.py)
            check_sharded(model)

    def rows_of(self, source: InputSource) -> InputSource:
        return shard_source(source, self.run, batch_size(source))

    def rows(self, recorded: InputSource) -> int | None:
        return batch_size(recorded)

    def grads(self, loss: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[Grads, Grads]:
        grads = sharded_grads(loss, list(params), self.world_size)
        return [local_grad(g) for g in grads], grads

    def moments(self, tensors: Sequence[torch.Tensor]) -> list[tuple[float, float, int]]:
        return sharded_moments(tensors)

    def settle(self, model: nn.Module) -> None:
        reshard_all(model)  # the pre-passes leave FSDP's root unsharded

    def step_ranks(self) -> Any:
        return ShardedRanks(self.run)
