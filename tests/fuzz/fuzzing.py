"""The fuzzer's library (its Hypothesis profiles, quick and full, are in tests/conftest.py):
Hypothesis strategies for what our readers are fed (TOML, JSON, binary blobs,
paths, numbers at and past every bound, text with control characters), the files they are written
into, and the one property every reader must keep:

    it returns a value, or raises ConfigError (our error type: the one `error:`/`warning:` line)
    whose text is one printable line naming the file and the field; within TIMEOUT seconds and
    MEMORY more bytes of address space; no warnings (a library's warning is a second line).

Any other exception (a traceback), a hang, a huge allocation or a warning fails the example, and
Hypothesis shrinks it to the smallest input that still fails.
"""

import contextlib
import json
import math
import os
import resource
import signal
import string
import sys
import warnings

from hypothesis import settings
from hypothesis import strategies as st

from minimal_fsdp.config.choices import ConfigError

TIMEOUT = 30  # seconds: far above any reader's time on a tiny file, even on a loaded machine
MEMORY = 3 * 2**30  # bytes of address space a reader may add while it runs


def full_tier():
    """Whether pytest runs with --full or --fuzz-full (conftest.py loads fuzz-ci or fuzz-full)."""
    return settings.default.max_examples > 20


def scaled(quick, full):
    """A test's example count: `quick` in the quick tier, five times that under --full (CI's time),
    `full` under --fuzz-full (the cheap readers get the most: over 10,000 examples in all)."""
    if settings.default.max_examples >= 800:
        return full
    return min(full, 5 * quick) if full_tier() else quick


class Hang(BaseException):
    """Raised in the reader by the alarm: a BaseException, so that a reader's broad `except
    Exception` cannot swallow it."""


def _address_space():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def bounded(timeout=TIMEOUT, memory=MEMORY):
    """The reader's run, bounded in time (SIGALRM: Hang) and memory (RLIMIT_AS: MemoryError, a
    failure too), with every warning recorded and failing."""
    old_handler = signal.signal(signal.SIGALRM, _hang)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    now = _address_space()
    if now is not None and memory is not None:
        limit = now + memory
        resource.setrlimit(resource.RLIMIT_AS, (min(limit, hard) if hard > 0 else limit, hard))
    signal.alarm(timeout)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        shown = [w for w in caught if not _ours_to_ignore(w)]
        assert not shown, f"a warning besides the one line: {shown[0].category.__name__}: " + str(
            shown[0].message
        )
    finally:
        signal.alarm(0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, old_handler)


def _ours_to_ignore(w):
    # pytest.ini's ignored warnings say nothing about the reader
    return "assuming the intent is to save in a single process" in str(w.message)


def _hang(signum, frame):
    raise Hang(f"the reader ran for over {TIMEOUT} s")


def one_line(error, *words):
    """error's text is one printable line (no NUL, no newline, no control character) naming each
    of `words` (the file, the field)."""
    text = str(error)
    assert text.strip(), f"{type(error).__name__} with no text"
    bad = [c for c in text if not c.isprintable()]
    assert not bad, f"the line carries {bad[0]!r} raw: {text[:300]!r}"
    missing = [w for w in words if str(w) not in text]
    assert not missing, f"{text[:300]!r} does not name {missing}"
    return text


def holds(call, *words, errors=(ConfigError,), timeout=TIMEOUT, memory=MEMORY):
    """The property: call() returns (its value is returned), or raises one of `errors` in one line
    naming `words` (None is returned); bounded in time and memory, without warnings."""
    with bounded(timeout, memory):
        try:
            return call()
        except errors as e:
            one_line(e, *words)
            return None


# ---- strategies ----

# numbers at and past the bounds readers use: 64-bit, float's range, 2^24/2^62 caps, digits limits
EDGE_INTS = [
    0,
    1,
    -1,
    2,
    255,
    256,
    65535,
    65536,
    2**24,
    2**24 + 1,
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**62,
    2**62 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64,
    10**10,
    100000,
]


def hostile_ints():
    return st.one_of(
        st.sampled_from(EDGE_INTS),
        st.integers(-1000, 1000),
        st.integers(),
        st.integers(300, 4299).map(lambda digits: 10**digits),  # past float's range, str()-able
        st.integers(-(2**70), 2**70),
    )


def hostile_floats():
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1e308, math.inf, -math.inf, math.nan, 0.5]),
        st.floats(-10, 10),
    )


CONTROL = "\0\n\r\t\x1b\x7f\u2028\u0085"


def hostile_text(max_size=40):
    """Text with control characters, NUL, path parts and unpaired surrogates' neighbours."""
    return st.one_of(
        st.text(max_size=max_size),
        st.text(alphabet=string.ascii_letters + "/._-" + CONTROL, max_size=max_size),
        st.sampled_from(["", ".", "..", "/", "a/b", "a\0b", "run\nname", " x", "x ", "~", "-x"]),
    )


