"""What a TARGET string names, decided once for every command (README, "Targets").

`profile` and `compare` (targets/resolve.py), `sweep` (compare/sweep.py) and the sharded
build of a distributed run (distributed/build.py) each accept a different subset of
targets, but they must agree on what a string *is*: the order below is the contract, and
keeping it in one function is what stops the three from drifting apart.

Order: `package.module:callable` (when no such path exists) → an existing path → a
shipped config's name. A path is a folder (a Hugging Face model folder), a
`.safetensors` file, a config file (`.yaml`, `.yml`, `.toml`, `.json`: read here, so that
an actscan config and a Hugging Face `config.json` are told apart once), or anything else
(refused by every consumer, each with its own words). A string that names nothing is one
BadInputError line listing the shipped configs.

No torch here: `sweep` plans its sizes and `actscan configs` lists the shipped configs
without loading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any

from actscan.errors import BadInputError, path_problem
from actscan.models.arch import is_actscan_config, read_config_file

__all__ = ["CONFIGS_DIR", "CONFIG_SUFFIXES", "Kind", "TargetKind", "classify", "shipped_configs"]

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


def shipped_configs() -> dict[str, Path]:
    """Shipped config name → its file (usable by name as a TARGET)."""
    if not CONFIGS_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(CONFIGS_DIR.iterdir()) if p.suffix in CONFIG_SUFFIXES}


class Kind(StrEnum):
    CALLABLE = "module:callable"
    BUILTIN_CONFIG = "actscan config"  # the built-in actscan-gpt family
    HF_CONFIG = "Hugging Face config"  # a config.json (or yaml/toml) with no weights
    SAFETENSORS = "safetensors file"
    FOLDER = "folder"  # a Hugging Face model folder, if anything
    OTHER = "other file"  # refused by every consumer


@dataclass(frozen=True)
class TargetKind:
    """One TARGET, classified. `path` is None only for `module:callable`; a shipped
    config's name has its file as `path` and `shipped` set; config kinds carry the parsed
    file as `config`."""

    kind: Kind
    target: str  # as the user wrote it
    path: Path | None = None
    shipped: bool = False
    config: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def is_config(self) -> bool:
        return self.kind in (Kind.BUILTIN_CONFIG, Kind.HF_CONFIG)

    def config_dict(self) -> dict[str, Any]:
        """The parsed config file as a fresh dict (config kinds only)."""
        if self.config is None:
            raise ValueError(f"{self.target}: not a config target")
        return dict(self.config)


def classify(target: str) -> TargetKind:
    """TARGET → what it names (see the module doc); BadInputError if it names nothing.

    A config file is read (a bad one is its ConfigError line); nothing else is opened.
    """
    path = Path(target)
    problem = path_problem(path)
    exists = problem is None and path.exists()
    if ":" in target and not exists and not _looks_like_windows_path(target):
        return TargetKind(Kind.CALLABLE, target)
    if problem is not None:  # there, or named, but not usable: say why, not "no such file"
        raise BadInputError(f"{target}: {problem}")
    shipped = False
    if not exists:
        names = shipped_configs()
        if target not in names:
            hint = f" (shipped configs: {', '.join(names)})" if names else ""
            raise BadInputError(f"no such file or folder: {target}{hint}")
        path, shipped = names[target], True
    if path.is_dir():
        return TargetKind(Kind.FOLDER, target, path)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return TargetKind(Kind.SAFETENSORS, target, path)
    if suffix in CONFIG_SUFFIXES:
        data = read_config_file(path)
        kind = Kind.BUILTIN_CONFIG if is_actscan_config(data) else Kind.HF_CONFIG
        return TargetKind(kind, target, path, shipped, data)
    return TargetKind(Kind.OTHER, target, path)


def _looks_like_windows_path(target: str) -> bool:
    return len(target) > 2 and target[1] == ":" and target[2] in "\\/"
