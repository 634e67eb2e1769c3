"""ModelInfo for a model whose resolver is not a file: the built-in family and a bare
nn.Module (the API, `module:callable`).

`builtin_info` is the one place the built-in family's ModelInfo is made: a config, a
checkpoint, a sharded build and `scan()` on an `ActscanGPT` all describe it the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actscan.records import ModelInfo

if TYPE_CHECKING:
    from torch import nn

    from actscan.models.arch import ArchConfig

__all__ = ["builtin_info", "infer_info"]


def builtin_info(
    cfg: ArchConfig, source: str, n_params: int, *, at_init: bool, with_config: bool = True
) -> ModelInfo:
    """The built-in family's ModelInfo; `with_config` adds the whole config to `arch`
    (what a config or checkpoint target records; a module handed over in code does not)."""
    from actscan.models.gpt import arch_facts

    arch = {**arch_facts(cfg), "max_positions": cfg.seq_len}
    if with_config:
        arch["config"] = cfg.to_dict()
    return ModelInfo(
        source=source,
        family=cfg.family,
        n_params=n_params,
        n_blocks=cfg.n_layers,
        d_model=cfg.d_model,
        vocab_size=cfg.vocab_size,
        at_init=at_init,
        task="causal-lm",
        arch=arch,
    )


def infer_info(model: nn.Module, source: str = "python") -> ModelInfo:
    """What can be read off an nn.Module without a resolver's help.

    A module handed over in code (the API, `module:callable`) is taken to be at init: that
    is how tests and CI build models, and init-scale is what catches a broken init there.
    Trained weights say so with `scan(at_init=False)` (`--trained`).
    """
    from actscan.models.gpt import ActscanGPT

    n_params = sum(p.numel() for p in model.parameters())
    if isinstance(model, ActscanGPT):
        return builtin_info(model.config, source, n_params, at_init=True, with_config=False)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type:
        vocab = getattr(config, "vocab_size", None)
        d = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        is_lm = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
        return ModelInfo(
            source=source,
            family=str(model_type),
            n_params=n_params,
            d_model=d,
            vocab_size=vocab,
            task="causal-lm" if is_lm else "encoder",
            at_init=True,
        )
    return ModelInfo(source=source, family="custom", n_params=n_params, at_init=True)
