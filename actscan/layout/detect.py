"""Find the residual stream: embedding, blocks, branches, norms, activations, head.

The blocks are the longest `nn.ModuleList` of same-class children (a hybrid's mixed list of
composite layers when every same-class list lies inside its layers); branches are a first
guess from module names here, and `layout_proof.prove_layout` replaces the guess with what
one forward pass shows each block adds to the stream (post-branch norms, gains, post-LN
encoders whose attention module holds the residual add), with no per-family table.
"""

from __future__ import annotations

import re

from torch import nn

from actscan.records import BlockInfo, Layout, Role

_ATTN_RE = re.compile(r"(^|_)(attn|attention|self_attn|self_attention|mixer|mha|sa)$", re.I)
_MLP_RE = re.compile(
    r"(^|_)(mlp|ffn|ff|feed_forward|feedforward|fc|mlp_block|ffn_block|moe|block_sparse_moe)$", re.I
)
_ACT_TYPES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish, nn.Softplus,
    nn.ReLU6, nn.Hardswish, nn.SELU, nn.CELU, nn.GLU,
)  # fmt: skip
_ACT_NAME = re.compile(r"(gelu|relu|silu|swish|activation|tanh|sigmoid|mish)", re.I)
_NORM_NAME = re.compile(r"norm", re.I)
_FINAL_NORM_NAME = re.compile(r"(final|norm_f|ln_f)", re.I)
# Not the token embedding: rotary tables return (cos, sin); poolers are not output heads.
_NOT_EMBED = re.compile(r"rotary", re.I)
_NOT_HEAD = re.compile(r"(^|\.)pooler(\.|$)", re.I)


def is_norm(mod: nn.Module) -> bool:
    return isinstance(mod, nn.LayerNorm | nn.GroupNorm | nn.RMSNorm) or bool(
        _NORM_NAME.search(type(mod).__name__)
    )


def is_act(mod: nn.Module) -> bool:
    if isinstance(mod, _ACT_TYPES):
        return True
    name = type(mod).__name__
    return bool(_ACT_NAME.search(name)) and not list(mod.children())


def _has_children(mod: nn.Module) -> bool:
    return next(mod.children(), None) is not None


def _block_lists(model: nn.Module) -> list[tuple[tuple[int, int, int], str, list[str]]]:
    """(score, container, block names) of every ModuleList (or Sequential) of same-class
    composite children, in registration order."""
    out = []
    for order, (name, mod) in enumerate(model.named_modules()):
        if not isinstance(mod, nn.ModuleList | nn.Sequential):
            continue
        kids = list(mod.named_children())
        if len(kids) < 2 and not (isinstance(mod, nn.ModuleList) and len(kids) == 1):
            continue
        if len({type(m) for _, m in kids}) != 1 or not _has_children(kids[0][1]):
            continue
        score = (len(kids), int(isinstance(mod, nn.ModuleList)), -order)
        out.append((score, name, [f"{name}.{k}" if name else k for k, _ in kids]))
    return out


def _mixed_lists(model: nn.Module) -> list[tuple[tuple[int, int, int], str, list[str]]]:
    """ModuleLists of ≥ 2 composite children of more than one class (a hybrid's decoder:
    Jamba's Mamba and attention layers, Mllama's self- and cross-attention layers), in the
    form of `_block_lists`. A leaf child (an activation between convolutions: a codec's
    conv stack) rules the list out: blocks are composite."""
    out = []
    for order, (name, mod) in enumerate(model.named_modules()):
        kids = list(mod.named_children()) if isinstance(mod, nn.ModuleList) else []
        if len(kids) < 2 or len({type(m) for _, m in kids}) < 2:
            continue
        if not all(_has_children(m) for _, m in kids):
            continue
        score = (len(kids), 1, -order)
        out.append((score, name, [f"{name}.{k}" if name else k for k, _ in kids]))
    return out


