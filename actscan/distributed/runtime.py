"""The process group of a distributed run, and how its ranks fail together.

A run is distributed when it was started by `torchrun` (or `actscan profile --nproc N`,
which starts torchrun): the environment holds RANK, WORLD_SIZE and the rendezvous
address. `session()` joins the group (nccl on CUDA, gloo on CPU; every collective waits
at most `--dist-timeout` seconds), makes the run the `current()` one for `scan()` and the
sharded builder, and guarantees that every rank ends, with the same exit code, within a
bounded time, and that the one line the user reads names the rank that failed first:

* a rank whose command fails on its own error publishes it ("code|rank|line") in the
  rendezvous store; the first to publish wins (`compare_set`), so when every rank fails
  at once one line is kept and the others follow it at once;
* every rank runs a watchdog thread that polls that key: on seeing it, rank 0 prints
  the line, every rank acknowledges it and leaves through `os._exit`, whatever
  collective its main thread is blocked in, a moment after the failing rank (so that a
  launcher observes that one first);
* a rank whose collective failed because a peer is gone or silent (a connection reset,
  the collective timeout) never reports that error: it marks itself stuck, waits a
  moment for a rank with an error of its own, then names the ranks that neither failed
  nor got stuck: they "did not respond for T s" (a hang) or "stopped without reporting
  an error" (a process that vanished; under `--nproc` the launcher names its signal or
  exit code instead: `launch.py`, `faults.py`);
* a failing rank leaves a note in torchrun's error file (`faults.write_note`): torchrun's
  summary shows actscan's line, and `--nproc`'s launcher knows whether it was printed.

A rank that ends well (exit 0, or 1 for findings) waits for the others before it leaves:
launchers take exit 1 for a failure and would stop rank 0 while it writes the reports.

Ranks other than 0 print nothing: their stdout and stderr are captured in memory. The
one line the CLI prints for an error ("actscan: error: …") is held back on every rank
(`_HoldErrors`) until the rank knows whether it failed first.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO, cast

import torch

from actscan.distributed import faults
from actscan.errors import UsageError
from actscan.measure.inputs import Batch, InputSource

_ERROR_KEY = "actscan/error"  # "code|rank|line": the first failure (compare_set)
_ACK_KEY = "actscan/ack"  # how many ranks saw it
_PRINTED_KEY = "actscan/printed"  # rank 0 printed the line
_DONE_KEY = "actscan/done"  # how many ranks ended their command well (0 or 1)
_POLL_S = 0.1
_GRACE_S = 5.0  # how long a failing rank waits for the others to acknowledge
_FOLLOW_S = 0.5  # a rank that follows another's failure leaves this long after it
_CENSUS_S = 2.0  # a rank that lost a peer waits this long for the others to say why
DEFAULT_TIMEOUT_S = 120.0

_CURRENT: ContextVar[DistRun | None] = ContextVar("actscan_dist_run", default=None)


@dataclass(frozen=True)
class DistRun:
    """This rank's place in the run: what scan(), the builder and the merge read."""

    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo" | "nccl"
    device: torch.device  # where this rank's shard and activations live

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> DistRun | None:
    """The distributed run this process takes part in, or None (a plain run)."""
    return _CURRENT.get()


@contextlib.contextmanager
def active(run: DistRun | None) -> Iterator[DistRun | None]:
    """Make `run` the current one (tests and `session()` use it)."""
    token = _CURRENT.set(run)
    try:
        yield run
    finally:
        _CURRENT.reset(token)


def launched() -> bool:
    """Whether this process is a rank started by torchrun (or an equivalent launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def pick_backend(device: str | None) -> tuple[str, torch.device]:
    """nccl on CUDA, gloo on CPU; `device` is --device (None or "auto": CUDA if present)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = device or "auto"
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    if want != "cpu":
        raise UsageError(f"distributed runs support --device cpu or cuda, got {want!r}")
    return "gloo", torch.device("cpu")


