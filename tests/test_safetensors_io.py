"""Tests for the safetensors layer: the library validates, actscan words the refusal.

Corrupt files are built by hand (struct + json) so each case breaks exactly one rule; every
refusal must be a one-line `BadInputError` that names the file, and `actscan profile` must
exit 2 with that one line.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import pickle
import re
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from actscan.cli import app
from actscan.errors import BadInputError, UsageError
from actscan.targets.safetensors_io import (
    MAX_HEADER_LEN,
    SafetensorsHeader,
    TensorEntry,
    count_nonfinite,
    load_pickle_weights_only,
    load_sharded,
    load_tensors,
    read_header,
    refuse_pickle,
    save_tensors,
    supported_dtypes,
)

# --------------------------------------------------------------------------- helpers


def pack(header: dict[str, Any] | bytes, data: bytes = b"", header_len: int | None = None) -> bytes:
    """Bytes of a safetensors file: u64 LE length, header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    return struct.pack("<Q", n) + raw + data


def write(path: Path, header: dict[str, Any] | bytes, data: bytes = b"", **kw: Any) -> Path:
    path.write_bytes(pack(header, data, **kw))
    return path


def write_raw(path: Path, blob: bytes) -> Path:
    path.write_bytes(blob)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry(dtype: str, shape: list[Any], start: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


# a: F32 [2, 2] -> 16 bytes, b: I64 [3] -> 24 bytes
VALID = {
    "__metadata__": {"format": "pt"},
    "a": entry("F32", [2, 2], 0, 16),
    "b": entry("I64", [3], 16, 40),
}
VALID_DATA = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0) + struct.pack("<3q", 7, 8, 9)


def refused(path: Path, *fragments: str) -> str:
    """Assert read_header and load_tensors refuse `path` with one line naming it."""
    before = sha256(path) if path.is_file() else None
    for fn in (read_header, load_tensors):
        with pytest.raises(BadInputError) as info:
            fn(path)
        msg = str(info.value)
        assert "\n" not in msg, msg
        assert str(path) in msg, msg
        for fragment in fragments:
            assert fragment in msg, msg
    if before is not None:
        assert sha256(path) == before  # never modify the user's file
    return msg


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "model.safetensors"


# --------------------------------------------------------------------------- read_header: valid


