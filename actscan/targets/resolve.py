"""Turn a TARGET string into a model ready to scan (README, "Targets").

Order: `package.module:callable` → shipped config name → path (.safetensors file, folder,
config file). Each kind lives in its own module; this file only dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

from actscan.errors import BadInputError
from actscan.measure.inputs import InputSource
from actscan.records import ModelInfo

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def _configs_dir() -> Path:
    """Where the shipped configs are: inside the installed package, else the source tree.

    A wheel holds them as `actscan/configs/` (pyproject maps the top-level `configs/` folder
    there); an editable install or a run from a checkout has only the top-level folder.
    """
    packaged = resources.files("actscan") / "configs"
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "configs"


CONFIGS_DIR = _configs_dir()


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


def shipped_configs() -> dict[str, Path]:
    if not CONFIGS_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(CONFIGS_DIR.iterdir()) if p.suffix in CONFIG_SUFFIXES}


def resolve(target: str, opts: TargetOptions | None = None) -> Resolved:
    opts = opts or TargetOptions()
    resolved = _resolve(target, opts)
    if opts.at_init is None or opts.at_init == resolved.info.at_init:
        return resolved
    from dataclasses import replace

    return replace(resolved, info=replace(resolved.info, at_init=opts.at_init))


def _resolve(target: str, opts: TargetOptions) -> Resolved:
    path = Path(target)
    if ":" in target and not path.exists() and not _looks_like_windows_path(target):
        from actscan.targets.factory import resolve_factory

        return resolve_factory(target, opts)
    if not path.exists():
        shipped = shipped_configs()
        if target in shipped:
            path = shipped[target]
        else:
            hint = f" (shipped configs: {', '.join(shipped)})" if shipped else ""
            raise BadInputError(f"no such file or folder: {target}{hint}")
    from actscan.targets.builtin import resolve_config_file

    if path.is_dir():
        from actscan.targets.hf import resolve_folder

        return resolve_folder(path, opts)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from actscan.targets.checkpoint import resolve_safetensors

        return resolve_safetensors(path, opts)
    if suffix in CONFIG_SUFFIXES:
        return resolve_config_file(path, opts)
    from actscan.targets.safetensors_io import refuse_pickle

    refuse_pickle(path)  # raises for pickle files
    raise BadInputError(
        f"{path}: unsupported target type '{path.suffix or path.name}' "
        "(a .safetensors file, a Hugging Face folder, a config file or module:callable)"
    )


def _looks_like_windows_path(target: str) -> bool:
    return len(target) > 2 and target[1] == ":" and target[2] in "\\/"
