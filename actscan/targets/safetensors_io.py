"""Safe reading and writing of safetensors checkpoints.

A checkpoint is untrusted input. The `safetensors` library owns the format: it validates the
header length, JSON, dtypes, shapes, byte ranges and coverage before any tensor exists. This
layer words its refusals as one `BadInputError` line naming the file, and adds only what no
library does: pickles (`.bin`, `.pt`, … or a zip/pickle stream under any name) are refused
with a one-line conversion, since loading one can run code; only regular files are opened (a
FIFO would block the reader); a sharded index must agree with its shards; and dtypes with no
faithful cast to float weights are refused (`supported_dtypes`).
"""

from __future__ import annotations

import contextlib
import functools
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
from actscan.files import INDEX_CAP, loads_json, read_bounded

if TYPE_CHECKING:
    import torch

MAX_HEADER_LEN = 100_000_000
"""The library's cap on the JSON header (quoted in its "header too large" refusal)."""

PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"})

# safetensors dtype -> torch attribute. Deliberately narrower than the library: weights are
# cast to the model's float dtype, and complex, wide unsigned, sub-byte and scale-only formats
# have no faithful cast, so a file holding them is refused rather than silently converted.
_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip

# The library's reasons (after "Error while deserializing header: "), reworded for a user:
# it names neither the file nor the sizes involved. {size}: file bytes, {n}: header length.
_REASONS = (
    ("header too small", "file is truncated: {size} bytes, shorter than the 8-byte header length"),
    ("invalid header length", "header length {n} bytes is larger than the file ({size} bytes): "
     "truncated or not a safetensors file"),
    ("header too large", "header length {n} bytes exceeds the {max}-byte limit (corrupt or not "
     "a safetensors file)"),
    ("invalid UTF-8 in header: ", "header is not valid UTF-8 ({rest})"),
    ("invalid JSON in header: ", "header is not valid JSON for safetensors ({rest})"),
    ("invalid offset for tensor ", "tensor {rest} does not start where the previous one ends "
     "(tensors must be contiguous, without overlap or gap)"),
    ("incomplete metadata, file not fully covered", "the tensors do not cover the {data}-byte "
     "data section exactly: the file is truncated, or has unused bytes at the end"),
    ("invalid shape, data type, or offset for tensor", "a tensor's shape × dtype size differs "
     "from its byte range"),
)  # fmt: skip
_RUST_WORDS = (
    ("struct HashMetadata", "a JSON object"),
    ("struct TensorInfo", "a tensor entry {dtype, shape, data_offsets}"),
    ("expected usize", "expected an integer ≥ 0"),
)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header declares it."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SafetensorsHeader:
    """A header the library accepted, with only supported dtypes."""

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


