"""The one JSON codec (actscan/report/codec.py) and the report schema against the records.

The schema test walks Report's type hints, not a list kept by hand: a field added to any
record reachable from Report fails here until report.schema.json describes it, and a
schema property no record writes fails too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest

from actscan import scan
from actscan.models.arch import ArchConfig
from actscan.models.gpt import build_model
from actscan.records import JSON_META, JsonAs, Severity, json_as
from actscan.report.codec import from_json_obj, to_json_obj
from actscan.report.report import Report
from actscan.report.schema import load_schema

SCHEMA = load_schema()
ENVELOPE = {"schema_version", "tool"}  # written by Report.to_dict around the fields


# -- the schema and the records ------------------------------------------------------------
def _resolve(node: Mapping[str, Any]) -> Mapping[str, Any]:
    while "$ref" in node:
        target: Any = SCHEMA
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = {**{k: v for k, v in node.items() if k != "$ref"}, **target}
    return node


_VALUE_TYPES = {type(None): "null", bool: "boolean", int: "integer", float: "number"}


def _json_types(node: Mapping[str, Any]) -> set[str]:
    """The JSON types a schema node accepts ("integer" apart from "number")."""
    node = _resolve(node)
    out: set[str] = set()
    if "type" in node:
        out |= {node["type"]} if isinstance(node["type"], str) else set(node["type"])
    for v in [*node.get("enum", ()), *([node["const"]] if "const" in node else [])]:
        out.add(_VALUE_TYPES.get(type(v), "string"))
    for sub in node.get("anyOf", ()):
        out |= _json_types(sub)
    return out


def _options(tp: Any) -> list[Any]:
    if get_origin(tp) in (Union, types.UnionType):
        return list(get_args(tp))
    return [tp]


def _hint_types(tp: Any) -> tuple[set[str], set[str]]:
    """(JSON types the hint must be allowed, extra ones it may also write)."""
    need: set[str] = set()
    may: set[str] = set()
    for opt in _options(tp):
        origin = get_origin(opt)
        if opt is type(None):
            need.add("null")
        elif opt is bool:
            need.add("boolean")
        elif opt is int:
            need.add("integer")
        elif opt is float:
            need.add("number")
            may |= {"string", "integer"}  # "nan"/"inf"; 1.0 is an integer to JSON Schema
        elif opt is str or (isinstance(opt, type) and issubclass(opt, Enum)):
            need.add("string")
        elif origin is tuple or origin is list:
            need.add("array")
        elif origin in (dict, Mapping) or dataclasses.is_dataclass(opt):
            need.add("object")
        elif opt is Any:
            may |= {"string", "number", "integer", "boolean", "null", "array", "object"}
        else:
            raise AssertionError(f"no JSON type for {opt!r}")
    return need, may


def _accepts(schema_types: set[str], need: set[str]) -> bool:
    return all(t in schema_types or (t == "integer" and "number" in schema_types) for t in need)


def schema_mismatches(cls: type, node: Mapping[str, Any], where: str) -> list[str]:
    """Every difference between record `cls` (its JSON fields, by type hint) and the
    schema object `node`, recursing into nested records, arrays and pair objects."""
    node = _resolve(node)
    hints = get_type_hints(cls)
    props = dict(node.get("properties", {}))
    out: list[str] = []
    written = {}
    for f in dataclasses.fields(cls):
        shape: JsonAs = f.metadata.get(JSON_META, JsonAs())
        if not shape.skip:
            written[shape.name or f.name] = (hints[f.name], shape)
    extra = set(props) - set(written) - (ENVELOPE if cls is Report else set())
    out += [f"{where}.{k}: in the schema, no field of {cls.__name__}" for k in sorted(extra)]
    for key, (tp, shape) in written.items():
        if key not in props:
            out.append(f"{where}.{key}: field of {cls.__name__} missing from the schema")
            continue
        out += _value_mismatches(tp, props[key], f"{where}.{key}", shape)
    return out


def _value_mismatches(tp: Any, node: Mapping[str, Any], where: str, shape: JsonAs) -> list[str]:
    node = _resolve(node)
    types_ = _json_types(node)
    need, may = _hint_types(tp)
    if shape.empty_null:
        need.add("null")
    if shape.omit_none:  # None leaves the key out
        need.discard("null")
    if shape.mapping:
        need = (need - {"array"}) | {"object"}
    if not _accepts(types_, need):
        return [f"{where}: schema types {sorted(types_)} lack {sorted(need - types_)}"]
    # the schema may allow null where a record never writes it (gain drift): looser, not wrong
    if not types_ - {"null"} <= need | may:
        return [f"{where}: schema types {sorted(types_)}, record writes {sorted(need)}"]
    inner = [o for o in _options(tp) if o is not type(None)]
    out: list[str] = []
    for opt in inner:
        if dataclasses.is_dataclass(opt):
            sub = next(s for s in [node, *node.get("anyOf", ())] if "properties" in _resolve(s))
            out += schema_mismatches(opt, sub, where)  # type: ignore[arg-type]
        elif get_origin(opt) is tuple and not shape.mapping:
            args = get_args(opt)
            array = next(s for s in [node, *node.get("anyOf", ())] if "array" in _json_types(s))
            items = _resolve(array).get("items")
            if len(args) == 2 and args[1] is Ellipsis:
                if items is None:
                    out.append(f"{where}: array without items")
                elif shape.keys:
                    out += _pairs_mismatches(args[0], items, where, shape.keys)
                else:
                    out += _value_mismatches(args[0], items, f"{where}[]", JsonAs())
            elif items is not None:
                for a in args:
                    out += _value_mismatches(a, items, f"{where}[]", JsonAs())
    return out


def _pairs_mismatches(
    tp: Any, node: Mapping[str, Any], where: str, keys: tuple[str, ...]
) -> list[str]:
    node = _resolve(node)
    props = node.get("properties", {})
    if set(props) != set(keys):
        return [f"{where}[]: schema keys {sorted(props)}, record writes {list(keys)}"]
    out: list[str] = []
    for key, item_tp in zip(keys, get_args(tp), strict=True):
        out += _value_mismatches(item_tp, props[key], f"{where}[].{key}", JsonAs())
    return out


def test_report_schema_matches_the_records() -> None:
    assert schema_mismatches(Report, SCHEMA, "report") == []


def test_a_field_without_a_schema_entry_fails() -> None:
    """The walk reads the hints: a record with a new field, or a changed type, is caught."""

    @dataclass(frozen=True)
    class Grown:
        check: str
        reason: str
        since: int = 0

    @dataclass(frozen=True)
    class Retyped:
        check: int
        reason: str

    skipped = SCHEMA["properties"]["skipped"]["items"]
    assert schema_mismatches(Grown, skipped, "s") == [
        "s.since: field of Grown missing from the schema"
    ]
    assert schema_mismatches(Retyped, skipped, "s") == [
        "s.check: schema types ['string'] lack ['integer']"
    ]


# -- the codec -------------------------------------------------------------------------------
class Color(Enum):
    RED = "red"


@dataclass(frozen=True)
class Inner:
    x: float
    tag: Color = Color.RED


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner | None
    pair: tuple[int, float]
    many: tuple[Inner, ...] = ()
    table: dict[str, float] = field(default_factory=dict)
    points: tuple[tuple[int, float | None], ...] = field(
        default=(), metadata=json_as(keys=("k", "rms"))
    )
    opts: tuple[tuple[str, str], ...] = field(default=(), metadata=json_as(mapping=True))
    maybe: tuple[float, ...] = field(default=(), metadata=json_as(empty_null=True))
    later: Inner | None = field(default=None, metadata=json_as(omit_none=True))
    hidden: int = field(default=0, metadata=json_as(skip=True))
    renamed: int = field(default=0, metadata=json_as(name="alias"))


def test_codec_writes_every_shape_and_reads_it_back() -> None:
    rec = Outer(
        name="n",
        inner=Inner(math.inf),
        pair=(1, -math.inf),
        many=(Inner(1.5),),
        table={"a": math.nan},
        points=((0, 1.0), (2, None)),
        opts=(("depth", "4"),),
        hidden=7,
        renamed=3,
    )
    obj = to_json_obj(rec)
    assert obj == {
        "name": "n",
        "inner": {"x": "inf", "tag": "red"},
        "pair": [1, "-inf"],
        "many": [{"x": 1.5, "tag": "red"}],
        "table": {"a": "nan"},
        "points": [{"k": 0, "rms": 1.0}, {"k": 2, "rms": None}],
        "opts": {"depth": "4"},
        "maybe": None,
        "alias": 3,
    }
    back = from_json_obj(Outer, json.loads(json.dumps(obj)))
    assert back.inner == Inner(math.inf) and back.pair == (1, -math.inf)
    assert math.isnan(back.table["a"])
    assert back.points == rec.points and back.opts == rec.opts and back.maybe == ()
    assert back.many == rec.many and back.renamed == 3 and back.hidden == 0
    assert isinstance(back.inner, Inner) and back.inner.tag is Color.RED
    later = to_json_obj(dataclasses.replace(rec, later=Inner(2.0)))
    assert list(later)[-2:] == ["later", "alias"]  # declaration order, omitted only when None


def test_codec_ignores_unknown_keys_and_takes_defaults() -> None:
    back = from_json_obj(Outer, {"name": "n", "inner": None, "pair": [0, 1.0], "new": 1})
    assert back == Outer(name="n", inner=None, pair=(0, 1.0))


# -- a real scan, both ways ------------------------------------------------------------------
def test_a_scan_with_steps_and_attention_round_trips() -> None:
    cfg = ArchConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    report = scan(build_model(cfg), steps=2, lr=1e-3, batch=4)
    assert report.dynamics is not None and len(report.dynamics.steps) == 3
    assert report.attention and report.layout and report.branches
    text = report.to_json()
    back = Report.from_dict(json.loads(text))
    # params and the heat map's channel maxima are not in the JSON (by design)
    assert back == dataclasses.replace(report, params=())
    assert back.to_json() == text
    assert all(isinstance(f.severity, Severity) for f in back.findings)


@pytest.mark.parametrize("key", ["layers", "stream", "attention"])
def test_nonfinite_strings_read_back_as_floats(key: str) -> None:
    cfg = ArchConfig(n_layers=2, d_model=32, n_heads=2, vocab_size=64, seq_len=16)
    data = json.loads(scan(build_model(cfg), batch=2, backward=False).to_json())
    rec = data[key][0]
    name = next(k for k, v in rec.items() if isinstance(v, float))
    rec[name] = "inf"
    back = Report.from_dict(data)
    assert getattr(getattr(back, key)[0], name) == math.inf
