"""Hugging Face in and out: tiny random GPT2LMHeadModel / LlamaForCausalLM built locally with transformers
(no network), imported into our models, and ours exported and reloaded by transformers, each with the same
logits (fp32, max abs diff < 1e-4). Then --hf_model on 2 ranks: training starts from the Hugging Face weights
and tokenizer, and generation matches transformers' greedy decoding."""
import json
import shutil
import sys

import pytest
import torch

from conftest import ROOT, launch, make_text
from test_end_to_end import sample_of
from test_parallelize import logged_losses

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT))
from basic_training import MODELS  # noqa: E402
from minimal_fsdp import checkpoint, hf  # noqa: E402
from minimal_fsdp.config import ConfigError, parse_args  # noqa: E402
from minimal_fsdp.data import TokenData, dataset_dir  # noqa: E402
from minimal_fsdp.llama import LlamaConfig  # noqa: E402
from minimal_fsdp.model import GPTConfig  # noqa: E402
from minimal_fsdp.parallelize import init_weights  # noqa: E402
from minimal_fsdp.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 500000.0}


def hf_gpt2(directory, **kw):
    torch.manual_seed(0)
    config = transformers.GPT2Config(**dict(dict(n_layer=2, n_head=4, n_embd=32, n_positions=24, vocab_size=53),
                                             **kw))
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(directory)
    return model.eval()


def hf_llama(directory, **kw):
    torch.manual_seed(0)
    fields = dict(hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=53, max_position_embeddings=24, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(fields, **kw)))
    model.save_pretrained(directory)
    return model.eval()


def ours_from(directory, seq_length=None):
    model_type, config = hf.read_config(directory, seq_length)
    model = MODELS[model_type][0](config).eval()
    hf.load_weights(model, directory, model_type)
    return model


@torch.no_grad()
def assert_same_logits(ours, theirs, vocab_size, length):
    idx = torch.randint(0, vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    expected = theirs(idx).logits
    got = torch.stack([ours(idx[:, :t]) for t in range(1, length + 1)], dim=1)  # ours: last position only
    assert (got - expected).abs().max().item() < 1e-4
    loss = torch.nn.functional.cross_entropy(expected[:, :-1].reshape(-1, vocab_size), idx[:, 1:].reshape(-1))
    assert ours(idx[:, :-1], idx[:, 1:]).item() == pytest.approx(loss.item(), abs=1e-5)


# -----------------------------------------------------------------------------
# in

def test_gpt2_import(tmp_path):
    theirs = hf_gpt2(tmp_path)
    ours = ours_from(tmp_path)
    assert ours.config == GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32)
    assert_same_logits(ours, theirs, 53, 24)


def test_gpt2_import_with_a_shorter_context_keeps_the_first_positions(tmp_path):
    theirs = hf_gpt2(tmp_path)
    ours = ours_from(tmp_path, seq_length=10)
    assert ours.wpe.weight.shape[0] == 10
    assert_same_logits(ours, theirs, 53, 10)


@pytest.mark.parametrize("variant", ["gqa", "llama3-rope", "tied-embeddings"])
def test_llama_import(tmp_path, variant):
    kw = {"gqa": {}, "llama3-rope": {"rope_parameters": LLAMA3_ROPE},
          "tied-embeddings": {"tie_word_embeddings": True, "num_key_value_heads": 6}}[variant]
    theirs = hf_llama(tmp_path, **kw)
    ours = ours_from(tmp_path)
    assert_same_logits(ours, theirs, 53, 24)
    if variant == "llama3-rope":  # the scaling is applied, and it matters at these lengths
        assert ours.config.rope_scaling["factor"] == 8.0 and ours.config.rope_theta == 500000.0
        plain = MODELS["llama"][0](LlamaConfig(**dict(ours.config.to_dict(), rope_scaling=None))).eval()
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
        hf.read_config(tmp_path, seq_length=32)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, model_type="bert")))
    with pytest.raises(ConfigError, match="is a 'bert' model; supported are gpt2 and llama"):
        hf.read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, activation_function="relu")))
    with pytest.raises(ConfigError, match="activation relu"):
        hf.read_config(tmp_path)


def test_hub_name_offline_or_without_huggingface_hub(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there: offline, instantly
    with pytest.raises(ConfigError, match="--hf_model someone/some-model .* unreachable"):
        hf.resolve("someone/some-model")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError, match="pip install huggingface_hub"):
        hf.resolve("someone/some-model")
    with pytest.raises(ConfigError, match="has no config.json"):
        hf.resolve(str(tmp_path))


