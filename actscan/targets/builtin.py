"""Config files: the built-in actscan-gpt family (Hugging Face configs go to hf.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actscan.models.arch import (
    ArchConfig,
    apply_overrides,
    build_config,
    is_actscan_config,
    read_config_file,
    with_init,
)
from actscan.records import ModelInfo
from actscan.targets.resolve import Resolved, TargetOptions


def arch_from_mapping(data: dict[str, Any], where: str, opts: TargetOptions) -> ArchConfig:
    cfg = build_config(data, where)
    if opts.overrides:
        cfg = apply_overrides(cfg, opts.overrides)
    return with_init(cfg, opts.init)


def build_builtin(cfg: ArchConfig, source: str, seed: int, *, at_init: bool) -> Resolved:
    from actscan.models.gpt import arch_facts, build_model

    model = build_model(cfg, seed=seed)
    info = ModelInfo(
        source=source,
        family=cfg.family,
        n_params=sum(p.numel() for p in model.parameters()),
        n_blocks=cfg.n_layers,
        d_model=cfg.d_model,
        vocab_size=cfg.vocab_size,
        at_init=at_init,
        task="causal-lm",
        arch={**arch_facts(cfg), "max_positions": cfg.seq_len, "config": cfg.to_dict()},
    )
    return Resolved(model=model, info=info)


def resolve_config_file(path: Path, opts: TargetOptions) -> Resolved:
    data = read_config_file(path)
    if not is_actscan_config(data):
        from actscan.targets.hf import resolve_hf_config

        return resolve_hf_config(path, data, opts)
    cfg = arch_from_mapping(data, str(path), opts)
    return build_builtin(cfg, str(path), opts.seed, at_init=True)
