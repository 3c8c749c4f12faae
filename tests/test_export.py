"""export.py: a 2-rank sharded checkpoint -> one safetensors file whose tensors equal the checkpoint's, as
torch's own DCP converter reads them."""
import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import TINY_MODEL, launch, make_text
from minimal_fsdp import checkpoint, export
from minimal_fsdp.model import GPT, GPTConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    work = tmp_path_factory.mktemp("export")
    (work / "corpus.txt").write_text(make_text())
    launch(["--dataset", "text", "--input_file", "corpus.txt", *TINY_MODEL, "--max_steps", 2, "--eval_interval", 0],
           ranks=2, cwd=work)
    return work / "checkpoints" / "shakespeare"


def test_export_round_trip(ckpt, tmp_path):
    step = checkpoint.latest(ckpt)
    assert len(list(step.glob("*.distcp"))) == 2  # really sharded
    export.main([str(ckpt), str(tmp_path / "out")])  # a run directory means its newest checkpoint
    exported = load_file(tmp_path / "out" / "model.safetensors")
    dcp_to_torch_save(step, tmp_path / "reference.pt")  # torch's converter, independent of ours
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)["model"]
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    config = GPTConfig(**json.loads((tmp_path / "out" / "config.json").read_text()))
    model = GPT(config)
    model.load_state_dict(exported)  # the files are enough to rebuild the model for inference
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_export_casts_to_bf16(ckpt, tmp_path):
    export.main([str(ckpt / "latest"), str(tmp_path / "out"), "--dtype", "bf16"])
    exported = load_file(tmp_path / "out" / "model.safetensors")
    full = checkpoint.load_full_model_state(checkpoint.latest(ckpt))
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v.bfloat16()) for k, v in full.items())


def test_hf_format_hands_the_full_state_to_hf_module(ckpt, tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("minimal_fsdp.hf")
    fake.save_hf = lambda state_dict, model_meta, out_dir: calls.append((state_dict, model_meta, out_dir))
    monkeypatch.setitem(sys.modules, "minimal_fsdp.hf", fake)
    export.main([str(ckpt), str(tmp_path / "hf"), "--format", "hf"])
    (state, model_meta, out_dir), = calls
    assert model_meta == checkpoint.read_meta(checkpoint.latest(ckpt))["model"] and out_dir == tmp_path / "hf"
    assert state.keys() == checkpoint.load_full_model_state(checkpoint.latest(ckpt)).keys()


def test_bad_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export.main([str(tmp_path / "missing"), str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing'} is not a complete checkpoint: " \
                                              f"{tmp_path / 'missing'}: no such directory"


def test_hf_format_without_hf_module_is_one_line(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "minimal_fsdp.hf", None)  # as if minimal_fsdp/hf.py did not exist
    with pytest.raises(SystemExit) as e:
        export.main([str(ckpt), str(tmp_path / "hf"), "--format", "hf"])
    assert e.value.code == 2 and "--format hf needs minimal_fsdp/hf.py" in capsys.readouterr().err
