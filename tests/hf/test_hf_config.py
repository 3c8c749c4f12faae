"""hf/read.py, a Hugging Face directory's config.json and files: every check read_config makes and
the config it builds (transformers' defaults for absent fields, both spellings of rope settings),
resolve's answers for a directory, a path and a hub name (the hub mocked: no network), and broken or
hostile directories (each field of config.json, weights and tokenizer files that are not what they
claim, a config the weights do not hold): one error naming the file and the field, nothing
allocated."""

import json
import os
import struct
import sys
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.data import tokenizer
from minimal_fsdp.hf import write
from minimal_fsdp.hf.hub import resolve
from minimal_fsdp.hf.read import check_weights, load_tokenizer, read_config, read_model_config
from minimal_fsdp.models.gpt import GPTConfig
from minimal_fsdp.models.llama import LlamaConfig

from support import HF_GPT as GPT
from support import LLAMA3, bare, gpt2_config, llama_config, ours, save_config

transformers = pytest.importorskip("transformers")


# -----------------------------------------------------------------------------
# config.json in


def read(tmp_path, config_dict, **kw):
    return read_config(save_config(tmp_path / "m", config_dict), **kw)


def test_gpt2_config_as_transformers_saves_it(tmp_path):
    gpt2_config(n_positions=40, n_head=8, n_layer=3, resid_pdrop=0.3).save_pretrained(
        tmp_path / "m"
    )
    assert read_config(tmp_path / "m") == (
        "gpt",
        GPTConfig(
            vocab_size=53,
            seq_length=40,
            num_layers=3,
            num_heads=8,
            embed_size=32,
            bias=True,
            dropout=0.0,
        ),
    )
    model_type, config = read_config(tmp_path / "m", seq_length=40, dropout=0.25)
    assert (config.seq_length, config.dropout) == (40, 0.25)
    assert read_config(tmp_path / "m", seq_length=7)[1].seq_length == 7
    with pytest.raises(ConfigError) as error:
        read_config(tmp_path / "m", seq_length=41)
    assert (
        str(error.value)
        == f"--seq_length 41 is longer than --hf_model {tmp_path / 'm'}'s context of 40 tokens"
    )


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"activation_function": "gelu_pytorch_tanh"},
        {"n_inner": 128},
        {"n_inner": None},
        {"layer_norm_epsilon": 1e-5},
        {"scale_attn_by_inverse_layer_idx": False},
    ],
)
def test_gpt2_configs_we_implement(tmp_path, fields):
    # what transformers reads the same file as
    theirs = transformers.GPT2Config(**dict(bare("gpt2"), **fields))
    assert (
        theirs.activation_function in ("gelu_new", "gelu_pytorch_tanh")
        and theirs.layer_norm_epsilon == 1e-5
    )
    assert read(tmp_path, dict(bare("gpt2"), **fields)) == (
        "gpt",
        GPTConfig(
            vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32, bias=True
        ),
    )


def rejected(tmp_path, config_dict, what):
    with pytest.raises(ConfigError) as error:
        read(tmp_path, config_dict)
    assert (
        str(error.value)
        == f"--hf_model {tmp_path / 'm'} uses {what}, which our model does not implement"
    )


