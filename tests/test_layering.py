"""The layering of actscan/, read from the code's own imports (an AST walk, nothing runs).

docs/design.md draws the data flow target → layout → measure → steps → diagnose → report →
render; these tests keep the arrows that must never exist out of the code. `KNOWN` lists
today's exceptions, each to be removed, never added to: a new exception fails the test.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "actscan"


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted (the deepest actscan module the import names)
    line: int
    local: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(base: str, name: str | None) -> str:
    """The deepest module among `base.name` and `base` that exists."""
    if name is not None and f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    return base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def edges_of(mod: str) -> Iterator[Edge]:
    tree = ast.parse(MODULES[mod].read_text(), filename=str(MODULES[mod]))
    is_pkg = MODULES[mod].name == "__init__.py"

    def walk(node: ast.AST, local: bool, type_only: bool) -> Iterator[Edge]:
        for child in ast.iter_child_nodes(node):
            c_local = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            c_type = type_only or (isinstance(child, ast.If) and _is_type_checking(child.test))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == "actscan" or a.name.split(".")[0] == "torch":
                        yield Edge(mod, a.name, child.lineno, c_local, c_type)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                root = base.split(".")[0]
                if root == "torch":
                    yield Edge(mod, base, child.lineno, c_local, c_type)
                elif root == "actscan":
                    for a in child.names:
                        yield Edge(mod, _resolve(base, a.name), child.lineno, c_local, c_type)
            yield from walk(child, c_local, c_type)

    yield from walk(tree, False, False)


EDGES = [e for m in MODULES for e in edges_of(m)]


def _in(mod: str, *packages: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


# (rule name, importer packages, forbidden imported packages)
FORBIDDEN: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("nothing imports the CLI", ("actscan",), ("actscan.cli",)),
    (
        "report/ holds data: no renderer, check or measurement",
        ("actscan.report",),
        (
            "actscan.render",
            "actscan.diagnose",
            "actscan.measure",
            "actscan.layout",
            "actscan.steps",
            "torch",
        ),
    ),
    (
        "render/ never computes: no measure, targets or torch",
        ("actscan.render",),
        (
            "actscan.measure",
            "actscan.layout",
            "actscan.steps.loop",
            "actscan.targets",
            "actscan.models",
            "actscan.distributed",
            "actscan.run",
            "torch",
        ),
    ),
    (
        "measure/layout/steps never import settings, targets, report or distributed",
        ("actscan.measure", "actscan.layout", "actscan.steps"),
        (
            "actscan.settings",
            "actscan.targets",
            "actscan.report",
            "actscan.distributed",
            "actscan.api",
            "actscan.run",
        ),
    ),
    (
        "targets/ build models: no run, api, distributed, compare or output",
        ("actscan.targets",),
        (
            "actscan.run",
            "actscan.api",
            "actscan.distributed",
            "actscan.compare",
            "actscan.report",
            "actscan.render",
        ),
    ),
    (
        "comparing and sweeping reports is pure: no torch (compare/precision.py runs models)",
        ("actscan.compare.pairs", "actscan.compare.sweep"),
        ("torch", "actscan.measure", "actscan.layout", "actscan.run", "actscan.models.gpt"),
    ),
]
DIAGNOSE_MAY_IMPORT = ("actscan.diagnose", "actscan.records", "actscan.numfmt", "actscan.errors")

# Today's exceptions, to be removed (never added to): (importer, imported).
KNOWN: set[tuple[str, str]] = set()


def violations() -> list[str]:
    out = []
    for e in EDGES:
        if e.type_only:
            continue
        for rule, importers, forbidden in FORBIDDEN:
            if rule == "nothing imports the CLI" and _in(e.src, "actscan.cli"):
                continue
            if rule == "nothing imports the CLI" and e.src == "actscan.__main__":
                continue
            hit = _in(e.src, *importers) and _in(e.dst, *forbidden)
            if hit and (e.src, e.dst) not in KNOWN:
                out.append(f"{e.src}:{e.line} imports {e.dst} ({rule})")
        impure = _in(e.src, "actscan.diagnose") and not _in(e.dst, *DIAGNOSE_MAY_IMPORT)
        if impure and (e.src, e.dst) not in KNOWN:
            out.append(f"{e.src}:{e.line} imports {e.dst} (diagnose is pure)")
    return out


def test_no_forbidden_arrow() -> None:
    assert violations() == []


def test_known_exceptions_still_exist() -> None:
    """An exception that no longer occurs leaves KNOWN: the list only shrinks."""
    present = {(e.src, e.dst) for e in EDGES}
    assert sorted(KNOWN - present) == []


def _cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in EDGES:
        if e.dst in MODULES and e.dst != e.src:
            graph[e.src].add(e.dst)
    # a package's __init__ is imported before its submodules: an edge into a submodule
    # also imports every package above it
    for e in EDGES:
        if e.dst in MODULES:
            parts = e.dst.split(".")
            for i in range(1, len(parts)):
                parent = ".".join(parts[:i])
                if parent in MODULES and parent != e.src and not _in(e.src, parent):
                    graph[e.src].add(parent)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_no_import_cycles() -> None:
    """Every import counts (module-level, function-local, TYPE_CHECKING): a cycle hidden in
    a function is still a cycle in the design."""
    assert _cycles() == []


def test_diagnose_loads_no_torch() -> None:
    code = "import actscan.diagnose, sys; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_help_loads_no_torch() -> None:
    code = (
        "import sys, actscan.cli; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


HOOK_API = {
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_full_backward_hook",
    "register_full_backward_pre_hook",
    "register_backward_hook",
    "register_hook",
}
HOOK_OWNER = "actscan.measure.hooks"


def hook_callers() -> set[str]:
    out = set()
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in HOOK_API
            ):
                out.add(mod)
    return out - {HOOK_OWNER}


def test_one_owner_of_hooks() -> None:
    """Only measure/hooks.py registers hooks: each other module goes through a HookSet."""
    assert sorted(hook_callers()) == []


MAX_FUNCTION_LINES = 120


def long_functions() -> set[str]:
    out = set()
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    out.add(f"{mod}:{node.name}")
    return out


def test_no_function_over_the_limit() -> None:
    """A function a newcomer cannot read in one screen-and-a-half is split by its stages."""
    assert sorted(long_functions()) == []


_MUTATORS = {"append", "update", "add", "setdefault", "pop", "clear", "extend", "insert"}
_MUTATORS |= {"remove", "discard", "popitem", "appendleft"}
_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter"}


def _root(node: ast.expr) -> str:
    """`a` of `a.b[c].d`."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def mutable_globals(mod: str) -> set[str]:
    """Module-level names a function of `mod` mutates or rebinds (`global`)."""
    tree = ast.parse(MODULES[mod].read_text())
    containers: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets = [node.target]
        value = getattr(node, "value", None)
        is_container = isinstance(
            value, ast.Dict | ast.List | ast.Set | ast.DictComp | ast.ListComp | ast.SetComp
        ) or (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in _CONTAINERS
        )
        if is_container:
            containers |= {t.id for t in targets if isinstance(t, ast.Name)}
    top = {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    out: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                out |= set(node.names)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
            ):
                out |= {_root(node.func.value)} & (top | containers)
            elif isinstance(node, ast.Assign | ast.AugAssign):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Subscript | ast.Attribute):
                        out |= {_root(t)} & (top | containers)
    return out


