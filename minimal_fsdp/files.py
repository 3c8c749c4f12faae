"""Writing a file so that no reader ever sees half of it: write a temporary sibling, then rename it over."""
import os
from pathlib import Path


def write_atomic(path, write):
    """Call write(tmp) on a temporary file beside `path`, then rename it to `path`. The pid in the name keeps
    concurrent writers (ranks sharing a file system) apart; a failed write leaves no temporary behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
