"""The package's shape: folders by subject (at most 20 entries at the top); the layering written
once, in the table atop minimal_fsdp/__init__.py (which room may import which), followed by every
import and used by every rule, stated alike by each subpackage's __init__ docstring and
docs/architecture.md; no loop of rooms and no import cycle; no import chain longer than the rooms'
floors allow (STEPS_WITHIN_ROOMS); the commands on
top (no room imports one); XLA behind the backends' seam; a docstring atop each module; no code
comment pointing into the benchmark log, whose entries move on; and no library function taking the
whole training Config. The reader of imports is tested
itself, on planted imports of every form."""

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minimal_fsdp"
# A chain of imports may cross each floor of rooms once (the rooms' longest chain: 11 floors, from
# commands down to files) and take this many more steps between modules of one room.
STEPS_WITHIN_ROOMS = 3


def module_name(path, package=PACKAGE):
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(package=PACKAGE):
    return {module_name(p, package): p for p in package.rglob("*.py")}


def imported_modules(source, name, modules, is_package=False):
    """The package's modules that `source` (module `name`) imports anywhere: at the top or inside a
    function (a lazy import that only breaks a cycle is still a cycle in the design), in every form:
    `import minimal_fsdp.x`, `from minimal_fsdp.x import y`, `from minimal_fsdp import x`, relative
    (`from .x import y`, `from .. import x`), and importlib.import_module("minimal_fsdp.x"). An
    imported name that is a module counts as that module, else the module it comes from."""
    root = name.split(".")[0]
    base = name if is_package else name.rpartition(".")[0]

    def known(module):
        while module and module not in modules:
            module = module.rpartition(".")[0]
        return module

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {known(a.name) for a in node.names if a.name.split(".")[0] == root}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                stem = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{stem}.{node.module}" if node.module else stem
            else:
                module = node.module or ""
            if module.split(".")[0] != root:
                continue
            for a in node.names:
                whole = f"{module}.{a.name}"
                found.add(whole if whole in modules else known(module))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).split(".")[0] == root
        ):
            found.add(known(node.args[0].value))
    return found - {name, ""}


def graph_of(package=PACKAGE):
    modules = modules_of(package)
    return {
        name: imported_modules(path.read_text(), name, modules, path.name == "__init__.py")
        for name, path in modules.items()
    }


MODULES = modules_of()
GRAPH = graph_of()


