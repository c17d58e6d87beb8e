"""The package's layout shows its flow (issue #30): sides that import only from the sides before
them, no import circle, no private name used outside its module. Read from the source with
ast, every import counted (those inside functions too)."""

import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "memory_audit")
# the order data flows in; a module imports from its own side, the sides before it and the base
ORDER = {"base": 0, "reading": 1, "naming": 2, "recording": 3, "prediction": 4, "comparison": 5, "top": 6}
BASE = ("schema", "text", "nodynamo", "nosympy", "_fastcore")
TOP = ("cli", "cli_args", "__main__", "__init__")


def _modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    out["memory_audit._fastcore"] = os.path.join(PACKAGE, "_fastcore.c")  # the compiled core: imports nothing
    return out


def _side(name):
    parts = name.split(".")
    if len(parts) == 2 and parts[1] in ORDER:  # a side's own __init__
        return parts[1]
    if len(parts) == 2:
        leaf = parts[1]
        return "base" if leaf in BASE else "top" if leaf in TOP else "?"
    if len(parts) == 1:
        return "top"  # the package itself
    return parts[1]


def _imports(name, path, modules):
    """[(imported module, [names imported from it], line)] of the package's modules `name` imports."""
    if path.endswith(".c"):
        return []
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("memory_audit"):
                continue
            for alias in node.names:  # `from . import x`: x may be a module
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.append((sub, [], node.lineno))
                else:
                    out.append((target, [alias.name], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("memory_audit")]
    return out


def test_every_module_has_a_side():
    assert {_side(n) for n in _modules()} <= set(ORDER), sorted(n for n in _modules() if _side(n) not in ORDER)


def test_no_module_imports_from_a_side_after_its_own():
    modules, bad = _modules(), []
    for name, path in modules.items():
        for target, _, line in _imports(name, path, modules):
            if ORDER[_side(target)] > ORDER[_side(name)]:
                bad.append(f"{name}:{line} imports {target} ({_side(name)} -> {_side(target)})")
    assert bad == []


def test_no_import_circle():
    modules = _modules()
    graph = {n: {t for t, _, _ in _imports(n, p, modules) if t != n and t in modules} for n, p in modules.items()}
    # the package __init__ files import nothing but what they re-export; a circle is a path back
    circles = []

    def visit(node, path, on_path):
        for nxt in sorted(graph[node]):
            if nxt in on_path:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt], on_path | {nxt})
        done.add(node)
    done = set()
    for n in sorted(graph):
        if n not in done:
            visit(n, [n], {n})
    assert circles == []


def test_no_private_name_used_outside_its_module():
    """`from .x import _y` and `x._y` across modules; the compiled core `_fastcore` (trace.py's C
    twin, a module of its own) is the one private module others import."""
    modules, bad = _modules(), []
    for name, path in modules.items():
        imported = {}
        for target, names, line in _imports(name, path, modules):
            bad += [f"{name}:{line} imports {target}.{n}" for n in names if n.startswith("_")]
        if path.endswith(".c"):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):  # module objects bound by `from . import x [as y]`
            if isinstance(node, ast.ImportFrom) and node.level:
                for alias in node.names:
                    imported[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert bad == []


def test_prediction_reads_the_audits_names_not_its_recorder():
    """The shadow run names a fake step's tensors with the audit's own code (naming/), and nothing
    of recording/ (the allocator's history, the profiler, the files) on the way."""
    modules, bad = _modules(), []
    for name, path in modules.items():
        if _side(name) == "prediction":
            bad += [f"{name}:{line} imports {target}" for target, _, line in _imports(name, path, modules)
                    if _side(target) == "recording"]
    assert bad == []
