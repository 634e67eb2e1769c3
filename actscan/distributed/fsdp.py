"""FSDP2 wrapping, shard-wise materialisation and the sharded backward pass.

The model is built on the meta device, `fully_shard` wraps every block of its layout
(then the root, which keeps the rest: embeddings, final norm, head), and each rank
allocates only its own shards (`to_empty`). Values reach a shard in one of two ways:

* `fill_local(model, values)`: a dict name → full-shape *source* (a safetensors slice
  reader or a tensor computed one unit at a time) of which each rank copies only the
  rows of its shard (FSDP2 shards dim 0, `torch.chunk`-style);
* the built-in family computes its init one unit at a time (targets: `build.py`).

A parameter's local rows are read off its DTensor (`compute_local_shape_and_global_offset`),
so the loader follows FSDP2's own layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from actscan.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


def check_supported(run_dtype: torch.dtype | None, *, model_dtype: torch.dtype) -> None:
    """What a distributed scan() does not run yet: casting sharded weights (--dtype)."""
    if run_dtype is not None and run_dtype != model_dtype:
        raise UsageError(
            "--dtype is not supported in distributed runs yet (sharded weights stay "
            "fp32): use --amp bf16|fp16 for a low-precision forward"
        )


def local_rows(p: Any) -> tuple[int, int]:
    """[start, stop) of dim 0 that this rank's shard of `p` (a DTensor) holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if not shape:
        return 0, 0
    return int(offset[0]), int(offset[0]) + int(shape[0])


def shard_model(model: nn.Module, blocks: Iterable[str], device: torch.device) -> list[FSDPModule]:
    """fully_shard every block, then the root; ranks hold shards only (still on meta).

    Gradients are summed, not averaged, across ranks: each rank's loss is already its
    share (1/N) of the global mean, so the sum is the one-process gradient.
    """
    from torch.distributed.fsdp import fully_shard

    mods = dict(model.named_modules())
    wrapped: list[FSDPModule] = []
    for name in blocks:
        mod = mods[name]
        if any(True for _ in mod.parameters()):
            wrapped.append(fully_shard(mod))
    wrapped.append(fully_shard(model))
    for m in wrapped:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    return wrapped


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's shards; buffers (not sharded) keep their values."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved:
                b.copy_(saved[name].to(b.device))


def fill_local(model: nn.Module, read: Callable[[str, int, int], torch.Tensor | None]) -> list[str]:
    """Copy into every parameter's local shard the rows `read(name, start, stop)` returns
    (None: no value for that name). Returns the names that had none."""
    from torch.distributed.tensor import DTensor

    missing = []
    seen: set[int] = set()
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(p, DTensor):
                lo, hi = local_rows(p)
                local = p.to_local()
            else:
                lo, hi, local = 0, (p.shape[0] if p.dim() else 0), p
            if local.numel() == 0:
                if read(name, lo, lo) is None:
                    missing.append(name)
                continue
            rows = read(name, lo, hi)
            if rows is None:
                missing.append(name)
                continue
            local.copy_(rows.reshape(local.shape).to(local.dtype))
    return missing


def sharded_grads(
    loss: torch.Tensor, params: Sequence[torch.Tensor], world_size: int
) -> list[torch.Tensor | None]:
    """Backward of this rank's share (1/N) of the global mean loss: FSDP's reduced
    gradients of `params` (DTensors, sharded like the parameters: what the sharded
    optimizer steps with). `.grad` is cleared again."""
    (loss / world_size).backward()
    out = [p.grad for p in params]
    for p in params:
        p.grad = None
    return out


def local_grad(g: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient's local shard (DTensor `to_local()`), or the gradient itself."""
    from torch.distributed.tensor import DTensor

    return g.to_local() if isinstance(g, DTensor) else g


def reshard_all(model: nn.Module) -> None:
    """Back to shards everywhere (FSDP keeps the root unsharded after a forward)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (local shards)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total
