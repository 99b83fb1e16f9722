"""DESIGN.md's layering, enforced: a module imports only from its own layer or the layers below.

kernels < codecs < pagepool < tiers < drafter < runtime < (training, bench, demo, testing) < serve
< cli < __main__ (``python -m kvstrata``);
``integrations`` (vLLM / SGLang) ranks with the top layers but uses only tiers, pagepool and codecs
(never the runtime); no module outside it may import vllm or sglang.
``dtypes``, ``devices`` and ``tokenizer`` are leaves every layer may use; ``assets`` and ``nn`` (model building
blocks and the checkpoint loader, shared by drafter, runtime and training) sit just above them.
Imports inside functions count too (a lazy import upward is still an upward dependency).
No import loops between modules, and no module over ``MAX_MODULE_LINES`` lines.
"""

import ast
from pathlib import Path

import kvstrata

ROOT = Path(kvstrata.__file__).resolve().parent
RANK = {"dtypes": 0, "devices": 0, "tokenizer": 0, "assets": 1, "nn": 1, "kernels": 2, "codecs": 3,
        "pagepool": 4, "tiers": 5, "drafter": 6, "runtime": 7, "training": 8, "bench": 8,
        "demo": 8, "testing": 8, "integrations": 8, "serve": 9, "cli": 10, "__main__": 11}


def _top(module_path: Path) -> str:
    rel = module_path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


def _imported_tops(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    pkg_parts = list(path.relative_to(ROOT).parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - (node.level - 1)]
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:          # `from .. import x` at the package root: x is the module
                    parts = [a.name for a in node.names]
                    out.update(p for p in parts if p in RANK)
                    continue
                out.add(parts[0])
            elif node.module and node.module.split(".")[0] == "kvstrata":
                mod = node.module.split(".")
                out.update([mod[1]] if len(mod) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                mod = a.name.split(".")
                if mod[0] == "kvstrata" and len(mod) > 1:
                    out.add(mod[1])
    return {t for t in out if t in RANK}


def test_every_package_is_ranked():
    tops = {p.name.removesuffix(".py") for p in ROOT.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or
            (p.suffix == ".py" and p.name != "__init__.py")}
    assert tops <= set(RANK), f"unranked top-level modules: {tops - set(RANK)}"


def test_imports_only_point_down():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == ROOT:
            continue
        me = _top(path)
        for dep in _imported_tops(path):
            if dep != me and RANK[dep] >= RANK[me]:
                bad.append(f"{path.relative_to(ROOT)} ({me}) imports {dep}")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


ENGINES = ("vllm", "sglang")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


def test_integrations_use_only_tiers_pagepool_codecs():
    allowed = {"integrations", "tiers", "pagepool", "codecs", "kernels", "dtypes"}
    bad = []
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        for dep in _imported_tops(path) - allowed:
            bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, "\n".join(bad)


def test_core_never_imports_an_engine():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        if _top(path) == "integrations":
            continue
        for dep in _imported_modules(path) & set(ENGINES):
            bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, "\n".join(bad)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["kvstrata", *parts])


def _kvstrata_imports(path: Path, modules: set[str]) -> set[str]:
    """The kvstrata modules ``path`` imports (lazy imports included); ``from pkg import name``
    counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = _module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                mod = ".".join(base + (node.module.split(".") if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in modules}


def test_no_import_loops_between_modules():
    """Two modules never import each other, directly or through others (a package's
    ``__init__`` re-exporting its own modules is not a loop: it is left out of the graph)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = {m: {d for d in _kvstrata_imports(p, modules)
                 if d != m and paths[d].name != "__init__.py"}
             for m, p in paths.items() if p.name != "__init__.py"}
    loops, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                loops.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not loops, "import loops:\n" + "\n".join(loops)


#: A room that holds one idea (issue 19): a module past this many lines is split by idea.
MAX_MODULE_LINES = 600


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in sorted(ROOT.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, (f"modules over {MAX_MODULE_LINES} lines (split them by idea): "
                      + ", ".join(f"{m} ({n})" for m, n in long.items()))
