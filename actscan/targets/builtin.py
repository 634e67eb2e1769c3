"""Config files of the built-in actscan-gpt family (Hugging Face configs go to hf.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from actscan.errors import BadInputError
from actscan.models.arch import ArchConfig, apply_overrides, build_config, with_init
from actscan.targets.footprint import RunPlan, Shape, check_fits, extrapolate
from actscan.targets.info import builtin_info
from actscan.targets.resolved import Resolved, TargetOptions


def arch_from_mapping(data: dict[str, Any], where: str, opts: TargetOptions) -> ArchConfig:
    cfg = build_config(data, where)
    if opts.overrides:
        cfg = apply_overrides(cfg, opts.overrides, opts.flag("set"))
    return with_init(cfg, opts.init, opts.flag("init"))


def builtin_shape(cfg: ArchConfig, where: str) -> Shape:
    """The config's size for the memory estimate: its parameters counted on the meta
    device at depth 1 and 2 (footprint.extrapolate), whatever n_layers says."""
    from actscan.models.gpt import ActscanGPT, NoMetaNormal

    def build(depth: int) -> ActscanGPT:
        with NoMetaNormal():  # as build_model: a meta normal_ imports torch._dynamo (1–2 s)
            return ActscanGPT(replace(cfg, n_layers=depth))

    try:
        numel = extrapolate(build, cfg.n_layers)
    except Exception as err:  # sizes past what torch can describe (numel past int64)
        first = next((ln for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise BadInputError(f"{where}: this architecture cannot be built: {first}") from None
    return Shape(
        numel=numel,
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        d_ff=cfg.ff_dim,
        n_heads=cfg.n_heads,
        vocab=cfg.vocab_size,
        max_positions=cfg.seq_len,
    )


def build_builtin(
    cfg: ArchConfig, source: str, seed: int, *, at_init: bool, plan: RunPlan | None = None
) -> Resolved:
    """The model for `cfg`, once its estimated memory fits the machine (`plan`: the run's
    settings; None: no estimate, the caller sized it)."""
    from actscan.models.gpt import build_model

    if plan is not None:
        check_fits(builtin_shape(cfg, source), plan, source)
    model = build_model(cfg, seed=seed)
    n_params = sum(p.numel() for p in model.parameters())
    return Resolved(model=model, info=builtin_info(cfg, source, n_params, at_init=at_init))


def resolve_builtin_config(path: Path, data: dict[str, Any], opts: TargetOptions) -> Resolved:
    """An actscan config file (already read by classify): the model at initialization."""
    cfg = arch_from_mapping(data, str(path), opts)
    return build_builtin(cfg, str(path), opts.seed, at_init=True, plan=opts.plan)
