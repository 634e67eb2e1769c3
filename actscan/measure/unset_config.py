"""The config fields a failing forward read as None: what the user sets to make it run.

A default config leaves to its checkpoints what the model reads unconditionally (DBRX's
`clip_qkv` fed to `clamp`, ESM's `pad_token_id` compared with every id, Step3p7's
`sliding_window` for a mask it always builds); a folder that omits one fails deep in
the model with an error that names a local variable, not the field. The traceback says
which: a value the failing lines read that is None (a local, `obj.attr`, or `self.attr`
set in its module's `__init__` from `<config>.<field>`), or a field the error names,
matched against the fields the config (and its sub-configs) leaves None. A field the
config class no longer declares (checkpoints saved by older versions carry it) fails as
an AttributeError on the config itself: `missing_config_field` names it.

Everything duck-types the config; nothing imports transformers.
"""

from __future__ import annotations

import inspect
import linecache
import re
import traceback
from typing import Any

from torch import nn

__all__ = ["missing_config_field", "unset_config_fields"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ATTR = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\b")
# what every config carries and leaves None without a model reading it
_HOUSEKEEPING = {"dtype", "architectures", "problem_type", "label2id", "id2label"}
_HOUSEKEEPING |= {"finetuning_task", "tokenizer_class", "prefix", "task_specific_params"}


def _none_fields(config: Any, prefix: str = "", depth: int = 2) -> dict[str, str]:
    """field name -> its dotted path, for every field the config (or a sub-config, up to
    `depth` deep) holds as None; the top-level's first."""
    out: dict[str, str] = {}
    subs: list[tuple[str, Any]] = []
    for key, value in sorted(vars(config).items()):
        if key.startswith("_") or key in _HOUSEKEEPING:
            continue
        if value is None:
            out.setdefault(key, prefix + key)
        elif depth and hasattr(value, "to_dict") and hasattr(value, "__dict__"):
            subs.append((key, value))
    for key, sub in subs:
        for name, path in _none_fields(sub, f"{prefix}{key}.", depth - 1).items():
            out.setdefault(name, path)
    return out


def _set_from(cls: type, attr: str) -> set[str]:
    """The fields the `__init__`s of `cls` and its bases assign `self.<attr>` from
    (`self.clip_qkv = attn_config.clip_qkv`, `self.padding_idx = config.pad_token_id`)."""
    pattern = rf"self\.{re.escape(attr)}\s*=\s*[A-Za-z_][\w.]*\.(\w+)\b"
    found: set[str] = set()
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is None or base.__module__.startswith("torch."):
            continue
        try:
            found |= set(re.findall(pattern, inspect.getsource(init)))
        except (OSError, TypeError):
            continue
    return found


def _read_as_none(frame: Any, line: str) -> set[str]:
    """Names whose value the line reads as None in `frame`, with the config fields a
    None `self.<attr>` was set from."""
    found: set[str] = set()
    local = frame.f_locals
    for name in set(_IDENT.findall(line)):
        if name in local and local[name] is None:
            found.add(name)
    for base, attr in set(_ATTR.findall(line)):
        obj = local.get(base)
        if obj is None:
            continue
        try:
            value = inspect.getattr_static(obj, attr, 0)
            if isinstance(value, property):
                value = getattr(obj, attr)
        except Exception:
            continue
        if value is None and not (isinstance(obj, nn.Module) and attr in obj._modules):
            found.add(attr)
            if isinstance(obj, nn.Module):
                found |= _set_from(type(obj), attr)
    return found


def unset_config_fields(err: BaseException, model: nn.Module) -> list[str]:
    """The dotted config fields left None that the failing forward read (its traceback's
    lines) or its error names; [] when none or the model has no config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "__dict__"):
        return []
    unset = _none_fields(config)
    if not unset:
        return []
    names = set(_IDENT.findall(str(err)))
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        line = linecache.getline(frame.f_code.co_filename, lineno)
        names |= _read_as_none(frame, line)
    return [path for name, path in unset.items() if name in names]


def missing_config_field(err: BaseException, model: nn.Module) -> str | None:
    """The dotted field the forward asked its config (or a sub-config) for and it lacks
    (Qwen2.5-Omni's thinker reads `vision_start_token_id`), else None."""
    config = getattr(model, "config", None)
    if not isinstance(err, AttributeError) or config is None or not err.name:
        return None
    owner = getattr(err, "obj", None)
    if owner is config:
        return err.name
    for key, sub in vars(config).items():
        if sub is owner and hasattr(sub, "to_dict"):
            return f"{key}.{err.name}"
    return None
