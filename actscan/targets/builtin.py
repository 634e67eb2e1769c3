"""Config files of the built-in actscan-gpt family (Hugging Face configs go to hf.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actscan.models.arch import ArchConfig, apply_overrides, build_config, with_init
from actscan.targets.info import builtin_info
from actscan.targets.resolved import Resolved, TargetOptions


def arch_from_mapping(data: dict[str, Any], where: str, opts: TargetOptions) -> ArchConfig:
    cfg = build_config(data, where)
    if opts.overrides:
        cfg = apply_overrides(cfg, opts.overrides)
    return with_init(cfg, opts.init)


def build_builtin(cfg: ArchConfig, source: str, seed: int, *, at_init: bool) -> Resolved:
    from actscan.models.gpt import build_model

    model = build_model(cfg, seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    return Resolved(model=model, info=builtin_info(cfg, source, n_params, at_init=at_init))


def resolve_builtin_config(path: Path, data: dict[str, Any], opts: TargetOptions) -> Resolved:
    """An actscan config file (already read by classify): the model at initialization."""
    cfg = arch_from_mapping(data, str(path), opts)
    return build_builtin(cfg, str(path), opts.seed, at_init=True)
