"""The package's shape: folders by subject (at most 20 entries at the top), the layering each
subpackage's __init__ declares (which subpackage may import which), no import cycle, import chains
at most 9 modules deep, the commands on top (nothing of another subject imports one), XLA behind the
backends' seam, a docstring atop each module, and no code comment pointing into the benchmark log,
whose entries move on."""

import ast
import functools
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minimal_fsdp"


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}

# Which room (a subpackage, or a module at the top) may import which. Bottom to top: config and
# files are the ground (no torch in config); the math (models) needs only config; launch, data,
# parallel, checkpoint, hf and inference each build on the ones before; eval scores what inference
# loads; metrics, train, backends and run wire a training run; tools and the commands sit on top. A
# command (minimal_fsdp.__main__'s table) may import anything; no module of another subject imports
# a command.
GROUND = {"config", "files"}
LAYERS = {
    "config": {"files"},
    "files": {"config"},
    "launch": GROUND,
    "models": GROUND,
    "data": GROUND | {"launch"},
    "parallel": GROUND | {"launch", "models"},
    "checkpoint": GROUND | {"launch", "models", "parallel"},
    "hf": GROUND | {"launch", "models", "data", "checkpoint"},
    "inference": GROUND | {"launch", "models", "data", "parallel", "checkpoint", "hf"},
    "eval": GROUND | {"launch", "models", "data", "parallel", "checkpoint", "hf", "inference"},
    "metrics": GROUND | {"launch", "profiling"},
    "profiling": GROUND,
    "train": GROUND
    | {"launch", "models", "data", "parallel", "checkpoint", "metrics", "eval", "profiling"},
    "backends": GROUND | {"launch", "models", "data", "parallel", "checkpoint", "hf", "metrics"},
    "run": GROUND
    | {
        "launch",
        "models",
        "data",
        "parallel",
        "checkpoint",
        "hf",
        "inference",
        "metrics",
        "train",
        "backends",
    },
    # tools/flags_doc.py documents every command of __main__'s table (which imports only config)
    "tools": GROUND
    | {
        "launch",
        "models",
        "data",
        "parallel",
        "checkpoint",
        "hf",
        "inference",
        "metrics",
        "__main__",
    },
    "__main__": GROUND,
    "__init__": set(),
}