def json_values(max_leaves=30):
    """Any JSON value, numbers past float's range and deep nesting included."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        hostile_ints(),
        hostile_floats(),
        hostile_text(),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(hostile_text(12), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def deep(depth):
    """JSON text nested `depth` deep (what json.loads and many parsers recurse on)."""
    return "[" * depth + "]" * depth


def dumps(value):
    """JSON text of a value that may hold inf/nan and integers past 4300 digits (json.dumps writes
    Infinity, NaN; an integer past Python's digit limit is written out by hand)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # written out whole: the reader meets Python's limit
    try:
        return json.dumps(value, ensure_ascii=False)
    finally:
        sys.set_int_max_str_digits(limit)


def mutated(text):
    """Raw mutations of a file's text or bytes: cut, a byte flipped, bytes inserted, repeated, or
    left alone; what a torn write or a hand edit does."""
    blob = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text

    @st.composite
    def build(draw):
        data = bytearray(blob)
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(["cut", "flip", "insert", "repeat", "none"]))
            at = draw(st.integers(0, max(0, len(data))))
            if kind == "cut":
                data = data[:at]
            elif kind == "flip" and data:
                at = min(at, len(data) - 1)
                data[at] ^= draw(st.integers(1, 255))
            elif kind == "insert":
                data[at:at] = draw(
                    st.one_of(
                        st.binary(max_size=8),
                        st.sampled_from(
                            [b"\0", b"\xff", b"\n", b"[[[[", b"9" * 400, b"{", b'"', b"\xc3"]
                        ),
                    )
                )
            elif kind == "repeat" and data:
                data = data[:at] + data[at:] * draw(st.integers(2, 4))
        return bytes(data)

    return build()


# ---- files ----

PATH_KINDS = ("file", "missing", "directory", "fifo", "loop", "dangling", "link", "link to fifo")


def place(path, kind, data=b""):
    """Put at `path` what `kind` says: a regular file holding data, nothing, a directory, a FIFO, a
    symbolic-link loop, a dangling link, a link to a regular file, a link to a FIFO."""
    path = os.fspath(path)
    if kind == "file":
        with open(path, "wb") as f:
            f.write(data)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        os.symlink(os.path.basename(path) + ".b", path)
        os.symlink(os.path.basename(path), path + ".b")
    elif kind == "dangling":
        os.symlink(path + ".nowhere", path)
    elif kind == "link":
        with open(path + ".target", "wb") as f:
            f.write(data)
        os.symlink(os.path.basename(path) + ".target", path)
    elif kind == "link to fifo":
        os.mkfifo(path + ".fifo")
        os.symlink(os.path.basename(path) + ".fifo", path)
    return path


def path_kinds(weights=None):
    """Mostly a regular file (where the content is fuzzed), sometimes something that is not one."""
    return st.one_of(st.just("file"), st.just("file"), st.just("file"), st.sampled_from(PATH_KINDS))


# ---- TOML ----


def toml_value(value):
    """A value as TOML writes it: strings with every control character escaped (\\u0000 too),
    inf/nan as TOML's, any integer however long (tomllib reads it as Python int() does)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if abs(value) < 10**4000 else "9" * 4400  # past Python's digit limit too
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML's (\uXXXX, \n, \")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(type(value))


def toml_document(tables):
    """{section: {key: value}} (a value not a dict: a key outside any table) as TOML text."""
    lines = []
    for section, table in tables.items():
        if not isinstance(table, dict):
            lines.insert(0, f"{json.dumps(section)} = {toml_value(table)}")
            continue
        lines.append(f"[{json.dumps(section)}]")
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def path_text(max_size=30):
    """A path as a user, a template or a torn file writes it: mostly one holding a NUL or another
    control character somewhere (os.fspath refuses NUL; a newline breaks the one-line errors)."""
    plain = st.text(alphabet=string.ascii_letters + "/._-~ ", min_size=1, max_size=max_size)
    return st.one_of(
        st.tuples(plain, st.sampled_from(CONTROL), plain).map("".join),
        st.tuples(st.sampled_from(CONTROL), plain).map("".join),
        hostile_text(max_size),
    )


def flag_text(kind):
    """A number as a user types it on the command line: at and past every bound, inf/nan, past
    float's range, other notations."""
    return st.one_of(
        hostile_ints().map(str),
        hostile_floats().map(repr),
        st.sampled_from(["inf", "-inf", "nan", "NaN", "1e400", "-1e400", "1e30", "100000", "0x10"]),
        st.sampled_from(["1_000", " 5", "", "1.5", "-0", "+7", "١"]),
    )


def value_for(kind):
    """A hostile value of a flag of type `kind`: right-typed and at the bounds mostly, some of
    another type."""
    right = {
        int: hostile_ints(),
        float: st.one_of(hostile_floats(), hostile_ints()),
        str: hostile_text(),
        bool: st.booleans(),
        list: st.lists(hostile_text(12), max_size=3),
    }[kind]
    wrong = st.one_of(
        st.booleans(),
        hostile_ints(),
        hostile_floats(),
        hostile_text(8),
        st.lists(st.integers(), max_size=2),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    return st.one_of(right, right, right, wrong)


def config_tables(cls):
    """{section: {key: value}} for a command's flags dataclass: its own keys in their sections
    mostly, sometimes a misplaced or unknown key, a key outside any table, or a nested table."""
    import dataclasses

    fields = [f for f in dataclasses.fields(cls) if f.name != "config"]

    @st.composite
    def build(draw):
        tables = {}
        for f in draw(st.lists(st.sampled_from(fields), max_size=6, unique_by=lambda f: f.name)):
            choices = f.metadata["choices"]
            value = draw(
                st.one_of(st.sampled_from(choices), value_for(f.type))
                if choices
                else value_for(f.type)
            )
            section = draw(
                st.one_of(
                    st.just(f.metadata["section"]),
                    st.just(f.metadata["section"]),
                    st.sampled_from(["train", "model", "nowhere", f.name]),
                )
            )
            if section == f.name:
                tables[f.name] = value  # a key outside any table
            else:
                table = tables.setdefault(section, {})
                if isinstance(table, dict):
                    table[f.name] = value
        if draw(st.integers(0, 9)) == 0:
            tables.setdefault("train", {})
            if isinstance(tables["train"], dict):
                tables["train"]["nested"] = {"a": {"b": [[1]]}}
        return tables

    return build()
