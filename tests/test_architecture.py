"""The package layering (docs/architecture.md) as tests: each layer imports only layers before it,
no import cycles (function-level imports count, but for an explicit allow-list), no private names across modules, h5py only in ``ucl.store.h5``, and
``import ucl`` stays cheap (no torch, no h5py)."""
from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ucl"

# module prefix -> layer; a module may import its own layer and the layers before it
LAYERS = [
    (("ucl.errors", "ucl.dtypes", "ucl.files", "ucl.memory", "ucl.model_config", "ucl.cache"), 0),
    (("ucl.lang",), 1),
    (("ucl.layout",), 2),
    (("ucl.plan",), 3),
    (("ucl.store",), 4),
    (("ucl.formats",), 5),
    (("ucl.ops",), 6),
    (("ucl.train",), 7),
    (("ucl.cli", "ucl.demo", "ucl.picture", "ucl.__main__"), 8),
]
# The public face of binding: ``Spec.bind`` / ``Spec.synthesize_params`` (lang) call the layout
# layer, which never imports ``ucl.lang.spec`` back. Function-level, so no module cycle.
ALLOWED_UPWARD = {("ucl.lang.spec", "ucl.layout.bind")}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _imports(name: str, path: Path):
    """(imported module, imported names, at module level?, line) for every import in a module."""
    tree = _tree(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], id(node) in top, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [a.name for a in node.names]
            if mod == "ucl" or (not node.module and node.level) or any(f"{mod}.{n}" in MODULES for n in names):
                # `from . import ast`, `from ..lang import ast` import submodules: each name is a module when it is one
                for n in names:
                    yield f"{mod}.{n}" if f"{mod}.{n}" in MODULES else mod, [n], id(node) in top, node.lineno
            else:
                yield mod, names, id(node) in top, node.lineno


MODULES = _modules()


def _layer(module: str) -> int | None:
    for prefixes, layer in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return None


def _is_type_checking_block(path: Path, lineno: int) -> bool:
    tree = _tree(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            if node.lineno <= lineno <= max(getattr(n, "end_lineno", n.lineno) for n in node.body):
                return True
    return False


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if m != "ucl" and _layer(m) is None]
    assert not missing, f"modules outside the layering (add them to docs/architecture.md and LAYERS): {missing}"


def test_layers_import_only_layers_before_them():
    bad = []
    for name, path in MODULES.items():
        if name == "ucl":
            continue  # the lazy public face re-exports from every layer
        mine = _layer(name)
        for mod, _, _, line in _imports(name, path):
            theirs = _layer(mod) if mod.startswith("ucl") else None
            if theirs is not None and theirs > mine and (name, mod) not in ALLOWED_UPWARD:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line}: {name} (layer {mine}) imports {mod} (layer {theirs})")
    assert not bad, "\n".join(bad)


# Function-level imports that close a cycle on purpose, each with why the import is lazy. Every other
# import, at module level or inside a function, counts when looking for cycles.
ALLOWED_LAZY: dict[tuple[str, str], str] = {
    ("ucl.lang.spec", "ucl.layout.bind"): "Spec.bind and Spec.synthesize_params are the public face of the layout "
                                          "layer, which imports ucl.lang (whose __init__ re-exports Spec)",
}


def _graph(lazy: bool) -> dict[str, set[str]]:
    """Module -> the ucl modules it imports (with ``lazy``, inside functions too, but for the allow-list)."""
    graph = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for mod, _, top, line in _imports(name, path):
            if mod not in MODULES or mod == name or _is_type_checking_block(path, line):
                continue
            if top or (lazy and (name, mod) not in ALLOWED_LAZY):
                graph[name].add(mod)
                # importing ucl.a.b runs ucl/a/__init__.py first (the importer's own packages are running already)
                parts = mod.split(".")
                for parent in (".".join(parts[:i]) for i in range(2, len(parts))):
                    if parent in MODULES and parent != name and not name.startswith(parent + "."):
                        graph[name].add(parent)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if n.startswith(m + ".") or m == "ucl":
                continue  # a submodule importing its package's __init__; the lazy public face
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_graph(lazy=False))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_through_function_level_imports():
    """A function-level import is still an arrow: a cycle through one is a cycle, unless allow-listed."""
    cycles = _cycles(_graph(lazy=True))
    assert not cycles, "import cycles (through function-level imports):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_lazy_allow_list_is_needed():
    """Every allow-listed lazy import exists and is function-level (a stale entry hides nothing)."""
    found = {(name, mod) for name, path in MODULES.items() for mod, _, top, _ in _imports(name, path) if not top}
    assert not set(ALLOWED_LAZY) - found, sorted(set(ALLOWED_LAZY) - found)


def test_no_private_names_across_modules():
    bad = []
    for name, path in MODULES.items():
        for mod, names, _, line in _imports(name, path):
            if not mod.startswith("ucl") or mod == name:
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line}: imports private {mod}.{n}")
    assert not bad, "\n".join(bad)


def test_only_the_h5_module_imports_h5py():
    users = sorted(name for name, path in MODULES.items()
                   if any(mod.split(".")[0] == "h5py" for mod, _, _, _ in _imports(name, path)))
    assert users == ["ucl.store.h5"]


def test_import_ucl_is_lazy():
    code = ("import sys, ucl; heavy = [m for m in ('torch', 'h5py', 'lark', 'transformers') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"`import ucl` imported {out}"
    code = "import sys, ucl; ucl.Mesh; ucl.load_rank; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(__import__("ucl").__all__))
def test_public_names_resolve(name):
    import ucl
    assert getattr(ucl, name) is not None


def test_python_dash_m_ucl_works():
    out = subprocess.run([sys.executable, "-m", "ucl", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("ucl "), out.stderr


def _doc_names(module: str) -> list[str]:
    """How docs/architecture.md may name a module: dotted from ``ucl`` or from inside its package
    (``ucl.formats.hf.write``, ``formats.hf.write``, ``hf.write``), or by its last name alone when it
    sits right under a layer's package (``ops.export`` -> ``export``)."""
    parts = module.split(".")[1:]
    names = [".".join(parts[i:]) for i in range(len(parts) - 1)] + [module]
    return names + [parts[-1]] if len(parts) <= 2 else names


def test_the_architecture_doc_names_every_module():
    text = (ROOT.parent / "docs" / "architecture.md").read_text()

    def named(n: str) -> bool:  # a dotted name anywhere; a bare one in backticks; or as a path
        return bool(re.search(r"(?<![\w.])" + re.escape(n) + r"(?!\w)", text) if "." in n
                    else re.search(r"`" + re.escape(n) + r"[`.(/]", text)) \
            or bool(re.search(r"`" + re.escape(n.replace(".", "/")) + r"[/`]", text))

    missing = [m for m in MODULES if m != "ucl" and not any(named(n) for n in _doc_names(m))]
    assert not missing, f"docs/architecture.md does not name: {missing}"
