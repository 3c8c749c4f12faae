"""Every file, module and name that a docstring, a comment or a docs page names exists: a
`parallel/plan.py`-style path or a bare `plan.py` is a file of the repository; a dotted name that
starts with one of the package's modules (`plan.make_plan`, `checkpoint.find.find`,
`minimal_fsdp.hf.hub.resolve`) resolves to that module, then to a name it defines (or a class's
attribute); and no module's old name stands before a function or class of the package. A renamed
or moved function leaves no reference behind."""

import ast
import importlib.util
import re
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minimal_fsdp"
# files of other projects that the text names: nanoGPT's, torchtitan's, torch's
ELSEWHERE = {
    "model.py",
    "bench.py",
    "configurator.py",
    "job_config.py",
    "fsdp_utils.py",
    "hf_storage.py",
    "_consolidate_hf_safetensors.py",
}
# not modules of ours: a package not installed here, and objects whose methods a page names
# (transformers' model, a shell snippet's objects)
OUTSIDE = {"self", "torch_xla"}
OBJECTS = {"model.generate", "dry.run", "lab.run"}  # objects in examples, not modules
DOCSTRING = re.compile(r'^[ \t]*[rRuU]?"""(.*?)"""', re.S | re.M)
COMMENT = re.compile(r"(?:^|\s)#(.*)$", re.M)
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*(?:\.[A-Za-z_]\w*)+)")
# a dotted name ending so is a file name (meta.json, train.bin), not a module's attribute
SUFFIXES = {
    "py",
    "json",
    "jsonl",
    "md",
    "toml",
    "txt",
    "bin",
    "yaml",
    "pt",
    "sh",
    "png",
    "svg",
    "model",
}


@cache
def repository():
    """The repository's files, as paths and by name."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    return listed.split(), {Path(line).name for line in listed.split()}


@cache
def modules():
    """Dotted module path -> its file, for the package's modules and packages."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def defined(module):
    """The names a module binds at its top level, its functions and classes, and each class's
    attributes."""
    tree = ast.parse(modules()[module].read_text())
    names, definitions, attributes = set(), set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            definitions.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
        if isinstance(node, ast.ClassDef):
            own = attributes.setdefault(node.name, set())
            for n in ast.walk(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(n.name)
                elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    own.add(n.id)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    own.add(n.attr)
    return names | definitions, definitions, attributes


@cache
def definitions():
    """Every function and class the package defines at a module's top level."""
    return set().union(*(defined(module)[1] for module in modules()))


def _walk(module, rest):
    while rest and f"{module}.{rest[0]}" in modules():
        module, rest = f"{module}.{rest[0]}", rest[1:]
    if not rest:
        return True
    names, _, attributes = defined(module)
    if rest[0] in names:
        own = attributes.get(rest[0])
        return len(rest) == 1 or own is None or rest[1] in own
    # a field of an object the module defines (`plan.strategy`: ParallelPlan's)
    return len(rest) == 1 and any(rest[0] in own for own in attributes.values())


@cache
def by_last_name():
    """A module's last name -> the modules of that name (`find` -> minimal_fsdp.checkpoint.find)."""
    found = {}
    for module in modules():
        found.setdefault(module.split(".")[-1], []).append(module)
    return found


@cache
def resolves(dotted):
    """True or False for a dotted name that starts with a module of the package (or an old name
    before a function or class of it); None for anything else."""
    parts = dotted.split(".")
    if parts[-1] in SUFFIXES or any(len(part) == 1 for part in parts):  # a file; `minimal_fsdp.x`
        return None
    starts = by_last_name().get(parts[0], [])
    if starts:
        return any(_walk(start, parts[1:]) for start in starts)
    if parts[1] in definitions() and dotted not in OBJECTS and not importable(parts[0]):
        return False
    return None


@cache
def importable(name):
    return name in OUTSIDE or importlib.util.find_spec(name) is not None


def texts():
    """(where, text) of every comment and docstring of the package, the tests and the benchmarks,
    and every line of the docs. Found by pattern, not by the tokenizer, so the test stays quick: a
    docstring is a triple-quoted string that starts its line (a script held in a string,
    `X = \"\"\"...`, is code, not text), a comment what follows a `#` after a space."""
    sources = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
    for path in sorted(p for p in sources if "fuzz" not in p.parts):
        source = path.read_text()
        for match in [*DOCSTRING.finditer(source), *COMMENT.finditer(source)]:
            line = source.count("\n", 0, match.start()) + 1
            yield f"{path.relative_to(ROOT)}:{line}", match.group(1)
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            yield f"{page.relative_to(ROOT)}:{number}", line


@cache
def missing(name):
    files, names = repository()
    if "/" not in name:
        return name not in names and name not in ELSEWHERE
    return not any(path.endswith(name) for path in files)


def stale(text):
    """The files and dotted names `text` mentions that do not exist."""
    for name in FILE.findall(text):
        if missing(name):
            yield name
    for dotted in DOTTED.findall(FILE.sub("", text)):
        if resolves(dotted.rstrip(".")) is False:
            yield dotted


def test_every_file_module_and_name_the_text_mentions_exists():
    found = [f"{where}: {name}" for where, text in texts() for name in stale(text)]
    assert found == []


def test_a_stale_reference_is_seen():
    planted = {
        "see checkpoint_meta.py": "checkpoint_meta.py",  # a module's old file
        "in minimal_fsdp/hf/hub_cache.py": "minimal_fsdp/hf/hub_cache.py",  # a file never made
        "wired by `run.backend_for`": "run.backend_for",  # a function gone from its module
        "(`checkpoint.find.newest`)": "checkpoint.find.newest",
        "`minimal_fsdp.parallel.plan.count_params`": "minimal_fsdp.parallel.plan.count_params",
        "the class model.GPT": "model.GPT",  # a module's old name before a class of the package
        "checkpoint_meta.read_meta reads": "checkpoint_meta.read_meta",
        "`plan.ParallelPlan.no_such_field`": "plan.ParallelPlan.no_such_field",
    }
    for text, name in planted.items():
        assert list(stale(text)) == [name], text
    for real in (
        "parallel/plan.py and plan.make_plan",
        "`checkpoint.find.find`, minimal_fsdp.hf.hub.resolve and find.py",
        "plan.strategy (a field), gpt.GPT, train.Schedule.lr_at, meta.json, torch.save",
        "tests/test_docs.py, nanoGPT's model.py",
    ):
        assert list(stale(real)) == [], real
