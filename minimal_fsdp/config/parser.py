"""The one command-line parser of every command: argparse built from a flags dataclass, each field a
flag (or a positional argument) with its help, choices, default and TOML section; `--config
FILE.toml` read for every command, bounded like every other file read. Defaults < --config file <
command line.

A command's dataclass may set, as class variables: PROG (the command as typed), USAGE, DESCRIPTION,
and FILE_ALSO, dataclasses whose keys a --config file may also hold and this command ignores (so a
run's own config.toml serves the planner, sampling and progress). A `derived(values, given)`
static method, if any, fills in the values the flags imply before the instance is built (nothing is
written into it afterwards); a `check(given)` method, if any, runs last on the parsed flags
(`given`: the names set by the file or the command line). Nothing here
imports torch.
"""

import argparse
import dataclasses
import difflib
import re
import sys
from dataclasses import field

from minimal_fsdp.config.choices import ConfigError

MAX_CONFIG_BYTES = 2**20  # a flags file is a few KB; a bigger one is not a flags file


def flag(
    default, help, choices=None, section="train", positional=False, required=False, nargs=None
):
    """A flag: a dataclass field with its help text, choices and TOML section. `positional`: an
    argument without `--` (it may come from the file too); `required`: the command refuses to run
    without it; `nargs`: for list fields, argparse's ("+" by default, "..." for a command after
    `--`)."""
    return field(
        default=default,
        metadata={
            "help": help,
            "choices": choices,
            "section": section,
            "positional": positional,
            "required": required,
            "nargs": nargs,
        },
    )


def sections(cls):
    """The sections of `cls` in the order its fields first name them: --help's groups, the file's
    tables."""
    return tuple(dict.fromkeys(f.metadata["section"] for f in dataclasses.fields(cls)))


class _Parser(argparse.ArgumentParser):
    """argparse exits with a usage dump on a bad flag; we want one line and the same exit path as
    other errors, and a suggestion for a mistyped flag."""

    def error(self, message):
        # argparse's invalid choice, with the choices the value starts (or nearly) like
        bad = re.fullmatch(r"argument (\S+): invalid choice: '(.*)' \(choose from (.*)\)", message)
        if bad:
            choices = re.findall(r"'([^']*)'", bad[3])
            value = bad[2].lower()
            close = [c for c in choices if c.lower().startswith(value)] or [
                c
                for c in choices
                if c.lower() in difflib.get_close_matches(value, [c.lower() for c in choices], n=1)
            ]
            if close:
                message += f" (did you mean {' or '.join(close)}?)"
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        flags = [a.split("=", 1)[0] for a in extras if a.startswith("-")]
        if not flags:
            if extras:
                self.error(f"unrecognized arguments: {' '.join(extras)} (flags start with --)")
            return namespace
        close = difflib.get_close_matches(
            flags[0], [o for o in self._option_string_actions if o.startswith("--")], n=1
        )
        hint = f" (did you mean {close[0]}?)" if close else ""
        self.error(f"unrecognized flag {flags[0]}{hint}; `{self.prog} --help` lists them")


def _help(f):
    """The field's help with its default, as argparse prints it ('%' escaped); an unset default says
    nothing (the help says what unset means)."""
    text = f.metadata["help"].replace("%", "%%")
    if f.default is None:
        return text
    default = (
        ("on" if f.default else "off") if f.type is bool else str(f.default).replace("%", "%%")
    )
    return f"{text} (default: {default})"


_METAVARS = {int: "N", float: "NUM", str: "TEXT", list: "TEXT"}


def build_parser(cls, prog=None, description=None):
    """Flags grouped by their section (the tables of a --config file), each with its default.
    Abbreviations are refused: `--max_step 5` must not quietly mean --max_steps, nor break when a
    flag is added."""
    usage = getattr(cls, "USAGE", None)
    if prog not in (None, getattr(cls, "PROG", None)):
        # another command parsing these flags (progress takes train's) has its own usage line
        usage = f"{prog} [--config FILE.toml] [--FLAG VALUE ...]"
    parser = _Parser(
        prog=prog or getattr(cls, "PROG", None),
        usage=usage,
        description=description or getattr(cls, "DESCRIPTION", None),
        allow_abbrev=False,
    )
    fields = dataclasses.fields(cls)
    if "config" not in {f.name for f in fields}:
        parser.add_argument(
            "--config",
            metavar="FILE.toml",
            help="TOML file of flag values, in sections as the "
            "groups below; command-line flags override it",
        )
    groups = {section: parser.add_argument_group(f"[{section}]") for section in sections(cls)}
    for f in fields:
        group, meta = groups[f.metadata["section"]], f.metadata
        if meta["positional"]:
            nargs = meta["nargs"] or ("*" if f.type is list else "?")
            group.add_argument(
                f.name, nargs=nargs, default=f.default, help=_help(f), metavar=f.name.upper()
            )
        elif f.type is bool:
            group.add_argument(
                "--" + f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=_help(f),
            )
        else:
            group.add_argument(
                "--" + f.name,
                type=str if f.type is list else f.type,
                default=f.default,
                choices=meta["choices"],
                help=_help(f),
                nargs=meta["nargs"] or ("+" if f.type is list else None),
                metavar=None if meta["choices"] else _METAVARS[f.type],
            )
    return parser


def _on_command_line(f, argv):
    if f.metadata["positional"]:
        return False
    names = ("--" + f.name, "--no-" + f.name)
    return any(a in names or a.startswith(names[0] + "=") for a in argv)


