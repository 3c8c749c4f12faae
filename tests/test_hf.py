"""Hugging Face in and out: tiny random GPT2LMHeadModel / LlamaForCausalLM built locally with transformers
(no network), imported into our models, and ours exported and reloaded by transformers, each with the same
logits (fp32, max abs diff < 1e-4); exports carry a tokenizer.json that transformers' AutoTokenizer reads and
that gives our token ids, for every kind of tokenizer. Then --hf_model on 2 ranks, offline: training starts
from the Hugging Face weights and tokenizer, generation matches transformers' greedy decoding, and a Llama 3
(tiktoken tokenizer, rope scaling, GQA) trains, samples, exports and comes back through --hf_model."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import tokenizer_dirs
from conftest import ROOT, global_batch, launch, make_text
from test_end_to_end import sample_of
from test_parallelize import logged_losses

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT))
from minimal_fsdp.models import MODELS  # noqa: E402
from minimal_fsdp import checkpoint_find, checkpoint_meta, export, hf, hf_write, safe_load  # noqa: E402
from minimal_fsdp import tokenizer as tk  # noqa: E402
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
    model = MODELS[model_type](config).eval()
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
        plain = MODELS["llama"](LlamaConfig(**dict(ours.config.to_dict(), rope_scaling=None))).eval()
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
    ours = MODELS[model_type](config).eval()
    init_weights(ours, 0, torch.device("cpu"))
    meta = {"model": config.to_dict(), "model_type": model_type}
    hf_write.save_hf(ours.state_dict(), meta, tmp_path / "out", max_shard_bytes=30_000)  # several shards
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model_type]
    assert_same_logits(ours, theirs, 53, 24)
    # ... and it comes back in unchanged, also after a second export to the same directory as one file.
    hf_write.save_hf(ours.state_dict(), meta, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    again = ours_from(tmp_path / "out")
    for name, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_export_of_a_checkpoint_without_model_type_is_a_gpt(tmp_path):
    config = GPTConfig(vocab_size=300, seq_length=16, num_layers=1, num_heads=2, embed_size=16)
    ours = MODELS["gpt"](config)
    init_weights(ours, 0, torch.device("cpu"))
    hf_write.save_hf(ours.state_dict(), {"model": config.to_dict()}, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gpt2"


def stub_gpt2(monkeypatch):
    """A GPT2Tokenizer over a tiny tiktoken encoding with GPT-2's split pattern (no gpt2 files offline)."""
    tokenizer_dirs.stub_gpt2_encoding(monkeypatch)
    return tk.GPT2Tokenizer()


def tokenizer_of_kind(kind, tmp_path, monkeypatch):
    if kind == "char":
        return tk.train_tokenizer("char", tokenizer_dirs.training_text() + "".join(tokenizer_dirs.MIXED), None,
                                  tmp_path / "tok")
    if kind == "sentencepiece":
        return tk.load_tokenizer(tokenizer_dirs.write_sentencepiece(tmp_path / "tok"))
    if kind == "hf":
        return tk.load_tokenizer(tokenizer_dirs.write_tokenizer_json(tmp_path / "tok"))
    if kind == "tiktoken":
        return tk.load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tok")[0])
    return stub_gpt2(monkeypatch)