def test_valid_hand_built_file(ckpt: Path) -> None:
    write(ckpt, VALID, VALID_DATA)
    header = read_header(ckpt)
    assert isinstance(header, SafetensorsHeader)
    assert header.metadata == {"format": "pt"}
    assert header.tensors == {"a": TensorEntry("F32", (2, 2)), "b": TensorEntry("I64", (3,))}
    assert header.data_len == 40
    assert header.data_offset == 8 + header.header_len == len(pack(VALID))
    out = load_tensors(ckpt)
    assert torch.equal(out["a"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(out["b"], torch.tensor([7, 8, 9]))


def test_trailing_space_padding_and_empty_tensors_are_valid(ckpt: Path) -> None:
    header = {
        "a": entry("F32", [2], 0, 8),
        "e": entry("F16", [0, 3], 8, 8),
        "s": entry("U8", [], 8, 9),
    }
    raw = json.dumps(header).encode() + b"     "
    write(ckpt, raw, b"\0" * 9)
    out = load_tensors(ckpt)
    assert out["e"].shape == (0, 3) and out["s"].shape == ()


def test_header_length_with_pickle_like_bytes_is_not_mistaken_for_pickle(ckpt: Path) -> None:
    # N = 640 encodes as 80 02 00 ..., the same two bytes as a pickle protocol-2 stream.
    raw = json.dumps({"a": entry("F32", [1], 0, 4)}).encode()
    raw += b" " * (640 - len(raw))
    write(ckpt, raw, b"\0" * 4)
    assert ckpt.read_bytes()[:2] == b"\x80\x02"
    refuse_pickle(ckpt)
    assert read_header(ckpt).header_len == 640
    assert load_tensors(ckpt)["a"].shape == (1,)


@pytest.mark.parametrize(
    "raw",
    [
        b" {}",  # leading whitespace before the JSON object
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',  # a key given twice
        b'{"__metadata__": null, "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
        b'{"a": {"dtype": "F32", "shape": [0, 1099511627776, 1099511627776], '
        b'"data_offsets": [0, 0]}}',  # zero elements, however large the other dimensions
    ],
    ids=["leading-space", "duplicate-key", "null-metadata", "huge-empty"],
)
def test_what_the_library_accepts_is_accepted(ckpt: Path, raw: bytes) -> None:
    """The library is the authority on the format: its leniencies are not re-litigated."""
    write(ckpt, raw, b"\0" * (1 if b'"U8"' in raw else 0))
    header = read_header(ckpt)
    assert set(load_tensors(ckpt)) == set(header.tensors)


# --------------------------------------------------------------------------- refusals


def test_missing_path(ckpt: Path) -> None:
    refused(ckpt, "file not found")


def test_directory(tmp_path: Path) -> None:
    d = tmp_path / "weights.safetensors"
    d.mkdir()
    refused(d, "is a directory")


def test_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    refused(fifo, "not a regular file")


def _one(value: Any, data: int = 4) -> bytes:
    return pack({"h.0.w": value}, b"\0" * data)


def _offsets(value: Any) -> bytes:
    return _one({"dtype": "U8", "shape": [4], "data_offsets": value})


NOT_JSON = "header is not valid JSON for safetensors"
NOT_CONTIGUOUS = "does not start where the previous one ends"
NOT_COVERED = "do not cover the"
# (id, file bytes, fragments of the one-line message). Each breaks exactly one rule.
MALFORMED: list[tuple[str, bytes, tuple[str, ...]]] = [
    ("empty", b"", ("truncated", "0 bytes")),
    ("1-byte", b"\x10", ("truncated", "1 bytes")),
    ("7-bytes", b"\x10" * 7, ("truncated", "7 bytes")),
    (
        "length-past-file",
        pack(VALID, VALID_DATA, 5000),
        ("header length 5000 bytes is larger than the file",),
    ),
    (
        "length-over-100mb",
        pack(VALID, VALID_DATA, MAX_HEADER_LEN + 1),
        ("100000001", "exceeds the 100000000-byte limit"),
    ),
    ("not-utf8", pack(b'{"a\xff": 1}'), ("header is not valid UTF-8",)),
    ("cut-json", pack(b'{"a": '), (NOT_JSON,)),
    ("single-quotes", pack(b"{'a': 1}"), (NOT_JSON,)),
    ("trailing-garbage", pack(b'{"a": {}} trailing'), (NOT_JSON,)),
    ("nan", pack(b'{"x": NaN}'), (NOT_JSON,)),
    ("nul", pack(b'{"a": 1}\x00'), (NOT_JSON,)),
    (
        "deeply-nested",
        pack(b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        (NOT_JSON, "recursion limit"),
    ),
    ("array", pack(b"[1, 2]"), (NOT_JSON, "expected a JSON object")),
    ("string", pack(b'"str"'), (NOT_JSON, "expected a JSON object")),
    ("number", pack(b"12"), (NOT_JSON, "expected a JSON object")),
    (
        "metadata-array",
        pack({"__metadata__": [1], "a": entry("F32", [1], 0, 4)}, b"\0" * 4),
        (NOT_JSON, "expected a map"),
    ),
    (
        "metadata-string",
        pack({"__metadata__": "x", "a": entry("F32", [1], 0, 4)}, b"\0" * 4),
        (NOT_JSON, "expected a map"),
    ),
    (
        "metadata-int-value",
        pack({"__metadata__": {"k": 1}, "a": entry("F32", [1], 0, 4)}, b"\0" * 4),
        (NOT_JSON, "expected a string"),
    ),
    (
        "metadata-object-value",
        pack({"__metadata__": {"k": {"n": "v"}}, "a": entry("F32", [1], 0, 4)}, b"\0" * 4),
        (NOT_JSON, "expected a string"),
    ),
    ("entry-array", _one([1, 2]), (NOT_JSON,)),
    ("entry-string", _one("F32"), (NOT_JSON, "expected a tensor entry")),
    ("entry-number", _one(3), (NOT_JSON, "expected a tensor entry")),
    ("entry-null", _one(None), (NOT_JSON, "expected a tensor entry")),
    ("no-dtype", _one({"shape": [1], "data_offsets": [0, 4]}), ("missing field 'dtype'",)),
    ("no-shape", _one({"dtype": "F32", "data_offsets": [0, 4]}), ("missing field 'shape'",)),
    ("no-offsets", _one({"dtype": "F32", "shape": [1]}), ("missing field 'data_offsets'",)),
    (
        "dtype-C64",
        _one(entry("C64", [1], 0, 8), 8),
        ("tensor 'h.0.w' has unsupported dtype 'C64'", "supported: F64, F32"),
    ),
    ("dtype-U32", _one(entry("U32", [1], 0, 4)), ("tensor 'h.0.w' has unsupported dtype 'U32'",)),
    ("dtype-U16", _one(entry("U16", [2], 0, 4)), ("unsupported dtype 'U16'",)),
    ("dtype-F33", _one(entry("F33", [1], 0, 4)), ("unknown dtype 'F33'",)),
    ("dtype-lowercase", _one(entry("f32", [1], 0, 4)), ("unknown dtype 'f32'",)),
    ("dtype-number", _one(entry(4, [1], 0, 4)), (NOT_JSON,)),  # type: ignore[arg-type]
    ("shape-negative", _one(entry("F32", [-1, 4], 0, 8), 8), (NOT_JSON, "integer ≥ 0")),
    ("shape-float", _one(entry("F32", [2.0], 0, 8), 8), (NOT_JSON, "integer ≥ 0")),
    ("shape-string", _one(entry("F32", ["2"], 0, 8), 8), (NOT_JSON, "integer ≥ 0")),
    ("shape-bool", _one(entry("F32", [True], 0, 8), 8), (NOT_JSON, "integer ≥ 0")),
    ("shape-null", _one(entry("F32", [None], 0, 8), 8), (NOT_JSON, "integer ≥ 0")),
    ("shape-not-list", _one(entry("F32", "4", 0, 8), 8), (NOT_JSON, "expected a sequence")),
    ("shape-object", _one(entry("F32", {"0": 4}, 0, 8), 8), (NOT_JSON,)),  # type: ignore[arg-type]
    (
        "shape-negative-zero",
        pack(b'{"h.0.w": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}'),
        (NOT_JSON, "integer ≥ 0"),
    ),
    ("offsets-one", _offsets([0]), (NOT_JSON, "size 2")),
    ("offsets-three", _offsets([0, 4, 8]), (NOT_JSON, "2 elements")),
    ("offsets-decreasing", _offsets([4, 0]), ("tensor 'h.0.w'", NOT_CONTIGUOUS)),
    ("offsets-negative", _offsets([-4, 0]), (NOT_JSON, "integer ≥ 0")),
    ("offsets-float", _offsets([0.0, 4]), (NOT_JSON, "integer ≥ 0")),
    ("offsets-string", _offsets(["0", "4"]), (NOT_JSON, "integer ≥ 0")),
    ("offsets-bool", _offsets([True, 4]), (NOT_JSON, "integer ≥ 0")),
    ("offsets-str", _offsets("0-4"), (NOT_JSON, "size 2")),
    ("offsets-null", _offsets(None), (NOT_JSON, "size 2")),
    (
        "offsets-past-data",
        _one(entry("F32", [4, 4], 0, 64), 60),
        (NOT_COVERED, "60-byte data section", "truncated"),
    ),
    (
        "overlap",
        pack({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, b"\0" * 12),
        ("tensor 'b'", NOT_CONTIGUOUS),
    ),
    (
        "empty-inside-another",
        pack({"a": entry("F32", [2], 0, 8), "e": entry("F32", [0], 4, 4)}, b"\0" * 8),
        ("tensor 'e'", NOT_CONTIGUOUS),
    ),
    (
        "gap",
        pack({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, b"\0" * 20),
        ("tensor 'b'", NOT_CONTIGUOUS),
    ),
    ("gap-at-start", _one(entry("F32", [2], 4, 12), 12), ("tensor 'h.0.w'", NOT_CONTIGUOUS)),
    ("unused-tail", pack(VALID, VALID_DATA + b"\0" * 3), (NOT_COVERED, "unused bytes at the end")),
    ("no-tensors-but-data", pack({"__metadata__": {}}, b"\0" * 5), (NOT_COVERED, "5-byte")),
    (
        "shape-vs-bytes",
        _one(entry("F32", [4, 4], 0, 60), 60),
        ("a tensor's shape × dtype size differs from its byte range",),
    ),
    (
        "lone-surrogate",
        pack(b'{"a\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\0"),
        (NOT_JSON,),
    ),
    (
        "newline-in-name",
        pack({"a": entry("F32", [1], 0, 4), "bad\nname": entry("F32", [1], 8, 12)}, b"\0" * 12),
        ("tensor 'bad\\nname'", NOT_CONTIGUOUS),
    ),
    ("zip-pickle", b"PK\x03\x04" + b"\0" * 60, ("refusing to load pickle checkpoint",)),
    ("pickle-4", pickle.dumps({"w": [1.0]}, protocol=4), ("refusing to load pickle checkpoint",)),
]


@pytest.mark.parametrize(
    ("blob", "fragments"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_file_is_one_line_and_exit_2(
    tmp_path: Path, blob: bytes, fragments: tuple[str, ...]
) -> None:
    ckpt = write_raw(tmp_path / "model.safetensors", blob)
    msg = refused(ckpt, *fragments)
    assert msg.startswith(("bad checkpoint ", "refusing to load pickle checkpoint "))
    result = CliRunner().invoke(app, ["profile", str(ckpt)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"actscan: error: {msg}"  # one line, no traceback
    assert ckpt.read_bytes() == blob


def test_shape_and_byte_range_disagree(ckpt: Path) -> None:
    write(ckpt, {"h.0.w": entry("F32", [4, 4], 0, 60)}, b"\0" * 60)
    assert refused(ckpt) == (
        f"bad checkpoint {ckpt}: a tensor's shape × dtype size differs from its byte range"
    )


def test_pickle_in_safetensors_clothing(ckpt: Path) -> None:
    torch.save({"w": torch.zeros(2)}, ckpt)  # zip format
    refused(ckpt, "refusing to load pickle checkpoint", "weights_only=True")


# --------------------------------------------------------------------------- load_tensors


def test_load_subset_and_unknown_name(ckpt: Path) -> None:
    write(ckpt, VALID, VALID_DATA)
    assert list(load_tensors(ckpt, names=["b"])) == ["b"]
    with pytest.raises(BadInputError, match="no tensor named 'zz'") as info:
        load_tensors(ckpt, names=["a", "zz"])
    assert str(ckpt) in str(info.value)


def test_bad_device_is_a_usage_error(ckpt: Path) -> None:
    write(ckpt, VALID, VALID_DATA)
    with pytest.raises(UsageError, match="invalid device"):
        load_tensors(ckpt, device="nonsense")


def test_writing_into_loaded_tensor_leaves_file_unchanged(ckpt: Path) -> None:
    save_tensors({"w": torch.arange(16.0)}, ckpt)
    before = sha256(ckpt)
    t = load_tensors(ckpt)["w"]
    t.mul_(-3)
    assert sha256(ckpt) == before
    assert torch.equal(load_tensors(ckpt)["w"], torch.arange(16.0))


# --------------------------------------------------------------------------- save_tensors


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.dtype != torch.bool:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def test_round_trip_dtypes_and_metadata(ckpt: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.randn(4, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 2, generator=g).half(),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "i64": torch.arange(6).reshape(2, 3),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "nonfinite": torch.tensor([float("nan"), float("inf"), -float("inf")]),
        "f8a": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "f8b": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
    }
    meta = {"actscan.config": json.dumps({"d_model": 8}), "format": "pt"}
    save_tensors(tensors, ckpt, meta)
    header = read_header(ckpt)
    assert header.metadata == meta
    assert set(header.tensors) == set(tensors)
    assert header.tensors["bf16"].dtype == "BF16" and header.tensors["f8a"].dtype == "F8_E4M3"
    out = load_tensors(ckpt)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype, name
        if name == "nonfinite":
            assert torch.equal(out[name].isnan(), t.isnan())
        else:
            assert _bitwise_equal(out[name], t), name


def test_save_tied_views_and_non_contiguous(ckpt: Path) -> None:
    w = torch.randn(4, 3, requires_grad=True)
    base = torch.arange(12.0)
    tensors = {
        "wte": w,
        "lm_head": w,  # tied
        "first": base[:6],  # two views of one storage
        "second": base[6:],
        "t": torch.arange(6.0).reshape(2, 3).t(),  # non-contiguous
    }
    save_tensors(tensors, ckpt)
    out = load_tensors(ckpt)
    for name, t in tensors.items():
        assert torch.equal(out[name], t.detach()), name
    assert out["t"].is_contiguous()


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path: Path) -> None:
    ckpt = tmp_path / "model.safetensors"
    save_tensors({"a": torch.zeros(3)}, ckpt)
    save_tensors({"b": torch.ones(2)}, ckpt, {"v": "2"})
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert list(load_tensors(ckpt)) == ["b"]
    assert read_header(ckpt).metadata == {"v": "2"}


@pytest.mark.parametrize(
    ("tensors", "meta", "fragment"),
    [
        ({"c": torch.zeros(2, dtype=torch.complex64)}, None, "unsupported dtype"),
        ({"a": torch.zeros(2)}, {"k": 3}, "metadata"),
        ({"__metadata__": torch.zeros(2)}, None, "invalid tensor name"),
        ({"a": [1.0]}, None, "expected torch.Tensor"),
        ({"m": torch.empty(2, device="meta")}, None, "meta tensor"),
    ],
)
def test_failed_save_keeps_existing_file(
    tmp_path: Path, tensors: dict[str, Any], meta: Any, fragment: str
) -> None:
    ckpt = tmp_path / "model.safetensors"
    save_tensors({"keep": torch.arange(3.0)}, ckpt)
    before = sha256(ckpt)
    with pytest.raises(BadInputError, match=fragment):
        save_tensors(tensors, ckpt, meta)
    assert sha256(ckpt) == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


# --------------------------------------------------------------------------- sharded


def _make_sharded(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    t = {"h.0.w": torch.randn(2, 3), "h.0.b": torch.zeros(3), "h.1.w": torch.ones(3, 2)}
    save_tensors(
        {"h.0.w": t["h.0.w"], "h.0.b": t["h.0.b"]}, folder / "model-00001-of-00002.safetensors"
    )
    save_tensors({"h.1.w": t["h.1.w"]}, folder / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {"total_size": 60},
        "weight_map": {
            "h.0.w": "model-00001-of-00002.safetensors",
            "h.0.b": "model-00001-of-00002.safetensors",
            "h.1.w": "model-00002-of-00002.safetensors",
        },
    }
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps(index))
    return path, t


def test_sharded_round_trip(tmp_path: Path) -> None:
    index, tensors = _make_sharded(tmp_path)
    out = load_sharded(index)
    assert list(out) == ["h.0.w", "h.0.b", "h.1.w"]
    for name, t in tensors.items():
        assert torch.equal(out[name], t)
    assert list(load_sharded(index, names=["h.1.w"])) == ["h.1.w"]


def _edit_index(index: Path, **weight_map: str) -> None:
    obj = json.loads(index.read_text())
    obj["weight_map"].update({k.replace("_", "."): v for k, v in weight_map.items()})
    index.write_text(json.dumps(obj))


def test_sharded_tensor_in_wrong_shard(tmp_path: Path) -> None:
    index, _ = _make_sharded(tmp_path)
    _edit_index(index, h_1_w="model-00001-of-00002.safetensors")
    with pytest.raises(BadInputError) as info:
        load_sharded(index)
    msg = str(info.value)
    assert str(index) in msg
    assert "tensor 'h.1.w'" in msg


def test_sharded_index_puts_tensor_in_shard_that_lacks_it(tmp_path: Path) -> None:
    index, _ = _make_sharded(tmp_path)
    obj = json.loads(index.read_text())
    # shard 2 is never mentioned, shard 1 is said to hold h.1.w
    obj["weight_map"] = {
        "h.0.w": "model-00001-of-00002.safetensors",
        "h.0.b": "model-00001-of-00002.safetensors",
        "h.1.w": "model-00001-of-00002.safetensors",
    }
    index.write_text(json.dumps(obj))
    with pytest.raises(BadInputError, match="does not contain it"):
        load_sharded(index)


def test_sharded_stray_tensor_not_in_index(tmp_path: Path) -> None:
    index, _ = _make_sharded(tmp_path)
    obj = json.loads(index.read_text())
    del obj["weight_map"]["h.0.b"]
    index.write_text(json.dumps(obj))
    with pytest.raises(
        BadInputError, match=re.escape("contains tensor 'h.0.b' but the index does not list it")
    ):
        load_sharded(index)


def test_sharded_missing_shard(tmp_path: Path) -> None:
    index, _ = _make_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(BadInputError, match="does not exist"):
        load_sharded(index)


def test_sharded_corrupt_shard_names_the_shard(tmp_path: Path) -> None:
    index, _ = _make_sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(BadInputError, match=re.escape("model-00002-of-00002.safetensors")):
        load_sharded(index)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[1]", "expected a JSON object"),
        ("{not json", "not valid JSON"),
        ('{"metadata": {}}', 'has no "weight_map"'),
        ('{"weight_map": []}', '"weight_map" must be an object'),
        ('{"weight_map": {}}', '"weight_map" is empty'),
        ('{"weight_map": {"a": 1}}', "must be a shard file name"),
        ('{"weight_map": {"a": "../outside.safetensors"}}', "relative path inside"),
        ('{"weight_map": {"a": "/etc/passwd"}}', "relative path inside"),
    ],
)
def test_bad_index(tmp_path: Path, content: str, fragment: str) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(BadInputError, match=fragment) as info:
        load_sharded(index)
    assert str(info.value).startswith(f"bad index {index}:")


def test_missing_index(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="file not found"):
        load_sharded(tmp_path / "model.safetensors.index.json")


# --------------------------------------------------------------------------- pickle


@pytest.mark.parametrize("name", ["pytorch_model.bin", "m.pt", "m.PTH", "last.ckpt", "x.pkl"])
def test_refuse_pickle_by_suffix(tmp_path: Path, name: str) -> None:
    path = tmp_path / name  # need not exist: the name alone is enough
    with pytest.raises(BadInputError) as info:
        refuse_pickle(path)
    msg = str(info.value)
    assert msg.startswith(f"refusing to load pickle checkpoint {path}: pickle can execute code.")
    assert f"torch.load('{path}', weights_only=True)" in msg
    assert "save_file(" in msg and "'model.safetensors'" in msg
    assert "\n" not in msg


def test_refuse_pickle_by_magic(tmp_path: Path) -> None:
    zipped = tmp_path / "weights.data"
    torch.save({"w": torch.zeros(2)}, zipped)
    with pytest.raises(BadInputError, match="refusing to load pickle"):
        refuse_pickle(zipped)
    raw = tmp_path / "weights.raw"
    raw.write_bytes(pickle.dumps([1, 2], protocol=2))
    with pytest.raises(BadInputError, match="refusing to load pickle"):
        refuse_pickle(raw)


def test_refuse_pickle_passes_safetensors_and_missing(ckpt: Path) -> None:
    refuse_pickle(ckpt)  # missing: left for the loader to report
    write(ckpt, VALID, VALID_DATA)
    refuse_pickle(ckpt)


def test_load_pickle_weights_only(tmp_path: Path) -> None:
    sd = {"w": torch.randn(2, 2), "b": torch.zeros(2)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)
    out = load_pickle_weights_only(path)
    assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd)
    lightning = tmp_path / "last.ckpt"
    torch.save({"state_dict": sd, "epoch": 3}, lightning)
    assert load_pickle_weights_only(lightning).keys() == sd.keys()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_load_pickle_weights_only_blocks_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    with path.open("wb") as f:
        pickle.dump({"w": _Evil(marker)}, f, protocol=2)
    before = sha256(path)
    with pytest.raises(BadInputError, match="weights_only=True") as info:
        load_pickle_weights_only(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()
    assert sha256(path) == before


def test_load_pickle_weights_only_rejects_non_tensor_dict(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(1), "step": 3}, path)
    with pytest.raises(BadInputError, match="entry 'step' is int"):
        load_pickle_weights_only(path)


def test_load_pickle_weights_only_refused_on_old_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.zeros(1)}, path)
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    with pytest.raises(BadInputError, match=re.escape("older than 2.6")):
        load_pickle_weights_only(path)


# --------------------------------------------------------------------------- count_nonfinite


def test_count_nonfinite() -> None:
    nan, inf = float("nan"), float("inf")
    tensors = {
        "f32": torch.tensor([1.0, nan, inf, -inf, 0.0]),
        "bf16": torch.tensor([nan, 1.0]).bfloat16(),
        "f16_overflow": torch.tensor([70000.0, 1.0]).half(),  # inf in fp16
        "int": torch.arange(5),
        "bool": torch.tensor([True]),
        "empty": torch.zeros(0),
        "strided": torch.tensor([[nan, 1.0], [2.0, nan]]).t()[:, :1],
        "complex": torch.tensor([complex(nan, 0), 1j]),
    }
    assert count_nonfinite(tensors) == {
        "f32": 3,
        "bf16": 1,
        "f16_overflow": 1,
        "int": 0,
        "bool": 0,
        "empty": 0,
        "strided": 1,
        "complex": 1,
    }
    assert list(count_nonfinite(tensors)) == list(tensors)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
    ],
)
def test_count_nonfinite_float8_matches_upcast(dtype: torch.dtype) -> None:
    every = torch.arange(256, dtype=torch.uint8).view(dtype)
    expected = int(torch.isfinite(every.float()).logical_not().sum())
    assert count_nonfinite({"x": every}) == {"x": expected}
    assert count_nonfinite({"x": every.reshape(16, 16).t()}) == {"x": expected}


# --------------------------------------------------------------------------- property


def _valid_blob() -> bytes:
    header = {
        "__metadata__": {"format": "pt"},
        "emb": entry("F32", [2, 3], 0, 24),
        "bias": entry("BF16", [4], 24, 32),
        "ids": entry("I64", [2], 32, 48),
        "none": entry("F16", [0], 48, 48),
    }
    return pack(header, bytes(range(48)))


_VALID_BLOB = _valid_blob()
_N = len(_VALID_BLOB)

_mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, _N - 1), st.integers(0, 255)),
    st.tuples(st.just("set"), st.integers(0, 8), st.integers(0, 255)),  # header length bytes
    st.tuples(st.just("truncate"), st.integers(0, _N - 1), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 64), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, _N), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, _N - 1), st.just(0)),
)


