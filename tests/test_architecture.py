"""The package's shape (issue 37): no import cycle among its modules, no module over 400 lines, a docstring atop
each saying its job, and no code comment pointing into the benchmark diary, whose entries move on."""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minimal_fsdp"
MODULES = {p.stem: p for p in PACKAGE.glob("*.py")}


def imported_modules(path):
    """The package's modules that `path` imports anywhere: at the top or inside a function (a lazy import
    that only breaks a cycle is still a cycle in the design)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:
                found |= {alias.name for alias in node.names}
            elif node.module and node.module.split(".")[0] == "minimal_fsdp":
                parts = node.module.split(".")
                found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("minimal_fsdp.")}
    return found & set(MODULES)


def find_cycle(graph):
    """One cycle of the graph as a list of names, or None (depth-first search with three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle_and_no_false_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_among_the_packages_modules():
    graph = {name: imported_modules(path) - {name} for name, path in MODULES.items()}
    assert graph["run"], "the import reader found nothing: it no longer understands the package's imports"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_module_over_400_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"split these by job: {long}"


def test_every_module_says_its_job_in_a_docstring():
    missing = [name for name, path in MODULES.items()
               if name != "__init__" and not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing


def test_no_comment_points_into_the_benchmark_log():
    """A comment gives the measured reason; where it was measured lives in benchmarks/ (LOG.md moves on)."""
    pattern = re.compile(r"#.*(LOG\.md|LOG \"|\b(first|second|third|[a-z]+th) session\b)", re.IGNORECASE)
    hits = [f"{name}.py:{i}" for name, path in MODULES.items()
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits
