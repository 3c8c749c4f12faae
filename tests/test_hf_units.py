"""hf.py's parts, in this process (fast, and what mutation testing can see), with transformers as the reference
wherever it has an answer: the name map and which tensors GPT-2 stores transposed (against GPT2LMHeadModel's and
LlamaForCausalLM's own parameters), every check read_config makes and the config it builds (transformers' defaults
for absent fields, both spellings of rope settings), resolve's answers for a directory, a path and a hub name (the
hub mocked: no network), the weight files in every form (.bin saved on a GPU, memory-mapped, never unpickling code),
load_weights' shape checks, broken or hostile directories (each field of config.json, weights and tokenizer files
that are not what they claim, a config the weights do not hold: one error naming the file), the rows each rank of an
FSDP2 mesh reads (torch's fake process group: several ranks' shards in one process), the safetensors files
write_safetensors streams (read back by safetensors), the config.json transformers builds from, write_hf's shards,
index, metadata and stale files, and the tokenizer.json conversions (encoding as ours, transformers' byte table, the
probe's warning). The round trips of whole models through transformers, and --hf_model on 2 ranks, are in
test_hf.py."""
import json
import os
import struct
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import tokenizer_dirs
from minimal_fsdp import hf, hf_tokenizer, hf_write
from minimal_fsdp import tokenizer as tk
from minimal_fsdp.config import ConfigError
from minimal_fsdp.llama import LlamaConfig
from minimal_fsdp.model import GPTConfig
from minimal_fsdp.models import MODELS
from minimal_fsdp.parallelize import init_weights

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

GPT = GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32)
LLAMA = LlamaConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=6, num_kv_heads=2, embed_size=48,
                    intermediate_size=72)


def gpt2_config(**kw):
    return transformers.GPT2Config(**dict(dict(n_layer=2, n_head=4, n_embd=32, n_positions=24, vocab_size=53), **kw))


def llama_config(**kw):
    return transformers.LlamaConfig(**dict(dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                                num_attention_heads=6, num_key_value_heads=2, vocab_size=53,
                                                max_position_embeddings=24), **kw))


def save_config(directory, config_dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_dict))
    return directory


def ours(model_type, config=None, seed=0):
    model = MODELS[model_type](config or {"gpt": GPT, "llama": LLAMA}[model_type]).eval()
    init_weights(model, seed, torch.device("cpu"))
    return model


# -----------------------------------------------------------------------------
# names

@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_names_map_every_parameter_onto_transformers_own(model_type):
    theirs = (transformers.GPT2LMHeadModel(gpt2_config()) if model_type == "gpt"
              else transformers.LlamaForCausalLM(llama_config()))
    model = ours(model_type)
    names = hf.hf_names(model_type, model.config)
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    their_shapes = {name: tuple(p.shape) for name, p in theirs.named_parameters()}
    if model_type == "gpt":  # GPT-2's lm_head is the tied embedding: transformers lists it once, as wte
        assert "lm_head.weight" not in names
    assert set(names.values()) == set(their_shapes)
    for name, param in model.named_parameters():
        theirs_name = names[name]
        expected = their_shapes[theirs_name][::-1] if hf.is_transposed(theirs_name) else their_shapes[theirs_name]
        assert tuple(param.shape) == expected, name


def test_transposed_are_exactly_gpt2s_conv1d_weights():
    from transformers.pytorch_utils import Conv1D
    theirs = transformers.GPT2LMHeadModel(gpt2_config())
    modules = dict(theirs.named_modules())
    for name, _ in theirs.named_parameters():
        module, _, kind = name.rpartition(".")
        assert hf.is_transposed(name) == (isinstance(modules[module], Conv1D) and kind == "weight"), name
    assert any(hf.is_transposed(name) for name, _ in theirs.named_parameters())
    for name, _ in transformers.LlamaForCausalLM(llama_config()).named_parameters():
        assert not hf.is_transposed(name), name


# -----------------------------------------------------------------------------
# config.json in

def read(tmp_path, config_dict, **kw):
    return hf.read_config(save_config(tmp_path / "m", config_dict), **kw)


def test_gpt2_config_as_transformers_saves_it(tmp_path):
    gpt2_config(n_positions=40, n_head=8, n_layer=3, resid_pdrop=0.3).save_pretrained(tmp_path / "m")
    assert hf.read_config(tmp_path / "m") == ("gpt", GPTConfig(vocab_size=53, seq_length=40, num_layers=3,
                                                               num_heads=8, embed_size=32, bias=True, dropout=0.0))
    model_type, config = hf.read_config(tmp_path / "m", seq_length=40, dropout=0.25)
    assert (config.seq_length, config.dropout) == (40, 0.25)
    assert hf.read_config(tmp_path / "m", seq_length=7)[1].seq_length == 7
    with pytest.raises(ConfigError) as error:
        hf.read_config(tmp_path / "m", seq_length=41)
    assert str(error.value) == f"--seq_length 41 is longer than --hf_model {tmp_path / 'm'}'s context of 40 tokens"


def bare(model_type):
    """The fields without which there is no model: transformers' defaults fill in the rest."""
    if model_type == "gpt2":
        return {"model_type": "gpt2", "vocab_size": 53, "n_positions": 24, "n_embd": 32, "n_layer": 2, "n_head": 4}
    return {"model_type": "llama", "vocab_size": 53, "max_position_embeddings": 24, "hidden_size": 48,
            "intermediate_size": 72, "num_hidden_layers": 2, "num_attention_heads": 6}


@pytest.mark.parametrize("fields", [{}, {"activation_function": "gelu_pytorch_tanh"}, {"n_inner": 128},
                                    {"n_inner": None}, {"layer_norm_epsilon": 1e-5},
                                    {"scale_attn_by_inverse_layer_idx": False}])
def test_gpt2_configs_we_implement(tmp_path, fields):
    theirs = transformers.GPT2Config(**dict(bare("gpt2"), **fields))  # what transformers reads the same file as
    assert theirs.activation_function in ("gelu_new", "gelu_pytorch_tanh") and theirs.layer_norm_epsilon == 1e-5
    assert read(tmp_path, dict(bare("gpt2"), **fields)) == ("gpt", GPTConfig(vocab_size=53, seq_length=24,
                                                                               num_layers=2, num_heads=4,
                                                                               embed_size=32, bias=True))


def rejected(tmp_path, config_dict, what):
    with pytest.raises(ConfigError) as error:
        read(tmp_path, config_dict)
    assert str(error.value) == f"--hf_model {tmp_path / 'm'} uses {what}, which our model does not implement"


