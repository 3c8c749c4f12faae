"""safe_load.py: loading never runs code from a checkpoint's files (the metadata unpickler's
allow-list, torch.load with weights_only even where the environment asks torch for the unsafe
default), and reading a checkpoint's tensors in one process, with no other rank (any part of it,
each tensor's dtype and shape)."""

import io
import os
import pickle
import sys
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from minimal_fsdp.checkpoint import checkpointer, find, safe_load

from support import MakeDirectory, moments, run, same, saved, state_of, tiny, weights  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_with_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        safe_load.load_full_model_state(ckpt)
    assert not (tmp_path / "pwned").exists()


# ---- loading never runs code from the files ----


@pytest.fixture
def unsafe_default(monkeypatch):
    """torch.load's default made unsafe (weights_only=False), as a user may set it for their own
    files: the checkpoint's loads must say weights_only=True themselves."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def test_rng_files_are_read_without_running_code(run, tmp_path, unsafe_default):
    evidence = tmp_path / "code-ran"
    buffer = io.BytesIO()
    torch.save(MakeDirectory(evidence), buffer)
    (run / "step_3" / "rng_0.pt").write_bytes(buffer.getvalue())
    # verify names the replaced file by its size, before it unpickles anything
    assert find.verify(run / "step_3").startswith("rng_0.pt has ")
    with pytest.raises(pickle.UnpicklingError):
        checkpointer.restore_rng(run / "step_3", rank=0, world_size=1, seed=0)
    assert not evidence.exists()


def test_optimizer_entries_are_read_without_running_code(tmp_path, unsafe_default):
    evidence = tmp_path / "code-ran"
    model, optimizer = tiny()
    state = state_of(model, optimizer)
    state["optim"]["param_groups"][0]["lr"] = MakeDirectory(evidence)
    state["replicas"] = {"0": state_of(model, optimizer)}
    state["replicas"]["0"]["optim"]["param_groups"][0]["lr"] = MakeDirectory(evidence)
    path = checkpointer.save(tmp_path / "run", 1, None, None, {"replicas": 1}, state=state)
    for load in (checkpointer.load, checkpointer.load_replicas):
        with pytest.raises(CheckpointException):
            load(path, *tiny(seed=2))
        assert not evidence.exists()


def test_the_allow_list_holds_what_dcp_metadata_refers_to_and_nothing_that_runs_code(saved):
    allowed = safe_load._allowed_globals()
    metadata = "torch.distributed.checkpoint.metadata"
    assert {
        (metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    } <= allowed
    assert {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        # where Python 3.13 pickles them
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
        ("torch", "float32"),
        ("torch", "bfloat16"),
        ("torch", "strided"),
        ("torch", "contiguous_format"),
    } <= allowed
    # classes, torch's dtype/layout/memory-format values, and one torch function
    for module, name in allowed:
        if module == "pathlib._local" and sys.version_info < (3, 13):
            continue
        value = getattr(__import__(module, fromlist=[name]), name)
        assert isinstance(value, (type, torch.dtype, torch.layout, torch.memory_format)) or (
            module,
            name,
        ) == ("torch.serialization", "_get_layout"), (module, name)
        if module == metadata:
            assert value.__module__ == metadata
    assert (
        not {
            ("builtins", "getattr"),
            ("builtins", "eval"),
            ("os", "system"),
            ("posix", "system"),
            ("torch", "load"),
            ("builtins", "__import__"),
        }
        & allowed
    )
    referred = set()

    class Recording(safe_load._MetadataUnpickler):
        def find_class(self, module, name):
            referred.add((module, name))
            return super().find_class(module, name)

    with open(saved[0] / "step_3" / ".metadata", "rb") as f:
        Recording(f).load()
    assert referred - {("builtins", "getattr")} <= allowed and ("torch", "Size") in referred


def load_pickle(data, tmp_path):
    (tmp_path / ".metadata").write_bytes(data)
    return safe_load.read_dcp_metadata(tmp_path / ".metadata")


def test_metadata_may_not_change_a_class(tmp_path):
    with pytest.raises(
        pickle.UnpicklingError, match="^checkpoint metadata tries to modify a class$"
    ):
        load_pickle(b"ccollections\nOrderedDict\n}S'move_to_end'\nNsb.", tmp_path)
    assert OrderedDict.move_to_end is not None


def test_metadata_may_read_only_enum_members(tmp_path):
    with pytest.raises(
        pickle.UnpicklingError,
        match="^checkpoint metadata reads an attribute of <class 'collections.OrderedDict'>, which "
        "is not allowed$",
    ):
        load_pickle(b"cbuiltins\ngetattr\n(ccollections\nOrderedDict\nS'fromkeys'\ntR.", tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="reads an attribute of"):
        load_pickle(
            b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
            b"S'__init__'\ntR.",
            tmp_path,
        )
    member = load_pickle(
        b"cbuiltins\ngetattr\n(ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
        b"S'TORCH_CONTIGUOUS_FORMAT'\ntR.",
        tmp_path,
    )
    assert member.name == "TORCH_CONTIGUOUS_FORMAT"


def test_metadata_may_not_hold_persistent_ids(tmp_path):
    with pytest.raises(
        pickle.UnpicklingError,
        match="^checkpoint metadata holds a persistent id, which is not allowed$",
    ):
        load_pickle(b"P0\n.", tmp_path)


def test_safe_reader_reads_a_ranks_metadata_and_tags_it_with_its_load_id(run):
    step = run / "step_3"
    os.replace(step / ".metadata", step / "__0.metadata")
    reader = safe_load.SafeReader(str(step))
    metadata = reader.read_metadata(rank=0)
    assert metadata.storage_meta.load_id == reader.load_id is not None
    with pytest.raises(FileNotFoundError):
        reader.read_metadata()
    bare = dcp.metadata.Metadata(state_dict_metadata={})
    (step / ".metadata").write_bytes(pickle.dumps(bare))
    assert reader.read_metadata().storage_meta is None
    # not DCP's Metadata at all: returned for DCP to reject
    (step / ".metadata").write_bytes(pickle.dumps({}))
    assert reader.read_metadata() == {}


# ---- reading tensors in one process ----


def test_tensor_names_lists_the_models_tensors(saved):
    step = saved[0] / "step_3"
    assert safe_load.tensor_names(step) == [
        (name, p.shape, torch.float32) for name, p in tiny()[0].named_parameters()
    ]
    assert [name for name, _, _ in safe_load.tensor_names(step, "optim.state.ln_f.")] == [
        "weight.step",
        "weight.exp_avg",
        "weight.exp_avg_sq",
        "bias.step",
        "bias.exp_avg",
        "bias.exp_avg_sq",
    ]
    assert safe_load.tensor_names(step, "optim.param_groups.") == []  # not tensors


def test_read_tensors_keeps_each_tensors_dtype_and_shape(tmp_path):
    state = {
        "model": {
            "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "ints": torch.tensor([5, 6], dtype=torch.int32),
        }
    }
    path = checkpointer.save(tmp_path / "run", 1, None, None, {}, state=state)
    got = safe_load.read_tensors(path, ["ints", "half"])
    assert list(got) == ["ints", "half"]
    for name, tensor in got.items():
        assert tensor.dtype == state["model"][name].dtype and torch.equal(
            tensor, state["model"][name]
        )
    assert same(safe_load.load_full_model_state(path), state["model"])


def test_read_tensors_reads_any_part_of_the_checkpoint(saved):
    model, optimizer = tiny()
    got = safe_load.read_tensors(
        saved[0] / "step_3", ["weight.exp_avg", "bias.exp_avg_sq"], prefix="optim.state.ln_f."
    )
    assert torch.equal(got["weight.exp_avg"], optimizer.state[model.ln_f.weight]["exp_avg"])
    assert torch.equal(got["bias.exp_avg_sq"], optimizer.state[model.ln_f.bias]["exp_avg_sq"])


def test_load_restores_the_model_alone_or_with_its_optimizer(saved):
    model, optimizer = tiny(seed=4)
    checkpointer.load(saved[0] / "step_3", model)
    assert same(weights(model), saved[1])
    model, optimizer = tiny(seed=4)
    checkpointer.load(saved[0] / "step_3", model, optimizer)
    assert same(weights(model), saved[1])
    assert all(torch.equal(x, y) for x, y in zip(moments(optimizer), moments(tiny()[1])))


def test_read_tensors_needs_no_other_rank(saved, monkeypatch):
    """Export and inspection read a checkpoint in one process, also inside a running job: no
    collectives."""

    def collective(*args, **kwargs):
        raise AssertionError("read_tensors called a collective")

    for name in (
        "all_gather_object",
        "gather_object",
        "scatter_object_list",
        "broadcast_object_list",
        "barrier",
        "all_reduce",
        "broadcast",
    ):
        monkeypatch.setattr(dist, name, collective)
    assert same(
        safe_load.read_tensors(saved[0] / "step_3", ["ln_f.bias"]),
        {"ln_f.bias": saved[1]["ln_f.bias"]},
    )


def test_read_tensors_silences_only_dcps_single_process_notice(saved, monkeypatch):
    read_metadata = safe_load.SafeReader.read_metadata

    def warns(self, *args, **kwargs):
        warnings.warn("something else", FutureWarning)
        return read_metadata(self, *args, **kwargs)

    monkeypatch.setattr(safe_load.SafeReader, "read_metadata", warns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        safe_load.read_tensors(saved[0] / "step_3", ["ln_f.bias"])
    assert [str(w.message) for w in caught] == ["something else"]