def room(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def read_rules(text):
    """{room: the rooms it may import} from the package docstring's table (`    room: a, b`)."""
    rules = {"__init__": set()}
    for line in ast.get_docstring(ast.parse(text)).splitlines():
        match = re.fullmatch(r"    ([\w_]+): ?(.*)", line)
        if match:
            rules[match[1]] = {r.strip() for r in match[2].split(",") if r.strip()}
    return rules


RULES = read_rules((PACKAGE / "__init__.py").read_text())


def room_graph(graph):
    """{room: the other rooms its modules import}."""
    rooms = {room(m): set() for m in graph}
    for name, deps in graph.items():
        rooms[room(name)] |= {room(d) for d in deps if room(d) != room(name)}
    return rooms


def wrong_imports(name, deps, rules, modules):
    """The imports of module `name` that the rules do not allow, one line each."""
    wrong = []
    for dep in sorted(deps):
        if dep not in modules:
            wrong.append(f"{name} imports {dep}, which is not a module of the package")
        elif room(dep) != room(name) and room(dep) not in rules.get(room(name), ()):
            wrong.append(f"{name} ({room(name)}) imports {dep} ({room(dep)})")
    return wrong


def broken_rules(graph, rules, modules):
    """Every import the rules do not allow, and every rule no import uses: the rules both ways."""
    wrong = [
        line for name, deps in graph.items() for line in wrong_imports(name, deps, rules, modules)
    ]
    used = room_graph(graph)
    for owner, allowed in rules.items():
        wrong += [
            f"{owner} may import {other}, but none of its modules does"
            for other in sorted(allowed - used.get(owner, set()))
        ]
    return wrong


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


# An import of the command `minimal_fsdp.commands.train`, written every way the reader must see.
PLANTED = {
    "from": "from minimal_fsdp.commands.train import main\n",
    "from the package": "from minimal_fsdp.commands import train\n",
    "import": "import minimal_fsdp.commands.train\n",
    "import as": "import minimal_fsdp.commands.train as t\n",
    "lazy": "def f():\n    from minimal_fsdp.commands import train\n    return train\n",
    "relative": "from ..commands import train\n",
    "relative from": "from ..commands.train import main\n",
    "by name": "import importlib\nimportlib.import_module('minimal_fsdp.commands.train')\n",
}


@pytest.mark.parametrize("form", PLANTED)
def test_the_reader_sees_an_import_of_every_form(form):
    found = imported_modules(PLANTED[form], "minimal_fsdp.data.prepare", MODULES)
    assert found == {"minimal_fsdp.commands.train"}, found


def test_the_reader_resolves_relative_imports_from_a_package_and_a_module():
    assert imported_modules("from . import plan\n", "minimal_fsdp.parallel", MODULES, True) == {
        "minimal_fsdp.parallel.plan"
    }
    assert imported_modules(
        "from .plan import make_plan\n", "minimal_fsdp.parallel.choose", MODULES
    ) == {"minimal_fsdp.parallel.plan"}
    assert (
        imported_modules("import os\nfrom torch import nn\n", "minimal_fsdp.run", MODULES) == set()
    )


def test_the_reader_understands_the_imports():
    assert "minimal_fsdp.train" in GRAPH["minimal_fsdp.run"]
    assert "minimal_fsdp.checkpoint.find" in GRAPH["minimal_fsdp.checkpoint.checkpointer"]
    assert all(m in MODULES for m in commands())


def plants(target, name):
    """Module `name` importing `target` in every form, as source lines."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    dots = "." * len(package.split("."))
    parent, _, leaf = target.rpartition(".")
    return [
        f"from {parent} import {leaf}\n",
        f"from {target} import main\n",
        f"import {target}\n",
        f"import {target} as planted\n",
        f"def planted():\n    from {parent} import {leaf}\n",
        f"from {dots}{parent.partition('.')[2]} import {leaf}\n",
        f"import importlib\nimportlib.import_module({target!r})\n",
    ]


def test_an_upward_import_planted_in_any_module_is_refused():
    """Every module, the commands' included, given an import its room may not make (of a command;
    in a command, of the entry point above it), in each form: the layering test names it."""
    missed = []
    for name, path in sorted(MODULES.items()):
        target = {"commands": "minimal_fsdp.__main__", "__main__": "minimal_fsdp.tools.plot"}.get(
            room(name), "minimal_fsdp.commands.train"
        )
        for plant in plants(target, name):
            deps = GRAPH[name] | imported_modules(plant, name, MODULES, path.name == "__init__.py")
            if not wrong_imports(name, deps, RULES, MODULES):
                missed.append(f"{name}: {plant!r}")
    assert not missed, "\n".join(missed)


def test_a_rule_that_allows_more_than_the_code_uses_is_refused():
    looser = {owner: set(allowed) for owner, allowed in RULES.items()}
    looser["models"].add("launch")
    assert broken_rules(GRAPH, looser, MODULES) == [
        "models may import launch, but none of its modules does"
    ]


def test_the_top_of_the_package_is_a_table_of_contents():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 20, entries
    packages = [p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"]
    assert all((p / "__init__.py").exists() for p in packages)
    assert set(RULES) == {p.name for p in packages} | {p.stem for p in PACKAGE.glob("*.py")}


def test_every_import_follows_the_rules_and_every_rule_is_used():
    wrong = broken_rules(GRAPH, RULES, MODULES)
    assert not wrong, "\n".join(sorted(wrong))


def test_each_subpackage_and_the_docs_state_the_same_rules():
    """Each subpackage's __init__ docstring ends its imports in one sentence ("Imports a, b and
    c."), and docs/architecture.md's tables give each room's in their last column: the same rooms
    as the package's table."""
    named = lambda text: set(re.findall(r"[\w_]+", text)) & set(RULES)  # noqa: E731
    differ = []
    for path in sorted(PACKAGE.glob("*/__init__.py")):
        owner = path.parent.name
        sentences = re.findall(
            r"\bImports ([^.]*)\.", ast.get_docstring(ast.parse(path.read_text()))
        )
        if not sentences or named(sentences[-1]) != RULES[owner]:
            differ.append(f"{owner}/__init__.py: {sentences[-1:]}")
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        head = re.fullmatch(r"`([\w_]+)(/|\.py)`", cells[0]) if len(cells) == 3 else None
        if head:
            rows[head[1]] = named(cells[2])
    differ += [
        f"docs/architecture.md: {owner}: {rows.get(owner)}"
        for owner in sorted(set(RULES) - {"__init__"})
        if rows.get(owner) != RULES[owner]
    ]
    assert not differ, "\n".join(differ)