@pytest.mark.parametrize("fields,what", [
    ({"activation_function": "relu"}, "activation relu (we use GPT-2's tanh GELU)"),
    ({"activation_function": "gelu"}, "activation gelu (we use GPT-2's tanh GELU)"),
    ({"n_inner": 64}, "an MLP width other than 4 x n_embd"),
    ({"layer_norm_epsilon": 1e-6}, "a LayerNorm epsilon other than 1e-5"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_gpt2_configs_we_do_not_implement(tmp_path, fields, what):
    rejected(tmp_path, dict(bare("gpt2"), **fields), what)


def test_llama_defaults_are_transformers_defaults(tmp_path):
    theirs = transformers.LlamaConfig(**bare("llama"))
    model_type, config = read(tmp_path, bare("llama"))
    assert model_type == "llama"
    assert config == LlamaConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=6,
                                 num_kv_heads=theirs.num_key_value_heads, embed_size=48, intermediate_size=72,
                                 norm_eps=theirs.rms_norm_eps, rope_theta=theirs.rope_parameters["rope_theta"],
                                 rope_scaling=None, dropout=0.0)
    assert config.num_kv_heads == 6 and config.norm_eps == 1e-6 and config.rope_theta == 10000.0
    assert read(tmp_path, dict(bare("llama"), num_key_value_heads=None))[1].num_kv_heads == 6


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


@pytest.mark.parametrize("spelling", ["transformers 5", "transformers 4"])
def test_llama_config_as_transformers_saves_it(tmp_path, spelling):
    fields = dict(num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=32, head_dim=8,
                  hidden_act="silu", attention_bias=False, mlp_bias=False)
    if spelling == "transformers 5":
        llama_config(rope_parameters=dict(LLAMA3, rope_theta=500000.0), **fields).save_pretrained(tmp_path / "m")
        saved = json.loads((tmp_path / "m" / "config.json").read_text())
        assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 500000.0
    else:  # rope_theta beside rope_scaling, whose type was once spelled "type"
        save_config(tmp_path / "m", dict(bare("llama"), rope_theta=500000.0, torch_dtype="float32", **fields,
                                         rope_scaling=dict(LLAMA3, type=LLAMA3["rope_type"])))
    model_type, config = hf.read_config(tmp_path / "m", dropout=0.5)
    assert (model_type, config) == ("llama", LlamaConfig(
        vocab_size=53, seq_length=32, num_layers=2, num_heads=6, num_kv_heads=2, embed_size=48,
        intermediate_size=72, norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3, dropout=0.5))
    assert type(config.rope_theta) is float


@pytest.mark.parametrize("rope", [{"rope_parameters": {"rope_type": "default", "rope_theta": 20.0}},
                                  {"rope_scaling": {"type": "default"}, "rope_theta": 20},
                                  {"rope_parameters": {"rope_theta": 20.0}}])
def test_llama_plain_rope(tmp_path, rope):
    config = read(tmp_path, dict(bare("llama"), **rope))[1]
    assert (config.rope_theta, config.rope_scaling) == (20.0, None) and type(config.rope_theta) is float


@pytest.mark.parametrize("fields,what", [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear' (supported: default, llama3)"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' (supported: default, llama3)"),
    ({"rope_scaling": {"rope_type": "yarn", "type": "linear"}}, "rope type 'yarn' (supported: default, llama3)"),
    ({"hidden_act": "gelu"}, "activation gelu (we use SiLU)"),
    ({"attention_bias": True}, "biases in attention or MLP"),
    ({"mlp_bias": True}, "biases in attention or MLP"),
    ({"head_dim": 16}, "head_dim != hidden_size / heads"),
])
def test_llama_configs_we_do_not_implement(tmp_path, fields, what):
    rejected(tmp_path, dict(bare("llama"), **fields), what)


def test_other_model_types_and_a_model_flag_that_disagrees(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as error:
        read(tmp_path, {"model_type": "bert"})
    assert str(error.value) == f"--hf_model {tmp_path / 'm'} is a 'bert' model; supported are gpt2 and llama"
    with pytest.raises(ConfigError, match="is a None model"):
        read(tmp_path, {})
    save_config(tmp_path / "m", bare("llama"))
    checked = []  # against the weights (here none: test_a_config_is_checked_against_the_weights... has them)
    monkeypatch.setattr(hf, "check_weights", lambda *args: checked.append(args))
    cfg = SimpleNamespace(seq_length=12, dropout=0.125, model=None, hf_model="meta/llama")
    config = hf.read_model_config(tmp_path / "m", cfg)
    assert (config.model_type, config.seq_length, config.dropout) == ("llama", 12, 0.125)
    assert checked == [(tmp_path / "m", "llama", config)]
    assert hf.read_model_config(tmp_path / "m", SimpleNamespace(**dict(vars(cfg), model="llama"))) == config
    with pytest.raises(ConfigError) as error:
        hf.read_model_config(tmp_path / "m", SimpleNamespace(**dict(vars(cfg), model="gpt")))
    assert str(error.value) == "--model gpt, but --hf_model meta/llama is a llama model: drop --model"


# -----------------------------------------------------------------------------
# resolve: a directory, a path, a hub name (huggingface_hub mocked: nothing leaves this machine)

def test_a_directory_needs_config_and_weights(tmp_path):
    d = save_config(tmp_path / "m", bare("llama"))
    with pytest.raises(ConfigError) as error:
        hf.resolve(str(d))
    assert str(error.value) == (f"--hf_model {d} has a config.json but no weights (model.safetensors, its shards, "
                                "or pytorch_model.bin): download them too")
    for weights in ("model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin",
                    "pytorch_model-00001-of-00003.bin"):
        (d / weights).write_bytes(b"")
        assert hf.resolve(str(d)) == str(d)
        (d / weights).unlink()
    (d / "config.json").unlink()
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as error:
        hf.resolve(d)
    assert str(error.value) == f"--hf_model {d} has no config.json: pass a Hugging Face model directory"


# ---- hostile or broken model directories: one ConfigError naming the file and the field, nothing allocated ----

def gpt_dir(tmp_path, name="m"):
    """A GPT-2 directory of our tiny GPT (config.json, model.safetensors, a tokenizer)."""
    return hf_write.save_hf(ours("gpt").state_dict(), {"model": GPT.to_dict(), "model_type": "gpt"}, tmp_path / name,
                            tk.CharTokenizer("abcdefgh "))


def edit_config(directory, edit):
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))


BROKEN_CONFIGS = {
    "missing key": (lambda c: c.pop("n_embd"), "config.json has no n_embd"),
    "layers a string": (lambda c: c.update(n_layer="2"),
                        'config.json: n_layer is "2", not a whole number in [1, 4096]'),
    "zero heads": (lambda c: c.update(n_head=0), "config.json: n_head is 0, not a whole number in [1, 4096]"),
    "heads not dividing": (lambda c: c.update(n_head=3), "config.json: n_head 3 does not divide n_embd 32"),
    "negative vocabulary": (lambda c: c.update(vocab_size=-5),
                            "config.json: vocab_size is -5, not a whole number in [1, 16777216]"),
    "absurd width": (lambda c: c.update(n_embd=2**40, n_head=1),
                     "config.json: n_embd is 1099511627776, not a whole number in [1, 262144]"),
    "context a float": (lambda c: c.update(n_positions=24.5),
                        "config.json: n_positions is 24.5, not a whole number in [1, 16777216]"),
}


@pytest.mark.parametrize("case", BROKEN_CONFIGS)
def test_a_broken_config_json_is_one_error_naming_the_field(tmp_path, case):
    edit, problem = BROKEN_CONFIGS[case]
    d = gpt_dir(tmp_path)
    edit_config(d, edit)
    with pytest.raises(ConfigError) as error:
        hf.read_config(d)
    assert str(error.value) == f"--hf_model {d}: {problem}"


@pytest.mark.parametrize("text,problem", [
    (b"{not json", "config.json is not JSON (JSONDecodeError: Expecting property name enclosed in double quotes"),
    (b"[1, 2]", "config.json holds a JSON list, not an object"),
    (b"\xff\xfe", "config.json is not JSON (UnicodeDecodeError"),
    (b'{"model_type": "gpt2", "n_embd": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "config.json nests deeper than 32 levels"),
])
def test_a_config_json_that_is_not_a_json_object_is_one_error(tmp_path, text, problem):
    d = gpt_dir(tmp_path)
    (d / "config.json").write_bytes(text)
    for read in (hf.read_config, hf.load_tokenizer):  # run.py reads the tokenizer before the config
        with pytest.raises(ConfigError) as error:
            read(d)
        assert str(error.value).startswith(f"--hf_model {d}: {problem}")


def test_llama_fields_of_the_wrong_type_are_one_error(tmp_path):
    for fields, problem in [(dict(num_key_value_heads=4), "model: llama needs --num_heads divisible by --num_kv_heads"),
                            (dict(rms_norm_eps="small"), 'rms_norm_eps is "small", not a finite number > 0'),
                            (dict(rope_scaling=[1]), "rope_scaling is [1], not an object"),
                            (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                             "config.json has no rope_scaling.low_freq_factor")]:
        d = save_config(tmp_path / str(len(problem)), bare("llama") | {"num_attention_heads": 6} | fields)
        with pytest.raises(ConfigError) as error:
            hf.read_config(d)
        assert str(error.value).startswith(f"--hf_model {d}: config.json") and problem in str(error.value)


@pytest.mark.parametrize("edit,problem", [
    (lambda c: c.update(n_layer=300), "config.json: n_layer is 300, but the weights hold 2 layers"),
    (lambda c: c.update(n_embd=64), "transformer.wte.weight has shape (53, 32), our wte.weight is (53, 64)"),
    (lambda c: c.update(vocab_size=10**6),
     "transformer.wte.weight has shape (53, 32), our wte.weight is (1000000, 32)"),
])
def test_a_config_is_checked_against_the_weights_before_anything_is_allocated(tmp_path, monkeypatch, edit, problem):
    d = gpt_dir(tmp_path)
    edit_config(d, edit)
    model_type, config = hf.read_config(d)
    built = []
    monkeypatch.setattr(torch.nn.Parameter, "__new__", lambda cls, data=None, requires_grad=True: built.append(
        data.device) or torch.Tensor._make_subclass(cls, data, requires_grad))
    with pytest.raises(ConfigError) as error:
        hf.check_weights(d, model_type, config)
    assert str(error.value) == f"--hf_model {d}: {problem}"
    # shapes only: the model built on the meta device once the layer counts agree, never in memory
    assert {device.type for device in built} == (set() if "n_layer" in problem else {"meta"})


@pytest.mark.parametrize("content", [os.urandom(4096), struct.pack("<Q", 2**62) + b"{}", b""])
def test_weights_that_are_not_safetensors_are_one_error(tmp_path, content):
    d = gpt_dir(tmp_path)
    (d / "model.safetensors").write_bytes(content)
    with pytest.raises(ConfigError) as error:
        hf.check_weights(d, *hf.read_config(d))
    assert str(error.value).startswith(f"--hf_model {d}: model.safetensors cannot be read as safetensors "
                                       "(SafetensorError: ")


def test_weights_that_are_not_regular_files_or_outside_the_directory_are_refused(tmp_path):
    d = gpt_dir(tmp_path)
    (d / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (d / "model.safetensors").symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="model.safetensors cannot be read as safetensors .*not a regular file"):
        hf.check_weights(d, *hf.read_config(d))
    (d / "model.safetensors").unlink()
    index = {"weight_map": {"transformer.wte.weight": "../elsewhere.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError) as error:
        hf.check_weights(d, *hf.read_config(d))
    assert str(error.value) == (f"--hf_model {d}: model.safetensors.index.json: weight_map is not an object of file "
                                "names in the directory")


def test_a_deeply_nested_tokenizer_json_is_one_error(tmp_path):
    d = gpt_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError) as error:
        hf.load_tokenizer(d)
    assert str(error.value) == f"--hf_model {d}: tokenizer.json nests deeper than 32 levels"


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub with its cache, its file listing and its downloads recorded and answered here."""
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
    monkeypatch.setattr(tk, "reachable", lambda url: hub.calls.append(("reachable", url)) or hub.reachable)
    return hub


PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "model*.safetensors",
            "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json"]


def test_paths_that_are_not_directories_never_reach_the_hub(tmp_path, hub):
    (tmp_path / "file").write_text("")
    for name in (str(tmp_path / "file"), "./model", "/models/llama", "/models", "~/models", "~models", "org/name/extra",
                 "../x", ".x"):
        with pytest.raises(ConfigError) as error:
            hf.resolve(name)
        assert str(error.value) == f"--hf_model {name} is not a directory"
    assert hub.calls == []


def test_hub_name_from_the_cache(hub):
    hub.cached = "/cache/snapshot"
    assert hf.resolve("org/model") == "/cache/snapshot"
    assert hub.calls == [("download", "org/model", PATTERNS, True)]


def test_hub_name_offline(hub, monkeypatch):
    import huggingface_hub
    message = ("--hf_model gpt2 is not a local directory nor in the Hugging Face cache, and the hub "
               "(https://hub.example) is unreachable (offline?): download the model where the hub is reachable "
               "and pass its directory")
    hub.reachable = False
    with pytest.raises(ConfigError) as error:
        hf.resolve("gpt2")
    assert str(error.value) == message
    assert hub.calls[1:] == [("reachable", "https://hub.example")]
    hub.calls.clear()
    hub.reachable = True
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as error:
        hf.resolve("gpt2")
    assert str(error.value) == message and [c[0] for c in hub.calls] == ["download"]


@pytest.mark.parametrize("files,patterns", [
    (["config.json", "model.safetensors", "pytorch_model.bin"], [p for p in PATTERNS if "pytorch_model" not in p]),
    (["config.json", "pytorch_model.bin", "flax_model.msgpack"], PATTERNS),
])
def test_hub_name_downloaded_in_one_format(hub, files, patterns):
    hub.files = files
    assert hf.resolve("org/model") == "/cache/org/model"
    assert hub.calls[1:] == [("reachable", "https://hub.example"), ("list", "org/model"),
                             ("download", "org/model", patterns, False)]


@pytest.mark.parametrize("error,reason", [
    (RuntimeError("  401 gated repo\nlog in first"), "RuntimeError: 401 gated repo"),
    (RuntimeError("\n\nnot found \n"), "RuntimeError: not found"),
    (ValueError(""), "ValueError: "),
    (OSError("x" * 300), "OSError: " + "x" * 200),
])
def test_hub_errors_are_one_line(hub, error, reason):
    hub.error = error
    with pytest.raises(ConfigError) as raised:
        hf.resolve("org/model")
    assert str(raised.value) == f"--hf_model org/model could not be fetched from the Hugging Face hub ({reason})"
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_hub_name_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError) as error:
        hf.resolve("org/model")
    assert str(error.value) == ("--hf_model org/model is not a local directory, and fetching it from the Hugging "
                                "Face hub needs huggingface_hub: pip install huggingface_hub (or download the "
                                "model elsewhere and pass its directory)")
    assert error.value.__cause__ is None and error.value.__suppress_context__


# -----------------------------------------------------------------------------
# reading the weights

def write_state(directory, state, form):
    """A state dict saved as a Hugging Face directory holds it: one file or an index of shards, either format."""
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
        parts = [names[:len(names) // 2], names[len(names) // 2:]]
        ext = "safetensors" if form == "sharded safetensors" else "bin"
        prefix = "model" if ext == "safetensors" else "pytorch_model"
        weight_map = {}
        for i, part in enumerate(parts, 1):
            file = f"{prefix}-{i:05d}-of-00002.{ext}"
            (save_file if ext == "safetensors" else torch.save)({n: state[n] for n in part}, directory / file)
            weight_map.update({n: file for n in part})
        (directory / f"{prefix}.{ext}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("form", ["safetensors", "bin", "old bin", "sharded safetensors", "sharded bin"])
def test_checkpoint_files_read_rows_and_shapes_in_every_form(tmp_path, form):
    state = {"a": torch.arange(12.).reshape(3, 4), "b": torch.arange(5.), "c": torch.arange(6.).reshape(2, 3)}
    files = hf.CheckpointFiles(write_state(tmp_path, state, form))
    assert all(name in files for name in state) and "d" not in files
    assert [files.shape(n) for n in state] == [(3, 4), (5,), (2, 3)]
    assert torch.equal(files.rows("a", 1, 3), state["a"][1:3])
    assert torch.equal(files.rows("b", 2, 5), state["b"][2:])
    assert torch.equal(files.rows("a", 1, 3, transposed=True), state["a"].t()[1:3])
    assert torch.equal(files.rows("c", 0, 3, transposed=True), state["c"].t())


def test_checkpoint_files_prefer_safetensors_and_an_index(tmp_path):
    state = {"a": torch.ones(2)}
    write_state(tmp_path, {"a": torch.full((2,), 3.)}, "bin")
    write_state(tmp_path, {"a": torch.full((2,), 2.)}, "sharded bin")
    write_state(tmp_path, state, "safetensors")
    assert torch.equal(hf.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.ones(2))
    write_state(tmp_path, {"a": torch.zeros(2)}, "sharded safetensors")
    assert torch.equal(hf.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.zeros(2))
    for file in tmp_path.glob("model*"):
        file.unlink()
    assert torch.equal(hf.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.full((2,), 2.))
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    assert torch.equal(hf.CheckpointFiles(tmp_path).rows("a", 0, 2), torch.full((2,), 3.))
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(ConfigError) as error:
        hf.CheckpointFiles(tmp_path)
    assert str(error.value) == (f"--hf_model {tmp_path} has no model.safetensors or pytorch_model.bin (nor an "
                                "index of shards)")


def test_checkpoint_files_open_each_file_once(tmp_path):
    files = hf.CheckpointFiles(write_state(tmp_path, {"a": torch.ones(2, 2), "b": torch.ones(3)},
                                           "sharded safetensors"))
    for _ in range(3):
        files.shape("a"), files.rows("b", 0, 1)
    assert sorted(f.name for f in files.open_files) == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    first = dict(files.open_files)
    files.rows("a", 0, 1)
    assert all(files.open_files[f] is first[f] for f in first)


def hf_state(model_type, config):
    """A random transformers model of this config, saved as its directory would hold it: {name: tensor}."""
    torch.manual_seed(0)
    if model_type == "gpt":
        theirs = transformers.GPT2LMHeadModel(gpt2_config(n_positions=config.seq_length))
    else:
        theirs = transformers.LlamaForCausalLM(llama_config(max_position_embeddings=config.seq_length))
    state = {name: p.detach().clone() for name, p in theirs.named_parameters()}
    if model_type == "llama":  # as save_pretrained would (untied)
        state["lm_head.weight"] = theirs.lm_head.weight.detach().clone()
    return state


def expected_params(model_type, config, state):
    """Our parameters from their tensors, by the name map (transposed where GPT-2 stores Conv1D weights)."""
    names = hf.hf_names(model_type, config)
    return {ours: state[theirs].t() if hf.is_transposed(theirs) else state[theirs] for ours, theirs in names.items()}


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_load_weights_copies_every_tensor(tmp_path, model_type):
    config = {"gpt": GPT, "llama": LLAMA}[model_type]
    state = hf_state(model_type, config)
    model = ours(model_type)
    hf.load_weights(model, write_state(tmp_path, state, "safetensors"), model_type)
    expected = expected_params(model_type, config, state)
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_stored_names_hub_gpt2_prefix_and_tied_llama_head(tmp_path):
    gpt = hf_state("gpt", GPT)
    model = ours("gpt")  # the hub's gpt2 was saved from GPT2Model: no "transformer." prefix
    hf.load_weights(model, write_state(tmp_path / "gpt", {n.removeprefix("transformer."): t for n, t in gpt.items()},
                                       "safetensors"), "gpt")
    assert torch.equal(model.blocks[1].attn.qkv.weight, gpt["transformer.h.1.attn.c_attn.weight"].t())
    assert torch.equal(model.wpe.weight, gpt["transformer.wpe.weight"])
    llama = hf_state("llama", LLAMA)
    del llama["lm_head.weight"]  # Llama 3.2's tied embeddings
    model = ours("llama")
    hf.load_weights(model, write_state(tmp_path / "llama", llama, "safetensors"), "llama")
    assert torch.equal(model.lm_head.weight, llama["model.embed_tokens.weight"])
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()  # untied: trained apart from here on
    del llama["model.norm.weight"]
    write_state(tmp_path / "llama", llama, "safetensors")
    with pytest.raises(ConfigError) as error:
        hf.load_weights(model, tmp_path / "llama", "llama")
    assert str(error.value) == (f"--hf_model {tmp_path / 'llama'} has no tensor model.norm.weight: not a "
                                "checkpoint of this model type?")


def test_shapes_are_checked_before_anything_is_copied(tmp_path):
    state = hf_state("llama", LLAMA)
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(48, 71)
    model = ours("llama")
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError) as error:
        hf.load_weights(model, write_state(tmp_path, state, "safetensors"), "llama")
    assert str(error.value) == (f"--hf_model {tmp_path}: model.layers.1.mlp.down_proj.weight has shape (48, 71), "
                                "our blocks.1.mlp.down_proj.weight is (48, 72)")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_gpt2_positions_may_be_cut_to_a_shorter_context_only(tmp_path):
    state = hf_state("gpt", GPT)  # 24 positions
    short = GPTConfig(**dict(GPT.to_dict(), seq_length=10))
    model = ours("gpt", short)
    hf.load_weights(model, write_state(tmp_path / "a", state, "safetensors"), "gpt")
    assert torch.equal(model.wpe.weight, state["transformer.wpe.weight"][:10])
    for config, bad, shape in [(GPTConfig(**dict(GPT.to_dict(), seq_length=25)), None, (24, 32)),
                               (short, torch.zeros(24, 31), (24, 31)), (short, torch.zeros(24), (24,))]:
        if bad is not None:
            state["transformer.wpe.weight"] = bad
        model = ours("gpt", config)
        with pytest.raises(ConfigError) as error:
            hf.load_weights(model, write_state(tmp_path / "b", state, "safetensors"), "gpt")
        assert str(error.value) == (f"--hf_model {tmp_path / 'b'}: transformer.wpe.weight has shape {shape}, our "
                                    f"wpe.weight is {tuple(model.wpe.weight.shape)}")
    state = hf_state("llama", LLAMA)  # anything else, even with more rows, must match exactly
    state["model.embed_tokens.weight"] = torch.zeros(54, 48)
    with pytest.raises(ConfigError, match=r"model.embed_tokens.weight has shape \(54, 48\)"):
        hf.load_weights(ours("llama"), write_state(tmp_path / "c", state, "safetensors"), "llama")
    state = hf_state("gpt", GPT)  # a transposed tensor is compared as we store it
    state["transformer.h.0.mlp.c_fc.weight"] = state["transformer.h.0.mlp.c_fc.weight"].t().contiguous()
    with pytest.raises(ConfigError, match=r"transformer.h.0.mlp.c_fc.weight has shape \(32, 128\), our "
                                          r"blocks.0.mlp.fc.weight is \(128, 32\)"):
        hf.load_weights(ours("gpt"), write_state(tmp_path / "d", state, "safetensors"), "gpt")


# -----------------------------------------------------------------------------
# each rank reads its own rows: FSDP2 meshes on torch's fake process group, one rank at a time in this process

@pytest.fixture
def fake_rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def join(rank, shape):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=int(torch.tensor(shape).prod()))
        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rows,ranks", [(7, 3), (5, 4), (8, 4), (2, 3)])
def test_local_rows_are_torch_chunk_pieces(fake_rank, rows, ranks):
    from torch.distributed.tensor import DTensor, Shard
    full = torch.arange(rows * 3.).reshape(rows, 3)
    starts = [0] + [len(piece) for piece in torch.chunk(full, ranks)]
    starts = torch.tensor(starts + [0] * (ranks + 1 - len(starts))).cumsum(0).tolist()
    for rank in range(ranks):
        mesh = fake_rank(rank, (ranks,))
        pieces = torch.chunk(full, ranks)
        local = pieces[rank] if rank < len(pieces) else full[:0]
        param = DTensor.from_local(local, mesh, [Shard(0)], shape=full.shape, stride=full.stride())
        assert hf.local_rows(param) == (starts[rank], starts[rank + 1]), rank
        dist.destroy_process_group()
    assert hf.local_rows(full) == (0, rows)


def test_a_replicated_parameter_holds_every_row(fake_rank):
    from torch.distributed.tensor import DTensor, Replicate, Shard
    full = torch.arange(10.).reshape(5, 2)
    mesh = fake_rank(3, (2, 2))
    assert hf.local_rows(DTensor.from_local(full, mesh, [Replicate(), Replicate()])) == (0, 5)
    piece = torch.chunk(full, 2)[1]
    assert hf.local_rows(DTensor.from_local(piece, mesh, [Replicate(), Shard(0)], shape=full.shape,
                                            stride=full.stride())) == (3, 5)


@pytest.mark.parametrize("model_type,shape,rank", [("llama", (3,), 2), ("llama", (3,), 1), ("gpt", (4,), 3),
                                                   ("llama", (2, 3), 5), ("gpt", (2, 2), 2)])
def test_each_rank_of_a_mesh_loads_its_own_shard(tmp_path, fake_rank, model_type, shape, rank):
    from torch.distributed.fsdp import fully_shard
    config = {"gpt": GPT, "llama": LLAMA}[model_type]
    state = hf_state(model_type, config)
    directory = write_state(tmp_path, state, "safetensors")
    expected = expected_params(model_type, config, state)
    mesh = fake_rank(rank, shape)
    model = MODELS[model_type](config)
    fully_shard(model, mesh=mesh)
    hf.load_weights(model, directory, model_type)
    shard_rank = rank % shape[-1]
    for name, param in model.named_parameters():
        pieces = torch.chunk(expected[name], shape[-1])
        local = pieces[shard_rank] if shard_rank < len(pieces) else expected[name][:0]
        assert torch.equal(param.to_local(), local), name


# -----------------------------------------------------------------------------
# the directory's tokenizer

def stub_gpt2(monkeypatch):
    """tiktoken's gpt2 encoding stood in for by a tiny one with GPT-2's split pattern (no gpt2 files offline)."""
    return tokenizer_dirs.stub_gpt2_encoding(monkeypatch)


def test_load_tokenizer_of_a_directory(tmp_path, monkeypatch):
    gpt2 = save_config(tmp_path / "gpt2", bare("gpt2"))
    stub = stub_gpt2(monkeypatch)
    tokenizer = hf.load_tokenizer(gpt2)  # weights alone: tiktoken's GPT-2 BPE
    assert tokenizer.kind == "gpt2" and tokenizer.enc is stub
    tokenizer_dirs.write_tokenizer_json(gpt2)  # its own files win
    assert hf.load_tokenizer(gpt2).kind == "hf"
    llama = save_config(tmp_path / "llama", bare("llama"))  # a Llama has no default
    with pytest.raises(tk.TokenizerError) as error:
        hf.load_tokenizer(llama)
    assert str(error.value) == (f"--hf_model: {llama} holds no tokenizer: expected tokenizer.json (ours or Hugging "
                                "Face's), vocab.json + merges.txt, or tokenizer.model (or pass --tokenizer_dir DIR)")
    assert error.value.__cause__ is None and error.value.__suppress_context__
    tokenizer_dirs.write_vocab_merges(llama)
    assert hf.load_tokenizer(llama).kind == "hf"


def test_gpt2_without_tokenizer_files_offline(tmp_path, monkeypatch):
    gpt2 = save_config(tmp_path / "gpt2", bare("gpt2"))
    monkeypatch.setattr(tk, "gpt2_cached", lambda: False)
    monkeypatch.setattr(tk, "reachable", lambda url, timeout=5.0: False)
    with pytest.raises(tk.TokenizerError) as error:
        hf.load_tokenizer(gpt2)
    assert str(error.value) == (f"--hf_model {gpt2} has no tokenizer files (tokenizer.json, or vocab.json + "
                                "merges.txt), and tiktoken's gpt2 files are not cached nor downloadable (offline?): "
                                "copy the model's tokenizer files into it, or pass --tokenizer_dir DIR")
    assert error.value.__cause__ is None and error.value.__suppress_context__


# -----------------------------------------------------------------------------
# out: files, weights and config.json

def test_written_files_get_the_mode_the_umask_gives(tmp_path):
    previous = os.umask(0o027)
    try:
        hf_write.write_public(tmp_path / "a.json", lambda p: p.write_text("{}"))
        assert os.umask(0o027) == 0o027  # left as it was
        os.umask(0o002)
        hf_write.write_public(tmp_path / "b.json", lambda p: p.write_text("[]"))
    finally:
        os.umask(previous)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "b.json").read_text() == "[]" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json",
                                                                                                         "b.json"]


def test_safetensors_written_a_tensor_at_a_time_read_back_by_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g),
               "f16": torch.randn(2, 2, 3, generator=g), "i64": torch.arange(-5, 6), "i32": torch.arange(9).int(),
               "u8": torch.arange(250, 256).to(torch.uint8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i64": torch.int64,
              "i32": torch.int32, "u8": torch.uint8, "scalar": torch.float32, "empty": torch.float32}
    specs = [(name, tuple(t.shape), dtypes[name]) for name, t in tensors.items()]
    asked = []
    hf_write.write_safetensors(tmp_path / "w.safetensors", specs,
                               lambda name: asked.append(name) or tensors[name].float(),
                               {"format": "pt", "step": 12, "source": None})
    assert asked == list(tensors)  # once each, in file order
    loaded = load_file(tmp_path / "w.safetensors")
    for name, t in tensors.items():
        assert loaded[name].dtype == dtypes[name] and torch.equal(loaded[name], t.to(dtypes[name])), name
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "12", "source": "None"}
    raw = (tmp_path / "w.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0 and raw[8 + size - 1:8 + size] in (b" ", b"}")
    header = json.loads(raw[8:8 + size])
    offsets = [header[name]["data_offsets"] for name in tensors]  # in spec order, back to back
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert len(raw) == 8 + size + offsets[-1][1]


def test_safetensors_refuses_a_tensor_of_another_shape(tmp_path):
    with pytest.raises(AssertionError, match="^b$"):
        hf_write.write_safetensors(tmp_path / "w.safetensors", [("a", (2,), torch.float32), ("b", (3,), torch.float32)],
                                   lambda name: torch.zeros(2), {})
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_config_json_is_what_transformers_builds_the_same_model_from(tmp_path, model_type):
    config = {"gpt": GPTConfig(**dict(GPT.to_dict(), dropout=0.25)),
              "llama": LlamaConfig(**dict(LLAMA.to_dict(), dropout=0.25, norm_eps=1e-5, rope_theta=50.0,
                                          rope_scaling=LLAMA3))}[model_type]
    saved = hf_write.hf_config(model_type, config, torch.bfloat16, bos_id=3, eos_id=4)
    save_config(tmp_path / "m", saved)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "m")
    assert (theirs.vocab_size, theirs.bos_token_id, theirs.eos_token_id, theirs.dtype) == (53, 3, 4, torch.bfloat16)
    assert saved["torch_dtype"] == "bfloat16"  # transformers 4's spelling
    assert hf.read_config(tmp_path / "m") == (model_type, dataclass_replace(config, dropout=0.0))
    assert hf.read_config(tmp_path / "m", dropout=0.25) == (model_type, config)
    if model_type == "gpt":
        assert type(theirs).__name__ == "GPT2Config" and saved["architectures"] == ["GPT2LMHeadModel"]
        assert (theirs.n_positions, theirs.n_embd, theirs.n_layer, theirs.n_head) == (24, 32, 2, 4)
        assert (theirs.resid_pdrop, theirs.embd_pdrop, theirs.attn_pdrop) == (0.25, 0.25, 0.25)
        assert theirs.tie_word_embeddings
        # stated, not left to a reader's defaults: the fields read_config checks
        assert (saved["n_inner"], saved["activation_function"], saved["layer_norm_epsilon"]) == (None, "gelu_new", 1e-5)
        with pytest.raises(ConfigError) as error:
            hf_write.hf_config("gpt", GPTConfig(**dict(GPT.to_dict(), bias=False)))
        assert str(error.value) == "a GPT without biases has no GPT2LMHeadModel equivalent"
    else:
        assert type(theirs).__name__ == "LlamaConfig" and saved["architectures"] == ["LlamaForCausalLM"]
        assert (theirs.max_position_embeddings, theirs.hidden_size, theirs.intermediate_size,
                theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads,
                theirs.head_dim, theirs.rms_norm_eps, theirs.attention_dropout) == (24, 48, 72, 2, 6, 2, 8, 1e-5, 0.25)
        assert theirs.rope_parameters == dict(LLAMA3, rope_theta=50.0)
        assert not theirs.tie_word_embeddings and not theirs.attention_bias and not theirs.mlp_bias
        assert (saved["hidden_act"], saved["attention_bias"], saved["mlp_bias"]) == ("silu", False, False)
        # transformers 4 reads rope_theta and rope_scaling
        assert (saved["rope_theta"], saved["rope_scaling"]) == (50.0, dict(LLAMA3, rope_theta=50.0))
        plain = hf_write.hf_config("llama", LLAMA)
        assert plain["tie_word_embeddings"] is False
        assert plain["rope_scaling"] is None and plain["rope_parameters"] == {"rope_type": "default",
                                                                               "rope_theta": 10000.0}
        assert (plain["dtype"], plain["bos_token_id"], plain["eos_token_id"]) == ("float32", None, None)


STATED = {"gpt": ["architectures", "model_type", "vocab_size", "bos_token_id", "eos_token_id", "n_positions", "n_embd",
                   "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon", "resid_pdrop",
                   "embd_pdrop", "attn_pdrop", "tie_word_embeddings"],
          "llama": ["architectures", "model_type", "vocab_size", "bos_token_id", "eos_token_id",
                    "max_position_embeddings", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                    "attention_bias", "mlp_bias", "attention_dropout", "tie_word_embeddings"]}


@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_config_json_states_every_field_that_shapes_the_model(tmp_path, model_type):
    """Not left to a reader's defaults (they differ between readers and versions): each field is in the file,
    as the value transformers reads."""
    config = {"gpt": GPT, "llama": LLAMA}[model_type]
    saved = hf_write.hf_config(model_type, config, bos_id=1, eos_id=2)
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
    names = hf.hf_names("llama", LLAMA)
    sizes = [t.numel() * 4 for t in state.values()]
    limit = 3 * max(sizes) // 2  # the largest tensor fits; two large ones do not
    hf_write.save_hf(state, {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path, max_shard_bytes=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(tmp_path.glob("model-*.safetensors"))
    assert [f.name for f in files] == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                       for i in range(1, len(files) + 1)]
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
        assert sorted(loaded) == sorted(want) and all(index["weight_map"][n] == file.name for n in want)
        assert sum(t.numel() * 4 for t in loaded.values()) <= limit
    hf_write.save_hf(state, {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path / "exact",
                     max_shard_bytes=sum(sizes))  # all of it fits exactly: one file
    assert sorted(p.name for p in (tmp_path / "exact").iterdir()) == ["config.json", "model.safetensors"]
    hf_write.save_hf(state, {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path / "one", max_shard_bytes=1)
    assert len(list((tmp_path / "one").glob("model-*-of-*.safetensors"))) == len(state)  # a tensor a shard


def test_an_export_replaces_every_earlier_weight_file(tmp_path):
    state, meta = llama_state(), {"model": LLAMA.to_dict(), "model_type": "llama"}
    for stale in ("pytorch_model.bin", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
                  "model-00001-of-00009.safetensors", "model.safetensors.index.json", "README.md", "notes.bin"):
        (tmp_path / stale).write_text("old")
    hf_write.save_hf(state, meta, tmp_path, max_shard_bytes=20_000)
    kept = sorted(p.name for p in tmp_path.iterdir())
    shards = [n for n in kept if n.startswith("model-")]
    assert len(shards) > 1 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    assert kept == sorted(["README.md", "notes.bin", "config.json", "model.safetensors.index.json", *shards])
    hf_write.save_hf(state, meta, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                          "notes.bin"]
    hf_write.save_hf(state, meta, tmp_path, max_shard_bytes=20_000)
    assert "model.safetensors" not in {p.name for p in tmp_path.iterdir()}


def test_config_json_is_written_last(tmp_path, monkeypatch):
    written = []
    write_public = hf_write.write_public
    monkeypatch.setattr(hf_write, "write_public",
                        lambda path, write: written.append(path.name) or write_public(path, write))
    tokenizer = tk.CharTokenizer("abc ")
    hf_write.save_hf(llama_state(), {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path, tokenizer,
                     max_shard_bytes=20_000)
    assert written[-1] == "config.json" and {"tokenizer.json", "tokenizer_config.json",
                                             "model.safetensors.index.json"} < set(written)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] == LLAMA.seq_length


def test_config_names_the_dtype_holding_most_bytes_and_the_tokenizers_ids(tmp_path):
    from safetensors.torch import load_file
    state = llama_state()
    big = {"wte.weight", "lm_head.weight"}  # 2 x 53 x 48 of 27k parameters
    mixed = {n: t if n in big else t.bfloat16() for n, t in state.items()}
    specs = [(n, tuple(t.shape), t.dtype) for n, t in mixed.items()]
    out = hf_write.write_hf(tmp_path, {"model": LLAMA.to_dict(), "model_type": "llama"}, specs, mixed.__getitem__)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["dtype"], saved["bos_token_id"], saved["eos_token_id"]) == ("bfloat16", None, None)
    assert load_file(out / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    mixed = {n: t.bfloat16() if n in big else t for n, t in state.items()}
    specs = [(n, tuple(t.shape), t.dtype) for n, t in mixed.items()]
    hf_write.write_hf(tmp_path, {"model": LLAMA.to_dict(), "model_type": "llama"}, specs, mixed.__getitem__)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    # bytes, not parameters: 100 fp32 (400 bytes) outweigh 110 bf16 (220 bytes)
    config = LlamaConfig(vocab_size=10, seq_length=4, num_layers=0, num_heads=1, num_kv_heads=1, embed_size=10,
                         intermediate_size=1)
    specs = [("wte.weight", (10, 10), torch.float32), ("norm.weight", (10,), torch.bfloat16),
             ("lm_head.weight", (10, 10), torch.bfloat16)]
    small = hf_write.write_hf(tmp_path / "a" / "b", {"model": config.to_dict(), "model_type": "llama"}, specs,
                              lambda name: torch.zeros(dict((n, s) for n, s, _ in specs)[name]))
    assert json.loads((small / "config.json").read_text())["dtype"] == "float32"
    tokenizer = tk.CharTokenizer("ab")
    tokenizer.bos_id, tokenizer.eot_id = 0, 1
    hf_write.save_hf(state, {"model": LLAMA.to_dict(), "model_type": "llama"}, tmp_path, tokenizer)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (0, 1)


def test_gpt2_export_writes_conv1d_weights_transposed(tmp_path):
    from safetensors.torch import load_file
    model = ours("gpt")
    hf_write.save_hf(model.state_dict(), {"model": GPT.to_dict()}, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    theirs = dict(transformers.GPT2LMHeadModel(gpt2_config()).named_parameters())
    assert set(saved) == set(theirs)
    assert all(saved[n].shape == theirs[n].shape for n in theirs)
    assert torch.equal(saved["transformer.h.1.mlp.c_proj.weight"], model.blocks[1].mlp.proj.weight.t())
    assert torch.equal(saved["transformer.h.1.mlp.c_proj.bias"], model.blocks[1].mlp.proj.bias)


# -----------------------------------------------------------------------------
# out: the tokenizer

def test_byte_table_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    assert hf_tokenizer._bytes_to_unicode() == bytes_to_unicode()


def sentencepiece(**options):
    """A sentencepiece BPE trained here with trainer options of a Llama 2 tokenizer.model's kind."""
    import io
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(tokenizer_dirs.training_text().splitlines()), model_writer=model, model_type="bpe",
        vocab_size=320 if options.get("byte_fallback") else 200, normalization_rule_name="identity",
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2, **options)
    return tk.SentencePieceTokenizer(model.getvalue())


def assert_encodes_as(tok, tokenizer, texts):
    for text in texts:
        ids = tokenizer.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids), text


@pytest.mark.parametrize("options", [dict(byte_fallback=True), dict(byte_fallback=False),
                                     dict(byte_fallback=True, add_dummy_prefix=False),
                                     dict(byte_fallback=False, add_dummy_prefix=False, unk_id=3, bos_id=-1,
                                          eos_id=1, pad_id=0)])
def test_sentencepiece_as_tokenizer_json(tmp_path, options):
    tokenizer = sentencepiece(**options)
    tok, names = hf_tokenizer.hf_tokenizer(tokenizer)
    texts = tokenizer_dirs.MIXED + ["the king", "  two  spaces ", "中文 テキスト"]
    if options["byte_fallback"]:
        assert_encodes_as(tok, tokenizer, texts)
    else:  # unknown characters: one unk for a run of them, as sentencepiece
        for text in texts:
            assert tok.encode(text, add_special_tokens=False).ids == tokenizer.encode(text), text
        assert tokenizer.encode("中文") == [tokenizer.sp.unk_id()] or tokenizer.encode("中文")[-1:] == \
            [tokenizer.sp.unk_id()]
    sp = tokenizer.sp
    assert names == {"eos_token": sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None,
                     "bos_token": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
                     "unk_token": sp.id_to_piece(sp.unk_id())}
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    assert specials == {sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}


def test_tiktoken_as_tokenizer_json(tmp_path, monkeypatch):
    llama3 = tk.load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tok")[0])
    tok, names = hf_tokenizer.hf_tokenizer(llama3)
    assert_encodes_as(tok, llama3, tokenizer_dirs.MIXED + ["aaaa bbb"])
    assert names == {"eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>"}
    assert tok.token_to_id("<|end_of_text|>") == llama3.eot_id and tok.get_vocab_size() == llama3.vocab_size
    stub_gpt2(monkeypatch)
    gpt2 = tk.GPT2Tokenizer()
    tok, names = hf_tokenizer.hf_tokenizer(gpt2)
    assert_encodes_as(tok, gpt2, tokenizer_dirs.MIXED)
    assert names == {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    with pytest.raises(ConfigError) as error:
        hf_tokenizer._from_tiktoken(gpt2.ranks, gpt2.pattern, {"<|endoftext|>": len(gpt2.ranks) + 1})
    assert str(error.value) == (f"special token <|endoftext|> has id {len(gpt2.ranks) + 1}, which tokenizer.json "
                                "cannot give it")
    n = len(gpt2.ranks)  # ids handed out in id order, whatever the names' order
    tok = hf_tokenizer._from_tiktoken(gpt2.ranks, gpt2.pattern, {"<|a|>": n + 1, "<|b|>": n, "<|c|>": n + 2})
    assert [tok.token_to_id(t) for t in ("<|b|>", "<|a|>", "<|c|>")] == [n, n + 1, n + 2]


def test_tiktoken_takes_a_piece_that_is_a_token_whole():
    """Merging by rank alone would stop at a, bc, d: tiktoken takes "abcd" whole, as it is in the vocabulary."""
    import tiktoken
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"d": 3, b"bc": 4, b"ab": 5, b"cd": 6, b"abcd": 7, b" ": 8}
    pattern = r" ?[a-z]+"
    enc = tiktoken.Encoding(name="crafted", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    tok = hf_tokenizer._from_tiktoken(ranks, pattern, {})
    for text in ("abcd", "abcd abc bcd", "dcba"):
        assert tok.encode(text).ids == enc.encode_ordinary(text), text
    assert enc.encode_ordinary("abcd") == [7]


def test_hf_and_char_tokenizers_as_tokenizer_json(tmp_path):
    hf_tok = tk.load_tokenizer(tokenizer_dirs.write_tokenizer_json(tmp_path / "tok"))
    tok, names = hf_tokenizer.hf_tokenizer(hf_tok)
    assert tok.to_str() == hf_tok.json
    assert names == {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    chars = tk.CharTokenizer("ba \n")
    tok, names = hf_tokenizer.hf_tokenizer(chars)
    assert_encodes_as(tok, chars, ["ab  a\nb", "a"])
    assert names == {"eos_token": None, "bos_token": None}
    with pytest.raises(ConfigError) as error:
        hf_tokenizer.hf_tokenizer(SimpleNamespace(kind="bytes"))
    assert str(error.value) == "no Hugging Face tokenizer.json for a bytes tokenizer"


def test_tokenizer_files_transformers_reads(tmp_path, capsys):
    tokenizer = sentencepiece()
    hf_write.write_hf_tokenizer(tokenizer, tmp_path, 77)
    assert capsys.readouterr().err == ""
    assert (tmp_path / "tokenizer.model").read_bytes() == tokenizer.model_proto
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(theirs).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert theirs.model_max_length == 77 and theirs.clean_up_tokenization_spaces is False
    assert theirs.unk_token == tokenizer.sp.id_to_piece(tokenizer.sp.unk_id())
    ids = tokenizer.encode("the king  and . of")
    assert theirs.decode(ids) == tokenizer.decode(ids)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # stated: transformers 4 defaults to cleaning up spaces, which decodes "a ." as "a."
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["clean_up_tokenization_spaces"] is False
    chars = tk.CharTokenizer("xyz")  # the probe text is its own alphabet (it cannot encode ours)
    (tmp_path / "c").mkdir()
    hf_write.write_hf_tokenizer(chars, tmp_path / "c", 5)
    assert capsys.readouterr().err == "" and not (tmp_path / "c" / "tokenizer.model").exists()


def test_a_tokenizer_json_that_encodes_otherwise_is_reported(tmp_path, capsys, monkeypatch):
    tokenizer = sentencepiece()
    monkeypatch.setattr(tokenizer, "encode", lambda text: [0])
    hf_write.write_hf_tokenizer(tokenizer, tmp_path, 16)
    assert capsys.readouterr().err == ("warning: the exported tokenizer.json encodes a test text differently from "
                                       "our sentencepiece tokenizer: check it before relying on it\n")
    probes = []
    monkeypatch.setattr(tokenizer, "encode", lambda text: probes.append(text) or tokenizer.sp.encode(text))
    hf_write.write_hf_tokenizer(tokenizer, tmp_path, 16)
    assert probes == [hf_tokenizer.PROBE] and capsys.readouterr().err == ""


# -----------------------------------------------------------------------------
# .bin files: memory-mapped, weights only, on a CPU whichever device saved them

class Payload:
    """What a pickle can smuggle in: unpickling it runs code."""
    ran = []

    def __reduce__(self):
        return Payload.ran.append, ("code ran",)


def save_as_from_gpu(state, path, **kw):
    """torch.save as a GPU's tensors would be saved (their storages tagged cuda:0), without a GPU."""
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
    state = {"a": torch.arange(12.).reshape(3, 4)}
    save_as_from_gpu(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=zipfile)
    files = hf.CheckpointFiles(tmp_path)
    assert files.shape("a") == (3, 4) and torch.equal(files.rows("a", 1, 2), state["a"][1:2])
    assert files.rows("a", 0, 3).device.type == "cpu"
    assert mapped(tmp_path / "pytorch_model.bin") == zipfile  # torch < 1.6's format is read whole


@pytest.mark.parametrize("zipfile", [True, False])
def test_bin_files_never_run_pickled_code(tmp_path, monkeypatch, zipfile):
    """Not even where the environment asks torch.load to unpickle anything it is not told otherwise."""
    torch.save({"a": torch.ones(2), "b": Payload()}, tmp_path / "pytorch_model.bin",
               _use_new_zipfile_serialization=zipfile)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    Payload.ran.clear()
    with pytest.raises(ConfigError, match=r"pytorch_model.bin cannot be read as a PyTorch file \(UnpicklingError: "):
        hf.CheckpointFiles(tmp_path)
    assert Payload.ran == []


def test_safetensors_from_views_and_shards_filled_to_the_byte(tmp_path):
    from safetensors.torch import load_file
    # a strided 1-d view (not contiguous, and reshape(-1) keeps it so) and a transposed one
    full = torch.arange(16.)
    tensors = {"a": full[::2], "b": full.reshape(4, 4).t()}
    hf_write.write_safetensors(tmp_path / "v.safetensors", [("a", (8,), torch.float32), ("b", (4, 4), torch.float32)],
                               tensors.__getitem__, {})
    loaded = load_file(tmp_path / "v.safetensors")
    assert torch.equal(loaded["a"], full[::2]) and torch.equal(loaded["b"], full.reshape(4, 4).t())
    # a shard takes tensors while they fit, to the byte; the next shard starts empty
    config = LlamaConfig(vocab_size=2, seq_length=4, num_layers=0, num_heads=1, num_kv_heads=1, embed_size=1,
                         intermediate_size=1)
    meta = {"model": config.to_dict(), "model_type": "llama"}
    for shapes, expected in [([(2,), (1,), (1,)], [["model.embed_tokens.weight"],
                                                   ["model.norm.weight", "lm_head.weight"]]),
                             ([(1,), (1,), (1,)], [["model.embed_tokens.weight", "model.norm.weight"],
                                                   ["lm_head.weight"]])]:
        specs = [(name, shape, torch.float32) for name, shape in zip(["wte.weight", "norm.weight", "lm_head.weight"],
                                                                     shapes)]
        out = hf_write.write_hf(tmp_path / str(shapes), meta, specs, lambda name: torch.ones(dict(
                  (n, s) for n, s, _ in specs)[name]), max_shard_bytes=8)
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        got = [[n for n, f in weight_map.items() if f == file] for file in sorted(set(weight_map.values()))]
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
        hf_write.save_hf(state, meta, tmp_path / str(limit), max_shard_bytes=limit)
        files = sorted((tmp_path / str(limit)).glob("*.safetensors"))
        assert len(files) == 1 if limit > 20_000 else len(files) > 1
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                assert f.metadata() == expected, file.name


def test_special_tokens_are_skipped_when_decoding_asks_to(tmp_path):
    """transformers' generation decodes with skip_special_tokens=True: the eos must go, the text must stay."""
    llama3 = tk.load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tiktoken")[0])
    for tokenizer in (llama3, sentencepiece(byte_fallback=True)):
        tok, _ = hf_tokenizer.hf_tokenizer(tokenizer)
        ids = [tokenizer.bos_id, *tokenizer.encode("the king"), tokenizer.eot_id]
        assert tok.decode(ids, skip_special_tokens=True) == "the king", tokenizer.kind


def test_a_tokenizer_json_that_adds_a_bos_is_not_reported(tmp_path, capsys):
    """Hub tokenizer.json files (Llama's) add BOS in a post-processor; ours encodes without it, as the probe does."""
    from tokenizers import processors
    tok = tokenizer_dirs.bpe_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>",
                                                                                                    eos)])
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    tokenizer = tk.load_tokenizer(tmp_path / "tok")
    assert tok.encode("hi").ids[0] == eos and tokenizer.encode("hi")[0] != eos
    hf_write.write_hf_tokenizer(tokenizer, tmp_path, 16)
    assert capsys.readouterr().err == ""
