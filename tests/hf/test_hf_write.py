"""hf/write.py and export: our models written as Hugging Face directories that transformers loads
with the same logits (fp32, max abs diff < 1e-4); the safetensors files write_safetensors streams
(read back by safetensors, views and shards filled to the byte), the config.json transformers builds
the same model from, write_hf's shards, index, metadata, dtype and stale files, and the files'
modes."""

import json
import os
import struct

import pytest
import torch

from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.data.tokenizer import CharTokenizer
from minimal_fsdp.hf import read, write
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.gpt import GPTConfig
from minimal_fsdp.models.llama import LlamaConfig
from minimal_fsdp.parallel.parallelize import init_weights

from support import (
    HF_GPT as GPT,
)
from support import (
    HF_LLAMA as LLAMA,
)
from support import (
    LLAMA3,
    LLAMA3_ROPE,
    assert_same_logits,
    gpt2_config,
    llama_config,
    ours,
    ours_from,
    save_config,
)

transformers = pytest.importorskip("transformers")


# -----------------------------------------------------------------------------
# out


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, model_type):
    config = (
        GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32)
        if model_type == "gpt"
        else LlamaConfig(
            vocab_size=53,
            seq_length=24,
            num_layers=2,
            num_heads=6,
            num_kv_heads=2,
            embed_size=48,
            intermediate_size=72,
            rope_scaling=LLAMA3_ROPE,
            rope_theta=500000.0,
        )
    )
    ours = MODELS[model_type](config).eval()
    init_weights(ours, 0, torch.device("cpu"))
    meta = {"model": config.to_dict(), "model_type": model_type}
    # several shards
    write.save_hf(ours.state_dict(), meta, tmp_path / "out", max_shard_bytes=30_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (
        type(theirs).__name__ == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model_type]
    )
    assert_same_logits(ours, theirs, 53, 24)
    # ... and it comes back in unchanged, also after a second export to the same directory as
    # one file.
    write.save_hf(ours.state_dict(), meta, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    again = ours_from(tmp_path / "out")
    for name, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_export_of_a_checkpoint_without_model_type_is_a_gpt(tmp_path):
    config = GPTConfig(vocab_size=300, seq_length=16, num_layers=1, num_heads=2, embed_size=16)
    ours = MODELS["gpt"](config)
    init_weights(ours, 0, torch.device("cpu"))
    write.save_hf(ours.state_dict(), {"model": config.to_dict()}, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt2"


def test_export_dtype_and_file_permissions(tmp_path):
    config = LlamaConfig(
        vocab_size=53,
        seq_length=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_size=16,
        intermediate_size=32,
    )
    ours = MODELS["llama"](config)
    init_weights(ours, 0, torch.device("cpu"))
    state = {name: t.bfloat16() for name, t in ours.state_dict().items()}
    tokenizer = CharTokenizer("".join(chr(ord("a") + i) for i in range(26)) + " .")
    write.save_hf(
        state,
        {"model": config.to_dict(), "model_type": "llama"},
        tmp_path / "out",
        tokenizer,
        max_shard_bytes=2_000,
    )
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["dtype"] == saved["torch_dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert {p.dtype for p in theirs.parameters()} == {torch.bfloat16}
    umask = os.umask(0)
    os.umask(umask)
    files = sorted((tmp_path / "out").iterdir())
    assert (
        len([f for f in files if f.suffix == ".safetensors"]) > 1
        and (tmp_path / "out" / "tokenizer.json") in files
    )
    assert {f.name: f.stat().st_mode & 0o777 for f in files} == {
        f.name: 0o666 & ~umask for f in files
    }


# -----------------------------------------------------------------------------
# out: files, weights and config.json


def test_written_files_get_the_mode_the_umask_gives(tmp_path):
    previous = os.umask(0o027)
    try:
        write.write_public(tmp_path / "a.json", lambda p: p.write_text("{}"))
        assert os.umask(0o027) == 0o027  # left as it was
        os.umask(0o002)
        write.write_public(tmp_path / "b.json", lambda p: p.write_text("[]"))
    finally:
        os.umask(previous)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "b.json").read_text() == "[]" and sorted(
        p.name for p in tmp_path.iterdir()
    ) == ["a.json", "b.json"]


def test_safetensors_written_a_tensor_at_a_time_read_back_by_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g),
        "f16": torch.randn(2, 2, 3, generator=g),
        "i64": torch.arange(-5, 6),
        "i32": torch.arange(9).int(),
        "u8": torch.arange(250, 256).to(torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    dtypes = {
        "f32": torch.float32,
        "bf16": torch.bfloat16,
        "f16": torch.float16,
        "i64": torch.int64,
        "i32": torch.int32,
        "u8": torch.uint8,
        "scalar": torch.float32,
        "empty": torch.float32,
    }
    specs = [(name, tuple(t.shape), dtypes[name]) for name, t in tensors.items()]
    asked = []
    write.write_safetensors(
        tmp_path / "w.safetensors",
        specs,
        lambda name: asked.append(name) or tensors[name].float(),
        {"format": "pt", "step": 12, "source": None},
    )
    assert asked == list(tensors)  # once each, in file order
    loaded = load_file(tmp_path / "w.safetensors")
    for name, t in tensors.items():
        assert loaded[name].dtype == dtypes[name] and torch.equal(
            loaded[name], t.to(dtypes[name])
        ), name
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "12", "source": "None"}
    raw = (tmp_path / "w.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0 and raw[8 + size - 1 : 8 + size] in (b" ", b"}")
    header = json.loads(raw[8 : 8 + size])
    offsets = [header[name]["data_offsets"] for name in tensors]  # in spec order, back to back
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert len(raw) == 8 + size + offsets[-1][1]


def test_safetensors_refuses_a_tensor_of_another_shape(tmp_path):
    with pytest.raises(AssertionError, match="^b$"):
        write.write_safetensors(
            tmp_path / "w.safetensors",
            [("a", (2,), torch.float32), ("b", (3,), torch.float32)],
            lambda name: torch.zeros(2),
            {},
        )
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_config_json_is_what_transformers_builds_the_same_model_from(tmp_path, model_type):
    config = {
        "gpt": GPTConfig(**dict(GPT.to_dict(), dropout=0.25)),
        "llama": LlamaConfig(
            **dict(
                LLAMA.to_dict(), dropout=0.25, norm_eps=1e-5, rope_theta=50.0, rope_scaling=LLAMA3
            )
        ),
    }[model_type]
    saved = write.hf_config(model_type, config, torch.bfloat16, bos_id=3, eos_id=4)
    save_config(tmp_path / "m", saved)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert (theirs.vocab_size, theirs.bos_token_id, theirs.eos_token_id, theirs.dtype) == (
        53,
        3,
        4,
        torch.bfloat16,
    )
    assert saved["torch_dtype"] == "bfloat16"  # transformers 4's spelling
    assert read.read_config(tmp_path / "m") == (model_type, dataclass_replace(config, dropout=0.0))
    assert read.read_config(tmp_path / "m", dropout=0.25) == (model_type, config)
    if model_type == "gpt":
        assert type(theirs).__name__ == "GPT2Config" and saved["architectures"] == [
            "GPT2LMHeadModel"
        ]
        assert (theirs.n_positions, theirs.n_embd, theirs.n_layer, theirs.n_head) == (24, 32, 2, 4)
        assert (theirs.resid_pdrop, theirs.embd_pdrop, theirs.attn_pdrop) == (0.25, 0.25, 0.25)
        assert theirs.tie_word_embeddings
        # stated, not left to a reader's defaults: the fields read_config checks
        assert (saved["n_inner"], saved["activation_function"], saved["layer_norm_epsilon"]) == (
            None,
            "gelu_new",
            1e-5,
        )
        with pytest.raises(ConfigError) as error:
            write.hf_config("gpt", GPTConfig(**dict(GPT.to_dict(), bias=False)))
        assert str(error.value) == "a GPT without biases has no GPT2LMHeadModel equivalent"
    else:
        assert type(theirs).__name__ == "LlamaConfig" and saved["architectures"] == [
            "LlamaForCausalLM"
        ]
        assert (
            theirs.max_position_embeddings,
            theirs.hidden_size,
            theirs.intermediate_size,
            theirs.num_hidden_layers,
            theirs.num_attention_heads,
            theirs.num_key_value_heads,
            theirs.head_dim,
            theirs.rms_norm_eps,
            theirs.attention_dropout,
        ) == (24, 48, 72, 2, 6, 2, 8, 1e-5, 0.25)
        assert theirs.rope_parameters == dict(LLAMA3, rope_theta=50.0)
        assert not theirs.tie_word_embeddings and not theirs.attention_bias and not theirs.mlp_bias
        assert (saved["hidden_act"], saved["attention_bias"], saved["mlp_bias"]) == (
            "silu",
            False,
            False,
        )
        # transformers 4 reads rope_theta and rope_scaling
        assert (saved["rope_theta"], saved["rope_scaling"]) == (50.0, dict(LLAMA3, rope_theta=50.0))
        plain = write.hf_config("llama", LLAMA)
        assert plain["tie_word_embeddings"] is False
        assert plain["rope_scaling"] is None and plain["rope_parameters"] == {
            "rope_type": "default",
            "rope_theta": 10000.0,
        }
        assert (plain["dtype"], plain["bos_token_id"], plain["eos_token_id"]) == (
            "float32",
            None,
            None,
        )


STATED = {
    "gpt": [
        "architectures",
        "model_type",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
        "activation_function",
        "layer_norm_epsilon",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "tie_word_embeddings",
    ],
    "llama": [
        "architectures",
        "model_type",
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "attention_bias",
        "mlp_bias",
        "attention_dropout",
        "tie_word_embeddings",
    ],
}


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_config_json_states_every_field_that_shapes_the_model(tmp_path, model_type):
    """Not left to a reader's defaults (they differ between readers and versions): each field is in
    the file, as the value transformers reads."""
    config = {"gpt": GPT, "llama": LLAMA}[model_type]
    saved = write.hf_config(model_type, config, bos_id=1, eos_id=2)
    theirs = transformers.AutoConfig.from_pretrained(save_config(tmp_path / "m", saved))
    for key in STATED[model_type]:
        assert key in saved and saved[key] == getattr(theirs, key), key
    assert {"dtype", "torch_dtype"} <= set(saved)
    if model_type == "llama":
        assert {"rope_theta", "rope_parameters", "rope_scaling"} <= set(saved)


def dataclass_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


def llama_state(dtype=torch.float32):
    return {name: t.to(dtype) for name, t in ours("llama").state_dict().items()}


def test_shards_are_filled_greedily_in_order_up_to_the_limit(tmp_path):
    from safetensors.torch import load_file

    state = llama_state()
    names = read.hf_names("llama", LLAMA)
    sizes = [t.numel() * 4 for t in state.values()]
    limit = 3 * max(sizes) // 2  # the largest tensor fits; two large ones do not
    write.save_hf(
        state, {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path, max_shard_bytes=limit
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert index["metadata"] == {"total_size": sum(sizes)}
    assert list(index["weight_map"]) == [names[n] for n in state]  # every tensor, in our order
    expected, size = [[]], 0  # the greedy split, done here
    for name, nbytes in zip(state, sizes):
        if expected[-1] and size + nbytes > limit:
            expected.append([])
            size = 0
        expected[-1].append(names[name])
        size += nbytes
    assert len(expected) == len(files) > 2
    for file, want in zip(files, expected):
        loaded = load_file(file)
        assert sorted(loaded) == sorted(want) and all(
            index["weight_map"][n] == file.name for n in want
        )
        assert sum(t.numel() * 4 for t in loaded.values()) <= limit
    write.save_hf(
        state,
        {"model": LLAMA.to_dict(), "model_type": "llama"},
        tmp_path / "exact",
        max_shard_bytes=sum(sizes),
    )  # all of it fits exactly: one file
    assert sorted(p.name for p in (tmp_path / "exact").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    write.save_hf(
        state,
        {"model": LLAMA.to_dict(), "model_type": "llama"},
        tmp_path / "one",
        max_shard_bytes=1,
    )
    # a tensor a shard
    assert len(list((tmp_path / "one").glob("model-*-of-*.safetensors"))) == len(state)


def test_an_export_replaces_every_earlier_weight_file(tmp_path):
    state, meta = llama_state(), {"model": LLAMA.to_dict(), "model_type": "llama"}
    for stale in (
        "pytorch_model.bin",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model.bin.index.json",
        "model-00001-of-00009.safetensors",
        "model.safetensors.index.json",
        "README.md",
        "notes.bin",
    ):
        (tmp_path / stale).write_text("old")
    write.save_hf(state, meta, tmp_path, max_shard_bytes=20_000)
    kept = sorted(p.name for p in tmp_path.iterdir())
    shards = [n for n in kept if n.startswith("model-")]
    assert len(shards) > 1 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    assert kept == sorted(
        ["README.md", "notes.bin", "config.json", "model.safetensors.index.json", *shards]
    )
    write.save_hf(state, meta, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "notes.bin",
    ]
    write.save_hf(state, meta, tmp_path, max_shard_bytes=20_000)
    assert "model.safetensors" not in {p.name for p in tmp_path.iterdir()}


def test_config_json_is_written_last(tmp_path, monkeypatch):
    written = []
    write_public = write.write_public
    monkeypatch.setattr(
        write,
        "write_public",
        lambda path, writing: written.append(path.name) or write_public(path, writing),
    )
    tokenizer = CharTokenizer("abc ")
    write.save_hf(
        llama_state(),
        {"model": LLAMA.to_dict(), "model_type": "llama"},
        tmp_path,
        tokenizer,
        max_shard_bytes=20_000,
    )
    assert written[-1] == "config.json" and {
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    } < set(written)
    assert (
        json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"]
        == LLAMA.seq_length
    )


def test_config_names_the_dtype_holding_most_bytes_and_the_tokenizers_ids(tmp_path):
    from safetensors.torch import load_file

    state = llama_state()
    big = {"wte.weight", "lm_head.weight"}  # 2 x 53 x 48 of 27k parameters
    mixed = {n: t if n in big else t.bfloat16() for n, t in state.items()}
    specs = [(n, tuple(t.shape), t.dtype) for n, t in mixed.items()]
    out = write.write_hf(
        tmp_path, {"model": LLAMA.to_dict(), "model_type": "llama"}, specs, mixed.__getitem__
    )
    saved = json.loads((out / "config.json").read_text())
    assert (saved["dtype"], saved["bos_token_id"], saved["eos_token_id"]) == (
        "bfloat16",
        None,
        None,
    )
    assert load_file(out / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    mixed = {n: t.bfloat16() if n in big else t for n, t in state.items()}
    specs = [(n, tuple(t.shape), t.dtype) for n, t in mixed.items()]
    write.write_hf(
        tmp_path, {"model": LLAMA.to_dict(), "model_type": "llama"}, specs, mixed.__getitem__
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    # bytes, not parameters: 100 fp32 (400 bytes) outweigh 110 bf16 (220 bytes)
    config = LlamaConfig(
        vocab_size=10,
        seq_length=4,
        num_layers=0,
        num_heads=1,
        num_kv_heads=1,
        embed_size=10,
        intermediate_size=1,
    )
    specs = [
        ("wte.weight", (10, 10), torch.float32),
        ("norm.weight", (10,), torch.bfloat16),
        ("lm_head.weight", (10, 10), torch.bfloat16),
    ]
    small = write.write_hf(
        tmp_path / "a" / "b",
        {"model": config.to_dict(), "model_type": "llama"},
        specs,
        lambda name: torch.zeros(dict((n, s) for n, s, _ in specs)[name]),
    )
    assert json.loads((small / "config.json").read_text())["dtype"] == "float32"
    tokenizer = CharTokenizer("ab")
    tokenizer.bos_id, tokenizer.eot_id = 0, 1
    write.save_hf(state, {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path, tokenizer)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (0, 1)


def test_gpt2_export_writes_conv1d_weights_transposed(tmp_path):
    from safetensors.torch import load_file

    model = ours("gpt")
    write.save_hf(model.state_dict(), {"model": GPT.to_dict()}, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    theirs = dict(transformers.GPT2LMHeadModel(gpt2_config()).named_parameters())
    assert set(saved) == set(theirs)
    assert all(saved[n].shape == theirs[n].shape for n in theirs)
    assert torch.equal(
        saved["transformer.h.1.mlp.c_proj.weight"], model.blocks[1].mlp.proj.weight.t()
    )
    assert torch.equal(saved["transformer.h.1.mlp.c_proj.bias"], model.blocks[1].mlp.proj.bias)


def test_safetensors_from_views_and_shards_filled_to_the_byte(tmp_path):
    from safetensors.torch import load_file

    # a strided 1-d view (not contiguous, and reshape(-1) keeps it so) and a transposed one
    full = torch.arange(16.0)
    tensors = {"a": full[::2], "b": full.reshape(4, 4).t()}
    write.write_safetensors(
        tmp_path / "v.safetensors",
        [("a", (8,), torch.float32), ("b", (4, 4), torch.float32)],
        tensors.__getitem__,
        {},
    )
    loaded = load_file(tmp_path / "v.safetensors")
    assert torch.equal(loaded["a"], full[::2]) and torch.equal(loaded["b"], full.reshape(4, 4).t())
    # a shard takes tensors while they fit, to the byte; the next shard starts empty
    config = LlamaConfig(
        vocab_size=2,
        seq_length=4,
        num_layers=0,
        num_heads=1,
        num_kv_heads=1,
        embed_size=1,
        intermediate_size=1,
    )
    meta = {"model": config.to_dict(), "model_type": "llama"}
    for shapes, expected in [
        (
            [(2,), (1,), (1,)],
            [["model.embed_tokens.weight"], ["model.norm.weight", "lm_head.weight"]],
        ),
        (
            [(1,), (1,), (1,)],
            [["model.embed_tokens.weight", "model.norm.weight"], ["lm_head.weight"]],
        ),
    ]:
        specs = [
            (name, shape, torch.float32)
            for name, shape in zip(["wte.weight", "norm.weight", "lm_head.weight"], shapes)
        ]
        out = write.write_hf(
            tmp_path / str(shapes),
            meta,
            specs,
            lambda name: torch.ones(dict((n, s) for n, s, _ in specs)[name]),
            max_shard_bytes=8,
        )
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        got = [
            [n for n, f in weight_map.items() if f == file]
            for file in sorted(set(weight_map.values()))
        ]
        assert got == expected, shapes


def test_weight_files_carry_the_metadata_transformers_writes(tmp_path):
    from safetensors import safe_open

    theirs = transformers.LlamaForCausalLM(llama_config())
    theirs.save_pretrained(tmp_path / "theirs")
    with safe_open(str(tmp_path / "theirs" / "model.safetensors"), framework="pt") as f:
        expected = f.metadata()
    assert expected == {"format": "pt"}  # transformers 4 refuses a file without it
    state, meta = llama_state(), {"model": LLAMA.to_dict(), "model_type": "llama"}
    for limit in (5 * 2**30, 20_000):
        write.save_hf(state, meta, tmp_path / str(limit), max_shard_bytes=limit)
        files = sorted((tmp_path / str(limit)).glob("*.safetensors"))
        assert len(files) == 1 if limit > 20_000 else len(files) > 1
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                assert f.metadata() == expected, file.name
