"""Fuzzing a checkpoint's files, in this process: meta.json (its fields, its bytes), DCP's .metadata
pickle, a shard's bytes and an RNG file (each with its CRC-32 recomputed in meta.json, so only the
content can give it away). The property: verify (resume's check) and progress's cheap check either
pass it or give one line; a checkpoint verify passes is then used as export and resume use it, or
refused in one line, never with a traceback (checkpoint/find.py's contract: a checkpoint that fails
while loading is skipped as one that fails a check)."""

import copy
import io
import json
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuzzing
from minimal_fsdp.checkpoint import find as checkpoint_find
from minimal_fsdp.checkpoint.checkpointer import restore_rng
from minimal_fsdp.hf.export import export
from minimal_fsdp.tools import progress
from support import save_three


@pytest.fixture(scope="module")
def genuine(tmp_path_factory, one_rank_group):
    run, _, _ = save_three(tmp_path_factory.mktemp("genuine"))
    return run / "step_2"


def recorded(path, name):
    """Record `name`'s new size and CRC-32 in meta.json, as a forger (or a bug) would."""
    meta = json.loads((path / "meta.json").read_text())
    data = (path / name).read_bytes()
    if name in meta.get("files", {}):
        meta["files"][name] = [len(data), zlib.crc32(data)]
    (path / "meta.json").write_text(json.dumps(meta))


def meta_edits(meta):
    """meta.json with fields replaced, removed or added at any depth, or its bytes mutated."""

    @st.composite
    def build(draw):
        edited = copy.deepcopy(meta)
        for _ in range(draw(st.integers(1, 3))):
            node, keys = edited, []
            while isinstance(node, dict) and node and draw(st.booleans()):
                key = draw(st.sampled_from(sorted(node)))
                keys.append(key)
                if not isinstance(node[key], dict):
                    break
                node = node[key]
            if not isinstance(node, dict) or not node:
                continue
            key = draw(st.sampled_from(sorted(node)))
            if draw(st.integers(0, 4)) == 0:
                node.pop(key)
            else:
                node[key] = draw(fuzzing.json_values(6))
        text = fuzzing.dumps(edited)
        return draw(
            st.one_of(st.just(text.encode("utf-8", "surrogatepass")), fuzzing.mutated(text))
        )

    return build()


def rng_edits(state):
    """A torch.save'd RNG file whose fields have other types, shapes or values, or are missing."""
    values = st.one_of(
        fuzzing.json_values(3),
        st.sampled_from(
            [
                torch.zeros(3, dtype=torch.uint8),
                torch.zeros(5056, dtype=torch.int64),
                torch.zeros(624, dtype=torch.int64),
                torch.tensor([1.5]),
            ]
        ),
    )

    @st.composite
    def build(draw):
        edited = copy.deepcopy(state)
        part = draw(st.sampled_from(sorted(edited)))
        if isinstance(edited[part], dict) and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(edited[part])))
            if draw(st.booleans()):
                edited[part].pop(key)
            else:
                edited[part][key] = draw(values)
        elif draw(st.booleans()):
            edited.pop(part)
        else:
            edited[part] = draw(values)
        out = io.BytesIO()
        torch.save(edited, out)
        return out.getvalue()

    return build()


def damaged(genuine, part, data):
    meta = json.loads((genuine / "meta.json").read_text())
    if part == "meta.json":
        return meta_edits(meta)
    blob = (genuine / part).read_bytes()
    if part == "rng_0.pt":
        return rng_edits(torch.load(genuine / part, weights_only=True))
    return fuzzing.mutated(blob)


def check_checkpoint(genuine, part, blob):
    with tempfile.TemporaryDirectory() as d:
        run = Path(d, "run")
        shutil.copytree(genuine.parent, run, symlinks=True)
        path = run / genuine.name
        (path / part).write_bytes(blob)
        if part != "meta.json":
            recorded(path, part)
        cheap = fuzzing.holds(lambda: progress.problem(path)[0] or "")
        problem = fuzzing.holds(lambda: checkpoint_find.verify(path) or "")
        for why in (cheap, problem):
            if why:
                fuzzing.one_line(why)
        if problem != "":
            return
        # complete by every check: export uses it (its shards), resume restores its RNG states
        if part == "rng_0.pt":
            state = torch.get_rng_state()
            try:
                fuzzing.holds(lambda: restore_rng(path, 0, 1, 0), str(path))
            finally:
                torch.set_rng_state(state)
        else:
            fuzzing.holds(lambda: export(path, Path(d, "out")), str(path))


@settings(max_examples=fuzzing.scaled(8, 300))
@given(data=st.data())
def test_meta_json(genuine, data):
    check_checkpoint(genuine, "meta.json", data.draw(damaged(genuine, "meta.json", data)))


@settings(max_examples=fuzzing.scaled(5, 200))
@given(data=st.data())
def test_dcp_metadata(genuine, data):
    check_checkpoint(genuine, ".metadata", data.draw(damaged(genuine, ".metadata", data)))


@settings(max_examples=fuzzing.scaled(4, 100))
@given(data=st.data())
def test_shard_bytes(genuine, data):
    check_checkpoint(genuine, "__0_0.distcp", data.draw(damaged(genuine, "__0_0.distcp", data)))


@settings(max_examples=fuzzing.scaled(3, 200))
@given(data=st.data())
def test_rng_file(genuine, data):
    check_checkpoint(genuine, "rng_0.pt", data.draw(damaged(genuine, "rng_0.pt", data)))
