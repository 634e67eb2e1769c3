"""Bounded reads of the files a user points actscan at: configs, shard indexes, `--input`.

Every text or JSON file actscan parses is read here, and only here, so that no file can
make a run wait or fill memory before a parser has looked at it:

* only a regular file is opened: a FIFO would block the reader forever, and a device
  (`/dev/zero`, or a `.yaml` symlink to it) never ends. The kind is checked with `stat`
  before opening, and again on the open descriptor (opened non-blocking), so a path
  swapped between the two cannot slip through;
* at most `cap` bytes are read: a file larger than that is refused, naming the cap,
  before it is parsed. The caps are far above any real file of the kind (a Hugging Face
  `config.json` is a few KiB, a shard index of a 400B-parameter model under 1 MiB);
* JSON nested past the parser's recursion limit is a refusal, not a RecursionError.

Every refusal is one line naming the path and the reason (the caller's error class,
exit 2). No torch here: the CLI reads configs before it imports anything heavy.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from actscan.errors import ActscanError, BadInputError

__all__ = [
    "CONFIG_CAP",
    "INDEX_CAP",
    "INPUT_CAP",
    "loads_json",
    "mib",
    "read_bounded",
    "read_text_bounded",
    "regular_file",
]

MiB = 1 << 20
CONFIG_CAP = 4 * MiB  # actscan and Hugging Face configs, project files
INDEX_CAP = 64 * MiB  # model.safetensors.index.json
INPUT_CAP = 256 * MiB  # --input token ids or text

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def mib(n: int) -> str:
    """A byte count as the messages write it: 4 MiB, 0.5 MiB."""
    return f"{n / MiB:g} MiB"


def _kind(mode: int) -> str | None:
    """What a non-regular file is, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bounded(
    path: str | os.PathLike[str],
    *,
    cap: int,
    label: str | None = None,
    what: str = "file",
    error: type[ActscanError] = BadInputError,
) -> bytes:
    """The bytes of the regular file `path`, at most `cap` of them.

    `label` starts each message (default: the path); `what` names the kind of file in
    the size message ("config file", "--input file"). Everything else — missing, a
    directory, a FIFO, a device, a socket, too large, unreadable — is `error(one line)`.
    """
    shown = label if label is not None else _show(path)
    st = regular_file(path, label=shown, error=error)
    _refuse_size(st.st_size, cap, shown, what, error)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise error(f"{shown}: cannot read: {_reason(err)}") from None
    try:
        st = os.fstat(fd)  # the file that was opened, whatever the path names now
        _refuse_kind(st, shown, error)
        _refuse_size(st.st_size, cap, shown, what, error)
        chunks: list[bytes] = []
        total = 0
        while total <= cap:  # a file growing while read still stops at cap + 1 bytes
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as err:
        raise error(f"{shown}: cannot read: {_reason(err)}") from None
    finally:
        os.close(fd)
    _refuse_size(total, cap, shown, what, error, read=True)
    return b"".join(chunks)


def regular_file(
    path: str | os.PathLike[str],
    *,
    label: str | None = None,
    error: type[ActscanError] = BadInputError,
) -> os.stat_result:
    """`stat` of `path` (after symlinks) if it is a regular file; else `error(one line)`
    naming what it is. Nothing is opened."""
    shown = label if label is not None else _show(path)
    try:
        st = os.stat(path)  # follows symlinks: a link to /dev/zero is a character device
    except FileNotFoundError:
        raise error(f"{shown}: file not found") from None
    except (OSError, ValueError) as err:  # ENAMETOOLONG, ELOOP, EACCES, a NUL in the name
        raise error(f"{shown}: cannot read: {_reason(err)}") from None
    _refuse_kind(st, shown, error)
    return st


def read_text_bounded(
    path: str | os.PathLike[str],
    *,
    cap: int,
    label: str | None = None,
    what: str = "file",
    error: type[ActscanError] = BadInputError,
) -> str:
    """`read_bounded` decoded as UTF-8 (a byte-order mark is dropped)."""
    data = read_bounded(path, cap=cap, label=label, what=what, error=error)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        shown = label if label is not None else _show(path)
        raise error(f"{shown}: not UTF-8 text (byte {err.start})") from None


def loads_json(text: str | bytes, label: str, error: type[ActscanError] = BadInputError) -> Any:
    """JSON text → Python data; malformed or too deeply nested is `error(one line)`."""
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{label}: JSON nested too deeply") from None
    except (ValueError, TypeError) as err:  # JSONDecodeError, huge ints, bad UTF-8
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise error(f"{label}: not valid JSON ({first})") from None


def _refuse_kind(st: os.stat_result, shown: str, error: type[ActscanError]) -> None:
    kind = _kind(st.st_mode)
    if kind is not None:
        raise error(f"{shown}: is {kind}, not a regular file")


def _refuse_size(
    size: int, cap: int, shown: str, what: str, error: type[ActscanError], *, read: bool = False
) -> None:
    if size > cap:
        held = "more" if read else f"{size} bytes is more"  # a read stops at cap + 1 bytes
        raise error(f"{shown}: {held} than the {mib(cap)} actscan reads from a {what}")


def _reason(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err) or type(err).__name__


def _show(path: str | os.PathLike[str]) -> str:
    """The path as the user gave it, escaped if it would break the one-line message."""
    text = os.fspath(path)
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    return text if text.isprintable() else repr(text)