@pytest.mark.parametrize(
    "fields,what",
    [
        ({"activation_function": "relu"}, "activation relu (we use GPT-2's tanh GELU)"),
        ({"activation_function": "gelu"}, "activation gelu (we use GPT-2's tanh GELU)"),
        ({"n_inner": 64}, "an MLP width other than 4 x n_embd"),
        ({"layer_norm_epsilon": 1e-6}, "a LayerNorm epsilon other than 1e-5"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_gpt2_configs_we_do_not_implement(tmp_path, fields, what):
    rejected(tmp_path, dict(bare("gpt2"), **fields), what)


def test_llama_defaults_are_transformers_defaults(tmp_path):
    theirs = transformers.LlamaConfig(**bare("llama"))
    model_type, config = read(tmp_path, bare("llama"))
    assert model_type == "llama"
    assert config == LlamaConfig(
        vocab_size=53,
        seq_length=24,
        num_layers=2,
        num_heads=6,
        num_kv_heads=theirs.num_key_value_heads,
        embed_size=48,
        intermediate_size=72,
        norm_eps=theirs.rms_norm_eps,
        rope_theta=theirs.rope_parameters["rope_theta"],
        rope_scaling=None,
        dropout=0.0,
    )
    assert config.num_kv_heads == 6 and config.norm_eps == 1e-6 and config.rope_theta == 10000.0
    assert read(tmp_path, dict(bare("llama"), num_key_value_heads=None))[1].num_kv_heads == 6


@pytest.mark.parametrize("spelling", ["transformers 5", "transformers 4"])
def test_llama_config_as_transformers_saves_it(tmp_path, spelling):
    fields = dict(
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=32,
        head_dim=8,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )
    if spelling == "transformers 5":
        llama_config(rope_parameters=dict(LLAMA3, rope_theta=500000.0), **fields).save_pretrained(
            tmp_path / "m"
        )
        saved = json.loads((tmp_path / "m" / "config.json").read_text())
        assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 500000.0
    else:  # rope_theta beside rope_scaling, whose type was once spelled "type"
        save_config(
            tmp_path / "m",
            dict(
                bare("llama"),
                rope_theta=500000.0,
                torch_dtype="float32",
                **fields,
                rope_scaling=dict(LLAMA3, type=LLAMA3["rope_type"]),
            ),
        )
    model_type, config = read_config(tmp_path / "m", dropout=0.5)
    assert (model_type, config) == (
        "llama",
        LlamaConfig(
            vocab_size=53,
            seq_length=32,
            num_layers=2,
            num_heads=6,
            num_kv_heads=2,
            embed_size=48,
            intermediate_size=72,
            norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=LLAMA3,
            dropout=0.5,
        ),
    )
    assert type(config.rope_theta) is float


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 20.0}},
        {"rope_scaling": {"type": "default"}, "rope_theta": 20},
        {"rope_parameters": {"rope_theta": 20.0}},
    ],
)
def test_llama_plain_rope(tmp_path, rope):
    config = read(tmp_path, dict(bare("llama"), **rope))[1]
    assert (config.rope_theta, config.rope_scaling) == (20.0, None) and type(
        config.rope_theta
    ) is float


@pytest.mark.parametrize(
    "fields,what",
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "rope type 'linear' (supported: default, llama3)",
        ),
        (
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope type 'dynamic' (supported: default, llama3)",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "type": "linear"}},
            "rope type 'yarn' (supported: default, llama3)",
        ),
        ({"hidden_act": "gelu"}, "activation gelu (we use SiLU)"),
        ({"attention_bias": True}, "biases in attention or MLP"),
        ({"mlp_bias": True}, "biases in attention or MLP"),
        ({"head_dim": 16}, "head_dim != hidden_size / heads"),
    ],
)
def test_llama_configs_we_do_not_implement(tmp_path, fields, what):
    rejected(tmp_path, dict(bare("llama"), **fields), what)