@pytest.mark.parametrize("kind", ["char", "sentencepiece", "hf", "tiktoken", "gpt2"])
def test_export_carries_a_tokenizer_that_transformers_reads_as_ours(tmp_path, monkeypatch, kind):
    tokenizer = tokenizer_of_kind(kind, tmp_path, monkeypatch)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, seq_length=16, num_layers=1, num_heads=2, num_kv_heads=1,
                         embed_size=16, intermediate_size=32)
    ours = MODELS["llama"](config)
    init_weights(ours, 0, torch.device("cpu"))
    hf_write.save_hf(ours.state_dict(), {"model": config.to_dict(), "model_type": "llama"}, tmp_path / "out", tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in tokenizer_dirs.MIXED:
        ids = tokenizer.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
        assert theirs.decode(ids) == tokenizer.decode(ids) == text
    # bos/eos in config.json are ours, and are tokens of the vocabulary (or absent, for char)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eot_id)
    assert theirs.eos_token_id == tokenizer.eot_id and theirs.bos_token_id == tokenizer.bos_id
    for i in (tokenizer.bos_id, tokenizer.eot_id):
        assert i is None or i < tokenizer.vocab_size and theirs.convert_ids_to_tokens(i) is not None
    if kind != "char":
        assert tokenizer.eot_id is not None
    # and --hf_model reads the export's tokenizer back, with the same ids
    again = hf.load_tokenizer(tmp_path / "out")
    assert all(again.encode(t) == tokenizer.encode(t) for t in tokenizer_dirs.MIXED)
    assert again.eot_id == tokenizer.eot_id


def test_export_dtype_and_file_permissions(tmp_path):
    config = LlamaConfig(vocab_size=53, seq_length=16, num_layers=1, num_heads=2, num_kv_heads=1, embed_size=16,
                         intermediate_size=32)
    ours = MODELS["llama"](config)
    init_weights(ours, 0, torch.device("cpu"))
    state = {name: t.bfloat16() for name, t in ours.state_dict().items()}
    tokenizer = tk.CharTokenizer("".join(chr(ord("a") + i) for i in range(26)) + " .")
    hf_write.save_hf(state, {"model": config.to_dict(), "model_type": "llama"}, tmp_path / "out", tokenizer,
                     max_shard_bytes=2_000)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["dtype"] == saved["torch_dtype"] == "bfloat16"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert {p.dtype for p in theirs.parameters()} == {torch.bfloat16}
    umask = os.umask(0)
    os.umask(umask)
    files = sorted((tmp_path / "out").iterdir())
    assert len([f for f in files if f.suffix == ".safetensors"]) > 1 and (tmp_path / "out" / "tokenizer.json") in files
    assert {f.name: f.stat().st_mode & 0o777 for f in files} == {f.name: 0o666 & ~umask for f in files}


def test_gpt2_weights_without_tokenizer_files_offline_is_one_line(tmp_path, monkeypatch):
    hf_gpt2(tmp_path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(tk, "reachable", lambda url, timeout=5.0: False)
    with pytest.raises(ConfigError, match="has no tokenizer files .* --tokenizer_dir"):
        hf.load_tokenizer(tmp_path)


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


@pytest.mark.slow
def test_training_starts_from_the_hf_weights_and_tokenizer(tmp_path, corpus, llama_dir):
    directory, theirs, tokenizer = llama_dir
    args = ["--hf_model", directory, "--dataset", "text", "--input_file", corpus, "--data_dir", tmp_path / "data",
            "--seq_length", 32, "--batch_size", 2, "--max_steps", 1, "--log_interval", 1, "--eval_interval", 0,
            "--eval_batches", 1, "--num_tokens", 0, "--run_name", "run"]
    launch(args, ranks=2, cwd=tmp_path)
    # The first logged loss is that of the Hugging Face model on the first batches of both ranks.
    cfg = parse_args([str(a) for a in args])
    data = TokenData(dataset_dir(cfg, tokenizer))  # tokenized with the model's own tokenizer.model
    x, y = global_batch(data, 0, 2, 2, 32, cfg.seed)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(theirs(x).logits.reshape(-1, 301), y.reshape(-1)).item()
    assert logged_losses(tmp_path, "run")[0] == pytest.approx(expected, abs=1e-4)
    saved = checkpoint_find.latest(tmp_path / "checkpoints" / "run")
    assert json.loads((saved / "meta.json").read_text())["model_type"] == "llama"
    assert load_tokenizer(saved).model_proto == tokenizer.model_proto  # the tokenizer travels with it


@pytest.mark.slow
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


# -----------------------------------------------------------------------------
# offline, end to end: a GPT-2 directory with its own tokenizer files, and a Llama 3

def offline_env(tmp_path):
    """No hub, an empty tiktoken cache, and a proxy that refuses at once: nothing may be fetched."""
    refused = "http://127.0.0.1:9"
    return {"HF_HUB_OFFLINE": "1", "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-tiktoken-cache"),
            "HTTPS_PROXY": refused, "HTTP_PROXY": refused, "https_proxy": refused, "http_proxy": refused}


@pytest.mark.slow
def test_gpt2_directory_trains_and_samples_offline_with_its_own_tokenizer(tmp_path, corpus):
    directory = tmp_path / "gpt2"
    tokenizer_dirs.write_vocab_merges(directory)  # the older hub layout: vocab.json + merges.txt
    vocab = len(json.loads((directory / "vocab.json").read_text()))
    hf_gpt2(directory, vocab_size=vocab, bos_token_id=0, eos_token_id=0)  # <|endoftext|> is id 0 here
    out = launch(["--hf_model", directory, "--dataset", "text", "--input_file", corpus, "--data_dir",
                  tmp_path / "data", "--seq_length", 16, "--batch_size", 2, "--max_steps", 1, "--eval_interval", 0,
                  "--eval_batches", 1, "--num_tokens", 6, "--run_name", "gpt2"], ranks=2, cwd=tmp_path,
                 env=offline_env(tmp_path))
    assert sample_of(out.stdout).startswith("ROMEO:")
    prepared = list((tmp_path / "data" / "corpus").iterdir())
    assert [p.name[:3] for p in prepared] == ["hf-"]  # tokenized with the directory's BPE, not tiktoken's
    assert TokenData(prepared[0]).tokenizer.eot_id == 0


@pytest.fixture
def llama3_dir(tmp_path):
    """A tiny random Llama 3.1: Llama 3's tiktoken-format tokenizer.model (Meta's 256 special tokens after
    ~350 ranks), rope theta 500000 with Llama 3.1's scaling, grouped-query attention."""
    directory, num_ranks = tokenizer_dirs.write_tiktoken(tmp_path / "llama3")
    theirs = hf_llama(directory, vocab_size=num_ranks + 256, max_position_embeddings=64, initializer_range=0.2,
                      rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=16),
                      bos_token_id=num_ranks, eos_token_id=num_ranks + 1)
    return directory, theirs, tk.load_tokenizer(directory)


