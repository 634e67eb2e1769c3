"""Turn a TARGET string into a model ready to scan (README, "Targets").

What the string names is decided by `classify` (targets/classify.py); each kind is built
by its own module (factory, builtin, hf, checkpoint). This file only dispatches.
"""

from __future__ import annotations

from dataclasses import replace

from actscan.errors import BadInputError, UsageError
from actscan.targets.builtin import resolve_builtin_config
from actscan.targets.checkpoint import resolve_safetensors
from actscan.targets.classify import Kind, classify
from actscan.targets.factory import resolve_factory
from actscan.targets.hf import resolve_folder, resolve_hf_config
from actscan.targets.resolved import Resolved, TargetOptions
from actscan.targets.safetensors_io import refuse_pickle

__all__ = ["resolve"]


def resolve(target: str, opts: TargetOptions | None = None) -> Resolved:
    """TARGET → the model, its ModelInfo and inputs; `opts.at_init` overrides the
    resolver's judgement of whether the weights are an initialization."""
    opts = opts or TargetOptions()
    resolved = _resolve(target, opts)
    if opts.at_init is None or opts.at_init == resolved.info.at_init:
        return resolved
    return replace(resolved, info=replace(resolved.info, at_init=opts.at_init))


def _resolve(target: str, opts: TargetOptions) -> Resolved:
    what = classify(target)
    if opts.config is not None and what.kind not in (Kind.SAFETENSORS, Kind.FOLDER):
        raise UsageError(  # the folder says so itself, naming its config.json
            f"--config is for a bare .safetensors file; {target} ({what.kind.value}) "
            "carries its own architecture"
        )
    if what.kind is Kind.CALLABLE:
        return resolve_factory(target, opts)
    path = what.path
    assert path is not None  # every kind but CALLABLE names a path
    if what.kind is Kind.FOLDER:
        return resolve_folder(path, opts)
    if what.kind is Kind.SAFETENSORS:
        return resolve_safetensors(path, opts)
    if what.kind is Kind.BUILTIN_CONFIG:
        return resolve_builtin_config(path, what.config_dict(), opts)
    if what.kind is Kind.HF_CONFIG:
        return resolve_hf_config(path, what.config_dict(), opts)

    refuse_pickle(path)  # raises for pickle files
    raise BadInputError(
        f"{path}: unsupported target type '{path.suffix or path.name}' "
        "(a .safetensors file, a Hugging Face folder, a config file or module:callable)"
    )
