"""`--nproc N`: start the same command as N ranks on this host, through torchrun.

`actscan profile TARGET --nproc N …` runs `torch.distributed.run --standalone
--nproc-per-node N -m actscan profile TARGET …` (the command line without `--nproc`)
in this process: the ranks inherit stdout and stderr, only rank 0 writes to them, and
torchrun's own log lines and summary are silenced. A failure reads as one line: the one
the ranks printed (the first failing rank's error, or the ranks that hung), or, when a
rank died without a word (a signal, an exit of its own), the line this launcher prints
from what torchrun's agent observed: "rank 1 (host h) was killed by signal 9 (SIGKILL)",
"… exited with code 7 without reporting an error" (`faults.launcher_verdict`; exit 2).
Otherwise the exit code is the ranks' (they all exit with the same one). Importing this
module does not import torch (`actscan --help` stays fast).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from actscan.errors import UsageError


def launched() -> bool:
    """Whether this process is a rank started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def without_nproc(argv: Sequence[str]) -> list[str]:
    """The command line minus `--nproc N` / `--nproc=N`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def max_ranks() -> int:
    """The most ranks one host can usefully run: 4 per CPU core (gloo shares the cores), or
    one per visible GPU when there are more of those. Past it `--nproc` is a mistake (a typo
    of 100000 would otherwise start 100000 interpreters)."""
    gpus = 0
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(4 * (os.cpu_count() or 1), gpus)


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Run `python -m actscan ARGV` (without --nproc) as `nproc` ranks; their exit code."""
    from actscan.distributed import faults

    if nproc > (limit := max_ranks()):
        raise UsageError(
            f"--nproc {nproc}: this host has {os.cpu_count() or 1} CPU cores; at most {limit} "
            "ranks make sense here (more than one host: run torchrun on each)"
        )

    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # torchrun's agent logs (read at import)
    os.environ[faults.NPROC_ENV] = "1"  # the ranks leave naming a vanished rank to us
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--monitor-interval=0.1",
            "-m",
            "actscan",
            *without_nproc(argv),
        ]
    )
    try:
        run(args)
    except ChildFailedError as err:
        line, code = faults.launcher_verdict(err.failures)
        if line:
            print(line, file=sys.stderr)
        return code
    except (KeyboardInterrupt, SignalException):  # Ctrl-C: the agent stopped every rank
        return 130
    except Exception as err:  # the launcher itself (rendezvous, ports…)
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"actscan: error: --nproc {nproc}: could not start the ranks: {line}", file=sys.stderr
        )
        return 2
    return 0
