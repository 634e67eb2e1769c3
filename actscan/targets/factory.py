"""`package.module:callable` as a TARGET: profile any nn.Module from the user's own code.

The contract (also the README's):

* `package.module` is imported like `python -m` would: the current working directory comes
  first on `sys.path`, so `actscan profile mymodels:build` works from a repository's root
  without installing it. `callable` may be dotted (`mymodels:Factory.tiny`).
* The callable is called with no arguments and returns either
    - an `nn.Module`, or
    - a tuple `(module, example_inputs)`, where `example_inputs` is a tensor (one positional
      argument), a tuple (positional arguments) or a dict (keyword arguments) for
      `module(...)`; the same inputs are used for every batch.
* Inputs, first match wins:
    1. `--input-shape 4,32`: a standard-normal float tensor of that shape, re-drawn per batch
       from `--seed` (it overrides example inputs, so one factory serves several shapes);
    2. the example inputs the callable returned;
    3. a transformers model or the built-in actscan-gpt: random token ids, as for any LM,
       or the model's main input built from its config (images, audio, encoder-decoders);
    4. a module that owns an `nn.Embedding`: random token ids in `[0, vocab)` where vocab is
       the largest embedding's size, shape `--batch` × `--seq-len` (default 64, capped by the
       smallest other embedding, e.g. learned positions). One tiny forward pass decides the
       loss: if the output's last dimension equals vocab, it is read as logits and the loss
       is next-token cross-entropy (task "causal-lm"), else the mean square of the output;
    5. otherwise: an error asking for `--input-shape`.
* The loss is the mean square of the first output tensor unless rule 3/4 makes it a
  language model. The model is profiled as returned (no re-initialization) and taken to be
  at init: init-scale checks run (`TargetOptions.at_init=False`, `--trained`, says otherwise).
  A `torch.compile`d module is profiled through its original module, and a model built on
  the meta device is materialised with its own initialisers (measure/prepare.py).

Every failure — the module does not import, the attribute is missing, the callable raises or
returns the wrong type — is one BadInputError line naming the target (exit 2).
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import replace
from typing import Any

from actscan.errors import BadInputError, ResourceError, UsageError, resource_cause, resource_kind
from actscan.targets.info import infer_info
from actscan.targets.resolved import Resolved, TargetOptions

_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
DEFAULT_SEQ = 64
DEFAULT_BATCH = 4


def _one_line(err: BaseException) -> str:
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def load_callable(target: str) -> Any:
    """Import `package.module` and look up `callable` (dotted attribute path allowed)."""
    mod_name, _, attr = target.rpartition(":")
    if not _MODULE_RE.match(mod_name) or not _MODULE_RE.match(attr):
        raise BadInputError(
            f"'{target}': expected package.module:callable (e.g. mymodels:build_model)"
        )
    if sys.path[:1] != [""]:  # like `python -m`: the working directory first
        sys.path.insert(0, "")
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as err:
        if err.name and (mod_name == err.name or mod_name.startswith(err.name + ".")):
            raise BadInputError(
                f"'{target}': no module named '{err.name}' (run actscan from the folder that "
                "holds it, or install the package)"
            ) from None
        raise BadInputError(f"'{target}': importing {mod_name} failed: {_one_line(err)}") from None
    except BaseException as err:  # user code: any error, SystemExit included, is one line
        if isinstance(err, KeyboardInterrupt):
            raise
        raise BadInputError(f"'{target}': importing {mod_name} failed: {_one_line(err)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BadInputError(f"'{target}': module '{mod_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise BadInputError(f"'{target}': {attr} is a {type(obj).__name__}, not a callable")
    return obj


def resolve_factory(target: str, opts: TargetOptions) -> Resolved:
    """Call the user's factory and turn its result into a Resolved (see module docstring)."""
    import torch
    from torch import nn

    fn = load_callable(target)
    try:
        result = fn()
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt):
            raise
        if resource_kind(err) is not None:  # the factory asked for more than the machine has
            raise ResourceError(
                f"'{target}': calling it hit {resource_cause(err)}: make the factory build "
                "a smaller model, or run on a machine with more memory"
            ) from None
        raise BadInputError(f"'{target}': calling it raised {_one_line(err)}") from None
    example: Any = None
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[0], nn.Module):
            raise BadInputError(
                f"'{target}' returned a tuple of {len(result)} "
                f"({', '.join(type(r).__name__ for r in result)}); "
                "expected (nn.Module, example_inputs)"
            )
        result, example = result
        if not isinstance(example, torch.Tensor | tuple | dict):
            raise BadInputError(
                f"'{target}': example inputs are a {type(example).__name__}; expected a "
                "tensor, a tuple of arguments or a dict of keyword arguments"
            )
    if not isinstance(result, nn.Module):
        raise BadInputError(
            f"'{target}' returned {type(result).__name__}; expected an nn.Module "
            "or (nn.Module, example_inputs)"
        )
    if opts.init is not None or opts.overrides:
        raise UsageError(
            f"{opts.flag('init')} and {opts.flag('set')} apply to config targets, not to '{target}'"
        )
    from actscan.measure.prepare import materialize_meta, unwrap_compiled

    model, compiled = unwrap_compiled(result)
    made = materialize_meta(model, f"'{target}'", seed=opts.seed)
    notes = tuple(n for n in (compiled, made) if n)
    resolved = _resolve_module(target, model, example, opts)
    return replace(resolved, notes=(*notes, *resolved.notes)) if notes else resolved