def _hybrid_lists(model: nn.Module) -> list[tuple[tuple[int, int, int], str, list[str]]]:
    """The lists to find streams in: the same-class block lists, or, when every one of
    them lies inside a block of a mixed list (or there are none), the outermost mixed
    lists: a hybrid decoder's layers are its blocks, what lies inside them is not."""
    lists = _block_lists(model)
    mixed = _mixed_lists(model)
    outer = [m for m in mixed if not any(o[1] != m[1] and _nested(o[1], m[1]) for o in mixed)]
    inside = [c for c in lists if any(c[1].startswith(b + ".") for m in outer for b in m[2])]
    if outer and len(inside) == len(lists):
        return outer
    return lists


def _nested(a: str, b: str) -> bool:
    """One module path is the other or inside it ('' is the root, around everything)."""
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def find_streams(model: nn.Module) -> list[tuple[str, str, list[str]]]:
    """(stream name, container, block names) per residual stream, in registration order.

    One stream: the longest block list (the highest score), named "main". Several when the
    longest list and at least one other are disjoint, non-nested ModuleLists of ≥ 2
    same-class composite blocks, none inside another block list: an encoder-decoder's
    `encoder.layers`/`decoder.layers` (T5's `encoder.block`/`decoder.block`), two towers.
    Lists nested in blocks (MoE experts, T5's per-block `layer`) or around them (Swin's
    stages) never start a stream. Names come from the containers' paths, less the parts
    they share ("model.encoder.layers", "model.decoder.layers" → "encoder", "decoder").
    """
    lists = _hybrid_lists(model)
    if not lists:
        return []
    best = max(lists, key=lambda c: c[0])
    outer = [c for c in lists if not any(o[1] != c[1] and _nested(o[1], c[1]) for o in lists)]
    if best not in outer or not isinstance(model.get_submodule(best[1]), nn.ModuleList):
        return [("main", best[1], best[2])]
    found = [
        c
        for c in outer
        if c is best or (len(c[2]) >= 2 and isinstance(model.get_submodule(c[1]), nn.ModuleList))
    ]
    if len(found) < 2:
        return [("main", best[1], best[2])]
    found.sort(key=lambda c: -c[0][2])  # registration order
    names = _stream_names([c[1] for c in found])
    return [(n, c[1], c[2]) for n, c in zip(names, found, strict=True)]


def _stream_names(paths: list[str]) -> list[str]:
    """Each path less the leading and trailing parts all of them share; the full path
    when that leaves nothing or two alike."""
    parts = [p.split(".") for p in paths]
    lead = 0
    while all(len(p) > lead and p[lead] == parts[0][lead] for p in parts):
        lead += 1
    trail = 0
    while all(len(p) > lead + trail and p[-1 - trail] == parts[0][-1 - trail] for p in parts):
        trail += 1
    names = [".".join(p[lead : len(p) - trail]) for p in parts]
    if any(not n for n in names) or len(set(names)) < len(names):
        return paths
    return names


def _find_branch(block: nn.Module, pattern: re.Pattern[str]) -> str | None:
    """Shallowest submodule of the block whose own name matches the pattern."""
    hits = [
        name
        for name, _ in block.named_modules()
        if name and pattern.search(name.rsplit(".", 1)[-1])
    ]
    return min(hits, key=lambda n: (n.count("."), n)) if hits else None


