"""The package's import graph follows the pipeline: no circles, no stage importing a later one, no private names.

Built from the source files with ``ast`` (every ``import`` statement, at module
level or inside a function, counts), so nothing is imported to check it. The
stages, earliest first, follow DESIGN.md's pipeline (trace -> graph -> rules ->
problem -> encodings/solve -> schedule -> plan -> export | lower -> verify |
compare -> cli); the foundations every stage uses (errors, files, units, mesh,
sharding, the HLO reader, the cost model) come first. A module may import
modules of its own stage or earlier ones, never a later stage's, and never the
package ``shardsolve`` itself (its ``__init__`` binds every public name).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"shardsolve": ROOT / "shardsolve", "shardsolve.encodings": ROOT / "encodings"}

# Stages, earliest first: the first component of a module's name below ``shardsolve``.
STAGES: tuple[tuple[str, ...], ...] = (
    ("errors", "files", "units", "version", "model"),
    ("mesh",),
    ("sharding",),
    ("hlo",),
    ("cost",),
    ("trace",),
    ("graph",),
    ("rules",),
    ("problem",),
    ("annotations", "build", "logical", "flax", "workspace", "propagation"),  # flax: the glue to Flax models
    # (imported lazily); propagation: Shardy's shardings as an assignment of the built problem
    ("encodings", "iopddl"),  # the solver layer (presolve and tying inside encodings/)
    ("schedule", "memory"),  # memory: the plan's buffers, counted from its schedule
    ("lower",),  # the rewriter executes a schedule; ``plan.jit()`` runs its program
    ("export", "plan", "planner"),  # plan / export (``Plan`` methods hand off to export)
    ("verify", "compare", "explain"),
    ("cli",),
)
RANK = {name: k for k, names in enumerate(STAGES) for name in names}
# Files whose private imports are being reworked elsewhere; drop an entry once its file passes.
PRIVATE_NAMES_PENDING: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (``shardsolve.encodings`` included)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of a shardsolve module in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "shardsolve"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".") if is_package else module.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "shardsolve":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            out += [(m, [], node.lineno) for m in submodules]
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest or not submodules:
                out.append((target, rest, node.lineno))
    return out


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for module, path in MODULES.items():
        g.add_node(module)
        if module == "shardsolve":  # the package's facade imports every stage
            continue
        for target, names, line in _imports(module, path):
            owner = target
            while owner not in MODULES and "." in owner:
                owner = owner.rsplit(".", 1)[0]
            g.add_edge(module, owner, line=line, names=names)
    return g


def test_every_module_has_a_stage():
    assert {_stage(m) for m in MODULES if m != "shardsolve"} <= set(RANK)


def test_no_import_circles():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_no_stage_imports_a_later_one_or_the_package():
    bad = []
    for a, b, data in _graph().edges(data=True):
        where = f"{a} (line {data['line']})"
        if b == "shardsolve":
            bad.append(f"{where} imports the package shardsolve from inside it")
        elif RANK[_stage(b)] > RANK[_stage(a)]:
            bad.append(f"{where} imports {b}, a later stage")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["shardsolve", "encodings", "tests", "experiments"])
def test_no_private_name_used_outside_its_module(folder):
    """``from shardsolve.x import _y`` and ``x._y`` on an imported shardsolve module are refused."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if str(path.relative_to(ROOT)) in PRIVATE_NAMES_PENDING:
            continue
        module = next((m for m, p in MODULES.items() if p == path), path.stem)
        tree = ast.parse(path.read_text(), str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "shardsolve" and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shardsolve":
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__") and node.module != module:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name} from {node.module}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
        # monkeypatch.setattr(module, "_name", ...) reaches into a module the same way
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                    and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases
                    and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} patches {aliases[node.args[0].id]}."
                           f"{node.args[1].value}")
    assert not bad, "\n".join(bad)
