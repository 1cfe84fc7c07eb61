"""No two modules of src/posttrain import each other, directly or through others: a cycle check over the
module import graph (the package-level layer check is `test_cli_output.py`'s
`test_no_module_imports_an_upper_layer_and_packages_form_no_cycle`).

What counts as an edge `a -> b`: every `import posttrain.x.y` and `from posttrain.x import y` statement in
module `a`, at the top of the file or inside a function, a method or an `if TYPE_CHECKING:` block (a
type-only import still couples the two files); `from pkg import name` points at `pkg.name` when that
is a module, else at `pkg`. Not counted: the parent package that Python runs first (`import a.b` runs
`a/__init__.py`): a package's `__init__` that re-exports its submodules would otherwise be a cycle with
each of them, though no module of the two depends on the other; and `importlib.import_module` of a
name held in a string (a registry that imports by name, such as `envs/registry.py`'s built-in domains).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module under root/posttrain (a package is its __init__)."""
    out = {}
    for path in sorted((root / "posttrain").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the posttrain modules it imports (see the module docstring for what counts)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(name, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (~400)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / "posttrain" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_direct_indirect_function_level_and_type_only_cycles(tmp_path):
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "a/__init__.py": "from posttrain.a.one import f\n",  # the facade: not a cycle with a.one
            "a/one.py": "def f():\n    from posttrain.a import two\n",  # function-level
            "a/two.py": "from . import three\n",  # relative
            "a/three.py": "import posttrain.a.one\n",  # one -> two -> three -> one
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from posttrain import c\n",
            "c.py": "from posttrain.b import x\n",  # b <-> c through a type-only import
            "d.py": "import importlib\nimportlib.import_module('posttrain.e')\n",  # by name: not counted
            "e.py": "import posttrain.d\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["posttrain.a"] == {"posttrain.a.one"}
    assert graph["posttrain.a.two"] == {"posttrain.a.three"}
    assert graph["posttrain.c"] == {"posttrain.b"}
    assert cycles(graph) == [
        ["posttrain.a.one", "posttrain.a.three", "posttrain.a.two"],
        ["posttrain.b", "posttrain.c"],
    ]


def test_no_two_modules_import_each_other():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)
