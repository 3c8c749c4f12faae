"""tests/mutation_equivalent.txt names mutants by module and function: after a function moves or is
renamed, its entries name nothing and the mutants they excused would count as survivors. Each entry
must name a function (or a class's method) of a module tests/mutation.py mutates."""

import ast
import re

import mutation

FUNCTION = re.compile(
    r"minimal_fsdp\.(?P<module>[\w.]+?)\.x(ǁ(?P<cls>\w+)ǁ|_)(?P<name>\w+?)__mutmut_\d+"
)


def functions(module):
    """{'name', 'Class.method'} of one module's top-level functions and classes' methods."""
    tree = ast.parse((mutation.ROOT / mutation.source(module)).read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef):
            found |= {
                f"{node.name}.{f.name}"
                for f in node.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return found


def test_every_equivalent_mutant_names_a_function_of_a_mutated_module():
    stale = []
    for name in mutation.equivalent_mutants():
        match = FUNCTION.fullmatch(name)
        assert match, name
        module = match["module"]
        function = f"{match['cls']}.{match['name']}" if match["cls"] else match["name"]
        if module not in mutation.MODULES or function not in functions(module):
            stale.append(name)
    assert not stale, stale


def test_the_mutated_modules_are_setup_cfgs():
    assert "parallel.gossip" in mutation.MODULES and "train" in mutation.MODULES
    assert all((mutation.ROOT / mutation.source(m)).is_file() for m in mutation.MODULES)
    assert set(mutation.SCOPE) <= set(mutation.MODULES)