def first_line(err: BaseException) -> str:
    """One line from an exception (torch errors carry C++ stack frames after line one).
    A first line that ends in a colon announces the next (transformers' validation errors:
    "Validation error for field 'x':" then the reason), so the two are joined."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    text = lines[0]
    for more in lines[1:3]:
        if not text.endswith(":"):
            break
        text = f"{text} {more}"
    return f"{type(err).__name__}: {text}"


def _bad(path: str | os.PathLike[str], message: str, kind: str = "checkpoint") -> BadInputError:
    return BadInputError(f"bad {kind} {_show(path)}: {message}")


@functools.cache
def supported_dtypes() -> dict[str, Any]:
    """safetensors dtype name -> torch dtype, for the dtypes actscan loads."""
    import torch

    return {name: getattr(torch, attr) for name, attr in _DTYPES.items() if hasattr(torch, attr)}


def _regular_file(path: Path, kind: str = "checkpoint") -> tuple[int, bytes]:
    """(size, first 9 bytes). Only a regular file is opened: a FIFO would block the reader."""
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            suffix = ".safetensors" if kind == "checkpoint" else ".json"
            raise _bad(path, f"is a directory, expected a {suffix} file", kind)
        if not stat.S_ISREG(st.st_mode):
            raise _bad(path, "is not a regular file", kind)
        with path.open("rb") as f:
            return st.st_size, f.read(9)
    except FileNotFoundError:
        raise _bad(path, "file not found", kind) from None
    except OSError as err:
        raise _bad(path, f"cannot open: {err.strerror or err}", kind) from None


def _looks_like_pickle(head: bytes) -> bool:
    """True for a zip (torch.save since 1.6) or a pickle protocol 2-5 stream.

    A safetensors header length can start with the same bytes (N = 640 is `80 02 00 …`), but
    then byte 8 is the header's `{`; zip and pickle streams never have it there.
    """
    pickled = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    return (head.startswith(b"PK\x03\x04") or pickled) and head[8:9] != b"{"


def pickle_message(path: str | os.PathLike[str]) -> str:
    src = os.fspath(path)
    return (
        f"refusing to load pickle checkpoint {_show(path)}: pickle can execute code. "
        'Convert it once in a trusted environment: python -c "import torch; '
        "from safetensors.torch import save_file; "
        f"save_file(torch.load({src!r}, weights_only=True), 'model.safetensors')\""
    )


def _reason(err: BaseException, size: int, n: int) -> str:
    """The library's refusal as one readable clause (see `_REASONS`)."""
    text = str(err).strip().removeprefix("Error while deserializing header: ")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)  # names with "\n"
    for old, new in _RUST_WORDS:
        text = text.replace(old, new)
    text = re.sub(
        r"unknown variant `([^`]*)`, expected one of .*? at", r"unknown dtype `\1` at", text
    )
    for prefix, message in _REASONS:
        if text.startswith(prefix):
            rest = text[len(prefix) :].replace("`", "'")
            return message.format(size=size, n=n, max=MAX_HEADER_LEN, data=size - 8 - n, rest=rest)
    return f"safetensors could not read it: {first_line(err)}"


# --------------------------------------------------------------------------- read


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """The header of a safetensors file, as the library parses and validates it.

    Only the header is read (the library maps the file; no tensor is made). Pickles, non-files
    and every malformed layout become one `BadInputError` line naming the file.
    """
    from safetensors import safe_open

    p = Path(path)
    size, head = _regular_file(p)
    if _looks_like_pickle(head):
        raise BadInputError(pickle_message(path))
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else 0
    try:
        with safe_open(os.fspath(p), framework="pt") as f:
            metadata = f.metadata() or {}
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118
            tensors = {
                k: TensorEntry(v.get_dtype(), tuple(v.get_shape())) for k, v in slices.items()
            }
    except Exception as err:  # SafetensorError, or OSError from the map
        raise _bad(p, _reason(err, size, n)) from None
    for name, entry in tensors.items():
        if entry.dtype not in supported_dtypes():
            supported = ", ".join(supported_dtypes())
            raise _bad(
                p, f"tensor {name!r} has unsupported dtype {entry.dtype!r} (supported: {supported})"
            )
    return SafetensorsHeader(p, n, dict(metadata), tensors, size - 8 - n)


def load_tensors(
    path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load tensors (memory-mapped, copy-on-write: writing into one never changes the file).

    `read_header` runs first; anything that still fails inside safetensors or torch becomes a
    `BadInputError` naming the file.
    """
    import torch
    from safetensors import safe_open

    header = read_header(path)
    wanted = list(header.tensors) if names is None else list(dict.fromkeys(names))
    missing = [repr(n) for n in wanted if n not in header.tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise _bad(path, f"no tensor named {shown} (the file has {len(header.tensors)} tensors)")
    try:
        target = str(torch.device(device))
    except (RuntimeError, TypeError, ValueError) as err:
        raise UsageError(f"invalid device {device!r}: {first_line(err)}") from None
    try:
        with safe_open(os.fspath(header.path), framework="pt", device=target) as f:
            return {name: f.get_tensor(name) for name in wanted}
    except Exception as err:
        raise _bad(header.path, f"safetensors could not read it: {first_line(err)}") from None


# --------------------------------------------------------------------------- sharded


def load_sharded(
    index_json_path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint from its `model.safetensors.index.json`.

    The index's "weight_map" maps tensor names to shard files in the same folder. No library
    cross-checks it: each shard must hold exactly the tensors the index assigns to it, since a
    tensor found elsewhere, or a stray tensor not in the index, means index and shards are out
    of sync, and loading would silently pick one (`sharded_entries` checks that).
    """
    index_path = Path(index_json_path)
    weight_map = _checked_shards(index_path)[0]
    folder = index_path.parent
    wanted = set(weight_map) if names is None else set(names)
    unknown = sorted(wanted - set(weight_map))
    if unknown:
        raise _bad(index_path, f"no tensor named {unknown[0]!r} in the index", "index")
    by_shard: dict[str, list[str]] = {}
    for tensor_name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor_name)
    out: dict[str, torch.Tensor] = {}
    for shard, listed in by_shard.items():
        pick = [n for n in listed if n in wanted]
        if pick:
            out.update(load_tensors(folder / shard, pick, device))
    return {name: out[name] for name in weight_map if name in out}


