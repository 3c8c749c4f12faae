"""hf/read.py, reading a Hugging Face model, with transformers as the reference wherever it has an
answer: tiny random GPT2LMHeadModel / LlamaForCausalLM built locally (no network) and imported into
our models with the same logits (fp32, max abs diff < 1e-4); the name map and which tensors GPT-2
stores transposed (against transformers' own parameters); the weight files in every form
(.safetensors, sharded with an index, .bin saved on a GPU, memory-mapped, never unpickling code) and
load_weights' shape checks; the rows each rank of an FSDP2 mesh reads (torch's fake process group:
several ranks' shards in one process); the directory's tokenizer. The directory's config.json and
resolve are test_hf_config.py's; writing one, test_hf_write.py's; tokenizer.json,
test_hf_tokenizer.py's; --hf_model on 2 ranks, test_hf_runs.py's."""

import json
import os
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.data import tokenizer as tk
from minimal_fsdp.hf import hub, read
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.gpt import GPTConfig
from minimal_fsdp.models.llama import LlamaConfig

import tokenizer_dirs
from support import (
    HF_GPT as GPT,
)
from support import (
    HF_LLAMA as LLAMA,
)
from support import (
    LLAMA3_ROPE,
    assert_same_logits,
    bare,
    gpt2_config,
    hf_gpt2,
    hf_llama,
    llama_config,
    ours,
    ours_from,
    save_config,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


# -----------------------------------------------------------------------------
# names


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_names_map_every_parameter_onto_transformers_own(model_type):
    theirs = (
        transformers.GPT2LMHeadModel(gpt2_config())
        if model_type == "gpt"
        else transformers.LlamaForCausalLM(llama_config())
    )
    model = ours(model_type)
    names = read.hf_names(model_type, model.config)
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    their_shapes = {name: tuple(p.shape) for name, p in theirs.named_parameters()}
    # GPT-2's lm_head is the tied embedding: transformers lists it once, as wte
    if model_type == "gpt":
        assert "lm_head.weight" not in names
    assert set(names.values()) == set(their_shapes)
    for name, param in model.named_parameters():
        theirs_name = names[name]
        expected = (
            their_shapes[theirs_name][::-1]
            if read.is_transposed(theirs_name)
            else their_shapes[theirs_name]
        )
        assert tuple(param.shape) == expected, name


def test_transposed_are_exactly_gpt2s_conv1d_weights():
    from transformers.pytorch_utils import Conv1D

    theirs = transformers.GPT2LMHeadModel(gpt2_config())
    modules = dict(theirs.named_modules())
    for name, _ in theirs.named_parameters():
        module, _, kind = name.rpartition(".")
        assert read.is_transposed(name) == (
            isinstance(modules[module], Conv1D) and kind == "weight"
        ), name
    assert any(read.is_transposed(name) for name, _ in theirs.named_parameters())
    for name, _ in transformers.LlamaForCausalLM(llama_config()).named_parameters():
        assert not read.is_transposed(name), name


# -----------------------------------------------------------------------------
# in


def test_gpt2_import(tmp_path):
    theirs = hf_gpt2(tmp_path)
    ours = ours_from(tmp_path)
    assert ours.config == GPTConfig(
        vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32
    )
    assert_same_logits(ours, theirs, 53, 24)


def test_gpt2_import_with_a_shorter_context_keeps_the_first_positions(tmp_path):
    theirs = hf_gpt2(tmp_path)
    ours = ours_from(tmp_path, seq_length=10)
    assert ours.wpe.weight.shape[0] == 10
    assert_same_logits(ours, theirs, 53, 10)


@pytest.mark.parametrize("variant", ["gqa", "llama3-rope", "tied-embeddings"])
def test_llama_import(tmp_path, variant):
    kw = {
        "gqa": {},
        "llama3-rope": {"rope_parameters": LLAMA3_ROPE},
        "tied-embeddings": {"tie_word_embeddings": True, "num_key_value_heads": 6},
    }[variant]
    theirs = hf_llama(tmp_path, **kw)
    ours = ours_from(tmp_path)
    assert_same_logits(ours, theirs, 53, 24)
    if variant == "llama3-rope":  # the scaling is applied, and it matters at these lengths
        assert ours.config.rope_scaling["factor"] == 8.0 and ours.config.rope_theta == 500000.0
        plain = MODELS["llama"](
            LlamaConfig(**dict(ours.config.to_dict(), rope_scaling=None))
        ).eval()
        plain.load_state_dict(ours.state_dict())
        with pytest.raises(AssertionError):
            assert_same_logits(plain, theirs, 53, 24)


def test_import_from_bin_and_from_sharded_safetensors(tmp_path):
    theirs = hf_llama(tmp_path / "sharded", max_position_embeddings=24)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert_same_logits(ours_from(tmp_path / "sharded"), theirs, 53, 24)
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "sharded" / "config.json", tmp_path / "bin")
    torch.save(theirs.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert_same_logits(ours_from(tmp_path / "bin"), theirs, 53, 24)


def test_unsupported_checkpoints_are_one_line_errors(tmp_path):
    hf_gpt2(tmp_path)
    with pytest.raises(ConfigError, match="--seq_length 32 is longer than .* context of 24"):
        read.read_config(tmp_path, seq_length=32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(ConfigError, match="is a 'bert' model; supported are gpt2, llama and qwen2"):
        read.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, activation_function="relu")))
    with pytest.raises(ConfigError, match="activation relu"):
        read.read_config(tmp_path)