def test_other_model_types_and_a_model_flag_that_disagrees(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as error:
        read(tmp_path, {"model_type": "bert"})
    assert (
        str(error.value)
        == f"--hf_model {tmp_path / 'm'} is a 'bert' model; supported are gpt2, llama and qwen2"
    )
    with pytest.raises(ConfigError, match="is a None model"):
        read(tmp_path, {})
    save_config(tmp_path / "m", bare("llama"))
    # against the weights (here none: test_a_config_is_checked_against_the_weights... has them)
    checked = []
    monkeypatch.setattr("minimal_fsdp.hf.read.check_weights", lambda *args: checked.append(args))
    cfg = SimpleNamespace(seq_length=12, dropout=0.125, model=None, hf_model="meta/llama")
    config = read_model_config(tmp_path / "m", cfg)
    assert (config.model_type, config.seq_length, config.dropout) == ("llama", 12, 0.125)
    assert checked == [(tmp_path / "m", "llama", config)]
    assert (
        read_model_config(tmp_path / "m", SimpleNamespace(**dict(vars(cfg), model="llama")))
        == config
    )
    with pytest.raises(ConfigError) as error:
        read_model_config(tmp_path / "m", SimpleNamespace(**dict(vars(cfg), model="gpt")))
    assert (
        str(error.value) == "--model gpt, but --hf_model meta/llama is a llama model: drop --model"
    )


# -----------------------------------------------------------------------------
# resolve: a directory, a path, a hub name (huggingface_hub mocked: nothing leaves this machine)


def test_a_directory_needs_config_and_weights(tmp_path):
    d = save_config(tmp_path / "m", bare("llama"))
    with pytest.raises(ConfigError) as error:
        resolve(str(d))
    assert str(error.value) == (
        f"--hf_model {d} has a config.json but no weights (model.safetensors, its shards, "
        "or pytorch_model.bin): download them too"
    )
    for weights in (
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "pytorch_model.bin",
        "pytorch_model-00001-of-00003.bin",
    ):
        (d / weights).write_bytes(b"")
        assert resolve(str(d)) == str(d)
        (d / weights).unlink()
    (d / "config.json").unlink()
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as error:
        resolve(d)
    assert (
        str(error.value)
        == f"--hf_model {d} has no config.json: pass a Hugging Face model directory"
    )


# ---- hostile or broken model directories: one ConfigError naming the file and the field, nothing
# allocated ----


def gpt_dir(tmp_path, name="m"):
    """A GPT-2 directory of our tiny GPT (config.json, model.safetensors, a tokenizer)."""
    return write.save_hf(
        ours("gpt").state_dict(),
        {"model": GPT.to_dict(), "model_type": "gpt"},
        tmp_path / name,
        tokenizer.CharTokenizer("abcdefgh "),
    )


def edit_config(directory, edit):
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


BROKEN_CONFIGS = {
    "missing key": (lambda c: c.pop("n_embd"), "config.json has no n_embd"),
    "layers a string": (
        lambda c: c.update(n_layer="2"),
        'config.json: n_layer is "2", not a whole number in [1, 4096]',
    ),
    "zero heads": (
        lambda c: c.update(n_head=0),
        "config.json: n_head is 0, not a whole number in [1, 4096]",
    ),
    "heads not dividing": (
        lambda c: c.update(n_head=3),
        "config.json: n_head 3 does not divide n_embd 32",
    ),
    "negative vocabulary": (
        lambda c: c.update(vocab_size=-5),
        "config.json: vocab_size is -5, not a whole number in [1, 16777216]",
    ),
    "absurd width": (
        lambda c: c.update(n_embd=2**40, n_head=1),
        "config.json: n_embd is 1099511627776, not a whole number in [1, 262144]",
    ),
    "context a float": (
        lambda c: c.update(n_positions=24.5),
        "config.json: n_positions is 24.5, not a whole number in [1, 16777216]",
    ),
}


@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_a_broken_config_json_is_one_error_naming_the_field(tmp_path, case):
    edit, problem = BROKEN_CONFIGS[case]
    d = gpt_dir(tmp_path)
    edit_config(d, edit)
    with pytest.raises(ConfigError) as error:
        read_config(d)
    assert str(error.value) == f"--hf_model {d}: {problem}"


@pytest.mark.parametrize(
    "text,problem",
    [
        (
            b"{not json",
            "config.json is not JSON (JSONDecodeError: Expecting property name enclosed in double "
            "quotes",
        ),
        (b"[1, 2]", "config.json holds a JSON list, not an object"),
        (b"\xff\xfe", "config.json is not JSON (UnicodeDecodeError"),
        (
            b'{"model_type": "gpt2", "n_embd": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "config.json nests deeper than 32 levels",
        ),
    ],
)
def test_a_config_json_that_is_not_a_json_object_is_one_error(tmp_path, text, problem):
    d = gpt_dir(tmp_path)
    (d / "config.json").write_bytes(text)
    for reader in (read_config, load_tokenizer):  # run.py reads the tokenizer before the config
        with pytest.raises(ConfigError) as error:
            reader(d)
        assert str(error.value).startswith(f"--hf_model {d}: {problem}")


def test_llama_fields_of_the_wrong_type_are_one_error(tmp_path):
    for fields, problem in [
        (dict(num_key_value_heads=4), "model: llama needs --num_heads divisible by --num_kv_heads"),
        (dict(rms_norm_eps="small"), 'rms_norm_eps is "small", not a finite number > 0'),
        (dict(rope_scaling=[1]), "rope_scaling is [1], not an object"),
        (
            dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "config.json has no rope_scaling.low_freq_factor",
        ),
    ]:
        d = save_config(
            tmp_path / str(len(problem)), bare("llama") | {"num_attention_heads": 6} | fields
        )
        with pytest.raises(ConfigError) as error:
            read_config(d)
        assert str(error.value).startswith(f"--hf_model {d}: config.json") and problem in str(
            error.value
        )


@pytest.mark.parametrize(
    "edit,problem",
    [
        (
            lambda c: c.update(n_layer=300),
            "config.json: n_layer is 300, but the weights hold 2 layers",
        ),
        (
            lambda c: c.update(n_embd=64),
            "transformer.wte.weight has shape (53, 32), our wte.weight is (53, 64)",
        ),
        (
            lambda c: c.update(vocab_size=10**6),
            "transformer.wte.weight has shape (53, 32), our wte.weight is (1000000, 32)",
        ),
    ],
)
def test_a_config_is_checked_against_the_weights_before_anything_is_allocated(
    tmp_path, monkeypatch, edit, problem
):
    d = gpt_dir(tmp_path)
    edit_config(d, edit)
    model_type, config = read_config(d)
    built = []
    monkeypatch.setattr(
        torch.nn.Parameter,
        "__new__",
        lambda cls, data=None, requires_grad=True: (
            built.append(data.device) or torch.Tensor._make_subclass(cls, data, requires_grad)
        ),
    )
    with pytest.raises(ConfigError) as error:
        check_weights(d, model_type, config)
    assert str(error.value) == f"--hf_model {d}: {problem}"
    # shapes only: the model built on the meta device once the layer counts agree, never in memory
    assert {device.type for device in built} == (set() if "n_layer" in problem else {"meta"})


@pytest.mark.parametrize("content", [os.urandom(4096), struct.pack("<Q", 2**62) + b"{}", b""])
def test_weights_that_are_not_safetensors_are_one_error(tmp_path, content):
    d = gpt_dir(tmp_path)
    (d / "model.safetensors").write_bytes(content)
    with pytest.raises(ConfigError) as error:
        check_weights(d, *read_config(d))
    assert str(error.value).startswith(
        f"--hf_model {d}: model.safetensors cannot be read as safetensors (SafetensorError: "
    )


def test_weights_that_are_not_regular_files_or_outside_the_directory_are_refused(tmp_path):
    d = gpt_dir(tmp_path)
    (d / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (d / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(
        ConfigError, match="model.safetensors cannot be read as safetensors .*not a regular file"
    ):
        check_weights(d, *read_config(d))
    (d / "model.safetensors").unlink()
    index = {"weight_map": {"transformer.wte.weight": "../elsewhere.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError) as error:
        check_weights(d, *read_config(d))
    assert str(error.value) == (
        f"--hf_model {d}: model.safetensors.index.json: weight_map is not an object of file "
        "names in the directory"
    )


def test_a_deeply_nested_tokenizer_json_is_one_error(tmp_path):
    d = gpt_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError) as error:
        load_tokenizer(d)
    assert str(error.value) == f"--hf_model {d}: tokenizer.json nests deeper than 32 levels"


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub with its cache, its file listing and its downloads recorded and answered
    here."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    hub = SimpleNamespace(calls=[], cached=None, files=[], error=None, reachable=True)

    def snapshot_download(name, allow_patterns, local_files_only=False):
        hub.calls.append(("download", name, allow_patterns, local_files_only))
        if local_files_only:
            if hub.cached is None:
                raise FileNotFoundError("not in the cache")
            return hub.cached
        return f"/cache/{name}"

    class HfApi:
        def list_repo_files(self, name):
            hub.calls.append(("list", name))
            if hub.error:
                raise hub.error
            return hub.files

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", HfApi)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.example")
    monkeypatch.setattr(
        tokenizer, "reachable", lambda url: hub.calls.append(("reachable", url)) or hub.reachable
    )
    return hub


PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
]


def test_paths_that_are_not_directories_never_reach_the_hub(tmp_path, hub, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative names resolve here, not wherever pytest runs
    (tmp_path / "file").write_text("")
    for name in (
        str(tmp_path / "file"),
        "./model",
        "/models/llama",
        "/models",
        "~/models",
        "~models",
        "org/name/extra",
        "../x",
        ".x",
    ):
        with pytest.raises(ConfigError) as error:
            resolve(name)
        assert str(error.value) == f"--hf_model {name} is not a directory"
    assert hub.calls == []


def test_hub_name_from_the_cache(hub):
    hub.cached = "/cache/snapshot"
    assert resolve("org/model") == "/cache/snapshot"
    assert hub.calls == [("download", "org/model", PATTERNS, True)]


def test_hub_name_offline(hub, monkeypatch):
    import huggingface_hub

    message = (
        "--hf_model gpt2 is not a local directory nor in the Hugging Face cache, and the hub "
        "(https://hub.example) is unreachable (offline?): download the model where the hub is "
        "reachable and pass its directory"
    )
    hub.reachable = False
    with pytest.raises(ConfigError) as error:
        resolve("gpt2")
    assert str(error.value) == message
    assert hub.calls[1:] == [("reachable", "https://hub.example")]
    hub.calls.clear()
    hub.reachable = True
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as error:
        resolve("gpt2")
    assert str(error.value) == message and [c[0] for c in hub.calls] == ["download"]


@pytest.mark.parametrize(
    "files,patterns",
    [
        (
            ["config.json", "model.safetensors", "pytorch_model.bin"],
            [p for p in PATTERNS if "pytorch_model" not in p],
        ),
        (["config.json", "pytorch_model.bin", "flax_model.msgpack"], PATTERNS),
    ],
)
def test_hub_name_downloaded_in_one_format(hub, files, patterns):
    hub.files = files
    assert resolve("org/model") == "/cache/org/model"
    assert hub.calls[1:] == [
        ("reachable", "https://hub.example"),
        ("list", "org/model"),
        ("download", "org/model", patterns, False),
    ]


@pytest.mark.parametrize(
    "error,reason",
    [
        (RuntimeError("  401 gated repo\nlog in first"), "RuntimeError: 401 gated repo"),
        (RuntimeError("\n\nnot found \n"), "RuntimeError: not found"),
        (ValueError(""), "ValueError: "),
        (OSError("x" * 300), "OSError: " + "x" * 200),
    ],
)
def test_hub_errors_are_one_line(hub, error, reason):
    hub.error = error
    with pytest.raises(ConfigError) as raised:
        resolve("org/model")
    assert (
        str(raised.value)
        == f"--hf_model org/model could not be fetched from the Hugging Face hub ({reason})"
    )
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_hub_name_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError) as error:
        resolve("org/model")
    assert str(error.value) == (
        "--hf_model org/model is not a local directory, and fetching it from the Hugging "
        "Face hub needs huggingface_hub: pip install huggingface_hub (or download the "
        "model elsewhere and pass its directory)"
    )
    assert error.value.__cause__ is None and error.value.__suppress_context__
