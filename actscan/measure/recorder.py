"""Forward/backward hooks that reduce every recorded output on the device.

Design (docs/design.md, "The recorder"), tuned so that the
instrumented step costs little more than reading each activation a few times:
- A forward hook reduces the module's output in fp32 (fp64 stays fp64; fp16/bf16 are
  upcast chunk by chunk into a scratch buffer before anything is squared) with
  memory-bound passes that vectorise, and no host transfer:
    sum Σx; the L2 norm of every row (last dim), squared and summed in fp64 at batch end
    (Σx² to ~1e-8 where one long fp32 accumulation drifts by 1e-4); per-channel amax and
    amin (max-abs = max(amax, -amin), exact); and two counts read off two maps written
    into a preallocated scratch: `x == 0` as 1.0/0.0 (±0 are zeros) and 1 + 0·x, which
    is 1 where x is finite and NaN where it is not; one nansum of both is exact (every
    partial sum is an integer < 2**24): zeros, and non-finite = n − finite, with no
    branch and no host sync. (Welford `var_mean`, `aminmax(dim)`, `isfinite().sum()`,
    `count_nonzero` and a division map are 2-100× slower on CPU.)
- Outputs above `_WHOLE` elements are processed in row chunks of about `_CHUNK`, so the
  scratch, the only extra memory, stays small (and in cache): nothing the size of an
  activation is allocated, except a contiguous copy of a non-contiguous output.
- A tensor that is the output of several modules (Identity, a wrapper returning its last
  child's output) is reduced once: the hook sees the same object at the same version and
  reuses the pending results; its gradient hook fans out to every module.
- With backward on, a tensor hook on each output (`HookSet.tensor`) measures the gradient
  w.r.t. that output (row norms again); it works with in-place ops where a full backward
  hook does not. Those hooks belong to the batch: `end_batch` removes them.
- At the end of each batch the pending per-chunk results are merged into per-module
  running accumulators with Chan's parallel formula (`merge_moments`), vectorised over all
  modules (a few kernels per batch, not per module). Memory stays flat in the number of batches.
- CPU outputs and gradients up to `_SERIAL` values are reduced with torch's thread count
  set to 1 (restored in `finally`): at that size a parallel region's fork/join costs as
  much as the pass itself. A gradient tensor handed to two outputs (both sides of a
  residual add) is reduced once.
- One host transfer at the very end (`result()`), which also summarises each module's
  per-channel max-abs (dead/live counts, median and max of the live channels) with one
  sort per width, so that no per-channel list is walked in Python.
- At the stream points (`tokens=`: the names whose per-token view is kept) each batch
  also gets, see `_token_view`: the top-k |x| with their flat positions (exact: topk
  within the k rows of largest row max-abs, no |x| copy of the activation), and on
  evenly spaced rows (≤ `_SUB` values): per channel how many values exceed `HIT_RMS` × the
  sample's RMS, and the median |x| of a strided sample of those (≤ `_SUB_MEDIAN`). Batches merge
  on the device (concat + topk; medians and counts stacked), read in the one transfer.
  With backward on, their gradient's row norms meet the forward's row norms of the same
  tokens: Σ_t |x_t|²·|g_t|² (the per-token relative gradient, free: both norms are
  computed anyway).
Limits: values above ~1.8e19 overflow the fp32 squares (the variance reads inf), as
they did with Welford in fp32; flushing denormals to zero (torch.set_flush_denormal)
makes subnormals count as zeros.
Hooks (one `HookSet`) are removed in `__exit__`, also when the forward raises.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from actscan.errors import UsageError
from actscan.measure import fused_reduce
from actscan.measure.hooks import HookSet
from actscan.measure.moments import merge_moments

_ACC = torch.float64  # merged scalars: exact counts beyond 2**24, tiny tensors
# Values per chunk of a large output (4 MiB of fp32): L2-sized 128K chunks measured
# slower at 12 × 768 (three times the kernel calls). Outputs up to _WHOLE: one go.
_CHUNK = 1 << 20
_WHOLE = 1 << 20
_MAX_CHANNELS = 1 << 20  # widest last dim kept per channel; every chunk is < 2**24 values
_SMALL = 1 << 14  # outputs this small sum in fp64 (+2 µs): exact means of tiny models
_WIDE_CHANNELS = 1 << 15  # per-channel results this wide (128 KB) go to reused buffers
_WIDE_ROW = 1024  # row length for the norms of outputs too wide for per-channel stats
_WORK = (torch.float32, torch.float64)  # reduced as they are; others upcast to fp32
# CPU outputs up to this many values are reduced on one thread: a pass over 64K values
# takes ~4 µs, which a parallel region's fork/join doubles, and on a busy machine a
# region can wait a whole time slice for its second thread.
_SERIAL = 1 << 18
_vnorm = torch.linalg.vector_norm
FP16_TINY = 2.0**-14  # fp16's smallest normal value (6.10e-05)
TOP_K = 8  # largest |x| kept per stream point, with (batch, position, channel)
# The per-token view's channel counts read a strided sample of at most _SUB values, its
# median |x| a strided sample of that of at most _SUB_MEDIAN (kthvalue costs ~10 ns per
# value: 0.7 ms over 64K values, ten times the rest of a hook on a 4 × 64 × 256 output).
# A median of 4096 samples is within ~2% (one standard error) of the exact one: ample
# for a ×1000 test.
_SUB = 1 << 16
_SUB_MEDIAN = 1 << 12
# A sampled value is a "hit" for its channel above this multiple of the sample's RMS (a
# Gaussian passes 6σ once in 5e8 values): a channel that is large across tokens hits on
# a large fraction of them, one carrying a massive value on a few tokens on almost none.
HIT_RMS = 6.0


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
    # fp16 runs only (Recorder(underflow=True)), else None: output values nonzero but below
    # fp16's smallest normal, and output-gradient values below it (zeros included).
    underflow: int | None = None
    grad_underflow: int | None = None
    # Summary of channel_max, computed on the device (None without per-channel stats):
    # channels at exactly 0, "live" ones (> 0 and finite), their median and their max.
    channel_dead: int | None = None
    channel_live: int | None = None
    channel_median: float | None = None
    channel_top: float | None = None
    # The per-token view (stream points only, else empty/None): the top-k |x| as
    # (signed value, batch index, flat index within that batch's tensor), the tensor's
    # shape, the median |x| (median of the per-batch sample medians) and per channel the
    # fraction of sampled values above HIT_RMS × RMS (None when not per channel).
    top: tuple[tuple[float, int, int], ...] = ()
    shape: tuple[int, ...] = ()
    median_abs: float | None = None
    channel_hits: tuple[float, ...] | None = None
    # Stream points with backward on: Σ over the tokens (rows of the last dim) of all
    # batches of |x_t|²·|g_t|², and the tokens counted.
    token_grad_sumsq: float | None = None
    token_rows: int = 0
    # The median over tokens of |x_t|·|g_t| (median of the per-batch medians): a robust
    # view where a few tokens (a causal sequence's first positions) hold the gradient.
    token_grad_median: float | None = None


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
    merge: called with the recorder right before `result()`'s host transfer, to combine
    the accumulators of a distributed run's ranks in place (actscan.distributed.merge).
    rows: a distributed rank's batch size. An output whose leading size differs (a
    position table, a rotary cache) is the same on every rank: only the main rank counts
    its values, and its gradient (each rank's partial sum) is summed over the ranks by
    the merge before it is squared. `main`: whether this is that rank.
    """

    # How each accumulator merges across the ranks of a distributed run, one line per
    # state attribute (docs/design.md, "Distributed runs"): a new statistic adds its line.
    MERGE: ClassVar[dict[str, str]] = {
        "_n,_mean,_m2": "chan",  # Chan's merge of (count, mean, M2)
        "_zeros": "sum",
        "_nonfinite": "sum",
        "_gsq": "sum",  # output-gradient Σg²
        "_pgsq": "sum",  # parameter-gradient Σg² of each rank's local shards
        "_uf": "sum",
        "_guf": "sum",
        "_gnumel": "sum",  # host list
        "_tsq": "sum",  # stream points: Σ_t |x_t|²·|g_t|² (token by token)
        "_trows": "sum",  # host list: the tokens counted in _tsq
        "_tprod": "cat",  # stream points: per batch and point the tokens' |x_t|·|g_t|
        "_amax": "max",
        "_chan": "channels",  # per-channel (amax, amin): MAX of amax and of -amin
        "_rep_g": "sum",  # gradients of replicated outputs (list of tensors), summed whole
    }

    def __init__(
        self,
        targets: Sequence[tuple[str, nn.Module]],
        *,
        stream_input: tuple[str, nn.Module] | None = None,
        backward: bool = True,
        channels: bool = True,
        device: torch.device | str = "cpu",
        underflow: bool = False,
        loss_scale: float = 1.0,
        merge: Callable[[Recorder], None] | None = None,
        rows: int | None = None,
        main: bool = True,
        tokens: Sequence[str] = (),
    ) -> None:
        self.targets = list(targets)
        self.merge = merge
        self.rows, self.main = rows, main
        self._rep_g: list[torch.Tensor] = []  # replicated outputs' gradients, per batch
        self._rep_mods: list[list[int]] = []
        self.underflow = underflow
        self.loss_scale = loss_scale  # the backward's loss was multiplied by it: unscale
        self.stream_input = stream_input
        self.backward = backward
        self.channels = channels
        self.device = torch.device(device)
        self.names = [n for n, _ in self.targets] + ([stream_input[0]] if stream_input else [])
        m = len(self.names)
        zeros = lambda: torch.zeros(m, dtype=_ACC, device=self.device)  # noqa: E731
        self._n, self._mean, self._m2 = zeros(), zeros(), zeros()
        self._zeros, self._nonfinite = zeros(), zeros()
        self._amax = torch.full((m,), float("-inf"), dtype=_ACC, device=self.device)
        self._gsq, self._pgsq = zeros(), zeros()
        self._calls = [0] * m
        self._gnumel = [0] * m
        self._tsq = zeros()
        self._trows = [0] * m
        # per (batch, stream point) the vector of |x_t|·|g_t| (fp32; a rank's rows, whole
        # batches once merged) and the modules it belongs to: medians in `result()`
        self._tprod: list[torch.Tensor] = []
        self._tprod_mods: list[list[int]] = []
        self._order: list[int] = [-1] * m
        self._seen = 0
        # running per-channel (amax, amin) of each module, while its width is constant
        self._chan: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * m
        self._chan_ok = [True] * m
        self._hooks = HookSet()  # module hooks: the recorder's lifetime
        self._grad_hooks = HookSet()  # this batch's tensor hooks: removed by end_batch
        self._threads = torch.get_num_threads()
        self._scratch: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}
        self._ones: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
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
        # fp16 underflow counts (only with underflow=True): device accumulators, and this
        # batch's pending (modules, count) pairs; counted once per tensor (aliases share).
        self._uf, self._guf = zeros(), zeros()
        self._uf_pend: list[tuple[list[int], torch.Tensor]] = []
        self._guf_pend: list[tuple[list[int], torch.Tensor]] = []
        self._uf_last: tuple[Any, int, list[int]] | None = None
        # The per-token view: module index -> its running (|top|, signed top, code) with
        # code = batch · numel + flat index; per-batch medians; channel hit/sample counts.
        self._tok_ix = {self.names.index(n) for n in tokens if n in self.names}
        self._tok_top: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._tok_med: dict[int, list[torch.Tensor]] = {}
        self._tok_hits: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._tok_shape: dict[int, tuple[int, ...]] = {}
        self._tok_last: tuple[Any, int, tuple[Any, ...]] | None = None
        self._tok_cols: dict[tuple[int, int, torch.device], torch.Tensor] = {}
        self._batch = 0

    # -- hooks ---------------------------------------------------------------------
    def _reset_pending(self) -> None:
        # One entry per reduced chunk: (module, element count, Σx, fp32 row norms (1-d),
        # [finite count, zero count]); the tensors stay on the device.
        self._pend: list[tuple[Any, ...]] = []
        # Global amax/amin of calls not kept per channel (channels off, width changed).
        self._c_idx: list[int] = []
        self._c_hi: list[torch.Tensor] = []
        self._c_lo: list[torch.Tensor] = []
        # One entry per gradient: the modules sharing that output, and its row norms.
        self._g_mods: list[list[int]] = []
        self._g_rows: list[torch.Tensor] = []
        # The last reduced tensor, to reduce an output shared by nested modules once:
        # (weakref, version, first entry, end entry, amax, amin, per-channel, grad mods)
        self._last: tuple[Any, ...] | None = None
        # The last gradient reduced: (weakref, version, row norms). A residual add passes
        # one gradient tensor to both its inputs (block output and branch output).
        self._last_g: tuple[Any, ...] | None = None
        # Stream points: the forward's per-token row norms of a recorded output, keyed by
        # id of its gradient hook's module list; this batch's (modules, Σ_t |x_t|²|g_t|²).
        self._x_rows: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._t_pend: list[tuple[list[int], torch.Tensor]] = []

    def _buffer(self, key: tuple[torch.dtype, torch.device], slot: int, n: int) -> torch.Tensor:
        """The first n elements of a preallocated scratch (grown if ever too small)."""
        buf = self._scratch.get((*key, slot))
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, _CHUNK), dtype=key[0], device=key[1])
            self._scratch[(*key, slot)] = buf
        return buf[:n]

    def _record(self, i: int, t: torch.Tensor | None) -> None:
        self._calls[i] += 1
        if self._order[i] < 0:
            self._order[i] = self._seen
            self._seen += 1
        if t is None or t.is_meta or not t.numel():
            return
        rep = self.rows is not None and (t.dim() == 0 or t.shape[0] != self.rows)
        counted = not rep or self.main  # a replicated output: the main rank counts it
        if self.underflow and counted:
            self._count_underflow(i, t)
        if i in self._tok_ix:
            self._token_view(i, t)
        last = self._last
        if last is not None and last[0]() is t and last[1] == t._version:
            self._repeat(i, last)
            return
        start = len(self._pend)
        x = t.detach()
        if self._threads > 1 and x.device.type == "cpu" and x.numel() <= _SERIAL:
            torch.set_num_threads(1)
            try:
                hi, lo, per_channel = self._reduce(i, x)
            finally:
                torch.set_num_threads(self._threads)
        else:
            hi, lo, per_channel = self._reduce(i, x)
        if not counted:
            del self._pend[start:]  # the extremes stay: MAX of equal values
        mods = [i]
        if self._hooked(t):
            hook = self._rep_grad_hook if rep else self._grad_hook
            self._grad_hooks.tensor(t, partial(hook, mods))
            if not rep and i in self._tok_ix:
                self._keep_rows(i, t, mods, start)
        self._last = (weakref.ref(t), t._version, start, len(self._pend), hi, lo, per_channel, mods)
        self._update_channels(i, hi, lo, per_channel)

    def _token_view(self, i: int, t: torch.Tensor) -> None:
        """Top-k |x| with positions, the median |x| and per-channel hit counts of one
        stream tensor, merged into module i's running view; all on the device."""
        last = self._tok_last
        if last is not None and last[0]() is t and last[1] == t._version:
            vals, codes, med, hits = last[2]
        else:
            x = t.detach()  # read as it is (fp16/bf16 too): no upcast copy
            flat = x.reshape(-1)
            numel = flat.numel()
            c = x.shape[-1] if x.dim() >= 2 else numel
            rows = flat.view(-1, c)
            # Exact top-k |x| without a |x| copy: every value of the top k sits in one of
            # the k rows with the largest row max-abs; topk within those rows only.
            kr = min(TOP_K, rows.shape[0])
            row_top = torch.maximum(rows.amax(1), rows.amin(1).neg()).topk(kr).indices
            cand = rows[row_top].to(_ACC)  # (kr, c)
            pick = cand.abs().reshape(-1).topk(min(TOP_K, cand.numel())).indices
            vals = cand.reshape(-1)[pick]
            codes = row_top[pick // c] * c + pick % c + self._batch * numel
            # samples: every rstep-th row (≤ _SUB values, all channels), then every
            # mstep-th value of those (≤ _SUB_MEDIAN; mstep coprime to c) for the median
            rstep = max(1, -(-numel // _SUB))
            sub = rows[::rstep].abs()
            if sub.dtype not in _WORK:
                sub = sub.float()  # the sample only
            mstep = max(1, -(-sub.numel() // _SUB_MEDIAN))
            while mstep > 1 and math.gcd(mstep, c) != 1:
                mstep += 1
            msub = sub.reshape(-1)[::mstep]
            med = msub.kthvalue((msub.numel() + 1) // 2).values
            hits = None
            if self.channels and c <= _MAX_CHANNELS and x.dim() >= 2:
                rms = _vnorm(sub) / sub.numel() ** 0.5
                big = (sub > HIT_RMS * rms).sum(0, dtype=torch.float32)
                hits = (big, self._sample_rows(sub.shape[0], c, x.device))
            self._tok_last = (weakref.ref(t), t._version, (vals, codes, med, hits))
        self._tok_shape.setdefault(i, tuple(t.shape))
        run = self._tok_top.get(i)
        if run is not None:
            vals = torch.cat([run[1], vals])
            codes = torch.cat([run[2], codes])
            pick = vals.abs().topk(min(TOP_K, vals.numel())).indices
            vals, codes = vals[pick], codes[pick]
        self._tok_top[i] = (vals.abs(), vals, codes)
        self._tok_med.setdefault(i, []).append(med.to(_ACC))
        acc = self._tok_hits.get(i, ())
        if hits is None or acc is None or (acc and acc[0].shape != hits[0].shape):
            self._tok_hits[i] = None  # another width, or not per channel: no counts
        elif acc:
            acc[0].add_(hits[0])
            acc[1].add_(hits[1])
        else:
            self._tok_hits[i] = (hits[0].clone(), hits[1].clone())

    def _sample_rows(self, m: int, c: int, dev: torch.device) -> torch.Tensor:
        """(c,) filled with m: the sampled values per channel (cached per shape)."""
        key = (m, c, dev)
        got = self._tok_cols.get(key)
        if got is None:
            got = self._tok_cols[key] = torch.full((c,), float(m), device=dev)
        return got

    def _reduce(self, i: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Queue Σx, row norms and the two counts of x, chunk by chunk; (amax, amin)."""
        if x.dim() < 2:
            x = x.reshape(1, -1)
        elif not x.is_contiguous():
            x = x.contiguous()  # rare (a permuted output): one temporary copy
        c = x.shape[-1]
        per_channel = self.channels and c <= _MAX_CHANNELS
        work = x.dtype if x.dtype in _WORK else torch.float32
        key = (work, x.device)
        # one compiled read per chunk (fused_reduce: llvmlite, CPU, fp32); whole if x is fp32
        fused = work == torch.float32 and fused_reduce.runs_on(x.device)
        whole = fused and x.dtype == torch.float32
        if c <= _MAX_CHANNELS:
            x2 = x.view(-1, c)
            rows, per = x2.shape[0], max(1, _CHUNK // c)
            if whole or x2.numel() <= _WHOLE or rows <= per:
                chunks: Sequence[torch.Tensor] = (x2,)
            else:
                chunks = [x2[r : r + per] for r in range(0, rows, per)]
        else:  # too wide for per-channel stats: rows of _WIDE_ROW, then the remainder
            flat = x.view(-1)
            cut = flat.numel() - flat.numel() % _WIDE_ROW
            x2 = flat[:cut].view(-1, _WIDE_ROW)
            per = max(1, x2.shape[0] if whole else _CHUNK // _WIDE_ROW)
            chunks = [x2[r : r + per] for r in range(0, x2.shape[0], per)]
            if cut < flat.numel():
                chunks.append(flat[cut:].view(1, -1))
        hi = lo = None
        for ch in chunks:
            m = ch.numel()
            if ch.dtype != work:  # upcast into the scratch before anything is squared
                ch = self._buffer(key, 0, m).view(ch.shape).copy_(ch)
            if fused:
                s, norms, counts, h, low = fused_reduce.reduce(ch)
                self._pend.append((i, m, s, norms, counts))
                if not per_channel:
                    h, low = h.amax(), low.amin()
                if hi is None or lo is None:
                    hi, lo = h, low
                else:
                    torch.maximum(hi, h, out=hi)
                    torch.minimum(lo, low, out=lo)
                continue
            one = self._ones.get(key)
            if one is None:
                one = self._ones[key] = torch.ones((), dtype=work, device=x.device)
            maps = self._buffer(key, 1, 2 * m).view(2, *ch.shape)
            torch.add(one, ch, alpha=0, out=maps[0])  # 1 where finite, else NaN (0·inf)
            torch.eq(ch, 0, out=maps[1])  # 1.0 where ±0, else 0.0
            counts = torch.nansum(maps.view(2, m), dim=1)  # exact: integers < 2**24
            s = ch.sum(dtype=_ACC) if m <= _SMALL else ch.sum()  # fp64 where it is free
            self._pend.append((i, m, s, _vnorm(ch, dim=-1), counts))
            if not per_channel:
                h, low = ch.amax(), ch.amin()
            elif c < _WIDE_CHANNELS:
                h, low = ch.amax(0), ch.amin(0)
            elif hi is None:  # (C,) results of a wide row go to the scratch: fresh 200 KB
                h = torch.amax(ch, 0, out=self._buffer(key, 2, c))  # blocks would be mapped
                low = torch.amin(ch, 0, out=self._buffer(key, 3, c))  # and faulted in each time
            else:
                h = torch.amax(ch, 0, out=self._buffer(key, 4, c))
                low = torch.amin(ch, 0, out=self._buffer(key, 5, c))
            if hi is None or lo is None:
                hi, lo = h, low
            else:
                torch.maximum(hi, h, out=hi)
                torch.minimum(lo, low, out=lo)
        assert hi is not None and lo is not None
        return hi, lo, per_channel

    def _update_channels(
        self, i: int, hi: torch.Tensor, lo: torch.Tensor, per_channel: bool
    ) -> None:
        """Per-channel running amax/amin; the module's max-abs is read off it at the end."""
        if per_channel and self._chan_ok[i]:
            acc = self._chan[i]
            if acc is None:  # copies: hi and lo may be in the scratch, or shared outputs
                self._chan[i] = (hi.clone(), lo.clone())
                return
            if acc[0].shape == hi.shape:
                torch.maximum(acc[0], hi, out=acc[0])
                torch.minimum(acc[1], lo, out=acc[1])
                return
        if self._chan_ok[i] and self._chan[i] is not None:
            # another width (or too wide): per-channel stats of this module are void
            acc = self._chan[i]
            assert acc is not None
            self._c_idx.append(i)
            self._c_hi.append(acc[0].amax())
            self._c_lo.append(acc[1].amin())
            self._chan[i] = None
        if per_channel or self.channels:
            self._chan_ok[i] = False
        self._c_idx.append(i)  # global amax/amin of this call
        self._c_hi.append(hi.amax())  # a new tensor, never the scratch
        self._c_lo.append(lo.amin())

    def _repeat(self, i: int, last: tuple[Any, ...]) -> None:
        """Module i returned the tensor just reduced for another module: reuse it."""
        t, _, start, stop, hi, lo, per_channel, grad_mods = last
        self._pend += [(i, *e[1:]) for e in self._pend[start:stop]]
        self._update_channels(i, hi, lo, per_channel)
        grad_mods.append(i)  # used only if a gradient hook was registered for it
        out = t()
        if i in self._tok_ix and out is not None and self._hooked(out) and out.dim() >= 2:
            self._keep_rows(i, out, grad_mods, start)

    def _hooked(self, t: torch.Tensor) -> bool:
        """Whether t's gradient is measured."""
        return self.backward and t.requires_grad and torch.is_grad_enabled()

    def _keep_rows(self, i: int, t: torch.Tensor, mods: list[int], start: int) -> None:
        """Keep the per-token row norms of stream point i's output (queued by `_reduce`
        from `start`) for its gradient hook; only where rows are tokens: (tokens, channels)
        or (batch, tokens, channels), not a feature map (batch, channels, height, width)."""
        if t.dim() not in (2, 3) or t.shape[-1] > _MAX_CHANNELS:
            return
        key = id(mods)
        held = self._x_rows.get(key)
        if held is not None:
            held[0].append(i)
            return
        rows = [e[3] for e in self._pend[start:] if e[0] == i]
        if rows:
            self._x_rows[key] = ([i], rows[0] if len(rows) == 1 else torch.cat(rows))

    def _count_underflow(self, i: int, t: torch.Tensor) -> None:
        """Queue the count of values nonzero but below fp16's smallest normal (no sync)."""
        last = self._uf_last
        if last is not None and last[0]() is t and last[1] == t._version:
            last[2].append(i)
            return
        a = t.detach().abs()
        count = torch.count_nonzero((a < FP16_TINY) & (a > 0))
        mods = [i]
        self._uf_pend.append((mods, count))
        self._uf_last = (weakref.ref(t), t._version, mods)

    def _grad_hook(self, mods: list[int], grad: torch.Tensor) -> None:
        if self.underflow:  # below the smallest normal, flushed zeros included
            self._guf_pend.append((mods, torch.count_nonzero(grad.detach().abs() < FP16_TINY)))
        last = self._last_g
        if last is not None and last[0]() is grad and last[1] == grad._version:
            rows, numel = last[2], last[3]  # the same gradient as the last output's
        else:
            g = grad.detach()
            if g.dim() < 2:
                g = g.reshape(1, -1)
            if g.dtype not in _WORK:
                g = g.float()  # rare (low-precision gradients): one upcast copy
            if g.shape[-1] > _MAX_CHANNELS and g.is_contiguous() and g.numel() % _WIDE_ROW == 0:
                g = g.view(-1, _WIDE_ROW)  # short rows keep the fp32 norms accurate
            numel = g.numel()
            if self._threads > 1 and g.device.type == "cpu" and numel <= _SERIAL:
                torch.set_num_threads(1)
                try:
                    rows = _vnorm(g, dim=-1)
                finally:
                    torch.set_num_threads(self._threads)
            else:
                rows = _vnorm(g, dim=-1)
            self._last_g = (weakref.ref(grad), grad._version, rows, numel)
        for i in mods:
            self._gnumel[i] += numel
        self._g_mods.append(mods)
        self._g_rows.append(rows)
        held = self._x_rows.get(id(mods))
        if held is not None and held[1].numel() == rows.numel() and grad.shape[-1] <= _MAX_CHANNELS:
            prod = held[1].to(_ACC) * rows.reshape(-1).to(_ACC)
            self._t_pend.append((held[0], prod.square().sum()))
            self._tprod.append(prod.float())
            self._tprod_mods.append(held[0])
            for i in held[0]:
                self._trows[i] += rows.numel()

    def _rep_grad_hook(self, mods: list[int], grad: torch.Tensor) -> None:
        """A replicated output's gradient: kept whole (small: a position table) for the
        merge to sum over the ranks; squared in `result()`."""
        self._rep_g.append(grad.detach().to(_ACC).clone())
        self._rep_mods.append(mods)
        if self.main:
            for i in mods:
                self._gnumel[i] += grad.numel()

    def __enter__(self) -> Recorder:
        self._threads = torch.get_num_threads()
        try:
            for i, (_, mod) in enumerate(self.targets):
                self._hooks.forward(mod, partial(self._fwd_hook, i))
            if self.stream_input is not None:
                j = len(self.targets)
                self._hooks.forward_pre(
                    self.stream_input[1], partial(self._pre_hook, j), with_kwargs=True
                )
        except BaseException:
            self.remove()
            raise
        return self

    def _fwd_hook(self, i: int, _m: nn.Module, _a: Any, out: Any) -> None:
        if type(out) is torch.Tensor:
            self._record(i, out if out.is_floating_point() else None)
        else:
            self._record(i, first_tensor(out))

    def _pre_hook(self, j: int, _m: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        hidden = first_tensor(args)
        if hidden is None:
            hidden = kwargs.get("hidden_states")
            hidden = hidden if hidden is not None else first_tensor(kwargs)
        self._record(j, hidden)

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Every hook of the recorder, the module hooks and this batch's tensor hooks."""
        self._grad_hooks.remove()
        self._hooks.remove()

    # -- per batch -------------------------------------------------------------------
    def add_param_grads(self, grads: dict[nn.Parameter, torch.Tensor | None]) -> None:
        """Squared norms of the recorded modules' own parameter gradients, this batch."""
        owned = [(grads.get(p), i) for p, i in self._param_owner]
        pairs = [(g, i) for g, i in owned if g is not None]
        if not pairs:
            return
        norms = torch._foreach_norm(
            [g.float() if g.dtype != torch.float32 else g for g, _ in pairs]
        )
        sq = torch.stack(norms).to(_ACC).square()
        self._pgsq.index_add_(0, _ix([i for _, i in pairs], self.device), sq.to(self.device))

    def end_batch(self) -> None:
        """Merge this batch's pending results into the running accumulators (Chan)."""
        dev, m = self.device, len(self.names)
        if self._pend:
            mods, sizes, sums, rows, counts = zip(*self._pend, strict=True)
            idx = _ix(mods, dev)
            n = _ix(sizes, dev).to(_ACC)
            s = torch.stack(sums).to(dev, _ACC)
            fin, zer = torch.stack(counts, dim=1).to(dev, _ACC)
            q = _segment_sumsq(rows, dev)
            z = lambda: torch.zeros(m, dtype=_ACC, device=dev)  # noqa: E731
            bn = z().index_add_(0, idx, n)
            bs = z().index_add_(0, idx, s)
            bq = z().index_add_(0, idx, q)
            bmean = bs / bn.clamp_min(1)
            bm2 = (bq - bs * bmean).clamp_min(0)
            self._n, self._mean, self._m2 = merge_moments(
                (self._n, self._mean, self._m2), (bn, bmean, bm2)
            )
            self._zeros.index_add_(0, idx, zer)
            self._nonfinite.index_add_(0, idx, n - fin)
        if self._c_idx:
            hi = torch.stack(self._c_hi).to(dev, _ACC)
            lo = torch.stack(self._c_lo).to(dev, _ACC)
            self._amax.scatter_reduce_(
                0, _ix(self._c_idx, dev), torch.maximum(hi, lo.neg()), reduce="amax"
            )
        if self._g_rows:
            gsq = _segment_sumsq(self._g_rows, dev)
            gidx = [i for mods in self._g_mods for i in mods]
            src = [k for k, mods in enumerate(self._g_mods) for _ in mods]
            self._gsq.index_add_(0, _ix(gidx, dev), gsq[_ix(src, dev)])
        if self._t_pend:
            tidx = [i for mods, _ in self._t_pend for i in mods]
            tsq = torch.stack([q for mods, q in self._t_pend for _ in mods]).to(dev, _ACC)
            self._tsq.index_add_(0, _ix(tidx, dev), tsq)
        self._merge_underflow()
        self._reset_pending()
        self._grad_hooks.remove()  # the batch's backward ran: its handles go, not pile up
        self._tok_last = None
        self._batch += 1

    def _merge_underflow(self) -> None:
        dev = self.device
        for acc, pend in ((self._uf, self._uf_pend), (self._guf, self._guf_pend)):
            if pend:
                idx = [i for mods, _ in pend for i in mods]
                counts = torch.stack([c for mods, c in pend for _ in mods]).to(dev, _ACC)
                acc.index_add_(0, _ix(idx, dev), counts)
            pend.clear()
        self._uf_last = None

    # -- results --------------------------------------------------------------------
    def result(self, batches: int) -> dict[str, RawStats]:
        """One host transfer of everything; per-batch norms averaged as root-mean-square."""
        self.end_batch()
        if self.merge is not None:  # a distributed run: every rank's rows, exactly
            self.merge(self)
            self.merge = None
        if self._rep_g:  # whole gradients (summed over ranks): their Σg², once
            sq = torch.stack([g.square().sum() for g in self._rep_g]).to(self.device)
            at = [i for mods in self._rep_mods for i in mods]
            src = [k for k, mods in enumerate(self._rep_mods) for _ in mods]
            self._gsq.index_add_(0, _ix(at, self.device), sq[_ix(src, self.device)])
            self._rep_g, self._rep_mods = [], []
        dev, m = self.device, len(self.names)
        # per-channel max-abs = max(amax, -amin), a few kernels per distinct width
        groups: dict[tuple[int, torch.device], list[int]] = {}
        for i, acc in enumerate(self._chan):
            if acc is not None:
                groups.setdefault((acc[0].numel(), acc[0].device), []).append(i)
        blocks, summaries, kept, widths = [], [], [], []
        amax = self._amax.clone()
        for (width, _), members in groups.items():
            accs = [a for i in members if (a := self._chan[i]) is not None]  # all of them
            hi = torch.stack([a[0] for a in accs])
            lo = torch.stack([a[1] for a in accs])
            both = torch.maximum(hi, lo.neg()).to(dev, _ACC)
            rows = _ix(members, dev)
            amax[rows] = torch.maximum(amax[rows], both.amax(1))
            blocks.append(both.flatten())
            summaries.append(_channel_summary(both))
            kept += members
            widths += [width] * len(members)
        head = torch.stack(
            [
                self._n,
                self._mean,
                self._m2,
                self._zeros,
                self._nonfinite,
                amax,
                self._gsq,
                self._pgsq,
                self._uf.to(_ACC),
                self._guf.to(_ACC),
                self._tsq,
                self._token_medians(),
            ]
        ).flatten()
        tok_parts, tok_layout = self._token_parts()
        flat = torch.cat([head, *summaries, *blocks, *tok_parts]).cpu().tolist()  # the one transfer
        n, mean, m2, zeros, nonfin, amax_l, gsq, pgsq, uf, guf, tsq, tmed = (
            flat[k * m : (k + 1) * m] for k in range(12)
        )
        pos = 12 * m
        summary: list[dict[str, Any]] = [{} for _ in range(m)]
        for members in groups.values():
            k = len(members)
            dead, live, med, top = (flat[pos + j * k : pos + (j + 1) * k] for j in range(4))
            for r, i in enumerate(members):
                summary[i] = {
                    "channel_dead": int(dead[r]),
                    "channel_live": int(live[r]),
                    "channel_median": med[r],
                    "channel_top": top[r] if live[r] else None,
                }
            pos += 4 * k
        chan_lists: list[tuple[float, ...] | None] = [None] * m
        for i, width in zip(kept, widths, strict=True):
            chan_lists[i] = tuple(flat[pos : pos + width])
            pos += width
        views = self._token_results(flat, pos, tok_layout)
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
                max_abs=amax_l[i] if cnt else float("nan"),
                channel_max=chan_lists[i],
                grad_sumsq=(gsq[i] / batches) if self._gnumel[i] else None,
                grad_numel=self._gnumel[i],
                param_grad_sumsq=(pgsq[i] / batches)
                if self._has_params[i] and self.backward
                else None,
                order=self._order[i],
                token_grad_sumsq=tsq[i] if self._trows[i] else None,
                token_rows=self._trows[i],
                token_grad_median=tmed[i] if self._trows[i] and math.isfinite(tmed[i]) else None,
                **summary[i],
                **views.get(i, {}),
            )
        if self.underflow or self.loss_scale != 1.0:
            return self._fp16(out, uf, guf)
        return out

    def _token_medians(self) -> torch.Tensor:
        """(m,) fp64: per stream point the median over the batches of the median over
        tokens of |x_t|·|g_t| (NaN where none was measured); a few kernels for all."""
        dev, m = self.device, len(self.names)
        out = torch.full((m, max(1, len(self._tprod))), float("nan"), dtype=_ACC, device=dev)
        if not self._tprod:
            return out[:, 0]
        meds = torch.stack([v.median() for v in self._tprod]).to(dev, _ACC)
        rows, cols, src, seen = [], [], [], [0] * m
        for k, mods in enumerate(self._tprod_mods):
            for i in mods:
                rows.append(i)
                cols.append(seen[i])
                src.append(k)
                seen[i] += 1
        out[_ix(rows, dev), _ix(cols, dev)] = meds[_ix(src, dev)]
        return out.nanmedian(1).values

    def _token_parts(self) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """The per-token views as fp64 pieces of the one transfer: per module (index, k,
        width of the hit counts): values, codes, median, hit fractions."""
        parts: list[torch.Tensor] = []
        layout: list[tuple[int, int, int]] = []
        dev = self.device
        for i, (_, vals, codes) in self._tok_top.items():
            meds = torch.stack(self._tok_med[i]).to(dev)
            hits = self._tok_hits.get(i)
            frac = [] if not hits else [(hits[0] / hits[1].clamp_min(1)).to(dev, _ACC)]
            parts += [vals.to(dev, _ACC), codes.to(dev, _ACC), meds.median()[None], *frac]
            layout.append((i, vals.numel(), frac[0].numel() if frac else 0))
        return parts, layout

    def _token_results(
        self, flat: list[float], pos: int, layout: list[tuple[int, int, int]]
    ) -> dict[int, dict[str, Any]]:
        """RawStats fields of the per-token views, read from the transferred list."""
        views: dict[int, dict[str, Any]] = {}
        for i, k, width in layout:
            shape = self._tok_shape[i]
            numel = math.prod(shape)
            vals, codes = flat[pos : pos + k], flat[pos + k : pos + 2 * k]
            med = flat[pos + 2 * k]
            hits = tuple(flat[pos + 2 * k + 1 : pos + 2 * k + 1 + width]) if width else None
            pos += 2 * k + 1 + width
            top = tuple(
                (v, int(c) // numel, int(c) % numel) for v, c in zip(vals, codes, strict=True)
            )
            views[i] = {"top": top, "shape": shape, "median_abs": med, "channel_hits": hits}
        return views

    def _fp16(
        self, out: dict[str, RawStats], uf: list[float], guf: list[float]
    ) -> dict[str, RawStats]:
        """fp16 runs: the underflow counts, and gradient sums unscaled by the loss scale."""
        from dataclasses import replace

        s2 = self.loss_scale**2

        def unscaled(x: float | None, s: float = s2) -> float | None:
            return None if x is None else x / s

        return {
            name: replace(
                r,
                underflow=int(uf[i]) if self.underflow else None,
                grad_underflow=int(guf[i]) if self.underflow and self._gnumel[i] else None,
                grad_sumsq=unscaled(r.grad_sumsq),
                token_grad_sumsq=unscaled(r.token_grad_sumsq),
                token_grad_median=unscaled(r.token_grad_median, self.loss_scale),
                param_grad_sumsq=unscaled(r.param_grad_sumsq),
            )
            for i, (name, r) in enumerate(out.items())
        }


def _channel_summary(both: torch.Tensor) -> torch.Tensor:
    """(4·k,) fp64 for k rows of per-channel max-abs: dead count, live count, median and
    max of the live channels (> 0 and finite), one sort for all rows.

    The median is statistics.median's (the middle value, or the mean of the two middle
    ones), 0.0 when no channel is live.
    """
    live = (both > 0) & (both < float("inf"))  # NaN is neither
    count = live.sum(1)
    srt = torch.where(live, both, float("inf")).sort(1).values  # live values first
    last = both.shape[1] - 1
    lo = srt.gather(1, ((count - 1).clamp(0, last) // 2)[:, None])[:, 0]
    hi = srt.gather(1, (count // 2).clamp(max=last)[:, None])[:, 0]
    med = torch.where(count % 2 == 1, lo, (lo + hi) / 2)
    top = srt.gather(1, (count - 1).clamp(0, last)[:, None])[:, 0]
    none = count == 0
    return torch.cat(
        [
            (both == 0).sum(1).to(_ACC),
            count.to(_ACC),
            med.masked_fill(none, 0.0),
            top.masked_fill(none, 0.0),
        ]
    )


def _ix(values: Sequence[int], dev: torch.device) -> torch.Tensor:
    """Host ints -> device int64 without a blocking copy (no host sync on CUDA)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if dev.type == "cpu" else t.to(dev, non_blocking=True)


def _segment_sumsq(rows: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """Σ r² in fp64 of each 1-d fp32 row-norm vector: a handful of kernels per batch."""
    lens = [r.numel() for r in rows]
    vals = torch.cat([r if r.dim() == 1 else r.reshape(-1) for r in rows]).to(dev, _ACC).square()
    seg = torch.repeat_interleave(
        torch.arange(len(rows), device=dev), _ix(lens, dev), output_size=sum(lens)
    )  # output_size given: no host sync
    return torch.zeros(len(rows), dtype=_ACC, device=dev).index_add_(0, seg, vals)


def moments(tensors: Sequence[torch.Tensor]) -> list[tuple[float, float, int]]:
    """(mean, std, non-finite count) of each tensor, e.g. every parameter of a model.

    Tensors above _SMALL values take one compiled read of Σx and Σx² in fp64 (fp32 on a
    CPU with llvmlite: 0.116 → 0.087 s over GPT-2's 124M) or two vectorised passes (Σx
    and row norms); both ~10× faster than Welford. A tensor whose mean turns out to
    dwarf its spread (a norm gain, a bias: Σx² − n·mean² cancels there) is measured
    again with Welford's var_mean, as are the small ones from the start. At most two
    host transfers (outside any hook, a host-side decision is free); the exact
    non-finite count only for the rare tensors whose sums are not finite.
    """
    xs: list[torch.Tensor | None] = []
    parts: list[torch.Tensor] = []
    for t in tensors:
        t = t.detach()
        if t.device.type == "meta" or t.numel() == 0 or not t.is_floating_point():
            xs.append(None)
            parts.append(torch.zeros(2, dtype=_ACC))
            continue
        x = t if t.dtype in _WORK else t.float()
        xs.append(x)
        parts.append(_welford(x) if x.numel() <= _SMALL else _fast_moments(x))
    host = _to_host(parts)
    # Σx² − n·mean² keeps ~1e-7 × (1 + mean²/var) relative from fp32 rows: redo where
    # mean² > 10·var; from the fp64 sums of one read ~1e-16 × (1 + mean²/var): only where
    # mean² > 1e8·var (fp32 Welford's own ~1e-7 is then the better figure)
    redo = [
        (k, x)
        for k, (x, (mean, var)) in enumerate(zip(xs, host, strict=True))
        if x is not None
        and x.numel() > _SMALL
        and not var > (1e-8 if _one_read(x) else 10) * mean * mean
    ]
    if redo:
        again = _to_host([_welford(x) for _, x in redo])
        for (k, _), mv in zip(redo, again, strict=True):
            host[k] = mv
    out = []
    for t, (mean, var) in zip(tensors, host, strict=True):
        if not t.numel() or t.device.type == "meta" or not t.is_floating_point():
            out.append((0.0, 0.0, 0))
            continue
        bad = 0
        if not (abs(mean) < float("inf") and abs(var) < float("inf")):  # NaN or inf
            bad = int((~torch.isfinite(t.detach())).sum())
        out.append((mean, max(var, 0.0) ** 0.5 if var == var else var, bad))
    return out


def _to_host(parts: Sequence[torch.Tensor]) -> list[list[float]]:
    """Each (mean, var) pair on the host: one stack and one transfer per device, not one
    per tensor (on a GPU each transfer is a sync)."""
    out: list[list[float]] = [[] for _ in parts]
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(parts):
        by_device.setdefault(p.device, []).append(i)
    for idx in by_device.values():
        for i, pair in zip(idx, torch.stack([parts[i] for i in idx]).cpu().tolist(), strict=True):
            out[i] = pair
    return out


def _welford(x: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, correction=0)
    return torch.stack([mean, var]).to(_ACC)


def _one_read(x: torch.Tensor) -> bool:
    """Whether `_fast_moments` takes x's sums in fp64 from one compiled read."""
    return x.dtype == torch.float32 and x.is_contiguous() and fused_reduce.runs_on(x.device)


def _fast_moments(x: torch.Tensor) -> torch.Tensor:
    if _one_read(x):
        s1, s2 = fused_reduce.sums(x).unbind()  # one read, both sums in fp64
        mean = s1 / x.numel()
        return torch.stack([mean, s2 / x.numel() - mean * mean])
    x = x.reshape(1, -1) if x.dim() < 2 else x
    if x.shape[-1] > _MAX_CHANNELS and x.is_contiguous() and x.numel() % _WIDE_ROW == 0:
        x = x.view(-1, _WIDE_ROW)
    mean = x.sum(-1).sum(dtype=_ACC) / x.numel()  # row sums: faster than one long sum on CPU
    q = _vnorm(_vnorm(x, dim=-1), dtype=_ACC)
    return torch.stack([mean, q * q / x.numel() - mean * mean])


def iter_named(model: nn.Module, pattern: str | None) -> Iterator[tuple[str, nn.Module]]:
    """Modules to record: every named module except the root, filtered by a regex."""
    import re

    rx = re.compile(pattern) if pattern else None
    for name, mod in model.named_modules():
        if not name:
            continue
        if rx is None or rx.search(name):
            yield name, mod


def check_modules(model: nn.Module, pattern: str | None) -> None:
    """A `--modules` regex that matches no module would record nothing and skip every
    check in silence: UsageError naming the pattern and a few of the model's names."""
    if pattern is None or next(iter_named(model, pattern), None) is not None:
        return
    names = [name for name, _ in model.named_modules() if name]
    some = f" (its modules are named like {', '.join(names[:4])})" if names else ""
    raise UsageError(f"--modules {pattern!r} matches no module of the model{some}")
