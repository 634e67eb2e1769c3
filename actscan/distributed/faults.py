"""Which rank failed first, and the one line that says so.

A distributed job fails through one rank (its own error, a signal, an exit, a hang) and
the others fail after it: their collectives lose a peer ("Connection reset by peer",
a timeout). Those later errors are consequences and never the line the user reads. This
module holds what the ranks (`runtime`) and the `--nproc` launcher (`launch`) share to
tell the first failure from its consequences and to say it in one line that names the
rank and its host:

* `peer_error(err)`: whether an error came from a collective that lost a peer;
* the lines: `rank_line` (a rank's own error), `signal_line`, `exit_line`, `hang_line`,
  `lost_line` (a rank that vanished without a word);
* `write_note(...)`: what a failing rank leaves for its launcher in torchrun's error
  file (`TORCHELASTIC_ERROR_FILE`), in torch's own format, so torchrun's summary shows
  actscan's line, with actscan's fields beside (whether the line was printed, what kind
  of failure it was);
* `launcher_verdict(failures)`: for the failures torchrun's agent observed (in the
  order it observed them), the one line still to print (None: a rank printed it) and
  the exit code.

Exit codes: a rank's own error keeps its code (2 for a user mistake or a resource limit,
3 for a bug in actscan); a rank killed by a signal, one that exited with a code of its
own, one that hung or lost its peers is exit 2 (the environment failed, not actscan).
Importing this module imports neither torch nor the rest of actscan.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Mapping
from typing import Any

ERROR_PREFIX = "actscan: error: "
EXIT_ENV = 2  # a rank died, exited, hung or lost its peers: resource/environment failure
OWN_CODES = (1, 2, 3, 130)  # exit codes actscan gives itself (findings, usage, bug, Ctrl-C)
NPROC_ENV = "ACTSCAN_NPROC_LAUNCHER"  # set by `--nproc`: the launcher names silent deaths

# Words of the errors a collective raises when a peer is gone or silent: gloo's name its
# own source file, nccl's its name; torch's DistError subclasses are recognised by type.
_PEER_WORDS = ("/gloo/", "processgroupgloo", "processgroupnccl", "nccl error")
_TIMEOUT_WORDS = ("timed out", "timeout")


def host() -> str:
    return socket.gethostname()


def _chain(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def peer_error(err: BaseException | None) -> bool:
    """Whether `err` is a collective's failure on losing a peer (a consequence of another
    rank's failure), not this rank's own."""
    if err is None:
        return False
    from torch.distributed import DistError

    for e in _chain(err):
        if isinstance(e, DistError):
            return True
        if isinstance(e, RuntimeError) and any(w in str(e).lower() for w in _PEER_WORDS):
            return True
    return False


def timed_out(err: BaseException | None) -> bool:
    return err is not None and any(w in str(e).lower() for e in _chain(err) for w in _TIMEOUT_WORDS)


def who(rank: int, at: str | None) -> str:
    return f"rank {rank} (host {at})" if at else f"rank {rank}"


def rank_line(rank: int, at: str | None, line: str) -> str:
    """A rank's own error line, prefixed with the rank and its host."""
    text = line.removeprefix(ERROR_PREFIX).strip() or "failed"
    return f"{ERROR_PREFIX}{who(rank, at)}: {text}"


def signal_line(rank: int, at: str | None, signum: int) -> str:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = "an unknown signal"
    return f"{ERROR_PREFIX}{who(rank, at)} was killed by signal {signum} ({name})"


def exit_line(rank: int, at: str | None, code: int, why: str = "without reporting an error") -> str:
    return f"{ERROR_PREFIX}{who(rank, at)} exited with code {code} {why}"


def hang_line(ranks: Mapping[int, str | None], seconds: float) -> str:
    names = ", ".join(who(r, h) for r, h in list(ranks.items())[:4])
    more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    verb = "did" if len(ranks) == 1 else "all did"
    return (
        f"{ERROR_PREFIX}{names}{more} {verb} not respond for {seconds:g} s "
        "(--dist-timeout): hung, or stuck in a different collective"
    )


