"""File-system safety: files written atomically (write_atomic, sync), and hostile files read
without blocking or following links (open_regular, read_json). It imports nothing of the package:
the config, the launch and the checkpoints all read and write through it."""

import errno
import json
import os
import re
import stat
from pathlib import Path


def write_atomic(path, write, durable=False):
    """Call write(tmp) on a temporary file beside `path`, then rename it to `path`: no reader ever
    sees half of it. The pid in the name keeps concurrent writers (ranks sharing a file system)
    apart; a failed write leaves no temporary behind. durable: the data and the rename also survive
    a power cut (fsync of file and directory)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        if durable:
            sync(tmp)
        os.replace(tmp, path)
        if durable:
            sync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def sync(path):
    """fsync a file or a directory (for a directory: the names in it, e.g. after a rename)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- reading a file that may be hostile (a checkpoint's, a model directory's, a --config) ----
# The one way to read a file of ours: open_regular (a regular file, never a FIFO, device or loop,
# of bounded size, a path without NUL), then read_bytes/read_text/read_json (bounded depth,
# UTF-8, a JSON object); every failure is OSError or ValueError whose text completes "<file> ..."
# in one line.


def shown(value, limit=1000):
    """`value` as one printable line for an error message: control characters (NUL, newlines, ESC)
    escaped, never echoed raw, and cut at `limit` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[:limit] + "..."
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def open_regular(path, max_bytes=None, follow_links=False):
    """`path` opened for binary reading if it is a regular file (of at most max_bytes), else
    OSError. A device, FIFO, socket or symbolic link in a checkpoint is refused before it is opened
    (reading /dev/zero or a FIFO would never end); the file is opened without following links and
    without waiting, then checked again. follow_links: a link to a regular file is read (a file the
    user names, such as --config); a loop of links is OSError (ELOOP), as is a NUL in the path."""
    if "\0" in os.fspath(path):
        raise OSError(errno.EINVAL, "the path holds a NUL byte", shown(path, 1000))
    mode = (os.stat if follow_links else os.lstat)(path).st_mode
    if not stat.S_ISREG(mode):
        raise OSError(
            errno.EINVAL, "not a regular file (a link, directory, device or FIFO)", str(path)
        )
    fd = os.open(path, os.O_RDONLY | (0 if follow_links else os.O_NOFOLLOW) | os.O_NONBLOCK)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or max_bytes is not None and info.st_size > max_bytes:
        os.close(fd)
        why = (
            "not a regular file"
            if not stat.S_ISREG(info.st_mode)
            else f"{info.st_size} bytes, over {max_bytes}"
        )
        raise OSError(errno.EFBIG if "bytes" in why else errno.EINVAL, why, str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path, max_bytes, follow_links=False):
    """The bytes of `path` (open_regular's checks); at most max_bytes are read even if the file grew
    since it was checked."""
    with open_regular(path, max_bytes, follow_links) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"over {max_bytes} bytes", str(path))
    return data


def read_text(path, max_bytes, follow_links=False):
    """The UTF-8 text of `path` (read_bytes); ValueError naming where it is not UTF-8."""
    data = read_bytes(path, max_bytes, follow_links)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"is not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None


def read_json(path, max_bytes, max_depth=32, follow_links=False, kind=dict):
    """The JSON object in `path`, a regular file of at most max_bytes (open_regular), nested at most
    max_depth deep: json.loads recurses once per level, so a deeply nested file would end in
    RecursionError. Raises OSError, or ValueError whose text completes "<file> ..." in one line.
    kind: the type the top level must have (None: any)."""
    return parse_json(read_bytes(path, max_bytes, follow_links), max_depth, kind)


def parse_json(data, max_depth=32, kind=dict):
    """JSON text or bytes (read_json's checks, without the file): ValueError in one line."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise ValueError(f"is not JSON ({type(e).__name__}: {shown(e, 100)})") from None
    if _depth(text) > max_depth:
        raise ValueError(f"nests deeper than {max_depth} levels")
    try:
        value = json.loads(text)
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
        raise ValueError(
            f"is not JSON ({type(e).__name__}: {shown(' '.join(str(e).split()), 100)})"
        ) from None
    except ValueError as e:  # an integer past Python's digits limit
        raise ValueError(f"is not JSON we write ({shown(e, 100)})") from None
    if kind is not None and not isinstance(value, kind):
        raise ValueError(f"holds a JSON {type(value).__name__}, not an object")
    return value


def _depth(text):
    """How deep JSON text nests, strings skipped."""
    depth = deepest = 0
    for token in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        char = token.group()
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
