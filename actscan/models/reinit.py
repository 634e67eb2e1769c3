"""`--init SCHEME` on any model (`reinit`), with helpers that act on measured facts, not on
module types or family tables.

* `unit_gain_`: sets a norm's weight so that its effective gain (measured by a probe) is 1:
  w = 1 for x·w norms, w = 0 for Gemma's x·(1 + w).
* `token_usage` + `init_unhandled_`: re-initializes parameters the forward pass uses as
  matmul weights that are not the weight of an `nn.Linear` (fused 3-D MoE experts, routers
  holding a bare weight) with their real fan-in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from actscan.errors import ConfigError
from actscan.layout.detect import is_norm
from actscan.layout.usage import Usage, measure_usage, probe_gain
from actscan.measure.state import eval_mode
from actscan.models.arch import INITS, ArchConfig
from actscan.models.gpt import linear_std


def unit_gain_(mod: nn.Module, weight: nn.Parameter) -> None:
    """Effective gain 1 per channel. The gain is affine in w: probe at w = 0 and w = 1 and
    solve; a norm the probe cannot run keeps w = 1, the classical rule."""
    with torch.no_grad():
        weight.zero_()
        g0 = probe_gain(mod, weight)
        weight.fill_(1.0)
        g1 = probe_gain(mod, weight)
        if g0 is None or g1 is None:
            return
        slope = g1 - g0
        if bool((slope.abs() < 1e-6).any()):
            return
        w = (1.0 - g0) / slope
        # the norm's eps shifts the solution by ~1e-6: snap to the designed 1 (or 0)
        w = torch.where((w - w.round()).abs() < 1e-3, w.round(), w)
        weight.copy_(w.to(weight.dtype))


def token_usage(model: nn.Module) -> Usage | None:
    """Usage of a transformers model that reads token ids (one 8-token pass), else None."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if getattr(model, "main_input_name", "input_ids") != "input_ids" or not isinstance(vocab, int):
        return None
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    try:
        with eval_mode(model):
            return measure_usage(model, (), {"input_ids": ids})
    except Exception:  # a model this pass cannot run: --init keeps to nn.Linear weights
        return None


def is_linear_bias(usage: Usage | None, model: nn.Module, bias: nn.Parameter) -> bool:
    """Whether a bias enters a linear/conv call as its bias (zeroed by --init), rather than
    being structured (Mamba's dt_proj.bias sets the SSM time scales: kept)."""
    if usage is None:
        return True
    name = next((n for n, p in model.named_parameters() if p is bias), None)
    return name is None or any(u.op == "bias" for u in usage.uses.get(name, ()))


def init_unhandled_(
    model: nn.Module, usage: Usage | None, std: Callable[[int, int], float], done: set[int]
) -> list[str]:
    """N(0, std(fan_in, fan_out)) for matmul weights not yet initialized; their names."""
    if usage is None:
        return []
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            use = usage.role(name)
            if id(p) in done or use is None or use.op not in ("matmul", "conv"):
                continue
            if not use.fan_in:
                continue
            nn.init.normal_(p, 0.0, std(int(use.fan_in), int(use.fan_out or use.fan_in)))
            done.add(id(p))
            out.append(name)
    return out


def reinit(model: nn.Module, scheme: str, init_std: float, seed: int, flag: str = "--init") -> None:
    """`--init SCHEME` on a transformers model, with the built-in family's std rules.

    Linear (and GPT-2's transposed Conv1D) weights ~ N(0, std(scheme, fan_in, fan_out)),
    biases 0; embeddings N(0, init_std) for gpt2 (init_std/10 for small), else N(0, 1);
    norm gains 1 and biases 0. A tied head is the embedding's tensor and is left to it.
    Measured, not guessed: a norm's gain is 1 as the norm applies
    it (w = 0 for (1 + w) norms); other matmul weights (fused 3-D MoE experts) get the same
    rule with the fan-in the forward pass contracts over; structured biases are kept.
    """

    if scheme not in INITS:
        raise ConfigError(f"{flag} must be one of {'|'.join(INITS)}, got '{scheme}'")
    rule = ArchConfig(init=scheme, init_std=init_std)
    emb_std = {"gpt2": init_std, "small": init_std / 10}.get(scheme, 1.0)
    done: set[int] = set()
    usage = token_usage(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for mod in model.modules():
            weight = getattr(mod, "weight", None)
            if not isinstance(weight, nn.Parameter) or id(weight) in done:
                continue
            bias = getattr(mod, "bias", None)
            if isinstance(mod, nn.Embedding):
                nn.init.normal_(weight, 0.0, emb_std)
            elif isinstance(mod, nn.Linear) or (
                type(mod).__name__ == "Conv1D" and weight.dim() == 2
            ):
                fan_in, fan_out = (
                    weight.shape if type(mod).__name__ == "Conv1D" else weight.shape[::-1]
                )
                nn.init.normal_(weight, 0.0, linear_std(rule, int(fan_in), int(fan_out)))
            elif is_norm(mod):
                unit_gain_(mod, weight)
            else:
                continue
            done.add(id(weight))
            if (
                isinstance(bias, nn.Parameter)
                and id(bias) not in done
                and is_linear_bias(usage, model, bias)
            ):
                nn.init.zeros_(bias)
                done.add(id(bias))
        init_unhandled_(model, usage, lambda fi, fo: linear_std(rule, fi, fo), done)
