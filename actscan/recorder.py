"""Forward/backward hooks that reduce every recorded output on the device.

Design (see shared/docs/design.md, "Measuring without disturbing"):
- A forward hook reduces the module's output (first floating tensor) in fp32: var_mean
  (one Welford pass), per-channel aminmax over the last dim, non-zero and finite counts.
  The results stay on the device as 0-d tensors; nothing is transferred in a hook.
- With backward on, the hook attaches `output.register_hook` to measure the gradient
  w.r.t. that output (sum of squares), which works with in-place ops where
  `register_full_backward_hook` does not.
- At the end of each batch the pending per-call results are merged into per-module
  running accumulators with Chan's parallel formula, vectorised over all modules (a few
  kernels per batch, not per module). Memory stays flat in the number of batches.
- One host transfer at the very end (`result()`).
Hooks are removed in `__exit__`, also when the forward raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

_ACC = torch.float64  # merged scalars: exact counts beyond 2**24, tiny tensors


@dataclass(frozen=True)
class RawStats:
    """Host-side merged statistics of one recorded tensor stream (module output)."""

    name: str
    calls: int  # total over all batches
    numel: int
    mean: float
    var: float  # population variance
    zeros: int
    nonfinite: int
    max_abs: float
    channel_max: tuple[float, ...] | None
    grad_sumsq: float | None
    grad_numel: int
    param_grad_sumsq: float | None
    order: int


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first floating-point tensor in a (nested) output: tensor, tuple, list, dict."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if isinstance(obj, list | tuple):
        for item in obj:
            found = first_tensor(item)
            if found is not None:
                return found
    elif isinstance(obj, dict):
        for item in obj.values():
            found = first_tensor(item)
            if found is not None:
                return found
    return None


class Recorder:
    """Context manager: hooks on `targets`, plus the input of `stream_input` if given.

    targets: (name, module) pairs to record the output of.
    stream_input: (name, module) whose *input* is recorded as `name` (the residual
    stream at k = 0, as the first block sees it).
    """

    def __init__(
        self,
        targets: Sequence[tuple[str, nn.Module]],
        *,
        stream_input: tuple[str, nn.Module] | None = None,
        backward: bool = True,
        channels: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        self.targets = list(targets)
        self.stream_input = stream_input
        self.backward = backward
        self.channels = channels
        self.device = torch.device(device)
        self.names = [n for n, _ in self.targets] + ([stream_input[0]] if stream_input else [])
        m = len(self.names)
        zeros = lambda: torch.zeros(m, dtype=_ACC, device=self.device)  # noqa: E731
        self._n, self._mean, self._m2 = zeros(), zeros(), zeros()
        self._zeros, self._nonfinite, self._amax = zeros(), zeros(), zeros()
        self._gsq, self._pgsq = zeros(), zeros()
        self._calls = [0] * m
        self._gnumel = [0] * m
        self._order: list[int] = [-1] * m
        self._seen = 0
        self._chan: list[torch.Tensor | None] = [None] * m
        self._chan_ok = [True] * m
        self._handles: list[RemovableHandle] = []
        self._reset_pending()
        # Parameters owned (recurse=False) by each recorded module, for param-grad norms.
        self._param_owner: list[tuple[nn.Parameter, int]] = [
            (p, i)
            for i, (_, mod) in enumerate(self.targets)
            for p in mod.parameters(recurse=False)
            if p.requires_grad
        ]
        self._has_params = [False] * m
        for _, i in self._param_owner:
            self._has_params[i] = True

    # -- hooks ---------------------------------------------------------------------
    def _reset_pending(self) -> None:
        self._p_idx: list[int] = []
        self._p_n: list[int] = []
        self._p_mean: list[torch.Tensor] = []
        self._p_var: list[torch.Tensor] = []
        self._p_nz: list[torch.Tensor] = []
        self._p_fin: list[torch.Tensor] = []
        self._p_amax: list[torch.Tensor] = []
        self._g_idx: list[int] = []
        self._g_sq: list[torch.Tensor] = []

    def _record(self, i: int, out: Any) -> None:
        t = first_tensor(out)
        self._calls[i] += 1
        if self._order[i] < 0:
            self._order[i] = self._seen
            self._seen += 1
        if t is None or t.numel() == 0 or t.device.type == "meta":
            return
        x = t.detach()
        xf = x if x.dtype == torch.float32 else x.float()  # upcast before squaring
        var, mean = torch.var_mean(xf, correction=0)
        n = xf.numel()
        c = xf.shape[-1] if xf.dim() else 1
        lo, hi = torch.aminmax(xf.reshape(-1, c), dim=0)
        chan = torch.maximum(hi, lo.neg())  # (C,) per-channel max-abs
        self._p_idx.append(i)
        self._p_n.append(n)
        self._p_mean.append(mean)
        self._p_var.append(var)
        self._p_nz.append(torch.count_nonzero(xf))
        self._p_fin.append(torch.isfinite(xf).sum())
        self._p_amax.append(chan.max())
        if self.channels and self._chan_ok[i]:
            acc = self._chan[i]
            if acc is None:
                self._chan[i] = chan.clone()
            elif acc.shape == chan.shape:
                torch.maximum(acc, chan, out=acc)
            else:  # the module was called with another width: per-channel stats are void
                self._chan_ok[i] = False
                self._chan[i] = None
        if self.backward and t.requires_grad and torch.is_grad_enabled():
            t.register_hook(self._grad_hook(i))

    def _grad_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            self._g_idx.append(i)
            self._gnumel[i] += g.numel()
            self._g_sq.append(torch.linalg.vector_norm(g.detach(), dtype=torch.float32))

        return hook

    def __enter__(self) -> Recorder:
        try:
            for i, (_, mod) in enumerate(self.targets):

                def fwd(_m: nn.Module, _a: Any, out: Any, i: int = i) -> None:
                    self._record(i, out)

                self._handles.append(mod.register_forward_hook(fwd))
            if self.stream_input is not None:
                j = len(self.targets)

                def pre(_m: nn.Module, args: Any, kwargs: dict[str, Any], j: int = j) -> None:
                    hidden = first_tensor(args)
                    if hidden is None:
                        hidden = kwargs.get("hidden_states")
                        hidden = hidden if hidden is not None else first_tensor(kwargs)
                    self._record(j, hidden)

                self._handles.append(
                    self.stream_input[1].register_forward_pre_hook(pre, with_kwargs=True)
                )
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- per batch -------------------------------------------------------------------
    def add_param_grads(self, grads: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """Squared norms of the recorded modules' own parameter gradients, this batch."""
        pairs = [(grads.get(p), i) for p, i in self._param_owner]
        pairs = [(g, i) for g, i in pairs if g is not None]
        if not pairs:
            return
        norms = torch._foreach_norm(
            [g.float() if g.dtype != torch.float32 else g for g, _ in pairs]
        )
        sq = torch.stack(norms).to(_ACC).square()
        idx = torch.tensor([i for _, i in pairs], device=sq.device)
        self._pgsq.index_add_(0, idx.to(self.device), sq.to(self.device))

    def end_batch(self) -> None:
        """Merge this batch's pending results into the running accumulators (Chan)."""
        dev, m = self.device, len(self.names)
        if self._p_idx:
            idx = torch.tensor(self._p_idx, device=dev)
            n = torch.tensor(self._p_n, dtype=_ACC, device=dev)
            mean = torch.stack(self._p_mean).to(dev, _ACC)
            var = torch.stack(self._p_var).to(dev, _ACC)
            nz = torch.stack(self._p_nz).to(dev, _ACC)
            fin = torch.stack(self._p_fin).to(dev, _ACC)
            amax = torch.stack(self._p_amax).to(dev, _ACC)
            z = lambda: torch.zeros(m, dtype=_ACC, device=dev)  # noqa: E731
            bn = z().index_add_(0, idx, n)
            bmean = z().index_add_(0, idx, n * mean) / bn.clamp_min(1)
            bm2 = z().index_add_(0, idx, n * var + n * (mean - bmean[idx]).square())
            # Chan: merge (run_n, run_mean, run_m2) with (bn, bmean, bm2)
            tot = self._n + bn
            delta = torch.where(bn > 0, bmean - self._mean, torch.zeros_like(bmean))
            w = bn / tot.clamp_min(1)
            self._m2 += bm2 + delta.square() * self._n * w
            self._mean += delta * w
            self._n = tot
            self._zeros.index_add_(0, idx, n - nz)
            self._nonfinite.index_add_(0, idx, n - fin)
            self._amax.scatter_reduce_(0, idx, amax, reduce="amax")
        if self._g_idx:
            gidx = torch.tensor(self._g_idx, device=dev)
            gsq = torch.stack(self._g_sq).to(dev, _ACC).square()
            self._gsq.index_add_(0, gidx, gsq)
        self._reset_pending()

    # -- results --------------------------------------------------------------------
    def result(self, batches: int) -> dict[str, RawStats]:
        """One host transfer of everything; per-batch norms averaged as root-mean-square."""
        self.end_batch()
        chans = [c for c in self._chan if c is not None]
        flat = torch.cat(
            [
                torch.stack([self._n, self._mean, self._m2, self._zeros, self._nonfinite,
                             self._amax, self._gsq, self._pgsq]).flatten(),
                *[c.to(_ACC) for c in chans],
            ]
        ).cpu()  # fmt: skip
        m = len(self.names)
        n, mean, m2, zeros, nonfin, amax, gsq, pgsq = flat[: 8 * m].view(8, m).tolist()
        pos, chan_lists = 8 * m, []
        for c in self._chan:
            if c is None:
                chan_lists.append(None)
            else:
                chan_lists.append(tuple(flat[pos : pos + c.numel()].tolist()))
                pos += c.numel()
        out: dict[str, RawStats] = {}
        for i, name in enumerate(self.names):
            cnt = int(n[i])
            out[name] = RawStats(
                name=name,
                calls=self._calls[i],
                numel=cnt,
                mean=mean[i] if cnt else float("nan"),
                var=m2[i] / cnt if cnt else float("nan"),
                zeros=int(zeros[i]),
                nonfinite=int(nonfin[i]),
                max_abs=amax[i] if cnt else float("nan"),
                channel_max=chan_lists[i],
                grad_sumsq=(gsq[i] / batches) if self._gnumel[i] else None,
                grad_numel=self._gnumel[i],
                param_grad_sumsq=(pgsq[i] / batches) if self._has_params[i] and self.backward else None,
                order=self._order[i],
            )
        return out


def iter_named(model: nn.Module, pattern: str | None) -> Iterator[tuple[str, nn.Module]]:
    """Modules to record: every named module except the root, filtered by a regex."""
    import re

    rx = re.compile(pattern) if pattern else None
    for name, mod in model.named_modules():
        if not name:
            continue
        if rx is None or rx.search(name):
            yield name, mod