def test_hub_name_offline_or_without_huggingface_hub(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there: offline, instantly
    with pytest.raises(ConfigError, match="--hf_model someone/some-model .* unreachable"):
        hub.resolve("someone/some-model")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError, match="pip install huggingface_hub"):
        hub.resolve("someone/some-model")
    with pytest.raises(ConfigError, match="has no config.json"):
        hub.resolve(str(tmp_path))


# -----------------------------------------------------------------------------
# reading the weights


def write_state(directory, state, form):
    """A state dict saved as a Hugging Face directory holds it: one file or an index of shards,
    either format."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    names = list(state)
    if form == "safetensors":
        save_file(state, directory / "model.safetensors")
    elif form == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    elif form == "old bin":  # torch < 1.6's format, which cannot be memory-mapped
        torch.save(state, directory / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    else:
        parts = [names[: len(names) // 2], names[len(names) // 2 :]]
        ext = "safetensors" if form == "sharded safetensors" else "bin"
        prefix = "model" if ext == "safetensors" else "pytorch_model"
        weight_map = {}
        for i, part in enumerate(parts, 1):
            file = f"{prefix}-{i:05d}-of-00002.{ext}"
            (save_file if ext == "safetensors" else torch.save)(
                {n: state[n] for n in part}, directory / file
            )
            weight_map.update({n: file for n in part})
        (directory / f"{prefix}.{ext}.index.json").write_text(
            json.dumps({"weight_map": weight_map})
        )
    return directory


@pytest.mark.parametrize(
    "form", ["safetensors", "bin", "old bin", "sharded safetensors", "sharded bin"]
)
def test_checkpoint_files_read_rows_and_shapes_in_every_form(tmp_path, form):
    state = {
        "a": torch.arange(12.0).reshape(3, 4),
        "b": torch.arange(5.0),
        "c": torch.arange(6.0).reshape(2, 3),
    }
    files = read.CheckpointFiles(write_state(tmp_path, state, form))
    assert all(name in files for name in state) and "d" not in files
    assert [files.shape(n) for n in state] == [(3, 4), (5,), (2, 3)]
    assert torch.equal(files.rows("a", 1, 3), state["a"][1:3])
    assert torch.equal(files.rows("b", 2, 5), state["b"][2:])
    assert torch.equal(files.rows("a", 1, 3, transposed=True), state["a"].t()[1:3])
    assert torch.equal(files.rows("c", 0, 3, transposed=True), state["c"].t())


def test_checkpoint_files_prefer_safetensors_and_an_index(tmp_path):
    state = {"a": torch.ones(2)}
    write_state(tmp_path, {"a": torch.full((2,), 3.0)}, "bin")
    write_state(tmp_path, {"a": torch.full((2,), 2.0)}, "sharded bin")
    write_state(tmp_path, state, "safetensors")
    assert torch.equal(read.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.ones(2))
    write_state(tmp_path, {"a": torch.zeros(2)}, "sharded safetensors")
    assert torch.equal(read.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.zeros(2))
    for file in tmp_path.glob("model*"):
        file.unlink()
    assert torch.equal(read.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.full((2,), 2.0))
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    assert torch.equal(read.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.full((2,), 3.0))
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError) as error:
        read.CheckpointFiles(tmp_path)
    assert str(error.value) == (
        f"--hf_model {tmp_path} has no model.safetensors or pytorch_model.bin (nor an "
        "index of shards)"
    )


def test_checkpoint_files_open_each_file_once(tmp_path):
    files = read.CheckpointFiles(
        write_state(tmp_path, {"a": torch.ones(2, 2), "b": torch.ones(3)}, "sharded safetensors")
    )
    for _ in range(3):
        files.shape("a"), files.rows("b", 0, 1)
    assert sorted(f.name for f in files.open_files) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    first = dict(files.open_files)
    files.rows("a", 0, 1)
    assert all(files.open_files[f] is first[f] for f in first)


def hf_state(model_type, config):
    """A random transformers model of this config, saved as its directory would hold it: {name:
    tensor}."""
    torch.manual_seed(0)
    if model_type == "gpt":
        theirs = transformers.GPT2LMHeadModel(gpt2_config(n_positions=config.seq_length))
    else:
        theirs = transformers.LlamaForCausalLM(
            llama_config(max_position_embeddings=config.seq_length)
        )
    state = {name: p.detach().clone() for name, p in theirs.named_parameters()}
    if model_type == "llama":  # as save_pretrained would (untied)
        state["lm_head.weight"] = theirs.lm_head.weight.detach().clone()
    return state


def expected_params(model_type, config, state):
    """Our parameters from their tensors, by the name map (transposed where GPT-2 stores Conv1D
    weights)."""
    names = read.hf_names(model_type, config)
    return {
        ours: state[theirs].t() if read.is_transposed(theirs) else state[theirs]
        for ours, theirs in names.items()
    }


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_load_weights_copies_every_tensor(tmp_path, model_type):
    config = {"gpt": GPT, "llama": LLAMA}[model_type]
    state = hf_state(model_type, config)
    model = ours(model_type)
    read.load_weights(model, write_state(tmp_path, state, "safetensors"), model_type)
    expected = expected_params(model_type, config, state)
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_stored_names_hub_gpt2_prefix_and_tied_llama_head(tmp_path):
    gpt = hf_state("gpt", GPT)
    model = ours("gpt")  # the hub's gpt2 was saved from GPT2Model: no "transformer." prefix
    read.load_weights(
        model,
        write_state(
            tmp_path / "gpt",
            {n.removeprefix("transformer."): t for n, t in gpt.items()},
            "safetensors",
        ),
        "gpt",
    )
    assert torch.equal(
        model.blocks[1].attn.qkv.weight, gpt["transformer.h.1.attn.c_attn.weight"].t()
    )
    assert torch.equal(model.wpe.weight, gpt["transformer.wpe.weight"])
    llama = hf_state("llama", LLAMA)
    del llama["lm_head.weight"]  # Llama 3.2's tied embeddings
    model = ours("llama")
    read.load_weights(model, write_state(tmp_path / "llama", llama, "safetensors"), "llama")
    assert torch.equal(model.lm_head.weight, llama["model.embed_tokens.weight"])
    # untied: trained apart from here on
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
    del llama["model.norm.weight"]
    write_state(tmp_path / "llama", llama, "safetensors")
    with pytest.raises(ConfigError) as error:
        read.load_weights(model, tmp_path / "llama", "llama")
    assert str(error.value) == (
        f"--hf_model {tmp_path / 'llama'} has no tensor model.norm.weight: not a "
        "checkpoint of this model type?"
    )


def test_shapes_are_checked_before_anything_is_copied(tmp_path):
    state = hf_state("llama", LLAMA)
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(48, 71)
    model = ours("llama")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as error:
        read.load_weights(model, write_state(tmp_path, state, "safetensors"), "llama")
    assert str(error.value) == (
        f"--hf_model {tmp_path}: model.layers.1.mlp.down_proj.weight has shape (48, 71), "
        "our blocks.1.mlp.down_proj.weight is (48, 72)"
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_gpt2_positions_may_be_cut_to_a_shorter_context_only(tmp_path):
    state = hf_state("gpt", GPT)  # 24 positions
    short = GPTConfig(**dict(GPT.to_dict(), seq_length=10))
    model = ours("gpt", short)
    read.load_weights(model, write_state(tmp_path / "a", state, "safetensors"), "gpt")
    assert torch.equal(model.wpe.weight, state["transformer.wpe.weight"][:10])
    for config, bad, shape in [
        (GPTConfig(**dict(GPT.to_dict(), seq_length=25)), None, (24, 32)),
        (short, torch.zeros(24, 31), (24, 31)),
        (short, torch.zeros(24), (24,)),
    ]:
        if bad is not None:
            state["transformer.wpe.weight"] = bad
        model = ours("gpt", config)
        with pytest.raises(ConfigError) as error:
            read.load_weights(model, write_state(tmp_path / "b", state, "safetensors"), "gpt")
        assert str(error.value) == (
            f"--hf_model {tmp_path / 'b'}: transformer.wpe.weight has shape {shape}, our "
            f"wpe.weight is {tuple(model.wpe.weight.shape)}"
        )
    state = hf_state("llama", LLAMA)  # anything else, even with more rows, must match exactly
    state["model.embed_tokens.weight"] = torch.zeros(54, 48)
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight has shape \(54, 48\)"):
        read.load_weights(ours("llama"), write_state(tmp_path / "c", state, "safetensors"), "llama")
    state = hf_state("gpt", GPT)  # a transposed tensor is compared as we store it
    state["transformer.h.0.mlp.c_fc.weight"] = (
        state["transformer.h.0.mlp.c_fc.weight"].t().contiguous()
    )
    with pytest.raises(
        ConfigError,
        match=r"transformer.h.0.mlp.c_fc.weight has shape \(32, 128\), our "
        r"blocks.0.mlp.fc.weight is \(128, 32\)",
    ):
        read.load_weights(ours("gpt"), write_state(tmp_path / "d", state, "safetensors"), "gpt")


# -----------------------------------------------------------------------------
# each rank reads its own rows: FSDP2 meshes on torch's fake process group, one rank at a time in
# this process


@pytest.fixture
def fake_rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank, shape):
        dist.init_process_group(
            "fake", store=FakeStore(), rank=rank, world_size=int(torch.tensor(shape).prod())
        )
        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rows,ranks", [(7, 3), (5, 4), (8, 4), (2, 3)])
def test_local_rows_are_torch_chunk_pieces(fake_rank, rows, ranks):
    from torch.distributed.tensor import DTensor, Shard

    full = torch.arange(rows * 3.0).reshape(rows, 3)
    starts = [0] + [len(piece) for piece in torch.chunk(full, ranks)]
    starts = torch.tensor(starts + [0] * (ranks + 1 - len(starts))).cumsum(0).tolist()
    for rank in range(ranks):
        mesh = fake_rank(rank, (ranks,))
        pieces = torch.chunk(full, ranks)
        local = pieces[rank] if rank < len(pieces) else full[:0]
        param = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
        assert read.local_rows(param) == (starts[rank], starts[rank + 1]), rank
        dist.destroy_process_group()
    assert read.local_rows(full) == (0, rows)


def test_a_replicated_parameter_holds_every_row(fake_rank):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = torch.arange(10.0).reshape(5, 2)
    mesh = fake_rank(3, (2, 2))
    assert read.local_rows(DTensor.from_local(full, mesh, [Replicate(), Replicate()])) == (0, 5)
    piece = torch.chunk(full, 2)[1]
    assert read.local_rows(
        DTensor.from_local(
            piece, mesh, [Replicate(), Shard(0)], shape=full.shape, stride=full.stride()
        )
    ) == (3, 5)


@pytest.mark.parametrize(
    "model_type,shape,rank",
    [
        ("llama", (3,), 2),
        ("llama", (3,), 1),
        ("gpt", (4,), 3),
        ("llama", (2, 3), 5),
        ("gpt", (2, 2), 2),
    ],
)
def test_each_rank_of_a_mesh_loads_its_own_shard(tmp_path, fake_rank, model_type, shape, rank):
    from torch.distributed.fsdp import fully_shard

    config = {"gpt": GPT, "llama": LLAMA}[model_type]
    state = hf_state(model_type, config)
    directory = write_state(tmp_path, state, "safetensors")
    expected = expected_params(model_type, config, state)
    mesh = fake_rank(rank, shape)
    model = MODELS[model_type](config)
    fully_shard(model, mesh=mesh)
    read.load_weights(model, directory, model_type)
    shard_rank = rank % shape[-1]
    for name, param in model.named_parameters():
        pieces = torch.chunk(expected[name], shape[-1])
        local = pieces[shard_rank] if shard_rank < len(pieces) else expected[name][:0]
        assert torch.equal(param.to_local(), local), name


# -----------------------------------------------------------------------------
# the directory's tokenizer


def stub_gpt2(monkeypatch):
    """tiktoken's gpt2 encoding stood in for by a tiny one with GPT-2's split pattern (no gpt2 files
    offline)."""
    return tokenizer_dirs.stub_gpt2_encoding(monkeypatch)


def test_load_tokenizer_of_a_directory(tmp_path, monkeypatch):
    gpt2 = save_config(tmp_path / "gpt2", bare("gpt2"))
    stub = stub_gpt2(monkeypatch)
    tokenizer = read.load_tokenizer(gpt2)  # weights alone: tiktoken's GPT-2 BPE
    assert tokenizer.kind == "gpt2" and tokenizer.enc is stub
    tokenizer_dirs.write_tokenizer_json(gpt2)  # its own files win
    assert read.load_tokenizer(gpt2).kind == "hf"
    llama = save_config(tmp_path / "llama", bare("llama"))  # a Llama has no default
    with pytest.raises(tk.TokenizerError) as error:
        read.load_tokenizer(llama)
    assert str(error.value) == (
        f"--hf_model: {llama} holds no tokenizer: expected tokenizer.json (ours or Hugging "
        "Face's), vocab.json + merges.txt, or tokenizer.model (or pass --tokenizer_dir DIR)"
    )
    assert error.value.__cause__ is None and error.value.__suppress_context__
    tokenizer_dirs.write_vocab_merges(llama)
    assert read.load_tokenizer(llama).kind == "hf"


def test_gpt2_without_tokenizer_files_offline(tmp_path, monkeypatch):
    gpt2 = save_config(tmp_path / "gpt2", bare("gpt2"))
    monkeypatch.setattr(tk, "gpt2_cached", lambda: False)
    monkeypatch.setattr(tk, "reachable", lambda url, timeout=5.0: False)
    with pytest.raises(tk.TokenizerError) as error:
        read.load_tokenizer(gpt2)
    assert str(error.value) == (
        f"--hf_model {gpt2} has no tokenizer files (tokenizer.json, or vocab.json + "
        "merges.txt), and tiktoken's gpt2 files are not cached nor downloadable (offline?): "
        "copy the model's tokenizer files into it, or pass --tokenizer_dir DIR"
    )
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_gpt2_weights_without_tokenizer_files_offline_is_one_line(tmp_path, monkeypatch):
    hf_gpt2(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tk, "reachable", lambda url, timeout=5.0: False)
    with pytest.raises(ConfigError, match="has no tokenizer files .* --tokenizer_dir"):
        read.load_tokenizer(tmp_path)


# -----------------------------------------------------------------------------
# .bin files: memory-mapped, weights only, on a CPU whichever device saved them


class Payload:
    """What a pickle can smuggle in: unpickling it runs code."""

    ran = []

    def __reduce__(self):
        return Payload.ran.append, ("code ran",)


def save_as_from_gpu(state, path, **kw):
    """torch.save as a GPU's tensors would be saved (their storages tagged cuda:0), without a
    GPU."""
    import torch.serialization as serialization

    location_tag = serialization.location_tag
    serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(state, path, **kw)
    finally:
        serialization.location_tag = location_tag


def mapped(path):
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
@pytest.mark.parametrize("zipfile", [True, False])
def test_bin_files_saved_on_a_gpu_load_on_a_cpu_memory_mapped(tmp_path, zipfile):
    state = {"a": torch.arange(12.0).reshape(3, 4)}
    save_as_from_gpu(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=zipfile)
    files = read.CheckpointFiles(tmp_path)
    assert files.shape("a") == (3, 4) and torch.equal(files.rows("a", 1, 2), state["a"][1:2])
    assert files.rows("a", 0, 3).device.type == "cpu"
    assert mapped(tmp_path / "pytorch_model.bin") == zipfile  # torch < 1.6's format is read whole


@pytest.mark.parametrize("zipfile", [True, False])
def test_bin_files_never_run_pickled_code(tmp_path, monkeypatch, zipfile):
    """Not even where the environment asks torch.load to unpickle anything it is not told
    otherwise."""
    torch.save(
        {"a": torch.ones(2), "b": Payload()},
        tmp_path / "pytorch_model.bin",
        _use_new_zipfile_serialization=zipfile,
    )
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    Payload.ran.clear()
    with pytest.raises(
        ConfigError, match=r"pytorch_model.bin cannot be read as a PyTorch file \(UnpicklingError: "
    ):
        read.CheckpointFiles(tmp_path)
    assert Payload.ran == []
