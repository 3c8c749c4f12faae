"""export.py: a 2-rank sharded checkpoint -> one safetensors file whose tensors equal the checkpoint's, as
torch's own DCP converter reads them."""
import json

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


def test_hf_format_loads_in_transformers_with_the_same_logits(ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    export.main([str(ckpt), str(tmp_path / "hf"), "--format", "hf"])
    meta = checkpoint.read_meta(checkpoint.latest(ckpt))
    ours = GPT(GPTConfig(**meta["model"])).eval()
    ours.load_state_dict(checkpoint.load_full_model_state(checkpoint.latest(ckpt)))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, meta["model"]["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = ours(idx)  # logits of the last position
        got = theirs(idx).logits[:, -1]
    assert (got - expected).abs().max() < 1e-4


def test_bad_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export.main([str(tmp_path / "missing"), str(tmp_path / "out")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing'} is not a complete checkpoint: " \
                                              f"{tmp_path / 'missing'}: no such directory"
