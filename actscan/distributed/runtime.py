"""The process group of a distributed run, and how its ranks fail together.

A run is distributed when it was started by `torchrun` (or `actscan profile --nproc N`,
which starts torchrun): the environment holds RANK, WORLD_SIZE and the rendezvous
address. `session()` joins the group (nccl on CUDA, gloo on CPU), makes the run the
`current()` one for `scan()` and the sharded builder, and guarantees that every rank
ends, with the same exit code, within a bounded time:

* a rank whose command fails publishes its one error line in the rendezvous store and
  waits (a few seconds at most) for the others to acknowledge it;
* every rank runs a watchdog thread that polls that store key: on seeing it, rank 0
  prints the line (unless it printed its own), and the rank leaves with the same code
  through `os._exit`, whatever collective its main thread is blocked in;
* a rank that dies without a word (killed) is caught by the collective timeout
  (`ACTSCAN_DIST_TIMEOUT`, seconds, default 120).

Ranks other than 0 print nothing: their stdout and stderr are captured in memory, and
the last line of a failing rank's stderr is what rank 0 shows.
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
from typing import Any

import torch

from actscan.errors import UsageError
from actscan.measure.inputs import Batch, InputSource

_ERROR_KEY = "actscan/error"
_ACK_KEY = "actscan/ack"
_POLL_S = 0.1
_GRACE_S = 10.0  # how long a failing rank waits for the others to acknowledge
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


def timeout_s() -> float:
    raw = os.environ.get("ACTSCAN_DIST_TIMEOUT", "")
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise UsageError(f"ACTSCAN_DIST_TIMEOUT must be seconds, got {raw!r}") from None


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
                raw = s.store.get(_ERROR_KEY).decode()
            except Exception:  # the store is gone: the job is ending anyway
                return
            code_s, _, line = raw.partition("|")
            with s.lock:
                if s.finishing:
                    return  # this rank is failing or done on its own: it reports itself
                s.finishing = True
                if s.run.is_main and line:
                    s.real_stderr.write(line + "\n")
                    s.real_stderr.flush()
                _ack(s.store)
                os._exit(int(code_s or 2))


def _ack(store: Any) -> None:
    with contextlib.suppress(Exception):
        store.add(_ACK_KEY, 1)


class Session:
    """One rank's membership of the process group; see `session()`."""

    def __init__(self, run: DistRun, store: Any) -> None:
        self.run = run
        self.store = store
        self.lock = threading.Lock()
        self.finishing = False
        self.real_stdout, self.real_stderr = sys.stdout, sys.stderr
        self.captured = io.StringIO()
        self.watchdog = _Watchdog(self)

    def finish(self, code: int) -> int:
        """End this rank's part with `code`; a failure (≥ 2) ends every rank with it."""
        with self.lock:
            if self.finishing:  # the watchdog is already taking the process down
                time.sleep(_GRACE_S)
            self.finishing = True
        self.watchdog.stop.set()
        if code in (0, 1):
            return code
        line = self._error_line()
        if not self.run.is_main:
            line = line.replace("actscan: error: ", f"actscan: error: rank {self.run.rank}: ", 1)
        else:
            line = ""  # rank 0 printed its own line
        with contextlib.suppress(Exception):
            self.store.compare_set(_ERROR_KEY, "", f"{code}|{line}")
        deadline = time.monotonic() + _GRACE_S
        while time.monotonic() < deadline:  # the others leave before us: no rank hangs
            with contextlib.suppress(Exception):
                if self.store.add(_ACK_KEY, 0) >= self.run.world_size - 1:
                    break
            time.sleep(_POLL_S)
        self.real_stderr.flush()
        self.real_stdout.flush()
        os._exit(code)

    def _error_line(self) -> str:
        lines = [ln for ln in self.captured.getvalue().splitlines() if ln.strip()]
        err = [ln for ln in lines if ln.startswith("actscan: error:")]
        return (err or lines or [f"actscan: error: rank {self.run.rank} failed"])[-1]


@contextlib.contextmanager
def session(device: str | None = None) -> Iterator[Session]:
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
    timeout = datetime.timedelta(seconds=timeout_s())
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    store = dist.PrefixStore("actscan", dist.distributed_c10d._get_default_store())
    s = Session(run, store)
    if not run.is_main:  # others print nothing; a failure's line goes to rank 0
        sys.stdout = sys.stderr = s.captured
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


def run_ranked(body: Callable[[], int], device: str | None = None) -> int:
    """Run the command `body` (returns an exit code, raises `typer.Exit`) as this rank."""
    import typer

    with session(device) as s:
        try:
            code = body()
        except typer.Exit as stop:
            code = int(stop.exit_code)
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
