"""What every resolver takes (`TargetOptions`) and returns (`Resolved`).

A module of its own so that the resolvers (builtin, checkpoint, hf, factory) and the
dispatcher that calls them (resolve.py), as well as the sharded builder, share the two
records without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actscan.records import ModelInfo
from actscan.targets.footprint import RunPlan

if TYPE_CHECKING:
    from torch import nn

    from actscan.measure.inputs import InputSource

__all__ = ["Resolved", "TargetOptions"]


@dataclass(frozen=True)
class Resolved:
    model: nn.Module
    info: ModelInfo
    inputs: InputSource | None = None  # None: scan() invents token ids
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TargetOptions:
    config: Path | None = None  # --config: architecture for a bare .safetensors
    init: str | None = None
    overrides: dict[str, str] = field(default_factory=dict)  # --set
    option_prefix: str = "--"  # "--vs-": side B of compare/sweep (messages name --vs-set)
    seed: int = 0
    input_shape: tuple[int, ...] | None = None
    allow_nonfinite: bool = False
    allow_pickle: bool = False
    # --batch/--seq-len, for resolvers that must invent inputs themselves (module:callable
    # models with an nn.Embedding, --input FILE.txt); None: the resolver's default.
    batch: int | None = None
    seq_len: int | None = None
    # --at-init/--trained: whether the weights are an initialization (init-scale checks);
    # None: the resolver's judgement (configs and module:callable yes, checkpoints no).
    at_init: bool | None = None
    # what the run will do, for the memory estimate made before building (footprint.py)
    plan: RunPlan = field(default_factory=RunPlan)

    def flag(self, name: str) -> str:
        """The option as the user typed it: `flag("set")` is --set, or --vs-set for B."""
        return f"{self.option_prefix}{name}"
