"""export.py: a 2-rank sharded checkpoint -> one safetensors file whose tensors equal the
checkpoint's, as torch's own DCP converter reads them; --format hf -> what transformers'
AutoModelForCausalLM and AutoTokenizer read, with our logits and our token ids, in the dtype its
config names. Files get ordinary permissions."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from minimal_fsdp.checkpoint import find, safe_load
from minimal_fsdp.checkpoint.meta import read_meta
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.models.gpt import GPT, GPTConfig

from conftest import TINY_MODEL, launch, make_text
from support import command


def assert_ordinary_permissions(directory):
    """0666 less the umask, as any new file; not the 0600 of a temporary file."""
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in directory.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    work = tmp_path_factory.mktemp("export")
    (work / "corpus.txt").write_text(make_text())
    launch(
        [
            "--dataset",
            "text",
            "--input_file",
            "corpus.txt",
            *TINY_MODEL,
            "--max_steps",
            2,
            "--eval_interval",
            0,
        ],
        ranks=2,
        cwd=work,
    )
    return work / "checkpoints" / "corpus"


@pytest.mark.slow
def test_export_round_trip(ckpt, tmp_path):
    step = find.latest(ckpt)
    assert len(list(step.glob("*.distcp"))) == 2  # really sharded
    command(
        "export", *[str(ckpt), str(tmp_path / "out")]
    )  # a run directory means its newest checkpoint
    exported = load_file(tmp_path / "out" / "model.safetensors")
    dcp_to_torch_save(step, tmp_path / "reference.pt")  # torch's converter, independent of ours
    reference = torch.load(tmp_path / "reference.pt", weights_only=True)["model"]
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    config = GPTConfig(**json.loads((tmp_path / "out" / "config.json").read_text()))
    model = GPT(config)
    model.load_state_dict(exported)  # the files are enough to rebuild the model for inference
    # the checkpoint's tokenizer
    assert load_tokenizer(tmp_path / "out").chars == load_tokenizer(step).chars
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata()["model_type"] == "gpt"  # what minimal-fsdp sample rebuilds
    assert_ordinary_permissions(tmp_path / "out")


@pytest.mark.slow  # the ckpt fixture's 2-rank launch
def test_export_casts_to_bf16(ckpt, tmp_path):
    command("export", *[str(ckpt / "latest"), str(tmp_path / "out"), "--dtype", "bf16"])
    exported = load_file(tmp_path / "out" / "model.safetensors")
    full = safe_load.load_full_model_state(find.latest(ckpt))
    assert all(
        exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], v.bfloat16())
        for k, v in full.items()
    )


@pytest.mark.slow  # the ckpt fixture's 2-rank launch
@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_hf_format_loads_in_transformers_with_the_same_logits_and_tokens(ckpt, tmp_path, dtype):
    transformers = pytest.importorskip("transformers")
    command("export", *[str(ckpt), str(tmp_path / "hf"), "--format", "hf", "--dtype", dtype])
    step = find.latest(ckpt)
    meta = read_meta(step)
    ours = GPT(GPTConfig(**meta["model"])).eval()
    state = safe_load.load_full_model_state(step)
    ours.load_state_dict(
        {k: v.bfloat16().float() for k, v in state.items()} if dtype == "bf16" else state
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == {"float32": "float32", "bf16": "bfloat16"}[dtype]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32
    ).eval()
    idx = torch.randint(0, meta["model"]["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = ours(idx)  # logits of the last position
        got = theirs(idx).logits[:, -1]
    assert (got - expected).abs().max() < 1e-4
    # the char tokenizer of the run, as a tokenizer.json: the same ids, no bos/eos (char has none)
    ours_tokenizer = load_tokenizer(step)
    auto_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = make_text(2000)
    assert auto_tokenizer(text)["input_ids"] == ours_tokenizer.encode(text)
    assert auto_tokenizer.decode(ours_tokenizer.encode(text)) == text
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert_ordinary_permissions(tmp_path / "hf")


def test_bad_checkpoint_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        command("export", *[str(tmp_path / "missing"), str(tmp_path / "out")])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == f"error: {tmp_path / 'missing'} is not a complete checkpoint: "
        f"{tmp_path / 'missing'}: no such directory"
    )
