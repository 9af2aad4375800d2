"""The house's import rules, read from the source with ``ast``: impala <- actors <- learner.

``impala/`` (pure library) imports neither ``actors`` nor ``learner``; ``actors/`` does not
import ``learner``; and no module takes part in an import circle. Function-level imports
count as edges too, so a circle cannot hide inside a function. The same reading holds the
functions of the three packages to a screen each (:data:`FUNCTION_MAX_LINES`).
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("impala", "actors", "learner")
FLOOR = {"impala": 0, "actors": 1, "learner": 2}

# Upward imports known and still to be fixed, as (module, imported module); a new one fails. None left.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    mod = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    out[mod.removesuffix(".__init__")] = path
    return out


def _edges(modules: dict[str, str]) -> set[tuple[str, str]]:
    edges = set()
    for mod, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                # the longest project module the name refers to
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != mod and name.split(".")[0] in PACKAGES:
                    edges.add((mod, name))
    return edges


def _cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_graph_reader_sees_known_edges():
    edges = _edges(_modules())
    # guards against a reader that finds nothing and so passes everything below
    assert ("actors.actor", "actors.loop") in edges
    assert ("learner.run.runtime", "actors.actor") in edges
    assert ("impala.algos.vtrace", "impala.algos.vtrace") not in edges
    assert _cycles({("a", "b"), ("b", "c"), ("c", "a")}) == [["a", "b", "c", "a"]]


def test_no_import_circles():
    assert _cycles(_edges(_modules())) == []


def test_imports_point_down_only():
    upward = {(a, b) for a, b in _edges(_modules()) if FLOOR[b.split(".")[0]] > FLOOR[a.split(".")[0]]}
    assert upward <= KNOWN_UPWARD, sorted(upward - KNOWN_UPWARD)


def _room(mod: str) -> str:
    """The room of a module inside its package: its folder (``impala.envs.probe`` -> ``envs``,
    ``learner.run.runtime`` -> ``run``) or, for a module at the package's top (``impala.options``), the
    module itself."""
    return mod.split(".")[1] if mod.count(".") >= 1 else mod


def _room_edges(package: str) -> set[tuple[str, str]]:
    """Which room of ``package`` imports which other room of it."""
    inside = [
        (a, b) for a, b in _edges(_modules()) if a.startswith(package + ".") and b.startswith(package + ".")
    ]
    return {(_room(a), _room(b)) for a, b in inside if _room(a) != _room(b)}


def test_the_library_rooms_import_each_other_one_way():
    # A file-level check misses a circle between folders (nets -> envs while envs -> nets, through
    # different files); it makes the rooms one block a reader cannot take apart, so it is checked here.
    rooms = _room_edges("impala")
    assert ("nets", "envs") in rooms and ("envs", "options") in rooms  # the reader sees rooms at all
    assert _cycles(rooms) == []


def test_the_learner_rooms_import_each_other_one_way():
    # The same for learner/: the entry points (cli/), the run services (run/), the receiving side (serve/)
    # and the learners at its top import each other one way.
    rooms = _room_edges("learner")
    assert ("cli", "run") in rooms and ("run", "serve") in rooms  # the reader sees rooms at all
    assert _cycles(rooms) == []


LEARNER_TOP_MAX = 8


def test_the_learner_top_holds_a_few_modules():
    # learner/ in rooms a reader can take in: a few modules at its top (the learners, the group, the
    # evaluation engine, the Python API), the rest in its folders.
    top = sorted(m for m in _modules() if m.startswith("learner.") and m.count(".") == 1)
    top = [m for m in top if os.path.isfile(os.path.join(REPO, *m.split(".")) + ".py")]
    assert len(top) + 1 <= LEARNER_TOP_MAX, top  # + learner/__init__.py


# A function longer than this reads as several steps in one body: split it into named ones.
FUNCTION_MAX_LINES = 80


def _long_functions(path: str, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of each function in ``path`` longer than ``limit``, from ``def`` to its
    last line (decorators and docstring included), nested functions and methods each on their own."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                lines = child.end_lineno - min([child.lineno] + [d.lineno for d in child.decorator_list]) + 1
                if not isinstance(child, ast.ClassDef) and lines > limit:
                    found.append((name, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_the_function_reader_sees_long_functions(tmp_path):
    # guards against a reader that finds nothing and so passes everything below
    path = tmp_path / "m.py"
    lines = ["class C:", "    @staticmethod", "    def f():", *(f"        x{i} = {i}" for i in range(5))]
    path.write_text("\n".join(lines) + "\n")
    assert _long_functions(str(path), 6) == [("C.f", 7)]  # from the decorator to the last line
    assert _long_functions(str(path), 7) == []


def test_no_function_is_longer_than_a_screen():
    long = {
        f"{mod}.{name}": lines
        for mod, path in sorted(_modules().items())
        for name, lines in _long_functions(path, FUNCTION_MAX_LINES)
    }
    assert long == {}, f"over {FUNCTION_MAX_LINES} lines: {long}"