def lost_line(ranks: Mapping[int, str | None]) -> str:
    names = ", ".join(who(r, h) for r, h in list(ranks.items())[:4])
    more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    return (
        f"{ERROR_PREFIX}{names}{more} stopped without reporting an error "
        "(its process ended or its connection broke; the launcher's report has its exit status)"
    )


# -- the error file: what a failing rank leaves for its launcher ---------------------------
def write_note(
    rank: int, code: int, line: str, *, kind: str, printed: bool, root: int | None = None
) -> None:
    """Leave this rank's failure in torchrun's error file (a no-op without one).

    `kind`: "own" (this rank's own error), "verdict" (this rank named the ranks that
    hung or vanished), "lost" (this rank lost a peer and leaves naming it to the
    launcher), "follow" (another rank failed first: `root`), "done" (this rank finished
    its command with `code` 0 or 1: a launcher that stops it now stops a finished rank).
    torch's format comes first
    (torchrun's summary prints `message`); actscan's fields are beside it.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    shown = {
        "follow": f"stopped after rank {root} failed (its line is above)",
        "done": f"finished with exit {code}",
    }.get(kind, line)
    data = {
        "message": {
            "message": shown,
            "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))},
        },
        "actscan": {
            "rank": rank,
            "code": code,
            "line": line,
            "kind": kind,
            "printed": printed,
            "root": root,
        },
    }
    tmp = f"{path}.actscan-{os.getpid()}"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)  # whole or absent: torchrun's agent parses it


def _note(failure: Any) -> dict[str, Any] | None:
    data = getattr(failure, "error_file_data", None)
    note = data.get("actscan") if isinstance(data, dict) else None
    return note if isinstance(note, dict) else None


def launcher_verdict(failures: Mapping[int, Any]) -> tuple[str | None, int]:
    """The line still to print (None: a rank printed it, or nothing is known) and the
    job's exit code, from torchrun's failures (rank → ProcessFailure, in the order its
    agent observed them; the agent stops the other ranks with SIGTERM after the first)."""
    at = host()
    notes = {r: _note(f) for r, f in failures.items()}
    for note in notes.values():
        if note and note.get("printed") and note.get("kind") != "done":
            return None, int(note.get("code") or EXIT_ENV)
    kinds = {r: (n or {}).get("kind") for r, n in notes.items()}
    done = [int(n.get("code") or 0) for r, n in notes.items() if n and kinds[r] == "done"]
    if done and all(kinds[r] == "done" or f.exitcode == 1 for r, f in failures.items()):
        return None, max(done)  # every rank had finished; the agent stopped the last ones
    silent = {r: f for r, f in failures.items() if notes[r] is None}
    if (
        silent and all(f.exitcode in OWN_CODES for f in silent.values()) and not any(notes.values())
    ):  # every rank exited with actscan's own code before its session began: rank 0 said why
        first = next(iter(silent.values()))
        return None, int(first.exitcode)
    died = {r: f for r, f in silent.items() if f.exitcode not in OWN_CODES}
    if died:
        picked = [r for r, f in died.items() if f.exitcode != -signal.SIGTERM] or list(died)
        rank = picked[0]
        code = int(died[rank].exitcode)
        if code < 0:
            return signal_line(rank, at, -code), EXIT_ENV
        return exit_line(rank, at, code), EXIT_ENV
    for kind in ("own", "verdict", "lost", "follow"):
        for note in notes.values():
            if note and note.get("kind") == kind and note.get("line"):
                return str(note["line"]), int(note.get("code") or EXIT_ENV)
    first_rank, first = next(iter(failures.items()))
    code = int(first.exitcode)
    if code in OWN_CODES:
        return None, code
    return exit_line(first_rank, at, code), EXIT_ENV
