"""Safe, strict reading and writing of safetensors checkpoints.

Why this layer exists: a checkpoint is untrusted input. Pickle files (`.bin`, `.pt`, …) can run
code when loaded, so they are refused unless the user opts in explicitly. A safetensors file
cannot run code, but a corrupt one should still end in one clear line naming the file and the
tensor, never in a traceback from the Rust parser or from torch. So `read_header` validates the
whole layout in pure Python first (reading only the first 8 + N bytes, never the data section),
and only files that pass it are handed to `safetensors.safe_open`.

Validation follows the format specification (https://github.com/huggingface/safetensors):
8-byte little-endian header length N, N bytes of UTF-8 JSON that begins with `{`, then the data
section, which the tensors must cover exactly and contiguously. Where the Rust parser is lenient
(duplicate JSON keys, a header starting with whitespace) this layer is stricter: an ambiguous
file is a bad file.

torch is imported lazily so that this module can be imported (and headers inspected) without
paying torch's import time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import secrets
import stat
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actscan.errors import BadInputError, UsageError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_HEADER_LEN",
    "PICKLE_SUFFIXES",
    "SafetensorsHeader",
    "TensorEntry",
    "count_nonfinite",
    "load_pickle_weights_only",
    "load_sharded",
    "load_tensors",
    "read_header",
    "refuse_pickle",
    "save_tensors",
    "supported_dtypes",
    "torch_dtype",
]

MAX_HEADER_LEN = 100_000_000
"""Same cap as the Rust parser: a larger header is a corrupt length, not a real checkpoint."""

MAX_INDEX_LEN = 100_000_000
"""A sharded index is a small JSON file; refuse to parse anything absurdly large."""

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})

_INT64_MAX = 2**63 - 1

# safetensors dtype name -> (torch attribute name, bytes per element). F8 types are
# only offered when the installed torch has them (see `supported_dtypes`).
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}

# Valid safetensors dtypes that actscan refuses, so the message can say "unsupported"
# rather than "unknown".
_KNOWN_UNSUPPORTED = frozenset(
    {"U16", "U32", "U64", "C64", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "F8_E4M3FNUZ"}
)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header declares it; offsets are relative to the data section."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: every tensor's dtype, shape and byte range are consistent."""

    path: Path
    header_len: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    data_len: int

    @property
    def data_offset(self) -> int:
        """Absolute file offset of the data section."""
        return 8 + self.header_len


# --------------------------------------------------------------------------- helpers


def _show(path: str | os.PathLike[str]) -> str:
    """The path as the user gave it, escaped if it would break the one-line message."""
    text = os.fspath(path)
    return text if text.isprintable() else repr(text)


def _q(name: str) -> str:
    """Quote a tensor name (repr keeps newlines and control characters on one line)."""
    return repr(name)


def _first_line(err: BaseException) -> str:
    """One line from an exception (torch errors carry C++ stack frames after line one)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _bad(path: str | os.PathLike[str], message: str, kind: str = "checkpoint") -> BadInputError:
    return BadInputError(f"bad {kind} {_show(path)}: {message}")


@functools.cache
def supported_dtypes() -> dict[str, Any]:
    """safetensors dtype name -> torch dtype, for the dtypes this torch can represent."""
    import torch

    out: dict[str, Any] = {}
    for name, (attr, _size) in _DTYPES.items():
        dt = getattr(torch, attr, None)
        if dt is not None:
            out[name] = dt
    return out


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name (KeyError if unsupported)."""
    return supported_dtypes()[name]