def sharded_entries(index_json_path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Every tensor's dtype and shape in a sharded checkpoint, read from the headers only
    (index and shards cross-checked as `load_sharded` does): what a config is checked
    against before anything is built."""
    weight_map, headers = _checked_shards(Path(index_json_path))
    return {name: headers[shard].tensors[name] for name, shard in weight_map.items()}


def _checked_shards(index_path: Path) -> tuple[dict[str, str], dict[str, SafetensorsHeader]]:
    """(weight map, each shard's header): each shard holds exactly what the index says."""
    weight_map = read_index(index_path)
    folder = index_path.parent
    bad = functools.partial(_bad, index_path, kind="index")
    by_shard: dict[str, list[str]] = {}
    for tensor_name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor_name)
    for shard in by_shard:
        if not (folder / shard).exists():
            raise bad(f"shard {shard!r} listed in the index does not exist in {_show(folder)}")
    headers: dict[str, SafetensorsHeader] = {}
    held: dict[str, set[str]] = {}
    for shard, listed in by_shard.items():
        headers[shard] = read_header(folder / shard)
        held[shard] = set(headers[shard].tensors)
        for tensor_name in listed:
            if tensor_name not in held[shard]:
                where = next((f"; it is in {s}" for s, h in held.items() if tensor_name in h), "")
                raise bad(
                    f"the index puts tensor {tensor_name!r} in shard {shard}, "
                    f"but that shard does not contain it{where}"
                )
        for tensor_name in sorted(held[shard]):
            mapped = weight_map.get(tensor_name)
            if mapped != shard:
                said = f"puts it in shard {mapped}" if mapped is not None else "does not list it"
                raise bad(f"shard {shard} contains tensor {tensor_name!r} but the index {said}")
    return weight_map, headers


def read_index(index_path: Path) -> dict[str, str]:
    """The weight map of a shard index (a regular file under INDEX_CAP, actscan/files.py),
    checked: names map to relative shard paths inside the index's folder."""
    bad = functools.partial(_bad, index_path, kind="index")
    label = f"bad index {_show(index_path)}"
    raw = read_bounded(index_path, cap=INDEX_CAP, label=label, what="shard index")
    obj = loads_json(raw, label)
    if not isinstance(obj, dict):
        raise bad(f"expected a JSON object, got {type(obj).__name__}")
    weight_map = obj.get("weight_map")
    if weight_map is None:
        raise bad('has no "weight_map"')
    if not isinstance(weight_map, dict) or not weight_map:
        raise bad(f'"weight_map" {"is empty" if weight_map == {} else "must be an object"}')
    for tensor_name, shard in weight_map.items():
        if not isinstance(shard, str):
            kind = type(shard).__name__
            raise bad(
                f'"weight_map" value for {tensor_name!r} must be a shard file name, got {kind}'
            )
        # Shards stay inside the index's folder (symlinks are fine: the HF cache uses them).
        if not shard or "\x00" in shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise bad(
                f"shard name {shard!r} for tensor {tensor_name!r} must be a relative path "
                "inside the index's folder"
            )
    return dict(weight_map)


# --------------------------------------------------------------------------- pickle


def refuse_pickle(path: str | os.PathLike[str]) -> None:
    """Raise `BadInputError` for a pickle checkpoint (by suffix or by zip/pickle magic).

    Loading a pickle runs arbitrary code, so actscan never does it implicitly; the message
    gives the one-line conversion to safetensors. Returns None for anything else (including
    a missing file: the loader that follows reports that).
    """
    p = Path(path)
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise BadInputError(pickle_message(path))
    try:
        _size, head = _regular_file(p)
    except BadInputError:
        return
    if _looks_like_pickle(head):
        raise BadInputError(pickle_message(path))


def load_pickle_weights_only(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Explicit opt-in: load a pickle checkpoint with `torch.load(weights_only=True)`.

    Refused on torch < 2.6, where `weights_only=True` could still be bypassed to run code
    (CVE-2025-32434). Returns a flat name -> tensor dict; a Lightning-style checkpoint's
    "state_dict" is unwrapped. Anything else is refused rather than guessed at.
    """
    import torch
    from torch.torch_version import TorchVersion

    p = Path(path)
    if TorchVersion(str(torch.__version__)) < "2.6":
        raise BadInputError(
            f"refusing to load pickle checkpoint {_show(p)}: torch {torch.__version__} is older "
            "than 2.6, where weights_only=True is not safe (CVE-2025-32434); upgrade torch or "
            "convert the file to safetensors in a trusted environment"
        )
    _regular_file(p)
    try:
        obj = torch.load(os.fspath(p), weights_only=True, map_location="cpu")
    except Exception as err:
        raise _bad(
            p, f"torch.load(weights_only=True) refused or failed: {first_line(err)}"
        ) from err
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not obj:
        raise _bad(p, f"expected a dict of name -> tensor, got {type(obj).__name__}")
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            kind = type(value).__name__
            raise _bad(p, f"expected a dict of name -> tensor, but entry {key!r} is {kind}")
    return dict(obj)


# --------------------------------------------------------------------------- save


def save_tensors(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file atomically: `save_file` writes a temporary name in the target
    folder, which is fsynced and renamed over `path`, so an error never leaves a half-written
    checkpoint nor clobbers an existing one."""
    from safetensors.torch import save_file

    p = Path(path)
    folder = p.parent if str(p.parent) else Path(".")
    tmp = folder / f".{p.name}.{secrets.token_hex(6)}.tmp"
    prepared = _prepare_for_save(p, tensors)
    try:
        save_file(prepared, os.fspath(tmp), metadata=None if metadata is None else dict(metadata))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # the Rust writer creates 0600; follow the umask
        _fsync(tmp)
        os.replace(tmp, p)
    except OSError as err:
        raise _bad(p, f"cannot write to {_show(folder)}: {err.strerror or err}", "output") from None
    except Exception as err:
        raise _bad(p, f"safetensors could not write it: {first_line(err)}", "output") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    with contextlib.suppress(OSError):  # persist the rename (not every platform can)
        _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare_for_save(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fresh contiguous CPU copy of each tensor: tied weights and views then share no
    storage, which `save_file` would refuse."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name == "__metadata__":  # the header's reserved key: the file would not read back
            raise _bad(path, f"invalid tensor name {name!r}", "output")
        # Refused on write as on read (see _DTYPES), so actscan never writes what it cannot load.
        if isinstance(t, torch.Tensor) and t.dtype not in supported_dtypes().values():
            raise _bad(path, f"tensor {name!r} has unsupported dtype {t.dtype}", "output")
        ok = isinstance(t, torch.Tensor) and not t.is_meta  # else save_file says what is wrong
        out[name] = (
            t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True) if ok else t
        )
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
        counts[name] = 0
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        attr = str(t.dtype).removeprefix("torch.")
        if attr in _F8_NONFINITE:
            mask, value = _F8_NONFINITE[attr]
            bad = (t.view(torch.uint8) & mask) == value
        else:
            bad = torch.isfinite(t).logical_not_()
        pending.setdefault(t.device, []).append((name, bad.sum()))
    for items in pending.values():
        values = torch.stack([c for _, c in items]).tolist()
        for (name, _), value in zip(items, values, strict=True):
            counts[name] = int(value)
    return counts