# -----------------------------------------------------------------------------
# out

@pytest.mark.parametrize("model_type", ["gpt", "llama"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, model_type):
    config = GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32) \
        if model_type == "gpt" else LlamaConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=6,
                                                num_kv_heads=2, embed_size=48, intermediate_size=72,
                                                rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)
    ours = MODELS[model_type][0](config).eval()
    init_weights(ours, 0, torch.device("cpu"))
    meta = {"model": config.to_dict(), "model_type": model_type}
    hf.save_hf(ours.state_dict(), meta, tmp_path / "out", max_shard_bytes=30_000)  # several shards
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model_type]
    assert_same_logits(ours, theirs, 53, 24)
    # ... and it comes back in unchanged, also after a second export to the same directory as one file.
    hf.save_hf(ours.state_dict(), meta, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    again = ours_from(tmp_path / "out")
    for name, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_export_of_a_checkpoint_without_model_type_is_a_gpt_and_brings_the_tokenizer(tmp_path):
    config = GPTConfig(vocab_size=300, seq_length=16, num_layers=1, num_heads=2, embed_size=16)
    ours = MODELS["gpt"][0](config)
    init_weights(ours, 0, torch.device("cpu"))
    tokenizer = train_tokenizer("sentencepiece", make_text(20_000), 300, tmp_path / "tok")
    hf.save_hf(ours.state_dict(), {"model": config.to_dict()}, tmp_path / "out", tokenizer_dir=tmp_path / "tok")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt2"
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == tokenizer.model_proto
    assert not (tmp_path / "out" / "tokenizer.json").exists()  # ours is not Hugging Face's tokenizer.json


# -----------------------------------------------------------------------------
# --hf_model on 2 ranks

@pytest.fixture
def llama_dir(tmp_path, corpus):
    """A tiny random Llama with its own sentencepiece tokenizer.model (300 pieces; 301 embedding rows, so
    the embedding and head split unevenly over 2 ranks). Larger init so greedy decoding has no near-ties."""
    tokenizer = train_tokenizer("sentencepiece", corpus.read_text(), 300, tmp_path / "sp")
    directory = tmp_path / "hf-llama"
    theirs = hf_llama(directory, vocab_size=301, max_position_embeddings=64, initializer_range=0.2)
    shutil.copy(tmp_path / "sp" / "tokenizer.model", directory)
    return directory, theirs, tokenizer


def test_training_starts_from_the_hf_weights_and_tokenizer(tmp_path, corpus, llama_dir):
    directory, theirs, tokenizer = llama_dir
    args = ["--hf_model", directory, "--dataset", "text", "--input_file", corpus, "--data_dir", tmp_path / "data",
            "--seq_length", 32, "--batch_size", 2, "--max_steps", 1, "--log_interval", 1, "--eval_interval", 0,
            "--eval_batches", 1, "--num_tokens", 0, "--run_name", "run"]
    launch(args, ranks=2, cwd=tmp_path)
    # The first logged loss is that of the Hugging Face model on the first batches of both ranks.
    cfg = parse_args([str(a) for a in args])
    data = TokenData(dataset_dir(cfg, tokenizer))  # tokenized with the model's own tokenizer.model
    x, y = (torch.cat(t) for t in zip(*(data.get_batch("train", 0, r, 2, 2, 32, cfg.seed) for r in range(2))))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(theirs(x).logits.reshape(-1, 301), y.reshape(-1)).item()
    assert logged_losses(tmp_path, "run")[0] == pytest.approx(expected, abs=1e-4)
    saved = checkpoint.latest(tmp_path / "checkpoints" / "run")
    assert json.loads((saved / "meta.json").read_text())["model_type"] == "llama"
    assert load_tokenizer(saved).model_proto == tokenizer.model_proto  # the tokenizer travels with it


def test_generation_from_hf_model_matches_transformers_greedy(tmp_path, llama_dir):
    directory, theirs, tokenizer = llama_dir
    prompt = "KING:"
    out = launch(["--hf_model", directory, "--max_epochs", -1, "--prompt", prompt, "--num_tokens", 12,
                  "--temperature", 0, "--sharding", "hybrid-full-shard", "--shard_group_size", 2],
                 ranks=2, cwd=tmp_path)
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(theirs(torch.tensor([ids])).logits[0, -1].argmax().item())
    assert sample_of(out.stdout) == tokenizer.decode(ids)