class _HoldErrors:
    """A rank's stderr while its command runs: everything passes through to `target`
    except the CLI's one error line ("actscan: error: …"), held for `Session.finish`,
    which prints it only if this rank failed first."""

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self.held: list[str] = []
        self._pending = ""

    def write(self, text: str) -> int:
        data, self._pending = self._pending + text, ""
        out = []
        for line in data.splitlines(keepends=True):
            if line.startswith(faults.ERROR_PREFIX) and line.endswith("\n"):
                self.held.append(line.rstrip("\n"))
            elif not line.endswith("\n") and (
                line.startswith(faults.ERROR_PREFIX) or faults.ERROR_PREFIX.startswith(line)
            ):
                self._pending = line  # maybe an error line written in pieces
            else:
                out.append(line)
        if out:
            self.target.write("".join(out))
        return len(text)

    def release(self) -> None:
        """Pass on what was held (a run that ended well holds nothing, normally)."""
        lines, self.held = self.held, []
        if lines or self._pending:
            self.target.write("".join(f"{ln}\n" for ln in lines) + self._pending)
        self._pending = ""

    def flush(self) -> None:
        self.target.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding…: the target's
        return getattr(self.target, name)


class _Watchdog(threading.Thread):
    """Leaves the process when another rank has published a failure (see the module doc)."""

    def __init__(self, session: Session) -> None:
        super().__init__(name="actscan-dist-watchdog", daemon=True)
        self.session = session
        self.stop = threading.Event()

    def run(self) -> None:
        s = self.session
        while not self.stop.wait(_POLL_S):
            try:
                if not s.store.check([_ERROR_KEY]):
                    continue
                published = s.store.get(_ERROR_KEY).decode()
            except Exception:  # the store is gone: the job is ending anyway
                return
            with s.lock:
                if s.finishing:
                    return  # this rank is failing or done on its own: it reports itself
                s.finishing = True
            s.follow(published)


def _parse(published: str) -> tuple[int, int, str]:
    code_s, _, rest = published.partition("|")
    rank_s, _, line = rest.partition("|")
    return int(code_s or faults.EXIT_ENV), int(rank_s or 0), line


