"""The shape of the house, checked from the source alone (``ast``: nothing of the project is
imported, so a broken module fails here by name rather than by import error).

- no import circle among the modules of ``deadpool/`` and ``sim/``: imports inside functions
  count (they only postpone the circle), and ``from pkg import name`` where ``name`` is a
  submodule imports that submodule;
- no module of ``deadpool/``, ``sim/``, ``experiments/`` or ``paper_figures/`` past
  ``MAX_LINES`` lines;
- at most ``MAX_TOP_MODULES`` modules at the top of ``deadpool/`` (beside its packages);
- every package's ``__init__.py`` says what the package owns (a docstring);
- imports run one way, down the layers of ``LAYERS``: launch -> control -> rank -> mechanisms;
- no module imports an entry point (a ``__main__``): what two commands share lives in a module;
- every module path the text names (docstrings, comments, strings, docs, configs: a
  ``deadpool/<path>.py`` or a ``deadpool.<dotted>`` name) resolves: to a module or package, or
  to a name at the top of the longest module it starts with (a module that moved leaves no
  stale name behind). A bare ``<module>.py`` names a module of the file's own folder or
  package, or gives its path (``deadpool/rank/comm.py``): a bare name of another package's module
  is how a move leaves a stale name. A path under deadpool/ may leave out ``deadpool/`` (the
  README's and docs' ``rank/comm.py``) and must exist all the same; a retired module's name
  (``RETIRED``) is named nowhere, and a class is not named by a module it left
  (``<module>.<Class>`` with a bare module name).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRAPH_PACKAGES = ("deadpool", "sim")
SIZED_DIRS = ("deadpool", "sim", "experiments", "paper_figures")
MAX_LINES = 450
MAX_TOP_MODULES = 10
# where a module path may be named: the sources, tests, docs and configs (under
# experiments/results/ only the notes: the run outputs record what a past tree printed)
TEXT_DIRS = ("deadpool", "sim", "experiments", "paper_figures", "tests", "docs", "conf")
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml")
TEXT_SKIP = ("experiments/results/",)
# modules that no longer exist under any name, and where their contents went
RETIRED = {"protocol_wire": "deadpool.store.wire"}
# files whose stale names a change in flight rewrites (checked apart, as an expected failure):
# remove an entry once its file passes

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


def test_no_module_imports_an_entry_point():
    graph = import_graph()
    found = [f"  {m} imports {t}" for m in sorted(graph) for t in sorted(graph[m]) if t.endswith(".__main__")]
    assert not found, "imports of an entry point (python -m ...):\n" + "\n".join(found)


# a dotted name under deadpool (not inside a longer dotted or path name), a path of a module or
# folder under deadpool/; a dotted name ending in a file's suffix is a file name (a config's)
_FILE_SUFFIXES = {"py", "yaml", "yml", "md", "json", "csv", "txt", "toml", "log", "sh", "pt"}
_DOTTED = re.compile(r"(?<![\w./-])deadpool(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w./-])deadpool(?:/[A-Za-z_]\w*)+(?:\.py)?")
# a path under deadpool/ without it (``rank/comm.py``: how the README and docs name modules)
_PACKAGES = sorted(d.name for d in (ROOT / "deadpool").iterdir() if (d / "__init__.py").is_file())
_REL = re.compile(r"(?<![\w./-])(?:" + "|".join(_PACKAGES) + r")(?:/[A-Za-z_]\w*)+\.py")
# ``<module>.<Class>`` with a bare module name (``liveness.NodeLiveness``)
_BARE_CLASS = re.compile(r"(?<![\w./-])([a-z_]\w*)\.([A-Z]\w*[a-z]\w*)\b")
_BARE = re.compile(r"(?<![\w./\"'-])([A-Za-z_]\w*)\.py\b(?![\"'])")  # (quoted: code's)
_RETIRED = re.compile(r"(?<![\w./-])(" + "|".join(RETIRED) + r")\b")


@cache
def _top_names(path: Path) -> frozenset[str]:
    """The names a module defines or imports at its top (what ``module.name`` may mean)."""
    names = {"__file__", "__name__", "__path__", "__doc__", "__version__"}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return frozenset(names)


def unresolved(ref: str, mods: dict[str, Path]) -> str | None:
    """Why ``ref`` (a dotted name or a path under deadpool/) names nothing, or None when it
    resolves. A dotted name resolves by its longest module prefix; what follows must start with a
    name at the top of that module (``deadpool.store.wire.decode_plan``), so a name kept after its
    module moved (a package's name followed by the old module's) does not pass as an attribute."""
    if "/" in ref:
        if (ROOT / ref).is_file() or (not ref.endswith(".py") and (ROOT / ref).is_dir()):
            return None
        return "no such file or folder"
    parts = ref.split(".")
    i = len(parts)
    while ".".join(parts[:i]) not in mods:
        i -= 1
    if i == len(parts) or parts[i] in _top_names(mods[".".join(parts[:i])]):
        return None
    return f"{'.'.join(parts[:i])} has no module or name {parts[i]!r}"


def text_files() -> list[Path]:
    files = [p for p in sorted(ROOT.glob("*")) if p.suffix in TEXT_SUFFIXES or p.name == "Makefile"]
    for d in TEXT_DIRS:
        files += [p for p in sorted((ROOT / d).rglob("*")) if p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts
                  and (p.suffix == ".md" or not str(p.relative_to(ROOT)).startswith(TEXT_SKIP))]
    return [p for p in files if p != Path(__file__).resolve()]  # (this file names stale ones)


def _bare_unresolved(name: str, where: Path, packaged: dict[str, list[str]]) -> str | None:
    """Why a bare ``name.py`` in file ``where`` is ambiguous, or None: it must be a module of the
    file's folder or of deadpool/'s top; a module of a package of deadpool/ elsewhere must be
    named by its path (``packaged``: a bare name -> its paths under deadpool/)."""
    here = where.parent
    if (here / f"{name}.py").is_file() or (ROOT / "deadpool" / f"{name}.py").is_file():
        return None
    if name.startswith("__"):
        return None  # __init__.py, __main__.py: a package's, named with it
    if name not in packaged:
        return None  # not one of deadpool's (a script, another project's file)
    return "name it by its path under deadpool/: " + " or ".join(f"{m}.py" for m in packaged[name])


def stale_names(files, mods: dict[str, Path]) -> list[str]:
    packaged = {}  # bare name -> its paths under deadpool/, for the modules inside a package
    for m in mods:
        parts = m.split(".")
        if len(parts) > 2:
            packaged.setdefault(parts[-1], []).append("/".join(parts[1:]))
    classes = {}  # class name -> the modules that define it
    for m, path in mods.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(m)
    by_base = {}
    for m in mods:
        by_base.setdefault(m.rpartition(".")[2], []).append(m)

    def moved_class(base: str, name: str) -> str | None:  # a class named by a module it left
        if base not in by_base or name not in classes:
            return None
        if any(name in _top_names(mods[m]) for m in by_base[base]):
            return None
        return f"defined in {' or '.join(classes[name])}"

    out = []
    for p in files:
        where = p.relative_to(ROOT) if p.is_relative_to(ROOT) else p
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            refs = [r for r in _DOTTED.findall(line) if r.rpartition(".")[2] not in _FILE_SUFFIXES]
            found = [(ref, unresolved(ref, mods)) for ref in refs + _PATH.findall(line)]
            found += [(ref, unresolved(f"deadpool/{ref}", mods)) for ref in _REL.findall(line)]
            found += [(f"{b}.{c}", moved_class(b, c)) for b, c in _BARE_CLASS.findall(line)]
            found += [(f"{r}", f"retired: now {RETIRED[r]}") for r in _RETIRED.findall(line)]
            if not (p.suffix == ".md" and line.lstrip().startswith("|")):  # a table row names
                found += [(f"{b}.py", _bare_unresolved(b, p, packaged))  # its package apart
                          for b in _BARE.findall(line)]
            out += [f"  {where}:{n}: {ref} ({why})" for ref, why in found if why]
    return out


def test_the_name_check_resolves_modules_names_and_paths(tmp_path):
    mods = _modules(("deadpool",))
    pkg = "deadpool"
    ok = [f"{pkg}.store.wire.decode_plan", f"{pkg}.rank.comm", f"{pkg}.control", f"{pkg}/rank/comm.py",
          f"{pkg}/agent/", f"{pkg}.agent.__main__", f"{pkg}.train"]
    assert [r for r in ok if unresolved(r.rstrip("/"), mods)] == []
    bad = [f"{pkg}.protocol_wire", f"{pkg}.protocol_wire.decode_plan", f"{pkg}/comm.py",
           f"{pkg}.store.wire.no_such_function", f"{pkg}/no_such_folder", f"{pkg}.rank.coordinator"]
    assert [r for r in bad if unresolved(r, mods)] == bad
    doc = tmp_path / "page.md"
    doc.write_text(f"see `{pkg}/comm.py` and ``{pkg}.store.wire.decode_plan``, not /x/{pkg}/y.py\n")
    assert stale_names([doc], mods) == [f"  {doc}:1: {pkg}/comm.py (no such file or folder)"]
    retired = next(iter(RETIRED))
    doc.write_text(f"see ``{retired}.decode_plan``; the abort flag in abort.py and ``comm.py``\n")
    assert stale_names([doc], mods) == [
        f"  {doc}:1: {retired} (retired: now {RETIRED[retired]})",
        f"  {doc}:1: abort.py (name it by its path under deadpool/: rank/abort.py)",
        f"  {doc}:1: comm.py (name it by its path under deadpool/: rank/comm.py)"]
    doc.write_text("the abort flag in rank/abort.py, the rest in rank/comm_abort.py\n")
    assert stale_names([doc], mods) == [f"  {doc}:1: rank/comm_abort.py (no such file or folder)"]
    doc.write_text("read by ``liveness.NodeLiveness``, not ``watchdog.NodeLiveness`` (a variable: x.Foo)\n")
    assert stale_names([doc], mods) == [
        f"  {doc}:1: watchdog.NodeLiveness (defined in deadpool.control.liveness)"]
    here = ROOT / "deadpool" / "rank" / "heartbeat.py"  # a sibling may be named bare
    assert unresolved("deadpool/rank/comm.py", mods) is None
    assert _bare_unresolved("comm", here, {"comm": ["rank/comm"]}) is None


def test_every_named_module_path_exists():
    files = list(text_files())
    stale = stale_names(files, _modules(("deadpool",)))
    assert not stale, "names of deadpool modules or paths that do not exist:\n" + "\n".join(stale)

