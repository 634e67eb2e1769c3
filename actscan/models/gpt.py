"""The built-in `actscan-gpt` decoder-only transformer and its init schemes.

Written for legibility and exact control of every scale the theory talks about: each
branch scale (1/√(2L), ReZero, LayerScale, DeepNorm), the attention-logit scale and the
init rule are one config field. Attention logits pass through an identity module
(`AttentionLogits`) so the recorder sees them.

Each parameter's initial values come from its own random generator, seeded from (seed,
parameter name): the weights depend on the seed alone, never on the order parameters are
built in, so an eager build, a meta-device build initialised after, and a rank that builds
one block at a time all hold the same numbers, and none advances a shared random stream.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from actscan.models.arch import ArchConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


class AttentionLogits(nn.Identity):
    """Marks the pre-softmax attention scores (B, H, T, T) so they can be measured."""


class ScaledReadout(nn.Linear):
    """The μP readout: logits = (x Wᵀ) · mult with mult = 1/width_mult.

    A multiplier rather than Table 3's init variance 1/fan_in² and Adam lr η/fan_in: the
    two are the same network under Adam (W' = W/m has init std σ/m and moves by η/m per
    step), but the multiplier keeps tied embeddings possible and the logits nonzero at
    t = 0 (a zero-initialised readout has no log-log slope to fit there). A Linear, so
    the recorder and the layout see the scaled logits as the head's output."""

    def __init__(self, in_features: int, out_features: int, mult: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.mult = float(mult)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.mult


class BranchGain(nn.Module):
    """y = g · x with a learnable scalar (ReZero) or per-channel vector (LayerScale)."""

    def __init__(self, shape: tuple[int, ...], init: float) -> None:
        super().__init__()
        self.init_value = float(init)  # init_weights refills it (a meta build has no values)
        self.gain = nn.Parameter(torch.full(shape, self.init_value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x


def _norm(cfg: ArchConfig, dim: int | None = None) -> nn.Module:
    dim = cfg.d_model if dim is None else dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (B, H, T, D)."""
    _, _, t, d = x.shape
    half = d // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * freqs  # (T, D/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.rope = cfg.position == "rope"
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.logits = AttentionLogits()
        # QK-norm (cfg.qk_norm): per-head norms of q and k; absent otherwise, so a model
        # without it has exactly the parameters, draws and outputs it always had.
        self.q_norm = _norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.scale = {
            "1/sqrt(dk)": 1.0 / math.sqrt(cfg.head_dim),
            "1/dk": 1.0 / cfg.head_dim,
            "none": 1.0,
        }[cfg.attn_scale]
        if cfg.parametrization == "mup":
            # 1/d_head, equal to 1/√d_head at the base width: √(d_head/m) / d_head.
            self.scale = 1.0 / math.sqrt(cfg.head_dim * cfg.width_mult)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        # (B, T, C) -> (B, H, T, D)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = _rope(q), _rope(k)
        scores = self.logits((q @ k.transpose(-2, -1)) * self.scale)  # (B, H, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        self.up = nn.Linear(cfg.d_model, cfg.ff_dim, bias=cfg.bias)
        if self.gated:
            self.gate = nn.Linear(cfg.d_model, cfg.ff_dim, bias=cfg.bias)
        self.act = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "swiglu": nn.SiLU}[
            cfg.activation
        ]()
        self.down = nn.Linear(cfg.ff_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.pre = cfg.placement == "pre"
        self.norm1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = _norm(cfg)
        self.mlp = MLP(cfg)
        self.alpha = cfg.deepnorm_alpha if cfg.branch_scale == "deepnorm" else 1.0
        if cfg.branch_scale in {"rezero", "layerscale"}:
            shape = (1,) if cfg.branch_scale == "rezero" else (cfg.d_model,)
            init = 0.0 if cfg.branch_scale == "rezero" else cfg.layerscale_init
            self.attn_gain: nn.Module = BranchGain(shape, init)
            self.mlp_gain: nn.Module = BranchGain(shape, init)
        else:
            self.attn_gain = nn.Identity()
            self.mlp_gain = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre:
            x = x + self.attn_gain(self.attn(self.norm1(x)))
            return x + self.mlp_gain(self.mlp(self.norm2(x)))
        x = self.norm1(self.alpha * x + self.attn_gain(self.attn(x)))
        return self.norm2(self.alpha * x + self.mlp_gain(self.mlp(x)))


class ActscanGPT(nn.Module):
    """Decoder-only LM: ids (B, T) -> logits (B, T, V).

    `ActscanGPT(cfg, seed=s)` holds the weights of `build_model(cfg, s)` (which skips
    PyTorch's default initialisers this constructor runs first); under the meta device it
    holds none, and `init_weights` gives them later. `seed=None` draws from the global
    random stream in module order instead, as the committed sample checkpoints were made.
    """

    def __init__(self, cfg: ArchConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = _norm(cfg) if cfg.placement == "pre" else None
        if cfg.parametrization == "mup":
            self.head: nn.Linear = ScaledReadout(cfg.d_model, cfg.vocab_size, 1 / cfg.width_mult)
        else:
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        init_weights(self, cfg, seed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.config.seq_len and self.pos_emb is not None:
            raise ValueError(
                f"sequence length {t} exceeds the model's seq_len {self.config.seq_len}"
            )
        x = self.tok_emb(ids)  # (B, T, C)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        if self.norm_f is not None:
            x = self.norm_f(x)
        return self.head(x)

    def actscan_param_groups(self, lr: float) -> list[dict[str, Any]]:
        """Optimizer parameter groups with their learning rates (the steps engine uses
        them when a model has this method).

        μP (Tensor Programs V, Table 3, Adam): hidden matrices (the 2-D weights inside
        the blocks) at lr / width_mult; embeddings, the readout (its 1/width_mult
        multiplier already scales its update) and vectors (biases, norm and branch gains)
        at lr. SP: one group at lr.
        """
        params = dict(self.named_parameters())  # tied weights once
        if self.config.parametrization != "mup":
            return [{"params": list(params.values()), "lr": lr, "name": "all"}]
        hidden = [p for n, p in params.items() if n.startswith("blocks.") and p.ndim >= 2]
        ids = {id(p) for p in hidden}
        rest = [p for p in params.values() if id(p) not in ids]
        groups = [
            {"params": hidden, "lr": lr / self.config.width_mult, "name": "hidden"},
            {"params": rest, "lr": lr, "name": "vector-embedding-readout"},
        ]
        return [g for g in groups if g["params"]]


def linear_std(cfg: ArchConfig, fan_in: int, fan_out: int) -> float:
    return {
        "gpt2": cfg.init_std,
        "small": cfg.init_std / 10,
        "xavier": math.sqrt(2.0 / (fan_in + fan_out)),
        "kaiming": math.sqrt(2.0 / fan_in),
        "fan-in": math.sqrt(1.0 / fan_in),
    }[cfg.init]


def param_seed(seed: int, name: str) -> int:
    """The seed of one parameter's generator: a stable hash of (seed, name), the same in
    every process and Python version (unlike `hash()`)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _normal_(p: torch.Tensor, std: float, name: str, seed: int | None) -> None:
    """N(0, std²) into p from the generator of (seed, name), drawn in fp32 on the CPU so the
    values do not depend on p's device; the global stream when seed is None; nothing for a
    meta tensor (no values to hold, and meta normal_ imports torch._dynamo)."""
    if p.is_meta:
        return
    if seed is None:
        nn.init.normal_(p, 0.0, std)
        return
    gen = torch.Generator().manual_seed(param_seed(seed, name))
    if p.device.type == "cpu" and p.dtype == torch.float32:
        p.normal_(0.0, std, generator=gen)
    else:
        p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))


@torch.no_grad()
def init_weights(model: ActscanGPT, cfg: ArchConfig, seed: int | None = 0) -> None:
    """Apply cfg.init, then the branch scale. Norm gains 1, biases 0 (identity at init).

    Every draw is keyed by (seed, parameter name), so any subset of the model may hold
    values (the rest on the meta device, skipped): a rank initialising one block at a time
    gets that block's share of the whole model's weights.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # tied: the first name
    emb_std = cfg.init_std if cfg.init in {"gpt2", "small"} else (cfg.embed_std or 1.0)
    if cfg.init == "small":
        emb_std = cfg.init_std / 10
    if cfg.embed_std is not None:
        emb_std = cfg.embed_std
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            _normal_(mod.weight, emb_std, names[id(mod.weight)], seed)
        elif isinstance(mod, nn.Linear):
            if mod is model.head and cfg.tie_embeddings:
                continue
            std = linear_std(cfg, mod.in_features, mod.out_features)
            if cfg.parametrization == "mup":
                std = _mup_std(cfg, mod, mod is model.head)
            _normal_(mod.weight, std, names[id(mod.weight)], seed)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.LayerNorm | RMSNorm):
            nn.init.ones_(mod.weight)
            if (bias := getattr(mod, "bias", None)) is not None:
                nn.init.zeros_(bias)
        elif isinstance(mod, BranchGain):
            mod.gain.fill_(mod.init_value)
    for block in model.blocks:
        assert isinstance(block, Block)
        if cfg.mlp_bias_init and block.mlp.up.bias is not None:
            block.mlp.up.bias.fill_(cfg.mlp_bias_init)
        if cfg.branch_scale == "depth":
            block.attn.proj.weight.mul_(cfg.depth_scale)
            block.mlp.down.weight.mul_(cfg.depth_scale)
        elif cfg.branch_scale == "deepnorm":
            beta = cfg.deepnorm_beta
            c = cfg.d_model
            block.attn.qkv.weight[2 * c :].mul_(beta)  # value projection
            block.attn.proj.weight.mul_(beta)
            for lin in (block.mlp.up, block.mlp.down, getattr(block.mlp, "gate", None)):
                if lin is not None:
                    lin.weight.mul_(beta)


def _mup_std(cfg: ArchConfig, mod: nn.Linear, readout: bool) -> float:
    """μP init (Table 3, Adam): each rule evaluated at the base width's fan-in and
    fan-out, then hidden matrices ×1/√width_mult (variance ∝ 1/fan_in: a fan-in rule is
    unchanged, GPT-2's flat 0.02 becomes 0.02/√m); the readout keeps its base std (its
    1/width_mult multiplier makes the variance 1/fan_in²). Same draws as SP."""
    m = cfg.width_mult
    if readout:
        return linear_std(cfg, max(1, round(mod.in_features / m)), mod.out_features)
    base = linear_std(cfg, max(1, round(mod.in_features / m)), max(1, round(mod.out_features / m)))
    return base / math.sqrt(m)


def build_model(cfg: ArchConfig, seed: int = 0) -> ActscanGPT:
    """Build deterministically: the same config and seed give the same weights.

    The weights of `ActscanGPT(cfg, seed=seed)`, initialised once: the model is built on
    the meta device, so PyTorch's default initialisers (which init_weights overwrites)
    never run, then given CPU storage and its keyed init. The global random stream is not
    touched.
    """
    with torch.device("meta"), NoMetaNormal():
        model = ActscanGPT(cfg, seed)  # draws nothing: meta tensors hold no values
    _materialize(model)
    if cfg.tie_embeddings:
        model.head.weight = model.tok_emb.weight
    init_weights(model, cfg, seed)
    return model


def _materialize(model: nn.Module) -> None:
    """Uninitialised CPU storage for every meta parameter and buffer (to_empty is 0.3 s
    slower at 124M: empty_like from meta takes a slow path); ties are made afresh."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=p.dtype)
            setattr(mod, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            setattr(mod, name, torch.empty(b.shape, dtype=b.dtype))


class NoMetaNormal(TorchFunctionMode):
    """normal_ of a meta tensor as a no-op: its meta kernel imports torch._dynamo (1.5 s)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.normal_ or func is nn.init.normal_:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def arch_facts(cfg: ArchConfig) -> dict[str, object]:
    """Facts for ModelInfo.arch that checks and renderers may read."""
    return {
        "norm": cfg.norm,
        "placement": cfg.placement,
        "activation": cfg.activation,
        "branch_scale": cfg.branch_scale,
        "attn_scale": "1/dk" if cfg.parametrization == "mup" else cfg.attn_scale,
        "parametrization": cfg.parametrization,
        "head_dim": cfg.head_dim,
        "init": cfg.init,
        "init_std": cfg.init_std,
        "tie_embeddings": cfg.tie_embeddings,
        "n_layers": cfg.n_layers,
        "qk_norm": cfg.qk_norm,
    }