def foreign_global_reads() -> list[str]:
    mutable = {m: mutable_globals(m) for m in MODULES}
    out = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module in MODULES:
                for a in node.names:
                    if a.name in mutable[node.module] and node.module != mod:
                        out.append(f"{mod} imports {node.module}.{a.name}")
                    sub = f"{node.module}.{a.name}"
                    if sub in MODULES:
                        aliases[a.asname or a.name] = sub
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != mod
                and node.attr in mutable[aliases[node.value.id]]
            ):
                out.append(f"{mod} reads {aliases[node.value.id]}.{node.attr}")
    return sorted(set(out))


def test_no_module_reads_another_modules_mutable_globals() -> None:
    """State that changes at run time is passed or returned, never read across modules."""
    assert foreign_global_reads() == []


def _heavy_modules() -> set[str]:
    """Modules whose module-level imports reach torch."""
    top: dict[str, set[str]] = {m: set() for m in MODULES}
    torch_top: set[str] = set()
    for e in EDGES:
        if e.local or e.type_only:
            continue
        if e.dst.split(".")[0] == "torch":
            torch_top.add(e.src)
        elif e.dst in MODULES:
            top[e.src].add(e.dst)
    heavy: set[str] = set()
    changed = True
    while changed:
        changed = False
        for m in MODULES:
            if m not in heavy and (m in torch_top or top[m] & heavy):
                heavy.add(m)
                changed = True
    return heavy


def _help_path() -> set[str]:
    """The actscan modules `import actscan.cli` loads (what `actscan --help` pays for)."""
    code = "import sys, actscan.cli; print(' '.join(m for m in sys.modules if 'actscan' in m))"
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)
    return set(out.stdout.decode().split())


def test_function_local_imports_only_where_they_keep_startup_light() -> None:
    """A function-local import is there to keep `actscan --help` fast and free of torch, a
    light module free of torch, a single-process run free of the distributed stack, or
    every run free of an optional dependency's import until it is used (the numba and
    llvmlite kernels of the `fast` extra); anywhere else it belongs at the top of the
    module (the cycle test counts it anyway)."""
    heavy, help_path = _heavy_modules(), _help_path()
    kernel_deps = re.compile(r"^import (numba|llvmlite)\b", re.M)
    optional = {m for m, path in MODULES.items() if kernel_deps.search(path.read_text())}

    def justified(e: Edge) -> bool:
        lazy_stack = e.dst.startswith(("torch.distributed", "actscan.distributed"))
        return (
            e.src in help_path
            or e.src == "actscan"
            or (e.src not in heavy and (e.dst.split(".")[0] == "torch" or e.dst in heavy))
            or lazy_stack
            or e.dst in optional
        )

    needless = [
        f"{e.src}:{e.line} imports {e.dst}"
        for e in EDGES
        if e.local and not e.type_only and e.dst != e.src and not justified(e)
    ]
    assert needless == []
