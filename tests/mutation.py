"""Mutation testing on demand (too slow for CI): mutmut 3 on the modules where a silent bug costs
most.

    pip install -e '.[mutation]'
    python tests/mutation.py           # every module in MODULES, one after another, then the scores
    python tests/mutation.py resilience gossip  # some of them
    python tests/mutation.py --report           # the scores of what has run (no run)
    # the changed lines of each mutant not killed (no run)
    python tests/mutation.py --survivors gossip
    # run again only the mutants not killed (after adding tests)
    python tests/mutation.py --retest gossip
    # 4 mutants at a time (default 1: one process beside this one)
    python tests/mutation.py -j 4 gossip

mutmut's settings are in setup.cfg's [mutmut] section; its work stays in mutants/ (ignored by git),
where `mutmut show NAME` prints a mutant's diff and `mutmut browse` lists them all. Each mutant runs
only the tests that reached the mutated function when mutmut first ran the selected tests (in this
process: tests that start a process skip themselves under mutmut, see conftest.py). Mutants we
judged equivalent to the original code are listed, each with its reason, in
tests/mutation_equivalent.txt. Scores and survivors: tests/README.md.
"""

import configparser
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mutated_modules():
    """setup.cfg's [mutmut] only_mutate, as names under the package (parallel/gossip.py ->
    parallel.gossip): the one list of what is mutated."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    paths = config["mutmut"]["only_mutate"].split()
    return [".".join(Path(p).with_suffix("").parts[1:]) for p in paths]


MODULES = mutated_modules()
# Where only part of a module is in scope: the functions (mutmut's names, globs) mutated and scored.
# config/parser.py: the --config file's values, not the command line's parser (argparse's).
SCOPE = {"config.parser": ["x__checked__*", "x_load_config_file__*"]}
EQUIVALENT = ROOT / "tests" / "mutation_equivalent.txt"
# These decorators leave a function's body safe to copy and call through mutmut's trampoline, so
# their functions get mutated too. mutmut 3 skips every decorated function (other than staticmethod
# and classmethod), which here would leave out AccumAdamW.step, Gossip.finish, train.evaluate,
# tokens.epoch_order and others. Not @property or @contextmanager: the trampoline cannot call
# through those.
SAFE_DECORATORS = ("torch.no_grad()", "functools.lru_cache(")


def mutate_decorated_functions_too():
    import libcst as cst
    from mutmut.mutation import file_mutation

    skip = file_mutation.MutationVisitor._skip_node_and_children
    code = cst.Module([]).code_for_node

    def skip_unless_safely_decorated(self, node):
        if (
            isinstance(node, cst.FunctionDef)
            and node.decorators
            and all(code(d.decorator).startswith(SAFE_DECORATORS) for d in node.decorators)
        ):
            # judged as if undecorated; the copies keep the decorators
            node = node.with_changes(decorators=[])
        return skip(self, node)

    file_mutation.MutationVisitor._skip_node_and_children = skip_unless_safely_decorated


def equivalent_mutants():
    """{mutant name: reason} from tests/mutation_equivalent.txt (`name  reason` per line, #
    comments)."""
    found = {}
    for line in EQUIVALENT.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition(" ")
            found[name] = reason.strip()
    return found


def results(module):
    """{mutant name: status} of one module's last run, or None if it never ran."""
    from mutmut.stats import status_by_exit_code

    meta = ROOT / "mutants" / source(module).with_suffix(".py.meta")
    if not meta.exists():
        return None
    return {
        name: status_by_exit_code[code]
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items()
        if in_scope(module, name)
    }


def source(module):
    """parallel.gossip -> minimal_fsdp/parallel/gossip.py (relative to the repository)."""
    return Path("minimal_fsdp", *module.split(".")).with_suffix(".py")


def named(modules):
    """The modules asked for: a full name (parallel.gossip) or its last part alone (gossip)."""
    found = []
    for name in modules:
        matches = [m for m in MODULES if name in (m, m.rsplit(".", 1)[-1])]
        if len(matches) != 1:
            sys.exit(
                f"error: {'ambiguous' if matches else 'unknown'} module {name}; choose from "
                f"{', '.join(MODULES)}"
            )
        found += matches
    return found


