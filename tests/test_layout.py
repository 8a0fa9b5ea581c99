"""The package's shape, read from the source (ast; nothing imported): no import cycles, no
function too long to hold in one's head, a top level of entry points, config and packages, and
one name per thing."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tiderl"
MAX_FUNCTION_LINES = 100

# The top level: entry points, the run config and its machinery, packages, and the one private
# helper every package's lazy `__init__` uses.
TOP_LEVEL = {"__init__.py", "launch.py", "export.py", "report.py", "config.py", "configlib.py",
             "_lazy.py", "models", "serving", "train", "envs", "agents", "control", "runtime",
             "sim"}
# Module names several packages share on purpose: each package's `config.py` holds the config
# dataclasses of what that package configures (composed by tiderl/config.py).
SHARED_MODULE_NAMES = {"__init__", "__main__", "config"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


class _Imports(ast.NodeVisitor):
    """Every module a file imports at run time: top-level and function-local imports alike
    (an import inside a function still closes a cycle), not `if TYPE_CHECKING:` blocks."""

    def __init__(self, name: str, is_package: bool, modules: dict[str, Path]):
        self.name, self.is_package, self.modules = name, is_package, modules
        self.found: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        if getattr(t, "id", None) == "TYPE_CHECKING" or getattr(t, "attr", None) == "TYPE_CHECKING":
            for n in node.orelse:
                self.visit(n)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.update(a.name for a in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            pkg = self.name if self.is_package else self.name.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                pkg = pkg.rsplit(".", 1)[0]
            base = f"{pkg}.{base}" if base else pkg
        for a in node.names:  # `from pkg import mod` imports the module pkg.mod
            full = f"{base}.{a.name}"
            self.found.add(full if full in self.modules else base)


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        v = _Imports(name, path.name == "__init__.py", modules)
        v.visit(ast.parse(path.read_text()))
        deps = set()
        for d in v.found:
            while d and d not in modules:  # `tiderl.x.y.attr` -> the module that defines it
                d = d.rsplit(".", 1)[0] if "." in d else ""
            if d and d != name:
                deps.add(d)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
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
                        out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "tiderl.runtime.job" in graph["tiderl.launch"]  # the graph sees function-local imports
    found = cycles(graph)
    assert not found, "import cycles (break each by moving the shared piece below both): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_composition_root_is_imported_by_entry_points_only():
    users = sorted(m for m, deps in import_graph().items() if "tiderl.runtime.job" in deps)
    assert users == ["tiderl.launch", "tiderl.sim.validate"], users


def test_no_function_over_100_lines():
    long = []
    for p in sorted(PKG.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = n.end_lineno - n.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({lines} lines)")
    assert not long, "split these into named pieces: " + ", ".join(long)


def test_top_level_holds_entry_points_config_and_packages():
    found = {p.name for p in PKG.iterdir() if p.name != "__pycache__"}
    assert found <= TOP_LEVEL, f"move {sorted(found - TOP_LEVEL)} into a package"


def test_one_name_per_thing():
    modules, classes = defaultdict(list), defaultdict(list)
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        if p.stem not in SHARED_MODULE_NAMES:
            modules[p.stem].append(rel)
        for n in ast.parse(p.read_text()).body:
            if isinstance(n, ast.ClassDef):
                classes[n.name].append(rel)
    same = {k: v for k, v in {**modules, **classes}.items() if len(v) > 1}
    assert not same, f"names used for different things: {same}"
