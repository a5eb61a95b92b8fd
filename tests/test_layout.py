"""The shape of the house, checked from the source alone (``ast``: nothing of the project is
imported, so a broken module fails here by name rather than by import error).

- no import circle among the modules of ``deadpool/`` and ``sim/``: imports inside functions
  count (they only postpone the circle), and ``from pkg import name`` where ``name`` is a
  submodule imports that submodule;
- no module of ``deadpool/``, ``sim/``, ``experiments/`` or ``paper_figures/`` past
  ``MAX_LINES`` lines;
- at most ``MAX_TOP_MODULES`` modules at the top of ``deadpool/`` (beside its packages);
- every package's ``__init__.py`` says what the package owns (a docstring);
- imports run one way, down the layers of ``LAYERS``: launch -> control -> rank -> mechanisms.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPH_PACKAGES = ("deadpool", "sim")
SIZED_DIRS = ("deadpool", "sim", "experiments", "paper_figures")
MAX_LINES = 450
MAX_TOP_MODULES = 10

# Layer of a module: the entry of its longest dotted prefix here (a module may import its own
# layer or a lower one, never a higher one). Mechanisms are the default for modules of deadpool/
# not named: parallel, snapshot, checkpoint, data, export, store and the shared top modules.
LAUNCH, CONTROL, RANK, MECHANISMS = 3, 2, 1, 0
LAYERS = {
    "deadpool": MECHANISMS,
    # launch: the entry points, the job's process, the launchers and the node agent
    "deadpool.train": LAUNCH,
    "deadpool.memory": LAUNCH,
    "deadpool.drain": LAUNCH,
    "deadpool.launch": LAUNCH,
    "deadpool.agent": LAUNCH,
    # control: the coordinator and its recovery decisions
    "deadpool.control": CONTROL,
    "deadpool.recovery": CONTROL,
    # rank: one training process (and the parts of the agent and of recovery it runs)
    "deadpool.rank": RANK,
    "deadpool.agent.board": RANK,
    "deadpool.agent.client": RANK,
    "deadpool.agent.files": RANK,
    "deadpool.recovery.integrity": RANK,
    "deadpool.recovery.pause": RANK,
    "deadpool.recovery.restore": RANK,
    "deadpool.recovery.spike": RANK,
}


def _modules(packages=GRAPH_PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of ``mods`` that module ``name`` imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"

    def known(dotted: str) -> str | None:  # the longest prefix that is one of ours
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            m = known(t)
            if m and m != name:
                out.add(m)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle per strongly connected component of more than one module, each as the
    modules in import order with the first repeated at the end (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(set(comp))
    return [_loop(graph, comp) for comp in comps]


def _loop(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest circle through the smallest module of ``comp`` (breadth-first)."""
    start = min(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def layer(module: str) -> int | None:
    m = module
    while m:
        if m in LAYERS:
            return LAYERS[m]
        m = m.rpartition(".")[0]
    return None


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    found = sorted(circles(g))
    assert found == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_no_module_past_the_line_limit():
    long = []
    for d in SIZED_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            n = len(p.read_text().splitlines())
            if n > MAX_LINES:
                long.append(f"  {p.relative_to(ROOT)}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines:\n" + "\n".join(long)


def test_few_modules_at_the_top_of_deadpool():
    top = sorted(p.name for p in (ROOT / "deadpool").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at the top of deadpool/: {top}"


def test_every_package_says_what_it_owns():
    bare = [str(p.relative_to(ROOT)) for d in SIZED_DIRS for p in sorted((ROOT / d).rglob("__init__.py"))
            if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not bare, f"package __init__.py without a docstring: {bare}"


def test_imports_run_down_the_layers():
    graph = import_graph()
    up = [f"  {m} ({layer(m)}) imports {t} ({layer(t)})" for m in sorted(graph) for t in sorted(graph[m])
          if m.startswith("deadpool") and layer(t) > layer(m)]
    assert not up, "imports that run up the layers (launch 3 > control 2 > rank 1 > mechanisms 0):\n" + "\n".join(up)