def _apply(blob: bytes, ops: list[tuple[str, int, int]]) -> bytes:
    b = bytearray(blob)
    for op, pos, value in ops:
        if op == "set" and pos < len(b):
            b[pos] = value
        elif op == "truncate":
            del b[pos:]
        elif op == "extend":
            b += bytes([value]) * pos
        elif op == "insert":
            b[pos:pos] = bytes([value])
        elif op == "delete" and pos < len(b):
            del b[pos]
    return bytes(b)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz")


_counter = itertools.count()


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError("read_header/load_tensors hung")


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_files_succeed_or_raise_bad_input(
    fuzz_dir: Path, ops: list[tuple[str, int, int]]
) -> None:
    blob = _apply(_VALID_BLOB, ops)
    # a fresh name each time: earlier results may still map earlier files
    path = fuzz_dir / f"m{next(_counter)}.safetensors"
    path.write_bytes(blob)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        try:
            header = read_header(path)
        except BadInputError as err:
            assert str(path) in str(err) and "\n" not in str(err)
            return
        # What the reader accepts, torch must load as declared.
        out = load_tensors(path)
        assert set(out) == set(header.tensors)
        for name, t in out.items():
            assert tuple(t.shape) == header.tensors[name].shape
            assert t.dtype == supported_dtypes()[header.tensors[name].dtype]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        assert path.read_bytes() == blob  # never modified
        path.unlink()
