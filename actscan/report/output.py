"""The one JSON encoder and the one atomic file writer of every report, comparison,
sweep, CI format and plot.

JSON has no NaN or Infinity: the report schema spells non-finite numbers as the strings
"nan", "inf" and "-inf", and `json_safe` is the only place that does it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from actscan.errors import UsageError

__all__ = ["check_writable", "dumps", "json_safe", "write_atomic"]


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by "nan", "inf" or "-inf" (tuples become
    lists); everything else is returned as is."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any, indent: int | None = 2) -> str:
    """Strict JSON text of `obj` (made JSON-safe first; a stray NaN would raise)."""
    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _kind(mode: int) -> str | None:
    """Why an existing path is not an output actscan may replace; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "it is a symbolic link (actscan writes regular files only: name the file itself)"
    if stat.S_ISDIR(mode):
        return "it is a folder"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"it is {kind}, not a regular file (actscan writes regular files only)"


def _refusal(target: Path) -> str | None:
    """Why `target` cannot be written, or None. An existing target is looked at itself
    (lstat: a symlink is never followed), then the folder that would hold it."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        return f"{target.parent} is not a folder"
    except OSError as err:  # name too long, a loop of links, no permission, ...
        return err.strerror or str(err)
    if mode is not None:
        if (why := _kind(mode)) is not None:
            return why
        if not os.access(target, os.W_OK):
            return "the file is read-only"
    parent = target.absolute().parent
    if not parent.is_dir():
        shown = target.parent
        return f"{shown} is not a folder" if parent.exists() else f"folder {shown} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"folder {target.parent} is not writable"
    return None


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse, before any long work, an output path `write_atomic` would not write: only a
    regular file (existing and writable, or new in a writable folder) or "-" (stdout).

    A device, FIFO, socket, symbolic link or folder is refused and never replaced, so a
    mistyped or hostile path (`--json /dev/null` run as root) cannot change what it names.
    Raises UsageError("cannot write PATH: reason").
    """
    if str(path) == "-":
        return
    if (why := _refusal(Path(path))) is not None:
        raise UsageError(f"cannot write {path}: {why}")


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write `data` (text as UTF-8, or bytes) to `path` so readers never see a partial
    file; "-" is stdout.

    Only a regular file is replaced (`check_writable`, checked again here: a path that
    became a symlink, FIFO or device since is refused, not swapped for a file). Writes a
    temporary file in the same folder, fsyncs it and renames it over `path`, keeping the
    mode of a file it replaces (a new file gets the umask's). On failure the temporary
    file is removed and UsageError("cannot write PATH: reason") is raised.
    """
    if str(path) == "-":
        if isinstance(data, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(data)
            sys.stdout.flush()
        return
    check_writable(path)
    target = Path(path)
    tmp: str | None = None
    try:
        try:
            mode = os.lstat(target).st_mode & 0o7777
        except FileNotFoundError:
            mode = _new_file_mode()
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data if isinstance(data, bytes) else data.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())
            if hasattr(os, "fchmod"):  # mkstemp makes 0600; an output is a normal file
                os.fchmod(fh.fileno(), mode)
        os.replace(tmp, target)
        tmp = None
    except (OSError, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise UsageError(f"cannot write {path}: {reason}") from err
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