def _open_regular(path: Path, kind: str = "checkpoint") -> tuple[int, os.stat_result]:
    """Open a regular file read-only and return (fd, stat).

    O_NONBLOCK keeps a FIFO or device node from hanging the open; such paths are then refused
    because only a regular file has a size we can validate against.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _bad(path, "file not found", kind) from None
    except IsADirectoryError:
        raise _bad(path, f"is a directory, expected a {_expected(kind)} file", kind) from None
    except OSError as err:
        raise _bad(path, f"cannot open: {err.strerror or err}", kind) from None
    try:
        st = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise _bad(path, f"cannot stat: {err.strerror or err}", kind) from None
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise _bad(path, f"is a directory, expected a {_expected(kind)} file", kind)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _bad(path, "is not a regular file", kind)
    return fd, st


def _expected(kind: str) -> str:
    return ".safetensors" if kind == "checkpoint" else ".json"


def _read_exact(fd: int, n: int) -> bytes:
    """Read exactly n bytes (or fewer only at end of file)."""
    chunks: list[bytes] = []
    left = n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _looks_like_pickle(head: bytes) -> bool:
    """True for a zip (torch.save since 1.6) or a pickle protocol 2-5 stream.

    A safetensors file whose header length happens to start with the same bytes (e.g. N = 640
    is `80 02 00 …`) always has `{` at byte 8; zip and pickle streams do not.
    """
    if head[8:9] == b"{":
        return False
    if head.startswith(b"PK\x03\x04"):
        return True
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _pickle_message(path: str | os.PathLike[str]) -> str:
    src = os.fspath(path)
    return (
        f"refusing to load pickle checkpoint {_show(path)}: pickle can execute code. "
        'Convert it once in a trusted environment: python -c "import torch; '
        "from safetensors.torch import save_file; "
        f"save_file(torch.load({src!r}, weights_only=True), 'model.safetensors')\""
    )


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key given twice makes the header ambiguous."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_int(literal: str) -> int | float:
    """`-0` becomes a float, as in serde_json, so it is refused where an unsigned int is due."""
    return -0.0 if literal == "-0" else int(literal)


def _parse_json(raw: bytes, path: Path, what: str, kind: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, no lone surrogates."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _bad(path, f"{what} is not valid UTF-8 (byte {err.start})", kind) from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_reject_duplicate_keys,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
        )
    except _DuplicateKey as err:
        raise _bad(path, f"{what} has the key {_q(err.key)} more than once", kind) from None
    except json.JSONDecodeError as err:
        raise _bad(
            path,
            f"{what} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})",
            kind,
        ) from None
    except (ValueError, RecursionError) as err:
        # RecursionError: absurdly deep nesting; ValueError: e.g. an int literal too long.
        raise _bad(path, f"{what} is not valid JSON ({_first_line(err)})", kind) from None
    return value


def _is_utf8(text: str) -> bool:
    """False for strings holding lone surrogates (legal `\\ud800` escapes in Python's JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- read


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and fully validate a safetensors header without touching the data section.

    Nothing is unpickled and nothing is memory-mapped; only 8 + N bytes are read. Every way the
    file can be inconsistent becomes one `BadInputError` line naming the file (and the tensor),
    so a file that passes can be handed to the Rust parser and torch without surprises.
    """
    p = Path(path)
    fd, st = _open_regular(p)
    try:
        file_len = st.st_size
        head = _read_exact(fd, 9)
        if _looks_like_pickle(head):
            raise BadInputError(_pickle_message(path))
        if len(head) < 8:
            raise _bad(
                p, f"file is truncated: {file_len} bytes, shorter than the 8-byte header length"
            )
        (header_len,) = struct.unpack("<Q", head[:8])
        if header_len > MAX_HEADER_LEN:
            raise _bad(
                p,
                f"header length {header_len} bytes exceeds the {MAX_HEADER_LEN}-byte limit "
                "(corrupt or not a safetensors file)",
            )
        if 8 + header_len > file_len:
            raise _bad(
                p,
                f"header length {header_len} bytes is larger than the file "
                f"({file_len} bytes, {file_len - 8} after the length): truncated or not a "
                "safetensors file",
            )
        if header_len < 2:
            raise _bad(p, f"header length {header_len} bytes is too short for a JSON object")
        os.lseek(fd, 8, os.SEEK_SET)
        raw = _read_exact(fd, header_len)
    finally:
        os.close(fd)
    if len(raw) != header_len:
        raise _bad(p, "file changed size while it was being read")
    if raw[:1] != b"{":
        raise _bad(p, "header is not a JSON object (it must begin with '{')")
    obj = _parse_json(raw, p, "header", "checkpoint")
    if not isinstance(obj, dict):
        raise _bad(p, f"header is not a JSON object but {type(obj).__name__}")
    data_len = file_len - 8 - header_len
    metadata = _check_metadata(p, obj.pop("__metadata__", {}))
    tensors = {name: _check_entry(p, name, value, data_len) for name, value in obj.items()}
    _check_layout(p, tensors, data_len)
    return SafetensorsHeader(
        path=p, header_len=header_len, metadata=metadata, tensors=tensors, data_len=data_len
    )


def _check_metadata(path: Path, value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad(path, f"__metadata__ must be an object of strings, got {_json_type(value)}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise _bad(
                path, f"__metadata__ value for {_q(key)} must be a string, got {_json_type(item)}"
            )
        if not (_is_utf8(key) and _is_utf8(item)):
            raise _bad(path, f"__metadata__ entry {_q(key)} holds an invalid unicode escape")
    return dict(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _check_entry(path: Path, name: str, value: Any, data_len: int) -> TensorEntry:
    """Validate one tensor entry in isolation (layout across tensors is checked later)."""
    t = f"tensor {_q(name)}"
    if not _is_utf8(name):
        raise _bad(path, f"{t} has a name with an invalid unicode escape")
    if not isinstance(value, dict):
        raise _bad(path, f"{t} must be an object, got {_json_type(value)}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in value]
    if missing:
        raise _bad(path, f"{t} is missing {', '.join(missing)}")

    dtype = value["dtype"]
    if not isinstance(dtype, str):
        raise _bad(path, f"{t} has dtype {_json_type(dtype)}, expected a string")
    supported = supported_dtypes()
    if dtype not in supported:
        known = dtype in _DTYPES or dtype in _KNOWN_UNSUPPORTED
        what = "unsupported" if known else "unknown"
        raise _bad(path, f"{t} has {what} dtype {dtype!r} (supported: {', '.join(supported)})")

    shape = value["shape"]
    if not isinstance(shape, list):
        raise _bad(path, f"{t} has shape {_json_type(shape)}, expected an array of integers")
    for dim in shape:
        if not _is_int(dim) or dim < 0:
            raise _bad(path, f"{t} has shape {_fmt_list(shape)}: dimensions must be integers ≥ 0")
    nonzero = math.prod(d for d in shape if d != 0)
    if nonzero > _INT64_MAX:
        raise _bad(path, f"{t} has shape {_fmt_list(shape)}, too large for torch")

    offsets = value["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or offsets[0] < 0
        or offsets[1] < offsets[0]
    ):
        raise _bad(
            path,
            f"{t} has data_offsets {_fmt_list(offsets)}, expected two non-decreasing integers ≥ 0",
        )
    start, end = offsets
    if end > data_len:
        raise _bad(
            path,
            f"{t} byte range [{start}, {end}] is out of range: the data section is "
            f"{data_len} bytes (truncated file?)",
        )
    expected = math.prod(shape) * _DTYPES[dtype][1]
    if expected != end - start:
        raise _bad(
            path,
            f"{t} declares shape {_fmt_list(shape)} × {dtype} = {expected} bytes but its "
            f"byte range is {end - start} bytes",
        )
    return TensorEntry(dtype=dtype, shape=tuple(shape), start=start, end=end)


def _fmt_list(value: Any) -> str:
    """Render a JSON value compactly on one line (`[4, 4]`), truncated if huge."""
    try:
        text = json.dumps(value, ensure_ascii=True, separators=(", ", ": "))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_layout(path: Path, tensors: Mapping[str, TensorEntry], data_len: int) -> None:
    """The data section must be covered exactly: no overlap, no gap, no unused tail."""
    order = sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end, item[0]))
    pos = 0
    prev: str | None = None
    for name, entry in order:
        if entry.start < pos:
            raise _bad(
                path,
                f"tensor {_q(name)} byte range [{entry.start}, {entry.end}] overlaps "
                f"tensor {_q(prev or '')} (which ends at {pos})",
            )
        if entry.start > pos:
            after = f"after tensor {_q(prev)}" if prev is not None else "at the start"
            raise _bad(
                path,
                f"gap of {entry.start - pos} unused bytes [{pos}, {entry.start}] in the data "
                f"section {after}, before tensor {_q(name)} (tensors must be contiguous)",
            )
        pos = entry.end
        prev = name
    if pos != data_len:
        raise _bad(
            path,
            f"{data_len - pos} unused bytes at the end of the data section (tensors cover "
            f"{pos} of {data_len} bytes)",
        )


# --------------------------------------------------------------------------- load


def load_tensors(
    path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load tensors from a validated safetensors file (memory-mapped, copy-on-write).

    `read_header` runs first so a corrupt file never reaches the Rust parser; anything that
    still fails inside safetensors or torch becomes a `BadInputError` naming the file. The
    mapping is private: writing into a returned tensor never changes the user's file.
    """
    header = read_header(path)
    wanted = _select(header, names)
    target = _parse_device(device)
    from safetensors import safe_open

    p = header.path
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(os.fspath(p), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            if keys != set(header.tensors):
                raise _bad(p, "safetensors and actscan disagree on the tensor names")
            for name in wanted:
                out[name] = f.get_tensor(name)
    except BadInputError:
        raise
    except Exception as err:
        raise _bad(p, f"safetensors could not read it: {_first_line(err)}") from err
    for name, tensor in out.items():
        entry = header.tensors[name]
        if tensor.dtype != torch_dtype(entry.dtype) or tuple(tensor.shape) != entry.shape:
            raise _bad(
                p,
                f"tensor {_q(name)} loaded as {tensor.dtype} {tuple(tensor.shape)}, "
                f"header says {entry.dtype} {list(entry.shape)}",
            )
    if target.type != "cpu":
        try:
            out = {name: t.to(target) for name, t in out.items()}
        except Exception as err:
            raise UsageError(f"cannot move tensors to device {target}: {_first_line(err)}") from err
    return out


def _select(header: SafetensorsHeader, names: Iterable[str] | None) -> list[str]:
    if names is None:
        return list(header.tensors)
    wanted = list(dict.fromkeys(names))
    missing = [n for n in wanted if n not in header.tensors]
    if missing:
        shown = ", ".join(_q(n) for n in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise _bad(
            header.path, f"no tensor named {shown} (the file has {len(header.tensors)} tensors)"
        )
    return wanted


def _parse_device(device: str | torch.device) -> torch.device:
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise UsageError(f"invalid device {device!r}: {_first_line(err)}") from None


def load_sharded(
    index_json_path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint from its `model.safetensors.index.json`.

    The index must be a JSON object whose "weight_map" maps tensor names to shard file names
    in the same folder. Every shard must exist and validate, and each shard must hold exactly
    the tensors the index assigns to it: a tensor found elsewhere, or a stray tensor not in the
    index, means the index and shards are out of sync, and loading would silently pick one.
    """
    index_path = Path(index_json_path)
    weight_map = _read_index(index_path)
    folder = index_path.parent

    by_shard: dict[str, list[str]] = {}
    for tensor_name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor_name)

    for shard in by_shard:
        if not (folder / shard).exists():
            raise _bad(
                index_path,
                f"shard {_q(shard)} listed in the index does not exist in {_show(folder)}",
                "index",
            )
    headers: dict[str, SafetensorsHeader] = {}
    for shard, listed in by_shard.items():
        header = read_header(folder / shard)
        headers[shard] = header
        for tensor_name in listed:
            if tensor_name not in header.tensors:
                holders = [s for s, h in headers.items() if tensor_name in h.tensors]
                where = f"; it is in {holders[0]}" if holders else ""
                raise _bad(
                    index_path,
                    f"the index puts tensor {_q(tensor_name)} in shard {shard}, "
                    f"but that shard does not contain it{where}",
                    "index",
                )
        for tensor_name in header.tensors:
            mapped = weight_map.get(tensor_name)
            if mapped != shard:
                said = f"puts it in shard {mapped}" if mapped is not None else "does not list it"
                raise _bad(
                    index_path,
                    f"shard {shard} contains tensor {_q(tensor_name)} but the index {said}",
                    "index",
                )

    wanted = set(weight_map) if names is None else set(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in weight_map]
    if unknown:
        raise _bad(index_path, f"no tensor named {_q(sorted(unknown)[0])} in the index", "index")

    out: dict[str, torch.Tensor] = {}
    for shard, listed in by_shard.items():
        pick = [n for n in listed if n in wanted]
        if pick:
            out.update(load_tensors(folder / shard, pick, device))
    return {name: out[name] for name in weight_map if name in out}


def _read_index(index_path: Path) -> dict[str, str]:
    fd, st = _open_regular(index_path, "index")
    try:
        if st.st_size > MAX_INDEX_LEN:
            raise _bad(index_path, f"{st.st_size} bytes is too large for an index", "index")
        raw = _read_exact(fd, st.st_size)
    finally:
        os.close(fd)
    obj = _parse_json(raw, index_path, "index", "index")
    if not isinstance(obj, dict):
        raise _bad(index_path, f"expected a JSON object, got {_json_type(obj)}", "index")
    if "weight_map" not in obj:
        raise _bad(index_path, 'has no "weight_map"', "index")
    weight_map = obj["weight_map"]
    if not isinstance(weight_map, dict):
        raise _bad(
            index_path, f'"weight_map" must be an object, got {_json_type(weight_map)}', "index"
        )
    if not weight_map:
        raise _bad(index_path, '"weight_map" is empty', "index")
    for tensor_name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise _bad(
                index_path,
                f'"weight_map" value for {_q(tensor_name)} must be a shard file name, '
                f"got {_json_type(shard)}",
                "index",
            )
        if not _is_safe_shard_name(shard):
            raise _bad(
                index_path,
                f"shard name {_q(shard)} for tensor {_q(tensor_name)} must be a "
                "relative path inside the index's folder",
                "index",
            )
    return dict(weight_map)


def _is_safe_shard_name(shard: str) -> bool:
    """Relative, no `..`, no NUL. (Symlinks are allowed: the HF cache links shards to blobs.)"""
    if not shard or "\x00" in shard or not _is_utf8(shard):
        return False
    pure = Path(shard)
    return not pure.is_absolute() and ".." not in pure.parts and not shard.startswith(("/", "\\"))


# --------------------------------------------------------------------------- pickle


def refuse_pickle(path: str | os.PathLike[str]) -> None:
    """Raise `BadInputError` for a pickle checkpoint (by suffix or by zip/pickle magic).

    Loading a pickle runs arbitrary code, so actscan never does it implicitly; the message
    gives the one-line conversion to safetensors. Returns None for anything else (including
    a missing file: the loader that follows reports that).
    """
    p = Path(path)
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise BadInputError(_pickle_message(path))
    try:
        fd, _st = _open_regular(p)
    except BadInputError:
        return
    try:
        head = _read_exact(fd, 9)
    finally:
        os.close(fd)
    if _looks_like_pickle(head):
        raise BadInputError(_pickle_message(path))


def _torch_at_least(major: int, minor: int) -> bool:
    import torch

    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__))
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (major, minor)


def load_pickle_weights_only(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Explicit opt-in: load a pickle checkpoint with `torch.load(weights_only=True)`.

    Refused on torch < 2.6, where `weights_only=True` could still be bypassed to run code
    (CVE-2025-32434). Returns a flat name -> tensor dict; a Lightning-style checkpoint's
    "state_dict" is unwrapped. Anything else is refused rather than guessed at.
    """
    import torch

    p = Path(path)
    if not _torch_at_least(2, 6):
        raise BadInputError(
            f"refusing to load pickle checkpoint {_show(p)}: torch {torch.__version__} is older "
            "than 2.6, where weights_only=True is not safe (CVE-2025-32434); upgrade torch or "
            "convert the file to safetensors in a trusted environment"
        )
    fd, _st = _open_regular(p)
    os.close(fd)
    try:
        obj = torch.load(os.fspath(p), weights_only=True, map_location="cpu")
    except Exception as err:
        raise _bad(
            p, f"torch.load(weights_only=True) refused or failed: {_first_line(err)}"
        ) from err
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj:
        raise _bad(p, f"expected a dict of name -> tensor, got {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise _bad(
                p, f"expected a dict of name -> tensor, but entry {key!r} is {type(value).__name__}"
            )
    return dict(obj)


# --------------------------------------------------------------------------- save


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file atomically.

    The file is written to a temporary name in the target folder, validated with
    `read_header`, fsynced and renamed over `path`, so a crash or error never leaves a
    half-written checkpoint and never clobbers an existing one. Tensors are detached, moved to
    the CPU and made contiguous; tensors that share storage (tied embeddings, views) are cloned
    so `save_file` does not refuse them.
    """
    from safetensors.torch import save_file

    p = Path(path)
    meta = _check_save_metadata(p, metadata)
    prepared = _prepare_for_save(p, tensors)

    folder = p.parent if str(p.parent) else Path(".")
    tmp = folder / f".{p.name}.{secrets.token_hex(6)}.tmp"
    try:
        # O_EXCL: never reuse an existing file; 0o666 lets the umask set the usual permissions.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        os.close(fd)
    except OSError as err:
        raise _bad(p, f"cannot write to {_show(folder)}: {err.strerror or err}", "output") from None
    try:
        try:
            save_file(prepared, os.fspath(tmp), metadata=meta)
        except Exception as err:
            raise _bad(p, f"safetensors could not write it: {_first_line(err)}", "output") from err
        read_header(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # the Rust writer creates 0600; follow the umask
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    """Persist the rename itself (best effort: not every platform can fsync a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_save_metadata(path: Path, metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise _bad(
                path,
                f"metadata must map strings to strings, got {key!r}: {type(value).__name__}",
                "output",
            )
    return dict(metadata)


def _prepare_for_save(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    supported = set(supported_dtypes().values())
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__" or not _is_utf8(name):
            raise _bad(path, f"invalid tensor name {name!r}", "output")
        if not isinstance(tensor, torch.Tensor):
            raise _bad(path, f"{_q(name)} is a {type(tensor).__name__}, not a tensor", "output")
        if tensor.layout != torch.strided:
            raise _bad(path, f"tensor {_q(name)} is sparse; call .to_dense() first", "output")
        if tensor.is_meta:
            raise _bad(path, f"tensor {_q(name)} is on the meta device and has no data", "output")
        if tensor.dtype not in supported:
            raise _bad(path, f"tensor {_q(name)} has unsupported dtype {tensor.dtype}", "output")
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        out[name] = t.contiguous()

    # Tied weights / views: any storage used by more than one tensor gets cloned for all but
    # the first user (cloning is cheap next to a write and keeps save_file's sharing check quiet).
    seen: set[int] = set()
    for name, t in out.items():
        if t.numel() == 0:
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            out[name] = t.clone()
        else:
            seen.add(ptr)
    return out


# --------------------------------------------------------------------------- stats


# Byte patterns of non-finite float8 values: (mask, value) such that `b & mask == value`.
# torch has no isfinite kernel for float8, and upcasting would copy 2-4× the memory.
_F8_NONFINITE: dict[str, tuple[int, int]] = {
    "float8_e4m3fn": (0x7F, 0x7F),  # NaN only (S.1111.111)
    "float8_e5m2": (0x7C, 0x7C),  # exponent all ones: Inf or NaN
    "float8_e4m3fnuz": (0xFF, 0x80),  # negative zero pattern is NaN
    "float8_e5m2fnuz": (0xFF, 0x80),
    "float8_e8m0fnu": (0xFF, 0xFF),
}


def count_nonfinite(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Number of NaN/Inf elements per tensor (0 for integer and bool tensors).

    Counts are reduced on each tensor's own device and brought to the host with one
    `torch.stack(...).tolist()` per device, so checking a whole GPU checkpoint costs one sync.
    """
    import torch

    counts: dict[str, int] = {}
    pending: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            counts[name] = 0
            continue
        attr = str(t.dtype).removeprefix("torch.")
        if attr in _F8_NONFINITE:
            mask, value = _F8_NONFINITE[attr]
            bad = (t.view(torch.uint8) & mask) == value
        else:
            bad = torch.isfinite(t).logical_not_()
        pending.setdefault(t.device, []).append((name, bad.sum()))
        counts[name] = 0
    for items in pending.values():
        values = torch.stack([c for _, c in items]).tolist()
        for (name, _), value in zip(items, values, strict=True):
            counts[name] = int(value)
    return {name: counts[name] for name in tensors}
