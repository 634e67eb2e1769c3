"""The one JSON codec of the frozen records: a record to JSON values and back.

Every report, comparison and sweep document is built from these two functions, so the
JSON of a record follows from its dataclass alone: `to_json_obj` writes each field in
declaration order, `from_json_obj` reads it back by the field's type hint (Optional,
`tuple[X, ...]`, fixed tuples, dicts and Mappings, enums, nested dataclasses). A new field
needs no codec change. The few fields the report format writes otherwise (pairs written as
objects, an empty tuple as null, a renamed key) say so in their metadata
(`actscan.records.json_as`).

Non-finite floats are written as the strings "nan", "inf" and "-inf" (output.json_safe) and
read back as floats wherever the hint says float.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from actscan.records import JSON_META, JsonAs
from actscan.report.output import json_safe

__all__ = ["from_json_obj", "to_json_obj"]

T = TypeVar("T")
_PLAIN = JsonAs()
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _shape(f: dataclasses.Field[Any]) -> JsonAs:
    shape = f.metadata.get(JSON_META, _PLAIN)
    assert isinstance(shape, JsonAs), f"{f.name}: json metadata must come from json_as()"
    return shape


# -- writing --------------------------------------------------------------------------------
def to_json_obj(value: Any) -> Any:
    """`value` as JSON values: a dataclass becomes an object of its fields (in declaration
    order), tuples and lists become arrays, enums their value, non-finite floats strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            shape = _shape(f)
            if shape.skip:
                continue
            v = getattr(value, f.name)
            if v is None and shape.omit_none:
                continue
            out[shape.name or f.name] = _write_field(v, shape)
        return out
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float):
        return json_safe(value)
    if isinstance(value, Mapping):
        return {k: to_json_obj(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_obj(v) for v in value]
    return value


def _write_field(v: Any, shape: JsonAs) -> Any:
    if shape.keys:
        return [dict(zip(shape.keys, to_json_obj(item), strict=True)) for item in v]
    if shape.mapping:
        return {k: to_json_obj(x) for k, x in v}
    if shape.empty_null and not v:
        return None
    return to_json_obj(v)


# -- reading --------------------------------------------------------------------------------
@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def from_json_obj(tp: type[T], obj: Any) -> T:
    """JSON values `obj` read as type `tp`: objects become the dataclass `tp` (unknown keys
    ignored, missing keys take the field's default), arrays tuples, strings enums, and
    "nan"/"inf"/"-inf" floats where the hint says float."""
    return typing.cast(T, _read(tp, obj))


def _read(tp: Any, obj: Any) -> Any:
    if tp is Any or obj is None:
        return obj
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        options = [a for a in get_args(tp) if a is not type(None)]
        return _read(options[0], obj) if len(options) == 1 else obj
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _read_record(tp, obj)
    if tp is float:
        return _NONFINITE.get(obj, obj) if isinstance(obj, str) else obj
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tp(obj)
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(args[0], x) for x in obj)
        return tuple(_read(a, x) for a, x in zip(args, obj, strict=True))
    if origin in (dict, Mapping):
        _, value_tp = get_args(tp)
        return {k: _read(value_tp, v) for k, v in obj.items()}
    if origin is list:
        (item_tp,) = get_args(tp)
        return [_read(item_tp, x) for x in obj]
    return obj


def _read_record(cls: type, obj: Mapping[str, Any]) -> Any:
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        shape = _shape(f)
        key = shape.name or f.name
        if not f.init or shape.skip or key not in obj:
            continue
        v = obj[key]
        if shape.keys and v is not None:
            v = [[item.get(k) for k in shape.keys] for item in v]
        elif shape.mapping and v is not None:
            v = list(v.items())
        elif shape.empty_null and v is None:
            v = ()
        kwargs[f.name] = _read(hints[f.name], v)
    return cls(**kwargs)