@pytest.mark.slow
def test_llama3_trains_samples_exports_and_comes_back_offline(tmp_path, corpus, llama3_dir):
    directory, theirs, tokenizer = llama3_dir
    vocab = tokenizer.vocab_size
    assert tokenizer.kind == "tiktoken" and theirs.config.vocab_size == vocab
    assert_same_logits(ours_from(directory), theirs, vocab, 24)
    args = ["--hf_model", directory, "--dataset", "text", "--input_file", corpus, "--data_dir", tmp_path / "data",
            "--seq_length", 32, "--batch_size", 2, "--max_steps", 2, "--log_interval", 1, "--eval_interval", 0,
            "--eval_batches", 1, "--num_tokens", 8, "--run_name", "llama3"]
    out = launch(args, ranks=2, cwd=tmp_path, env=offline_env(tmp_path))
    sample = sample_of(out.stdout)
    assert sample.startswith("ROMEO:") and len(tokenizer.encode(sample)) >= len(tokenizer.encode("ROMEO:")) + 8 - 2
    # The first loss is transformers' on the same batches, tokenized by the tiktoken tokenizer.
    cfg = parse_args([str(a) for a in args])
    data = TokenData(dataset_dir(cfg, tokenizer))
    assert data.meta["tokenizer"] == "tiktoken"
    x, y = global_batch(data, 0, 2, 2, 32, cfg.seed)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(theirs(x).logits.reshape(-1, vocab), y.reshape(-1)).item()
    assert logged_losses(tmp_path, "llama3")[0] == pytest.approx(expected, abs=1e-4)

    # Export the trained checkpoint: transformers gives our logits and our token ids.
    saved = checkpoint_find.latest(tmp_path / "checkpoints" / "llama3")
    export.main([str(saved), str(tmp_path / "export"), "--format", "hf"])
    trained = MODELS["llama"](LlamaConfig(**checkpoint_meta.read_meta(saved)["model"])).eval()
    trained.load_state_dict(safe_load.load_full_model_state(saved))
    assert_same_logits(trained, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval(),
                       vocab, 24)
    auto_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    for text in tokenizer_dirs.MIXED:
        assert auto_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["eos_token_id"] == tokenizer.eot_id and exported["rope_parameters"]["rope_type"] == "llama3"

    # ... and --hf_model on the export trains and samples, offline.
    out = launch(["--hf_model", tmp_path / "export", *args[2:-2], "--run_name", "again"], ranks=2, cwd=tmp_path,
                 env=offline_env(tmp_path))
    assert sample_of(out.stdout).startswith("ROMEO:")
    assert logged_losses(tmp_path, "again")[0] < logged_losses(tmp_path, "llama3")[0]  # it starts trained


@pytest.mark.slow
def test_a_broken_hugging_face_directory_is_one_line_for_training_and_sampling(tmp_path):
    """Each of these was a traceback (and the weights' header a huge allocation attempt): one `error:` line naming
    the file and the field, exit 2, on every path that reads the directory."""
    config = GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32)
    model = MODELS["gpt"](config)
    init_weights(model, 0, torch.device("cpu"))
    good = hf_write.save_hf(model.state_dict(), {"model": config.to_dict(), "model_type": "gpt"}, tmp_path / "good",
                            tk.CharTokenizer("ROMEO:\nabcdefghijklmnopqrstuvwxyz .,JULIETKNGS"))
    (tmp_path / "corpus.txt").write_text(make_text(20_000))
    no_heads = json.dumps(dict(json.loads((good / "config.json").read_text()), n_head=0)).encode()
    broken = {"weights": ("model.safetensors", b"\xff" * 4096, "model.safetensors cannot be read as safetensors"),
              "tokenizer": ("tokenizer.json", b"[" * 100_000, "tokenizer.json nests deeper than 32 levels"),
              "heads": ("config.json", no_heads, "config.json: n_head is 0, not a whole number in [1, 4096]")}
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name, (file, content, problem) in broken.items():
        directory = shutil.copytree(good, tmp_path / name)
        (directory / file).write_bytes(content)
        if name == "weights":  # training: every rank reads the directory; one line, exit 2
            result = launch(["--hf_model", directory, "--dataset", "text", "--input_file", "corpus.txt", "--seq_length",
                             16, "--batch_size", 2, "--max_steps", 1, "--num_tokens", 0, "--run_name", name],
                            ranks=2, cwd=tmp_path, check=False, timeout=180)
        else:
            result = subprocess.run([sys.executable, "-m", "minimal_fsdp.sample", directory, "--num_tokens", "3"],
                                    cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert len(errors) == 1 and errors[0].startswith(f"error: --hf_model {directory}: {problem}"), errors