def detect_layout(model: nn.Module, model_type: str | None = None) -> Layout:
    """Blocks, embedding, head and a first guess of each block's branches by name.

    `model_type` is accepted for callers but unused: no per-family table is needed since
    `layout_proof.prove_layout` checks the guess against one forward pass and replaces it.
    """
    modules = dict(model.named_modules())
    order = {name: i for i, name in enumerate(modules)}
    roles: dict[str, str] = {}
    block_of: dict[str, int] = {}
    streams = find_streams(model)
    blocks: list[BlockInfo] = []
    # the primary stream's list: the last one (an encoder-decoder's decoder)
    container = streams[-1][1] if streams else None
    note = None

    if not streams:
        note = (
            "no repeated blocks found (no nn.ModuleList of same-class modules): "
            "per-module statistics only, no residual stream"
        )
    for stream, _, names in streams:
        for bname in names:
            i = len(blocks)  # indices run on through the streams
            block = modules[bname]
            attn_rel = _find_branch(block, _ATTN_RE)
            mlp_rel = _find_branch(block, _MLP_RE)
            if mlp_rel and attn_rel and mlp_rel.startswith(attn_rel + "."):
                mlp_rel = None
            attn = f"{bname}.{attn_rel}" if attn_rel else None
            mlp = f"{bname}.{mlp_rel}" if mlp_rel else None
            adds = int(attn is not None) + int(mlp is not None) or 1
            blocks.append(
                BlockInfo(index=i, name=bname, attn=attn, mlp=mlp, adds=adds, stream=stream)
            )
            roles[bname] = Role.STREAM.value
            for sub_name, sub in block.named_modules(prefix=bname):
                block_of[sub_name] = i
                if sub_name == bname:
                    continue
                if attn and (sub_name == attn or sub_name.startswith(attn + ".")):
                    roles[sub_name] = Role.ATTN.value
                elif mlp and (sub_name == mlp or sub_name.startswith(mlp + ".")):
                    roles[sub_name] = Role.MLP.value
                if is_norm(sub):
                    roles[sub_name] = Role.NORM.value
                elif is_act(sub):
                    roles[sub_name] = Role.ACT.value

    first_block = order[blocks[0].name] if blocks else None
    # a module shared by every block (GPT-1's one activation instance) is listed once by
    # named_modules, under the first block's name: the others have no order of their own
    ends = [order[n] for n in block_of if n in order]
    last_block_end = max(ends) if ends else None
    embed = head = final_norm = None
    for name, mod in modules.items():
        if name in block_of or not name:
            continue
        if (
            isinstance(mod, nn.Embedding) or type(mod).__name__.endswith("Embedding")
        ) and not _NOT_EMBED.search(type(mod).__name__):
            roles[name] = Role.EMBED.value
            embed = embed or name
        elif is_norm(mod):
            roles[name] = Role.NORM.value
            if last_block_end is not None and order[name] > last_block_end:
                final_norm = final_norm or name
        elif is_act(mod):
            roles[name] = Role.ACT.value
        elif (
            isinstance(mod, nn.Linear)
            and (last_block_end is None or order[name] > last_block_end)
            and not _NOT_HEAD.search(name)
        ):
            head = name  # the last Linear after the blocks
    if final_norm is None and blocks:
        # Some families register the final norm before the blocks (OPT's decoder).
        final_norm = next(
            (
                n
                for n, r in roles.items()
                if r == Role.NORM.value and n not in block_of and _FINAL_NORM_NAME.search(n)
            ),
            None,
        )
    if head is not None:
        roles[head] = Role.HEAD.value
    # Embedding modules (word/position) are the wrapper's embed when a container holds them.
    if embed is not None and first_block is not None:
        parent = embed.rsplit(".", 1)[0] if "." in embed else None
        if (
            parent
            and parent in modules
            and order[parent] < first_block
            and parent not in block_of
            and "embed" in parent.rsplit(".", 1)[-1].lower()
        ):
            roles[parent] = Role.EMBED.value
    return Layout(
        blocks=tuple(blocks),
        embed=embed,
        head=head,
        final_norm=final_norm,
        container=container,
        roles=roles,
        block_of=block_of,
        note=note,
        streams=tuple((n, c) for n, c, _ in streams) if len(streams) > 1 else (),
    )


def stream_ks(layout: Layout) -> list[int]:
    """k after each block: cumulative residual additions (2 per attention+MLP block)."""
    ks, k = [], 0
    for b in layout.blocks:
        k += b.adds
        ks.append(k)
    return ks