def _first_line(err: BaseException) -> str:
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class Session:
    """One rank's membership of the process group; see `session()`."""

    def __init__(self, run: DistRun, store: Any, timeout_s: float) -> None:
        self.run = run
        self.store = store
        self.timeout_s = timeout_s
        self.host = faults.host()
        self.lock = threading.Lock()
        self.finishing = False
        self.error: BaseException | None = None  # what the command raised, if anything
        self.real_stdout, self.real_stderr = sys.stdout, sys.stderr
        self.captured = io.StringIO()
        self.stderr = _HoldErrors(self.real_stderr if run.is_main else self.captured)
        self.watchdog = _Watchdog(self)

    def noting(self, body: Callable[[], int]) -> Callable[[], int]:
        """`body`, remembering what it raised (the CLI's error wrapper turns it into a line)."""
        import typer

        def noted() -> int:
            try:
                return body()
            except typer.Exit:
                raise
            except BaseException as err:
                self.error = err
                raise

        return noted

    def finish(self, code: int, line: str | None = None) -> int:
        """End this rank's part with `code`; a failure (≥ 2) ends every rank with it.
        `line`: the failure's line when the CLI printed none (an exit from the model)."""
        if code in (0, 1):
            faults.write_note(self.run.rank, code, "", kind="done", printed=True)
            self._await_all()
        with self.lock:
            if self.finishing:  # the watchdog is already taking the process down
                time.sleep(_GRACE_S + _FOLLOW_S + 1.0)
            self.finishing = True
        self.watchdog.stop.set()
        if code in (0, 1):
            self.stderr.release()
            return code
        if faults.peer_error(self.error):
            self._lost_peer()
        held = line or (self.stderr.held[-1] if self.stderr.held else f"failed (exit {code})")
        mine = line is not None or code == 130  # a line that names the rank, or Ctrl-C's
        own = held if mine else faults.rank_line(self.run.rank, self.host, held)
        self._fail(code, own, kind="own")

    def _await_all(self) -> None:
        """Wait for every rank to be done (rank 0 writes the reports last): a launcher
        takes a rank's exit 1 (findings) for a failure and would stop the ones still at
        work. The watchdog still runs: a failure meanwhile ends this rank with it."""
        with contextlib.suppress(Exception):
            self.store.add(_DONE_KEY, 1)
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                if self.store.add(_DONE_KEY, 0) >= self.run.world_size:
                    return
                time.sleep(_POLL_S)

    # -- the failure protocol (module doc) ------------------------------------------------
    def _say(self, line: str) -> None:
        with contextlib.suppress(Exception):
            self.real_stderr.write(line + "\n")
            self.real_stderr.flush()

    def _exit(self, code: int) -> NoReturn:
        with contextlib.suppress(Exception):
            self.real_stderr.flush()
            self.real_stdout.flush()
        os._exit(code)

    def follow(self, published: str) -> NoReturn:
        """Another rank failed first: rank 0 prints its line; acknowledge it and leave,
        a moment after it."""
        code, root, line = _parse(published)
        printed = self.run.is_main and bool(line)
        if printed:
            self._say(line)
            with contextlib.suppress(Exception):
                self.store.set(_PRINTED_KEY, "1")
        faults.write_note(self.run.rank, code, line, kind="follow", printed=printed, root=root)
        with contextlib.suppress(Exception):
            self.store.add(_ACK_KEY, 1)
        time.sleep(_FOLLOW_S)
        self._exit(code)

    def _fail(self, code: int, line: str, *, kind: str, expect: int | None = None) -> NoReturn:
        """Publish this rank's failure; if another was first, follow it instead."""
        payload = f"{code}|{self.run.rank}|{line}"
        try:
            now = self.store.compare_set(_ERROR_KEY, "", payload).decode()
        except Exception:  # no store: say it here
            now = payload
        if now != payload:
            self.follow(now)
        if self.run.is_main:
            faults.write_note(self.run.rank, code, line, kind=kind, printed=True)
            self._say(line)
        want = self.run.world_size - 1 if expect is None else expect
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline:  # the others leave after us: no rank hangs
            with contextlib.suppress(Exception):
                if self.store.add(_ACK_KEY, 0) >= want:
                    break
            time.sleep(_POLL_S)
        if not self.run.is_main:
            try:
                printed = bool(self.store.check([_PRINTED_KEY]))
            except Exception:
                printed = False
            if not printed:  # rank 0 is gone or silent: say it here
                self._say(line)
            faults.write_note(self.run.rank, code, line, kind=kind, printed=True)
        self._exit(code)

    def _lost_peer(self) -> NoReturn:
        """This rank's collective failed because a peer is gone or silent: name the ranks
        that neither failed on their own nor got stuck like this one (module doc)."""
        err, r = self.error, self.run.rank
        with contextlib.suppress(Exception):
            self.store.set(f"actscan/stuck/{r}", "1")
        hang = faults.timed_out(err)
        if os.environ.get(faults.NPROC_ENV) and not hang:  # the launcher saw it die
            faults.write_note(r, faults.EXIT_ENV, "", kind="lost", printed=False)
            self._exit(faults.EXIT_ENV)
        peers = {q: self._where(q) for q in range(self.run.world_size) if q != r}
        gone = {q: at for q, (at, pid) in peers.items() if at == self.host and _gone(pid)}
        if gone and not hang:  # a rank of this host whose process ended: said at once
            alive = self.run.world_size - 1 - len(gone)
            self._fail(faults.EXIT_ENV, faults.lost_line(gone), kind="verdict", expect=alive)
        deadline = time.monotonic() + _CENSUS_S
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.store.check([_ERROR_KEY]):
                    self.follow(self.store.get(_ERROR_KEY).decode())
            time.sleep(_POLL_S)
        try:
            missing = {q: at for q, (at, _) in peers.items() if not self._stuck(q)}
        except Exception:
            missing = {}
        assert err is not None  # peer_error(None) is False
        if not missing:
            what = f"a collective failed on every rank: {_first_line(err)}"
            self._fail(faults.EXIT_ENV, faults.rank_line(r, self.host, what), kind="own")
        line = faults.hang_line(missing, self.timeout_s) if hang else faults.lost_line(missing)
        alive = self.run.world_size - 1 - (0 if hang else len(missing))
        self._fail(faults.EXIT_ENV, line, kind="verdict", expect=alive)

    def _stuck(self, rank: int) -> bool:
        return bool(self.store.check([f"actscan/stuck/{rank}"]))

    def _where(self, rank: int) -> tuple[str | None, int]:
        """(host, pid) that `rank` registered at the start ((None, 0): unknown)."""
        with contextlib.suppress(Exception):
            if self.store.check([f"actscan/host/{rank}"]):
                at, _, pid = self.store.get(f"actscan/host/{rank}").decode().rpartition("|")
                return at, int(pid)
        return None, 0