def test_the_commands_sit_on_top_in_one_room():
    """The table of __main__ runs each module of commands/, and nothing else; no room imports a
    command (the rules give commands/ to no room), and __main__ imports none: it names them."""
    assert commands() == {m for m in MODULES if room(m) == "commands"} - {"minimal_fsdp.commands"}
    assert not [owner for owner, allowed in RULES.items() if "commands" in allowed]
    for name in commands():
        tree = ast.parse(MODULES[name].read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert len(mains) == 1 and len(mains[0].args.args) == 1, f"{name}: one main(flags)"


def test_no_import_cycle_and_no_chain_longer_than_the_floors_allow():
    graph = {name: {m for m in deps if m in MODULES} for name, deps in GRAPH.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    rooms = {owner: frozenset(allowed) for owner, allowed in RULES.items()}
    floors = len(longest_chain(rooms))
    chain = longest_chain(graph)
    assert len(chain) <= floors + STEPS_WITHIN_ROOMS, " -> ".join(chain)


def test_no_loop_of_rooms():
    rooms = room_graph(GRAPH)
    assert find_cycle(rooms) is None, " -> ".join(find_cycle(rooms))


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


# Where the whole training Config may be taken: the commands (commands/), the flags and their
# checks (config/), the train command's body (run.run) and its one split of it into sections.
WHOLE_CONFIG_ALLOWED = {"run.run", "run.RunSections.of"}


def takes_whole_config(tree, prefix=""):
    """The qualified names of the functions (methods and nested ones too) in `tree` with a parameter
    named `cfg` or annotated `Config` (`config` alone names a model's shape)."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            found += takes_whole_config(node, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
            if any(
                p.arg == "cfg"
                or p.annotation is not None
                and re.search(r"\bConfig\b", ast.unparse(p.annotation))
                for p in params
            ):
                found.append(prefix + node.name)
            found += takes_whole_config(node, f"{prefix}{node.name}.")
        else:
            found += takes_whole_config(node, prefix)
    return found


def test_the_reader_sees_a_function_that_takes_the_whole_config():
    planted = (
        "def a(cfg): ...\n"
        "def b(x, *, config: Config): ...\n"
        "def c(config: 'flags.Config | None' = None): ...\n"
        "class K:\n    def m(self, cfg=None): ...\n"
        "def outer():\n    def inner(model, cfg): ...\n"
        "def fine(config, parallel: Parallel, model_config: GPTConfig): ...\n"
    )
    assert takes_whole_config(ast.parse(planted)) == ["a", "b", "c", "K.m", "outer.inner"]


def test_no_library_function_takes_the_whole_training_config():
    """Library code takes the sections of the flags it reads (config/sections.py), as torchtitan
    hands each component its part of the job config; only the commands, config/ and run.run take
    the whole training Config."""
    texts = {name: path.read_text() for name, path in MODULES.items()}
    found = {
        f"{name.partition('.')[2]}.{function}".lstrip(".")
        for name, text in texts.items()
        # parsed only where either word occurs: a quarter of the modules
        if room(name) not in ("commands", "config") and re.search(r"\b(cfg|Config)\b", text)
        for function in takes_whole_config(ast.parse(text))
    }
    whole = sorted(found - WHOLE_CONFIG_ALLOWED)
    assert not whole, f"take the sections they read (config/sections.py): {whole}"
    assert WHOLE_CONFIG_ALLOWED <= found, "an allowed function no longer takes it: drop it here"


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
