"""A bare `.safetensors` file as a TARGET, and the checkpoints actscan writes itself.

Where the architecture comes from, first match wins (docs/design.md, "Targets"):
  1. `--config PATH` (or a shipped config name): an actscan config, or a Hugging Face
     `config.json` (then the Hugging Face resolver builds the model);
  2. `config.json` in the file's folder;
  3. the file's own header: checkpoints written by `save_builtin` carry
     `{"format": "actscan", "actscan_config": <ArchConfig JSON>}` in `__metadata__`, so
     a single file is a complete, profilable model.

Order of work is chosen so that a bad file costs nothing and never half-runs: the header is
validated by the safetensors library (safetensors_io), names and shapes are checked against a model
built on the meta device, non-finite weights are counted, and only then is the real model
built and filled. The built model is fp32 whatever the file's dtype (`--dtype` casts it).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actscan.errors import BadInputError, ConfigError, UsageError, path_problem
from actscan.models.arch import ArchConfig, is_actscan_config, read_config_file, saved_config
from actscan.targets.builtin import arch_from_mapping, build_builtin
from actscan.targets.classify import shipped_configs
from actscan.targets.hf import resolve_hf_checkpoint
from actscan.targets.resolved import Resolved, TargetOptions
from actscan.targets.safetensors_io import (
    SafetensorsHeader,
    load_tensors,
    read_header,
    save_tensors,
)
from actscan.targets.weights import (
    check_finite,
    check_shapes,
    expected_shapes,
    load_weights,
    tied_aliases,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

FORMAT = "actscan"
_BLOCK_RE = re.compile(r"^blocks\.(\d{1,9})\.")
CONFIG_KEY = "actscan_config"


def save_builtin(model: nn.Module, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    """Write a built-in model as a self-describing safetensors checkpoint.

    The ArchConfig goes into the header's `__metadata__`, so `actscan profile FILE` needs no
    other file. A tied output head is stored once (under the embedding's name). `dtype`
    casts floating-point tensors (e.g. fp16 to halve the file). Written atomically.
    """
    from actscan.models.gpt import ActscanGPT

    if not isinstance(model, ActscanGPT):
        raise UsageError(
            f"save_builtin writes actscan-gpt models, got {type(model).__name__} "
            "(use safetensors.torch.save_file for other models)"
        )
    aliases = tied_aliases(model)
    tensors = {}
    for name, t in model.state_dict().items():
        if name in aliases:
            continue
        t = t.detach()
        tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    meta = {"format": FORMAT, CONFIG_KEY: json.dumps(saved_config(model.config), sort_keys=True)}
    save_tensors(tensors, path, metadata=meta)


def resolve_safetensors(path: Path, opts: TargetOptions) -> Resolved:
    """Build the model a `.safetensors` file belongs to and load its weights (checked)."""
    header = read_header(path)  # every corrupt-file case ends here, before any torch work
    kind, data, where = _architecture(path, header, opts)
    if kind == "hf":
        return _resolve_hf(path, Path(where), data, opts)
    if opts.init is not None:
        raise UsageError(
            f"{opts.flag('init')} re-initializes weights, which would discard {path}'s; "
            "profile its config instead to see an initialization"
        )
    cfg = arch_from_mapping(data, where, opts)
    _check_against(cfg, header)

    tensors = load_tensors(path)
    note = check_finite(tensors, str(path), allow=opts.allow_nonfinite)
    resolved = build_builtin(cfg, str(path), opts.seed, at_init=False, plan=opts.plan)
    load_weights(resolved.model, tensors, str(path))
    dtypes = sorted({e.dtype for e in header.tensors.values()})
    info = replace(
        resolved.info,
        arch={**resolved.info.arch, "config_source": where, "checkpoint_dtypes": dtypes},
    )
    return replace(resolved, info=info, notes=(note,) if note else ())


def _architecture(
    path: Path, header: SafetensorsHeader, opts: TargetOptions
) -> tuple[str, dict[str, Any], str]:
    """("actscan" | "hf", config mapping, where it came from) — see the module docstring."""
    if opts.config is not None:
        cfg_path = opts.config
        if (problem := path_problem(cfg_path)) is not None:
            raise ConfigError(f"--config {cfg_path}: {problem}")
        if not cfg_path.exists() and str(cfg_path) in shipped_configs():
            cfg_path = shipped_configs()[str(cfg_path)]
        if not os.path.lexists(cfg_path):  # anything there is read_config_file's to judge
            raise ConfigError(f"--config {cfg_path}: no such config file")
        return _classify(read_config_file(cfg_path), str(cfg_path))
    beside = path.parent / "config.json"
    if os.path.lexists(beside):
        return _classify(read_config_file(beside), str(beside))
    meta = header.metadata
    if CONFIG_KEY in meta:
        where = f"{path} (header __metadata__ {CONFIG_KEY})"
        try:
            data = json.loads(meta[CONFIG_KEY])
        except (ValueError, RecursionError) as err:
            raise BadInputError(f"bad checkpoint {where}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise BadInputError(f"bad checkpoint {where}: expected a JSON object")
        return "actscan", data, where
    raise BadInputError(
        f"{path}: no architecture for these weights: pass --config CONFIG, or put its "
        "config.json beside it (only checkpoints written by actscan carry their own)"
    )


def _classify(data: dict[str, Any], where: str) -> tuple[str, dict[str, Any], str]:
    if is_actscan_config(data):
        return "actscan", data, where
    if "model_type" in data:
        return "hf", data, where
    raise ConfigError(
        f"{where}: neither an actscan config (family/n_layers) nor a Hugging Face config "
        "(model_type)"
    )


def _check_against(cfg: ArchConfig, header: SafetensorsHeader) -> None:
    """Names and shapes against a meta-device model: no memory, no init, any size.

    The block count is compared first, from the tensor names alone: a corrupt or hostile
    config saying n_layers = 10⁹ must not make us build 10⁹ (meta) modules.
    """
    import torch

    from actscan.models.gpt import ActscanGPT

    indices = {int(m.group(1)) for n in header.tensors if (m := _BLOCK_RE.match(n))}
    # Distinct ints ≥ 0 with len n and max n-1 are exactly 0..n-1.
    if len(indices) != cfg.n_layers or (indices and max(indices) != cfg.n_layers - 1):
        top = max(indices, default=-1)
        held = f"{len(indices)} blocks" + (f" (indices up to {top})" if top >= len(indices) else "")
        raise BadInputError(
            f"bad checkpoint {header.path}: the config says n_layers={cfg.n_layers} but the "
            f"file holds tensors for {held} — wrong --config or architecture?"
        )
    try:
        with torch.device("meta"):
            meta = ActscanGPT(cfg)
    except Exception as err:  # e.g. sizes past int64 from a corrupt config
        first = next((ln for ln in str(err).splitlines() if ln.strip()), "")
        raise BadInputError(
            f"bad checkpoint {header.path}: its architecture cannot be built "
            f"({type(err).__name__}: {first})"
        ) from None
    check_shapes(
        expected_shapes(meta),
        {n: e.shape for n, e in header.tensors.items()},
        tied_aliases(meta),
        str(header.path),
    )


def _resolve_hf(
    path: Path, config_path: Path, data: dict[str, Any], opts: TargetOptions
) -> Resolved:
    """A Hugging Face config + these weights: built by the Hugging Face resolver."""

    return resolve_hf_checkpoint(path, config_path, data, opts)
