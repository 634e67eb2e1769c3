"""Per-rank parameter memory and merge time of a distributed run (tests, benchmarks).

With `ACTSCAN_DIST_STATS=PREFIX` each rank writes `PREFIX.rank{r}.json` at the end:

    rank, world_size, total_param_bytes (the whole model: what a one-process run holds),
    local_param_bytes (this rank's shards), build_peak_bytes (shards kept so far plus the
    one unit being initialised or read), run_peak_bytes (the most parameter memory held
    during the pass: shards plus every unsharded all-gather buffer alive at that moment,
    sampled before and after every module's forward and at every output's gradient),
    merge_ms (each recorder merge: collectives and Chan's merge), and with --steps
    steps_loop_ms (the step loop's wall time) and steps_reduce_ms (each step's two
    all-reduces).

Parameter memory is read off FSDP2's own parameter records (sharded data, all-gather
outputs, unsharded parameters), each storage counted once; activations are not counted.

The figures are handed in by the code that measures them (`note_build_peak` from the
sharded build, `note_merge_ms` from the merge, `note_steps` from the step loop); this
module keeps them and is the only one that reads them. It imports no other part of
actscan's distributed code, so any of it may report here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actscan.measure.hooks import HookSet

ENV = "ACTSCAN_DIST_STATS"


class ParamMemory:
    """Samples the parameter bytes this rank holds, on module hooks (removed by `remove`)."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.params: list[Any] = []
        for m in model.modules():
            if isinstance(m, FSDPModule):
                group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
                if group is not None:
                    self.params += list(group.fsdp_params)
        self.total = sum(p.numel() * p.element_size() for p in model.parameters())
        self.peak = 0
        self.hooks = HookSet()
        for m in model.modules():
            self.hooks.forward_pre(m, self._pre)
            self.hooks.forward(m, self._post)

    def held(self) -> int:
        seen: set[int] = set()
        total = 0
        for fp in self.params:
            parts = [
                getattr(fp, "_sharded_param_data", None),
                getattr(fp, "_unsharded_param", None),
                *(getattr(fp, "all_gather_outputs", None) or []),
            ]
            for t in parts:
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                if st.nbytes() == 0 or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def sample(self) -> None:
        self.peak = max(self.peak, self.held())

    def _pre(self, _m: nn.Module, _a: Any) -> None:
        self.sample()

    def _post(self, _m: nn.Module, _a: Any, out: Any) -> None:
        self.sample()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self.hooks.tensor(out, lambda g: self.sample())

    def local(self) -> int:
        from torch.distributed.tensor import DTensor

        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
            for p in (fp.sharded_param for fp in self.params)
        )

    def remove(self) -> None:
        self.hooks.remove()


@dataclass
class _Figures:
    """What this process measured so far (one per process: a rank is one process)."""

    build_peak_bytes: int = 0
    merge_ms: list[float] = field(default_factory=list)
    steps_loop_ms: list[float] = field(default_factory=list)  # the latest loop's, or none
    steps_reduce_ms: list[float] = field(default_factory=list)
    memory: list[ParamMemory] = field(default_factory=list)


_FIGURES = _Figures()


def note_build_peak(nbytes: int) -> None:
    """The sharded build held `nbytes` of parameters at one point (the peak is kept)."""
    _FIGURES.build_peak_bytes = max(_FIGURES.build_peak_bytes, nbytes)


def note_merge_ms(ms: float) -> None:
    """One recorder merge took `ms` milliseconds."""
    _FIGURES.merge_ms.append(ms)


def note_steps(loop_ms: float, reduce_ms: Sequence[float]) -> None:
    """The latest step loop: its wall time and each step's all-reduce time."""
    _FIGURES.steps_loop_ms = [loop_ms]
    _FIGURES.steps_reduce_ms = list(reduce_ms)


def track(model: nn.Module) -> None:
    """Start sampling `model`'s parameter memory if ACTSCAN_DIST_STATS asks for it."""
    if os.environ.get(ENV):
        _FIGURES.memory.append(ParamMemory(model))


def write(rank: int, world: int) -> None:
    """Write this rank's figures (see the module doc); a no-op without ACTSCAN_DIST_STATS."""
    prefix = os.environ.get(ENV)
    if not prefix or not _FIGURES.memory:
        return
    mem = _FIGURES.memory[-1]
    mem.sample()
    data = {
        "rank": rank,
        "world_size": world,
        "total_param_bytes": mem.total,
        "local_param_bytes": mem.local(),
        "build_peak_bytes": _FIGURES.build_peak_bytes,
        "run_peak_bytes": mem.peak,
        "merge_ms": list(_FIGURES.merge_ms),
        "steps_loop_ms": sum(_FIGURES.steps_loop_ms),
        "steps_reduce_ms": list(_FIGURES.steps_reduce_ms),
    }
    for m in _FIGURES.memory:
        m.remove()
    Path(f"{prefix}.rank{rank}.json").write_text(json.dumps(data))