def parse(cls, argv=None, prog=None, description=None):
    """An instance of `cls` from the command line: defaults < --config file < command line. The
    command line is read twice: once for --config, then in full with the file's values as the
    defaults."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser(cls, prog, description)
    config_file = parser.parse_known_args(argv)[0].config
    file_values = load_config_file(config_file, cls) if config_file else {}
    parser.set_defaults(**file_values)
    values = vars(parser.parse_args(argv))
    fields = dataclasses.fields(cls)
    if "config" not in {f.name for f in fields}:
        del values["config"]
    for f in fields:
        # an empty positional list: the file's, or the default
        if f.type is list and values[f.name] == []:
            values[f.name] = file_values.get(f.name, f.default)
        if f.metadata["required"] and values[f.name] in (None, []):
            name = f.name.upper() if f.metadata["positional"] else "--" + f.name
            raise ConfigError(f"{parser.prog} needs {name} (on the command line or in --config)")
    given = set(file_values) | {f.name for f in fields if _on_command_line(f, argv)}
    if hasattr(cls, "derived"):
        values = cls.derived(values, given)
    parsed = cls(**values)  # frozen: complete from here on
    if hasattr(parsed, "check"):
        parsed.check(given)
    # every command's numbers, from the file or the command line: one table (checks.py)
    from minimal_fsdp.config.checks import check_numbers

    check_numbers(parsed)
    return parsed


_TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list of strings",
}


def read_toml(path):
    """The tables of a TOML file, read as every other file the package reads from a user is
    (files.py): a regular file (a link is followed to one; a FIFO, device or socket is refused
    before it is opened), of at most MAX_CONFIG_BYTES, nested no deeper than the parser's recursion
    allows. Every failure: one line."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("--config needs tomli on Python < 3.11: pip install tomli") from None

    # here, not at the top: importing config loads nothing outside it (test_config.py)
    from minimal_fsdp.files import read_text, shown

    where = f"--config {shown(path, 1000)}"
    try:
        # a link is followed (a config is named by the user); a loop of links is ELOOP here
        return tomllib.loads(read_text(path, MAX_CONFIG_BYTES, follow_links=True))
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror or e}") from None
    except RecursionError:
        raise ConfigError(
            f"{where}: arrays or tables nest too deeply (a flags file has two levels: "
            "[section] and key)"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: {shown(e, 200)}") from None
    except ValueError as e:  # not UTF-8, or an integer past Python's digit limit
        raise ConfigError(f"{where}: {shown(e, 160)}") from None


def load_config_file(path, cls):
    """{flag name: value} from a TOML file whose tables are cls's sections and whose keys are its
    flags (or the flags of a FILE_ALSO dataclass, ignored). Unknown or misplaced keys and wrong
    types are one-line errors that name section.key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    also = {
        f.name: f.metadata["section"]
        for other in getattr(cls, "FILE_ALSO", ())
        for f in dataclasses.fields(other)
    }
    known = sections(cls) + tuple(s for s in dict.fromkeys(also.values()) if s not in sections(cls))
    values = {}
    from minimal_fsdp.files import shown

    tables = read_toml(path)
    path = shown(path, 1000)  # in the messages below: never a control character raw
    for section, table in tables.items():
        if not isinstance(table, dict):
            home = fields[section].metadata["section"] if section in fields else also.get(section)
            where = f"put it under [{home}]" if home else "sections are " + ", ".join(known)
            raise ConfigError(
                f"--config {path}: '{shown(section, 60)}' is outside any section; {where}"
            )
        if section not in known:
            raise ConfigError(
                f"--config {path}: unknown section [{shown(section, 60)}]; sections are "
                f"{', '.join(known)}"
            )
        for key, value in table.items():
            f = fields.get(key)
            if also.get(key) == section and (
                f is None or f.metadata["section"] != section or key == "config"
            ):
                continue  # another command's flag, in its place (a run's config file)
            if f is None or key == "config":
                close = difflib.get_close_matches(
                    key, [n for n in (*fields, *also) if n != "config"], n=1
                )
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(
                    f"--config {path}: unknown key {shown(section, 60)}.{shown(key, 60)}{hint}"
                )
            if f.metadata["section"] != section:
                raise ConfigError(
                    f"--config {path}: {section}.{key} belongs in [{f.metadata['section']}]"
                )
            values[key] = _checked(f, value, f"--config {path}: {section}.{key}")
    return values


def _checked(f, value, where):
    """A file's value for flag `f`, of the flag's type: ConfigError in one line otherwise. Ranges
    are checks.check_numbers's, for the file's values and the command line's alike."""
    from minimal_fsdp.files import shown

    ok = isinstance(value, f.type) and not (f.type is int and isinstance(value, bool))
    if f.type is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value, ok = float(value), True  # TOML writes 1 for 1.0
        except OverflowError:
            raise ConfigError(
                f"{where} must be a number within float's range, about 1.8e308 (got an integer "
                f"of {len(str(abs(value)))} digits)"
            ) from None
    if f.type is list:
        ok = ok and all(isinstance(v, str) for v in value)
    if not ok:
        raise ConfigError(f"{where} must be {_TYPE_NAMES[f.type]} (got {shown(value, 60)})")
    for text in value if f.type is list else [value] if f.type is str else []:
        if "\0" in text:  # no path can hold one, and open() would raise ValueError
            raise ConfigError(f"{where} holds a NUL byte ({shown(text, 60)}): remove it")
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise ConfigError(
            f"{where} must be one of {', '.join(choices)} (got {shown(repr(value), 60)})"
        )
    return value