def _gone(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie not yet reaped included)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):  # no /proc here: only a reaped process is known gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False


@contextlib.contextmanager
def session(device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[Session]:
    """Join the process group torchrun set up; see the module doc."""
    import torch.distributed as dist

    backend, dev = pick_backend(device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = DistRun(
        rank=rank,
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        backend=backend,
        device=dev,
    )
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    store = dist.PrefixStore("actscan", dist.distributed_c10d._get_default_store())
    s = Session(run, store, timeout_s)
    with contextlib.suppress(Exception):
        store.set(f"actscan/host/{rank}", f"{s.host}|{os.getpid()}")
    if not run.is_main:  # others print nothing; a failure's line goes to rank 0
        sys.stdout = s.captured
    sys.stderr = cast(TextIO, s.stderr)
    s.watchdog.start()
    try:
        with active(run):
            yield s
    finally:
        sys.stdout, sys.stderr = s.real_stdout, s.real_stderr
        s.watchdog.stop.set()
        if not s.finishing:
            s.finishing = True
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def run_ranked(
    body: Callable[[], int],
    device: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    errors: Callable[[Callable[[], int]], Callable[[], int]] = lambda f: f,
) -> int:
    """Run the command `body` (returns an exit code, raises `typer.Exit`) as this rank;
    `errors` is the CLI's error wrapper (one line per failure, printed on stderr)."""
    import typer

    with session(device, timeout_s) as s:
        try:
            code = errors(s.noting(body))()
        except typer.Exit as stop:
            code = int(stop.exit_code)
        except SystemExit as stop:  # the model (or a library) called sys.exit mid-run
            raw = stop.code if isinstance(stop.code, int) else 1
            why = "(sys.exit during the run)"
            return s.finish(faults.EXIT_ENV, faults.exit_line(s.run.rank, s.host, raw, why))
        if code in (0, 1):
            from actscan.distributed.telemetry import write

            write(s.run.rank, s.run.world_size)
        return s.finish(code)


# -- data parallel inputs ------------------------------------------------------------------
def shard_source(source: InputSource, run: DistRun, global_batch: int) -> InputSource:
    """This rank's rows of each global batch: rows [r·b, (r+1)·b) with b = batch / N.

    Every rank builds the same global batch (same seed) and keeps its slice, so the ranks
    together see exactly the inputs of a one-process run.
    """
    n = run.world_size
    if global_batch % n:
        raise UsageError(
            f"--batch {global_batch} does not divide by {n} processes: pick a multiple of {n}"
        )
    per = global_batch // n
    lo, hi = run.rank * per, (run.rank + 1) * per

    def local(i: int) -> Batch:
        return split_rows(source(i), global_batch, lo, hi)

    return local


def split_rows(b: Batch, global_batch: int, lo: int, hi: int) -> Batch:
    """Rows [lo, hi) of every tensor of `b` whose leading dim is the global batch's."""

    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == global_batch:
            return v[lo:hi]
        return v

    return Batch(tuple(cut(a) for a in b.args), {k: cut(v) for k, v in b.kwargs.items()})


# -- this rank's recorded pass --------------------------------------------------------------
