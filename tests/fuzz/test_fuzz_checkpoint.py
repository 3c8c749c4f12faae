"""Fuzzing a checkpoint's files, in this process: meta.json (its fields, its bytes), DCP's .metadata
pickle, a shard's bytes and an RNG file (each with its CRC-32 recomputed in meta.json, so only the
content can give it away). The property: verify (resume's check) and progress's cheap check either
pass it or give one line; a checkpoint verify passes is then used as export and resume use it, or
refused in one line, never with a traceback (checkpoint/find.py's contract: a checkpoint that fails
while loading is skipped as one that fails a check)."""

import copy
import io
import json
import math
import pickle
import re
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minimal_fsdp.checkpoint import find as checkpoint_find
from minimal_fsdp.checkpoint.checkpointer import restore_rng
from minimal_fsdp.hf.export import export
from minimal_fsdp.tools import progress

import fuzzing
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


STEP = re.compile(r"(?:replicas\.\d+\.)?optim\.state\..+\.step")
SETTING = re.compile(r"(?:replicas\.\d+\.)?optim\.param_groups\.\d+\.(\w+)")
# an entry written as a raw pickle: not None, which a setting may be (fused and foreach)
RAW = object()


def optimizer_entries(genuine, kind):
    """DCP's metadata of the genuine checkpoint, and its optimizer entries that restoring takes as
    they are (kind "steps": each parameter's AdamW step; "settings": each param group's):
    [(fqn, storage info)]."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(genuine)).read_metadata()
    entries = sorted(
        (index.fqn, info)
        for index, info in metadata.storage_data.items()
        if (STEP if kind == "steps" else SETTING).fullmatch(index.fqn)
    )
    return metadata, entries


def optimizer_edits(genuine, kind, raw):
    """The shards with one optimizer entry of `kind` replaced, its byte range and CRC-32 recomputed:
    a number drawn at and past every bound (saved as the entry was: a tensor of its dtype, a Python
    value), or (raw) the value as a raw pickle (what torch.load refuses with weights_only). Returns
    (the edited files {name: bytes}, fqn, the value written or RAW for a raw pickle)."""
    metadata, entries = optimizer_entries(genuine, kind)
    numbers = st.one_of(
        fuzzing.hostile_floats(),
        fuzzing.hostile_ints(),
        st.sampled_from([-5, 1e30, 3, 2.5, 1e-8, 0.99, 1.0, True, None]),
    )

    @st.composite
    def build(draw):
        fqn, info = draw(st.sampled_from(entries))
        shard = (genuine / info.relative_path).read_bytes()
        original = torch.load(io.BytesIO(shard[info.offset : info.offset + info.length]))
        value = draw(numbers)
        if isinstance(original, torch.Tensor):
            try:
                new = torch.tensor(value, dtype=original.dtype)
            except (OverflowError, RuntimeError, TypeError):
                new = torch.tensor(-5, dtype=original.dtype)
            value = new.item()
        elif isinstance(original, (list, tuple)) and original:
            new = list(original)
            new[draw(st.integers(0, len(new) - 1))] = value
            new = type(original)(new)
            value = new
        else:
            new = value
        out = io.BytesIO()
        if raw:
            out.write(pickle.dumps(new, protocol=draw(st.integers(2, 5))))
            value = RAW
        else:
            torch.save(new, out)
        return spliced(genuine, metadata, fqn, out.getvalue()), fqn, value

    return build()


def spliced(path, metadata, fqn, blob):
    """{shard name: its bytes with entry `fqn` replaced by blob, ".metadata": DCP's metadata with
    the byte ranges moved to match}."""
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)
    shard = (path / info.relative_path).read_bytes()
    edited = copy.deepcopy(metadata)
    delta = len(blob) - info.length
    for index, other in edited.storage_data.items():
        if index.fqn == fqn:
            other.length = len(blob)
        elif other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += delta
    return {
        info.relative_path: shard[: info.offset] + blob + shard[info.offset + info.length :],
        ".metadata": pickle.dumps(edited),
    }


def step_fits(value, meta_step):
    """A parameter's AdamW step restoring may take: a whole number in [0, meta.json's step]."""
    return math.isfinite(value) and value == int(value) and 0 <= value <= meta_step


def setting_fits(field, value):
    """A param group's setting restoring may take: a learning rate, eps or weight decay finite and
    not negative; betas in [0, 1); flags true or false."""
    number = type(value) is int or type(value) is float and math.isfinite(value)
    if field in ("lr", "weight_decay", "eps"):
        return number and value >= 0
    if field == "betas":
        return all(type(b) in (int, float) and 0 <= b < 1 for b in value)
    if field in ("amsgrad", "maximize", "capturable", "differentiable"):
        return type(value) is bool
    return True


def damaged(genuine, part, data):
    meta = json.loads((genuine / "meta.json").read_text())
    if part == "meta.json":
        return meta_edits(meta)
    blob = (genuine / part).read_bytes()
    if part == "rng_0.pt":
        return rng_edits(torch.load(genuine / part, weights_only=True))
    return fuzzing.mutated(blob)


def check_checkpoint(genuine, part, blob, used=None):
    """`part` (a file name; or None, blob then {name: bytes}) written into a copy of the genuine
    checkpoint; `used(path)`: what a checkpoint verify passes must then satisfy."""
    with tempfile.TemporaryDirectory() as d:
        run = Path(d, "run")
        shutil.copytree(genuine.parent, run, symlinks=True)
        path = run / genuine.name
        for name, data in (blob if part is None else {part: blob}).items():
            (path / name).write_bytes(data)
            if name != "meta.json":
                recorded(path, name)
        cheap = fuzzing.holds(lambda: progress.problem(path)[0] or "")
        problem = fuzzing.holds(lambda: checkpoint_find.verify(path) or "")
        for why in (cheap, problem):
            if why:
                fuzzing.one_line(why)
        if problem != "":
            return
        if used is not None:
            used(path)
        # complete by every check: export uses it (its shards), resume restores its RNG states
        if part == "rng_0.pt":
            state = torch.get_rng_state()
            try:
                fuzzing.holds(lambda: restore_rng(path, 0, 1, 0), str(path))
            finally:
                torch.set_rng_state(state)
        else:
            fuzzing.holds(lambda: export(path, Path(d, "out")), str(path))


@settings(max_examples=fuzzing.scaled(3, 150))
@given(data=st.data())
def test_meta_json(genuine, data):
    check_checkpoint(genuine, "meta.json", data.draw(damaged(genuine, "meta.json", data)))


@settings(max_examples=fuzzing.scaled(2, 100))
@given(data=st.data())
def test_dcp_metadata(genuine, data):
    check_checkpoint(genuine, ".metadata", data.draw(damaged(genuine, ".metadata", data)))


def test_a_control_character_in_a_metadata_name_is_escaped(genuine):
    """Found by test_dcp_metadata (2026-11-30): one byte of a tensor's name in .metadata turned into
    \\x01; the line naming it carried the raw control character."""
    blob = (genuine / ".metadata").read_bytes()
    name = b"optim.state.blocks.1.attn.qkv.weight.step"
    assert name in blob
    forged = blob.replace(name, name.replace(b".attn", b".\x01ttn"), 1)
    with tempfile.TemporaryDirectory() as d:
        run = Path(d, "run")
        shutil.copytree(genuine.parent, run, symlinks=True)
        path = run / genuine.name
        (path / ".metadata").write_bytes(forged)
        recorded(path, ".metadata")
        problem = checkpoint_find.verify(path)
    fuzzing.one_line(problem, "\\x01ttn")


@settings(max_examples=fuzzing.scaled(2, 100))
@given(data=st.data())
def test_shard_bytes(genuine, data):
    check_checkpoint(genuine, "__0_0.distcp", data.draw(damaged(genuine, "__0_0.distcp", data)))


@settings(max_examples=fuzzing.scaled(2, 100))
@given(data=st.data())
def test_rng_file(genuine, data):
    check_checkpoint(genuine, "rng_0.pt", data.draw(damaged(genuine, "rng_0.pt", data)))


def check_optimizer(genuine, edit):
    """Whether every check passed the edited checkpoint (then what it holds must fit)."""
    files, fqn, value = edit
    meta_step = json.loads((genuine / "meta.json").read_text())["step"]
    passed = []

    def used(path):
        passed.append(path)
        # one assertion per kind of entry: Hypothesis reports each that fails
        if value is RAW:
            raise AssertionError(f"{fqn}, a raw pickle, passed every check")
        if STEP.fullmatch(fqn):
            assert step_fits(value, meta_step), f"{fqn} = {value!r} passed every check"
        else:
            field = SETTING.fullmatch(fqn).group(1)
            assert setting_fits(field, value), f"{fqn} = {value!r} passed every check"

    check_checkpoint(genuine, None, files, used)
    return bool(passed)


def test_a_null_fused_setting_is_a_value_not_a_raw_pickle(genuine):
    """Found by test_optimizer_numbers (2026-12-01): a param group's `fused` saved as None (AdamW's
    own default, which verify rightly takes) was reported as a raw pickle passing every check,
    because None also marked the raw pickles."""
    metadata, _ = optimizer_entries(genuine, "settings")
    out = io.BytesIO()
    torch.save(None, out)
    files = spliced(genuine, metadata, "optim.param_groups.0.fused", out.getvalue())
    edit = (files, "optim.param_groups.0.fused", None)
    assert check_optimizer(genuine, edit), "a fused of None (AdamW's default) was refused"


# steps and settings apart: the hunting profile reports one failure per test
@pytest.mark.parametrize("kind", ["steps", "settings"])
@settings(max_examples=fuzzing.scaled(2, 100))
@given(data=st.data())
def test_optimizer_numbers(genuine, kind, data):
    """The AdamW step of a parameter, or a param group's setting, replaced in the shards by a
    number: a checkpoint verify passes holds only values restoring may take (resume restores them
    as they are: a step of -5 ended runs blaming --lr, 1e30 changed training silently)."""
    check_optimizer(genuine, data.draw(optimizer_edits(genuine, kind, raw=False)))


@pytest.mark.parametrize("kind", ["steps", "settings"])
@settings(max_examples=fuzzing.scaled(1, 50))
@given(data=st.data())
def test_optimizer_raw_pickles(genuine, kind, data):
    """An optimizer entry written as a raw pickle: refused in one line, with no warning of torch's
    beside it (torch.load warns before it refuses one)."""
    check_optimizer(genuine, data.draw(optimizer_edits(genuine, kind, raw=True)))
