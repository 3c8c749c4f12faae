"""The docs and the benchmark results state facts where a reader finds them: links resolve (files
and RESULTS.md anchors), results live under benchmarks/results/, the README lists every docs page
and every extra, and no text numbers work periods ("the ninth session") in place of a date."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "RESULTS.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")
ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "[a-z]+teenth|twentieth|twenty-[a-z]+"
)
WORK_PERIOD = re.compile(rf"\b({ORDINALS})\s+(session|work period)s?\b", re.IGNORECASE)


def pages():
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks").rglob("*.md")),
    ]


def anchors(path):
    return set(re.findall(r'<a id="([^"]+)"></a>', path.read_text()))


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve()
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and file == RESULTS and anchor not in anchors(RESULTS):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such anchor)")
    assert not broken


def test_results_anchors_named_in_tests_and_code_exist():
    """Comments may point at a RESULTS.md section by its anchor; the anchor must be there."""
    named = set()
    for path in [
        *ROOT.joinpath("tests").rglob("*.py"),
        *ROOT.joinpath("minimal_fsdp").rglob("*.py"),
    ]:
        for line in path.read_text().splitlines():
            if "RESULTS.md#" in line:
                named |= set(re.findall(r"#([a-z0-9-]+)", line.split("RESULTS.md", 1)[1]))
    assert named <= anchors(RESULTS), named - anchors(RESULTS)


def test_results_live_under_benchmarks_results_and_scripts_beside():
    top = {p.name for p in (ROOT / "benchmarks").iterdir() if p.is_file()}
    assert not {n for n in top if n.endswith((".md", ".jsonl"))}, (
        "result files belong in benchmarks/results/"
    )
    assert {"RESULTS.md", "LOG.md"} <= {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}


def test_results_open_with_the_current_numbers_each_with_its_provenance():
    text = RESULTS.read_text()
    first = text.index("## Current numbers")
    assert first < text.index("## Every result, newest first")
    header = next(line for line in text[first:].splitlines() if line.startswith("| what"))
    for column in ("date", "card", "GPUs", "torch", "commit", "command"):
        assert f" {column} |" in header, column
    dates = re.findall(r"^### .*\((\d{4}-\d\d-\d\d)[^)]*\)$", text, re.MULTILINE)
    assert dates and dates == sorted(dates, reverse=True), "sections newest first"


def test_readme_lists_every_docs_page_and_every_extra():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"(docs/{p.name})" not in readme]
    assert not missing, missing
    setup = ast.parse((ROOT / "setup.py").read_text())
    extras = next(
        kw.value
        for node in ast.walk(setup)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "extras_require"
    )
    names = [key.value for key in extras.keys]
    assert len(names) > 5
    assert not [n for n in names if f"`{n}`" not in readme and f"[{n}]" not in readme]


def test_readme_map_names_every_subpackage():
    readme = (ROOT / "README.md").read_text()
    subpackages = [p.parent.name for p in (ROOT / "minimal_fsdp").glob("*/__init__.py")]
    assert subpackages and not [s for s in subpackages if f"  {s}/" not in readme]


def test_no_text_numbers_work_periods():
    """Dates name when something was measured; a count of work periods means nothing to a reader."""
    texts = [
        *pages(),
        *(ROOT / "minimal_fsdp").rglob("*.py"),
        *(ROOT / "benchmarks").glob("*.py"),
        *(ROOT / "benchmarks").glob("*.sh"),
        ROOT / "tests" / "README.md",
    ]
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in texts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if WORK_PERIOD.search(line)
    ]
    assert not hits


def test_the_work_period_pattern_sees_them():
    assert WORK_PERIOD.search("as in the twenty-first session")
    assert WORK_PERIOD.search("LOG.md, Nineteenth\nsession".replace("\n", " "))
    assert not WORK_PERIOD.search("a terminal session of its own")


def package_strings(*parts):
    """Every string literal of these subpackages of minimal_fsdp (implicit concatenations joined,
    as the parser joins them), an f-string's formatted values as NUL: one text, the literals
    NUL-separated."""
    texts = []
    for path in sorted(p for part in parts for p in (ROOT / "minimal_fsdp" / part).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                parts = [v.value if isinstance(v, ast.Constant) else "\0" for v in node.values]
                texts.append("".join(parts))
    return "\0".join(texts)


# In a quoted error line: what stands for a value (N, T, HOST, A:P, NAME=V, a variable the code
# formats, the rank prefix exit_on_error adds, a flag's value), cut out before looking for the rest.
PLACEHOLDER = re.compile(
    r"\.\.\.|^rank [N0]: |\(who\)|\bA:P\b|\b[A-Z][A-Z0-9_]*(?:=\S*)?|(?<=--sharding )\S+|\bT(?=ms)"
)
# pieces of the table's lines that span a value the code formats (in brackets)
SPANS_A_VALUE = {
    "s rank is",  # MPI's {what} is
    "the rendezvous (joining rank 0's store and the process group) did not finish within",  # {what}
    "set without torchrun) but no",  # ({who}) but no
}


def test_launch_errors_table_quotes_lines_the_code_prints():
    """docs/launch.md's "When a launch goes wrong" table: every line it quotes (between backticks
    in its first column) is made of text the package prints, values aside; a line reworded in the
    code and not in the table fails here. The backend's own words, in brackets, are torch's."""
    text = (ROOT / "docs" / "launch.md").read_text()
    table = text[text.index("| line | cause | fix |") :].split("\n\n")[0]
    quoted = [
        line
        for row in table.splitlines()[2:]
        for line in re.findall(r"`([^`]+)`", row.strip("|").split(" | ")[0])
        if not line.startswith("(")
    ]
    assert len(quoted) >= 30
    code = package_strings("launch", "config")  # where launch errors are said
    missing = [
        (line, fragment)
        for line in quoted
        for fragment in (f.strip(" ()=,'") for f in PLACEHOLDER.split(line))
        if len(fragment) >= 8 and fragment not in code and fragment not in SPANS_A_VALUE
    ]
    assert not missing, missing
