"""Turn a TARGET string into a model ready to scan (README, "Targets").

What the string names is decided by `classify` (targets/classify.py); each kind is built
by its own module (factory, builtin, hf, checkpoint). This file only dispatches.
"""

from __future__ import annotations

from dataclasses import replace

from actscan.errors import BadInputError
from actscan.targets.classify import Kind, classify
from actscan.targets.resolved import Resolved, TargetOptions

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
    if what.kind is Kind.CALLABLE:
        from actscan.targets.factory import resolve_factory

        return resolve_factory(target, opts)
    path = what.path
    assert path is not None  # every kind but CALLABLE names a path
    if what.kind is Kind.FOLDER:
        from actscan.targets.hf import resolve_folder

        return resolve_folder(path, opts)
    if what.kind is Kind.SAFETENSORS:
        from actscan.targets.checkpoint import resolve_safetensors

        return resolve_safetensors(path, opts)
    if what.kind is Kind.BUILTIN_CONFIG:
        from actscan.targets.builtin import resolve_builtin_config

        return resolve_builtin_config(path, what.config_dict(), opts)
    if what.kind is Kind.HF_CONFIG:
        from actscan.targets.hf import resolve_hf_config

        return resolve_hf_config(path, what.config_dict(), opts)
    from actscan.targets.safetensors_io import refuse_pickle

    refuse_pickle(path)  # raises for pickle files
    raise BadInputError(
        f"{path}: unsupported target type '{path.suffix or path.name}' "
        "(a .safetensors file, a Hugging Face folder, a config file or module:callable)"
    )