def _resolve_module(target: str, model: Any, example: Any, opts: TargetOptions) -> Resolved:
    """Inputs for the user's module, first match wins (module docstring, "Inputs")."""
    from actscan.measure.inputs import tensor_source, user_source
    from actscan.measure.model_inputs import takes_token_ids

    info = infer_info(model, source=target)
    max_pos = _max_positions(model)
    if max_pos:
        info = replace(info, arch={**info.arch, "max_positions": max_pos})
    if opts.input_shape is not None:
        return Resolved(model, info, inputs=tensor_source(opts.input_shape, opts.seed))
    if example is not None:
        return Resolved(model, info, inputs=user_source(example))
    if not takes_token_ids(model) or (info.vocab_size and info.task in ("causal-lm", "encoder")):
        return Resolved(model, info)  # scan() builds inputs as for a transformers target
    return _token_inputs(target, model, info, opts)


def _token_inputs(target: str, model: Any, info: Any, opts: TargetOptions) -> Resolved:
    """Rule 4 of the contract: random token ids for a module with an nn.Embedding."""
    import torch
    from torch import nn

    from actscan.measure.inputs import token_source
    from actscan.measure.recorder import first_tensor
    from actscan.measure.state import eval_mode

    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not sizes:
        raise BadInputError(
            f"'{target}': cannot invent inputs for {type(model).__name__} (no nn.Embedding): "
            "pass --input-shape, e.g. --input-shape 4,32, or return (model, example_inputs)"
        )
    vocab = max(sizes)
    others = sorted(sizes)[:-1]
    seq = opts.seq_len or min([DEFAULT_SEQ, *others])
    batch = opts.batch or DEFAULT_BATCH
    source = token_source(vocab, batch, seq, opts.seed)
    # One tiny pass decides the loss: logits over the vocabulary, or anything else.
    probe = source(0).args[0][:1]
    try:
        with eval_mode(model), torch.no_grad():
            out = first_tensor(model(probe.to(_device(model))))
    except Exception as err:
        raise BadInputError(
            f"'{target}': {type(model).__name__} failed on random token ids "
            f"(vocab {vocab}, shape {list(probe.shape)}): {_one_line(err)}; "
            "pass --input-shape or return (model, example_inputs)"
        ) from None
    is_lm = out is not None and out.dim() == 3 and out.shape[-1] == vocab
    info = replace(info, vocab_size=vocab, task="causal-lm" if is_lm else "custom")
    return Resolved(
        model, info, inputs=source, notes=(f"inputs: random token ids in [0, {vocab})",)
    )


def _device(model: Any) -> Any:
    import torch

    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _max_positions(model: Any) -> int | None:
    """The longest sequence a built-in or transformers model accepts, if it says."""
    cfg = getattr(model, "config", None)
    for key in ("seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