def room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(path):
    """The package's modules that `path` imports anywhere: at the top or inside a function (a lazy
    import that only breaks a cycle is still a cycle in the design). `from minimal_fsdp.x import y`
    is module x.y where that is a module, else x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "minimal_fsdp"
        ):
            assert node.level == 0, f"{path}: relative import"
            found |= {
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                for a in node.names
            }
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add("relative import")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "minimal_fsdp"}
    return found


GRAPH = {name: imported_modules(path) - {name} for name, path in MODULES.items()}


def commands():
    """The modules minimal_fsdp/__main__.py's COMMANDS table runs (read from its source: no import
    needed)."""
    tree = ast.parse((PACKAGE / "__main__.py").read_text())
    table = next(
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "COMMANDS" for t in n.targets)
    )
    return {v.elts[1].value for v in table.values}


def find_cycle(graph):
    """One cycle of the graph as a list of names, or None (depth-first search with three
    colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def longest_chain(graph):
    """The longest import chain of an acyclic graph, as a list of modules."""

    @functools.lru_cache(maxsize=None)
    def chain(node):
        return max(([node, *chain(n)] for n in graph.get(node, ())), key=len, default=[node])

    return max((chain(n) for n in graph), key=len)


def test_the_helpers_see_cycles_and_chains():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert longest_chain({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == ["a", "b", "c"]


def test_the_reader_understands_the_imports():
    assert "minimal_fsdp.train" in GRAPH["minimal_fsdp.run"]
    assert "minimal_fsdp.checkpoint.find" in GRAPH["minimal_fsdp.checkpoint.checkpointer"]
    assert commands() >= {
        "minimal_fsdp.run",
        "minimal_fsdp.inference.sample",
        "minimal_fsdp.eval.evaluate",
    }
    assert all(m in MODULES for m in commands())


def test_the_top_of_the_package_is_a_table_of_contents():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 20, entries
    packages = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert all((p / "__init__.py").exists() for p in packages)
    assert set(LAYERS) - {"__init__", "__main__"} == {p.name for p in packages} | {
        p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")
    }


def test_no_import_cycle_and_chains_at_most_nine_deep():
    graph = {name: {m for m in deps if m in MODULES} for name, deps in GRAPH.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    chain = longest_chain(graph)
    assert len(chain) <= 9, " -> ".join(chain)


def test_every_import_follows_the_declared_layers():
    cmds = commands()
    wrong = []
    for name, deps in GRAPH.items():
        for dep in deps:
            if dep not in MODULES:
                wrong.append(f"{name} imports {dep}, which is not a module of the package")
            # a subject's library may share its command's module
            elif dep in cmds and room(dep) != room(name):
                wrong.append(f"{name} imports the command {dep}")
            elif (
                name not in cmds and room(dep) != room(name) and room(dep) not in LAYERS[room(name)]
            ):
                wrong.append(f"{name} ({room(name)}) imports {dep} ({room(dep)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_training_loop_imports_no_command():
    assert not (GRAPH["minimal_fsdp.train"] & commands())


def test_xla_is_behind_the_backends_seam():
    """torch_xla is imported in backends/xla.py alone; the device is compared with "xla" only where
    the flags are checked (config/), the plan picks the backend (parallel/plan.py) and the seam
    itself (backends/)."""
    allowed = ("minimal_fsdp.config.", "minimal_fsdp.backends", "minimal_fsdp.parallel.plan")
    imports, tests = [], []
    for name, path in MODULES.items():
        text = path.read_text()
        if name != "minimal_fsdp.backends.xla" and re.search(
            r"^\s*(import|from) torch_xla", text, re.M
        ):
            imports.append(name)
        if not name.startswith(allowed) and re.search(r"""[!=]= ["']xla["']""", text):
            tests.append(name)
    assert not imports and not tests, (imports, tests)


def test_every_module_and_subpackage_says_its_job_in_a_docstring():
    missing = [
        name
        for name, path in MODULES.items()
        if (path.name != "__init__.py" or path.parent != PACKAGE)
        and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not missing


def test_no_comment_points_into_the_benchmark_log():
    """A comment gives the measured reason; where it was measured lives in benchmarks/ (the log
    moves on)."""
    pattern = re.compile(
        r"#.*(LOG\.md|LOG \"|\b(first|second|third|[a-z]+th) session\b)", re.IGNORECASE
    )
    hits = [
        f"{name}:{i}"
        for name, path in MODULES.items()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits


USAGE = re.compile(r"    (MINIMAL_FSDP_\w+=\S+ )?(python3?|mpiexec|minimal-fsdp|torchrun|srun) ")


def test_every_usage_line_in_a_module_docstring_is_a_whole_command():
    """A usage example atop a module (the package, benchmarks/, tests/, the entry) copies into a
    shell as it reads: a command that goes on below its first line ends that line with a
    backslash, and a comment sits on its own line above (a line wrap had cut 14 commands between
    their flags)."""
    root = PACKAGE.parent
    cut = []
    for path in sorted(root.glob("*.py")) + sorted(
        p
        for folder in ("minimal_fsdp", "benchmarks", "tests")
        for p in (root / folder).rglob("*.py")
    ):
        lines = (ast.get_docstring(ast.parse(path.read_text()), clean=False) or "").splitlines()
        for line, below in zip(lines, lines[1:]):
            if USAGE.match(line) and below.startswith("     ") and not line.endswith("\\"):
                cut.append(f"{path.relative_to(root)}: {line.strip()[:60]}")
    assert not cut, cut
