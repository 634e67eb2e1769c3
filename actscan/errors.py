"""Errors the user can act on. Each maps to one line on stderr and exit code 2; and the
recognition of resource limits (memory, sizes) that torch raises as plain errors."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator, Mapping


class ActscanError(Exception):
    """Base: a user mistake or a bad file. `str(err)` is the one line the user sees."""

    exit_code = 2


class UsageError(ActscanError):
    """Bad option values or combinations."""


class BadInputError(ActscanError):
    """A missing, corrupt, unsupported or inconsistent file or model."""


class ConfigError(BadInputError):
    """A config file that cannot be parsed or has unknown/invalid fields."""


class ResourceError(ActscanError):
    """A resource limit: memory ran out, or a size is beyond what torch can hold."""


# -- resource limits ------------------------------------------------------------------------
# What torch (and Python) raise when memory or its size limits are exceeded, by a piece of
# the message: recognised by kind, not case by case, so any stage's allocation is covered.
_MEMORY = (
    "out of memory",
    "can't allocate memory",
    "cannot allocate memory",
    "not enough memory",
    "failed to allocate",
)
_SIZE = (
    "negative dimension",
    "overflow when unpacking long long",
    "integer multiplication overflow",
    "numel: integer",
    "size is too large",
    "storage size calculation overflowed",
)
MEMORY, SIZE = "memory", "size"


def resource_kind(err: BaseException) -> str | None:
    """MEMORY when `err` says memory ran out (torch's CPU allocator, CUDA's
    OutOfMemoryError, Python's MemoryError), SIZE when a size is beyond torch's int64
    or negative; None for any other error (a bug, or the model's own)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return MEMORY
    if not isinstance(err, RuntimeError | ValueError | TypeError | OverflowError):
        return None
    text = str(err).lower()
    if any(p in text for p in _MEMORY):
        return MEMORY
    if any(p in text for p in _SIZE):
        return SIZE
    return None


def resource_cause(err: BaseException) -> str:
    """The limit `err` hit, in a few words: "out of memory (tried to allocate 12.0 GB)"."""
    import re

    if resource_kind(err) == SIZE:
        neg = re.search(r"negative dimension (-\d+)", str(err))
        return f"a negative size ({neg.group(1)})" if neg else "a size beyond torch's limits"
    text = str(err)
    size = re.search(r"tried to allocate ([\d.]+ ?[KMGT]i?B)", text, re.IGNORECASE)
    if size:
        return f"out of memory (tried to allocate {size.group(1)})"
    raw = re.search(r"allocate (\d+) bytes", text)
    if raw:
        return f"out of memory (tried to allocate {_bytes(int(raw.group(1)))})"
    return "out of memory"


def _bytes(n: int) -> str:
    """A byte count as people read it: 12.0 GB, 3.2 TB."""
    value, unit = float(n), "bytes"
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if value < 1000 or unit == "PB":
            break
        value /= 1000
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


# The advice of each limit where it is hit: while the model is built, while it runs.
BUILD_ADVICE = {
    MEMORY: "use a smaller config (d_model, n_layers, vocab_size) or a machine with more memory",
    SIZE: "a size in the config is out of range: check d_model, n_layers, n_heads, d_ff, "
    "vocab_size and seq_len",
}
RUN_ADVICE = {
    MEMORY: "lower --batch or --seq-len (or run in --dtype bf16)",
    SIZE: "--batch × --seq-len is beyond what torch can hold: lower them",
}


@contextlib.contextmanager
def resource_limits(stage: str, advice: Mapping[str, str]) -> Iterator[None]:
    """Within: a resource error becomes `ResourceError("<stage>: <cause>: <advice>")`, so
    the user reads which limit was hit and which option lowers it (exit 2)."""
    try:
        yield
    except ActscanError:
        raise
    except Exception as err:
        kind = resource_kind(err)
        if kind is None:
            raise
        raise ResourceError(f"{stage}: {resource_cause(err)}: {advice[kind]}") from err


# -- paths ------------------------------------------------------------------------------
_OS_TEXT = {
    errno.ENAMETOOLONG: "file name too long",
    errno.ELOOP: "a symlink loop (it points back to itself)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.ENOSPC: "no space left on the device",
    errno.EROFS: "a read-only file system",
}


def os_error_text(err: OSError) -> str:
    """What the file system said, in the messages' words: "file name too long"."""
    if err.errno in _OS_TEXT:
        return _OS_TEXT[err.errno]
    return (err.strerror or str(err)).lower() if err.errno is not None else str(err)


def path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot be looked at: a name too long, a symlink loop or a broken
    symlink, no permission, a file where a folder should be. None when it is there (of
    any kind) or simply absent: each caller says what it expected to find."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return "a broken symlink (its target does not exist)" if os.path.islink(path) else None
    except OSError as err:
        return os_error_text(err)
    except ValueError:  # an embedded NUL byte
        return "not a valid path"
    return None