def patterns(module):
    """mutmut's names of the module's mutants in scope (globs)."""
    return [f"minimal_fsdp.{module}.{p}" for p in SCOPE.get(module, ["*"])]


def in_scope(module, name):
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in patterns(module))


def report(modules, seconds=None):
    equivalent = equivalent_mutants()
    print(
        f"\n{'module':<24} {'mutants':>7} {'killed':>6} {'survived':>8} {'no tests':>8} "
        f"{'equivalent':>10} {'score':>6} {'w/o equiv':>9} {'time':>6}"
    )
    survivors = []
    for module in modules:
        status = results(module)
        unrun = [n for n, s in (status or {}).items() if s == "not checked"]
        if not status or len(unrun) == len(status):
            print(f"{module:<24} not run")
            continue
        if unrun:
            print(
                f"{module:<24} {len(unrun)} of {len(status)} mutants not run yet: scored on the "
                f"others"
            )
            status = {n: s for n, s in status.items() if s != "not checked"}
        killed = sum(s in ("killed", "timeout") for s in status.values())
        survived = [n for n, s in status.items() if s in ("survived", "no tests")]
        same = [n for n in survived if n in equivalent]
        survivors += [f"{n}: {status[n]}" for n in survived if n not in equivalent]
        other = [
            f"{n}: {s}"
            for n, s in status.items()
            if s not in ("killed", "timeout", "survived", "no tests")
        ]
        survivors += other
        total = len(status)
        took = f"{seconds[module]:.0f}s" if seconds and module in seconds else ""
        print(
            f"{module:<24} {total:>7} {killed:>6} {len(survived) - len(same):>8} "
            f"{sum(status[n] == 'no tests' for n in survived):>8} {len(same):>10} "
            f"{100 * killed / total:>5.1f}% {100 * killed / max(1, total - len(same)):>8.1f}% "
            f"{took:>6}"
        )
    if survivors:
        print("\nnot killed and not recorded as equivalent (mutmut show NAME):")
        print("\n".join(f"  {line}" for line in survivors))


def show_survivors(modules):
    from mutmut.__main__ import get_diff_for_mutant

    equivalent = equivalent_mutants()
    for module in modules:
        for name, status in (results(module) or {}).items():
            if status not in ("killed", "timeout") and name not in equivalent:
                diff = get_diff_for_mutant(name, path=source(module)).splitlines()
                print(f"{name}: {status}")
                print(
                    "\n".join(
                        f"    {line}"
                        for line in diff
                        if line[:1] in "-+" and line[:3] not in ("---", "+++")
                    )
                )


def main(argv):
    children = "1"
    if argv[:1] == ["-j"]:
        children, argv = argv[1], argv[2:]
    if argv[:1] == ["--mutmut"]:  # mutmut's own command line, with the decorator patch
        mutate_decorated_functions_too()
        from mutmut.__main__ import cli

        cli(argv[1:])
        return
    if argv[:1] == ["--survivors"]:
        show_survivors(named(argv[1:]) or MODULES)
        return
    if argv[:1] == ["--retest"]:
        modules = named(argv[1:]) or MODULES
        names = [
            n
            for m in modules
            for n, s in (results(m) or {}).items()
            if s not in ("killed", "timeout")
        ]
        if names:
            subprocess.run(
                [sys.executable, __file__, "--mutmut", "run", "--max-children", children, *names],
                cwd=ROOT,
            )
        report(modules)
        return
    if argv[:1] == ["--report"]:
        report(named(argv[1:]) or MODULES)
        return
    modules = named(argv) or MODULES
    seconds = {}
    for module in modules:
        start = time.monotonic()
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--mutmut",
                "run",
                "--max-children",
                children,
                *patterns(module),
            ],
            cwd=ROOT,
        )
        seconds[module] = time.monotonic() - start
    report(modules, seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
