"""--hf_model on 2 ranks, offline: training starts from the Hugging Face weights and tokenizer,
generation matches transformers' greedy decoding, a GPT-2 directory trains and samples with its own
tokenizer files, a Llama 3 (tiktoken tokenizer, rope scaling, GQA) trains, samples, exports and
comes back through --hf_model, and a broken directory is one line for training and sampling."""

import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.checkpoint import find, meta, safe_load
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.data import tokenizer as tk
from minimal_fsdp.data.prepare import dataset_dir
from minimal_fsdp.data.tokenizer import load_tokenizer, train_tokenizer
from minimal_fsdp.data.tokens import TokenData
from minimal_fsdp.hf import write
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.gpt import GPTConfig
from minimal_fsdp.models.llama import LlamaConfig
from minimal_fsdp.parallel.parallelize import init_weights

import tokenizer_dirs
from conftest import ROOT, global_batch, launch, launch_runs, make_text
from support import (
    LLAMA3_ROPE,
    assert_same_logits,
    command,
    hf_gpt2,
    hf_llama,
    logged_losses,
    ours_from,
    sample_of,
)

transformers = pytest.importorskip("transformers")


# -----------------------------------------------------------------------------
# --hf_model on 2 ranks

PROMPT = "KING:"


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """A tiny random Llama with its own sentencepiece tokenizer.model (300 pieces; 301 embedding
    rows, so the embedding and head split unevenly over 2 ranks), larger init so greedy decoding has
    no near-ties; then, on 2 ranks of one launch (tests/several_runs.py), a generation from it and a
    training run that starts from it (in that order: the generation finds no checkpoint of the
    training run)."""
    work = tmp_path_factory.mktemp("llama")
    corpus = work / "corpus.txt"
    corpus.write_text(make_text())
    tokenizer = train_tokenizer("sentencepiece", corpus.read_text(), 300, work / "sp")
    directory = work / "hf-llama"
    theirs = hf_llama(directory, vocab_size=301, max_position_embeddings=64, initializer_range=0.2)
    shutil.copy(work / "sp" / "tokenizer.model", directory)
    generate = [
        "--hf_model",
        directory,
        "--max_epochs",
        -1,
        "--prompt",
        PROMPT,
        "--num_tokens",
        12,
        "--temperature",
        0,
        "--sharding",
        "hybrid-full-shard",
        "--shard_group_size",
        2,
    ]
    train = [
        "--hf_model",
        directory,
        "--dataset",
        "text",
        "--input_file",
        corpus,
        "--data_dir",
        work / "data",
        "--seq_length",
        32,
        "--batch_size",
        2,
        "--max_steps",
        1,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--eval_batches",
        1,
        "--num_tokens",
        0,
        "--run_name",
        "run",
    ]
    out = launch_runs([generate, train], ranks=2, cwd=work)
    return SimpleNamespace(
        work=work, theirs=theirs, tokenizer=tokenizer, train=train, stdout=out.stdout
    )


@pytest.mark.slow
def test_training_starts_from_the_hf_weights_and_tokenizer(llama_runs):
    theirs, tokenizer, args = llama_runs.theirs, llama_runs.tokenizer, llama_runs.train
    # The first logged loss is that of the Hugging Face model on the first batches of both ranks.
    cfg = parse_args([str(a) for a in args])
    data = TokenData(dataset_dir(cfg, tokenizer))  # tokenized with the model's own tokenizer.model
    x, y = global_batch(data, 0, 2, 2, 32, cfg.seed)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            theirs(x).logits.reshape(-1, 301), y.reshape(-1)
        ).item()
    assert logged_losses(llama_runs.work, "run")[0] == pytest.approx(expected, abs=1e-4)
    saved = find.latest(llama_runs.work / "checkpoints" / "run")
    assert json.loads((saved / "meta.json").read_text())["model_type"] == "llama"
    # the tokenizer travels with it
    assert load_tokenizer(saved).model_proto == tokenizer.model_proto


@pytest.mark.slow
def test_generation_from_hf_model_matches_transformers_greedy(llama_runs):
    theirs, tokenizer = llama_runs.theirs, llama_runs.tokenizer
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(theirs(torch.tensor([ids])).logits[0, -1].argmax().item())
    assert sample_of(llama_runs.stdout) == tokenizer.decode(ids)


# -----------------------------------------------------------------------------
# offline, end to end: a GPT-2 directory with its own tokenizer files, and a Llama 3


def offline_env(tmp_path):
    """No hub, an empty tiktoken cache, and a proxy that refuses at once: nothing may be fetched."""
    refused = "http://127.0.0.1:9"
    return {
        "HF_HUB_OFFLINE": "1",
        "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-tiktoken-cache"),
        "HTTPS_PROXY": refused,
        "HTTP_PROXY": refused,
        "https_proxy": refused,
        "http_proxy": refused,
    }


@pytest.mark.slow
def test_gpt2_directory_trains_and_samples_offline_with_its_own_tokenizer(tmp_path, corpus):
    directory = tmp_path / "gpt2"
    tokenizer_dirs.write_vocab_merges(directory)  # the older hub layout: vocab.json + merges.txt
    vocab = len(json.loads((directory / "vocab.json").read_text()))
    # <|endoftext|> is id 0 here
    hf_gpt2(directory, vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    out = launch(
        [
            "--hf_model",
            directory,
            "--dataset",
            "text",
            "--input_file",
            corpus,
            "--data_dir",
            tmp_path / "data",
            "--seq_length",
            16,
            "--batch_size",
            2,
            "--max_steps",
            1,
            "--eval_interval",
            0,
            "--eval_batches",
            1,
            "--num_tokens",
            6,
            "--run_name",
            "gpt2",
        ],
        ranks=2,
        cwd=tmp_path,
        env=offline_env(tmp_path),
    )
    assert sample_of(out.stdout).startswith("ROMEO:")
    prepared = list((tmp_path / "data" / "corpus").iterdir())
    # tokenized with the directory's BPE, not tiktoken's
    assert [p.name[:3] for p in prepared] == ["hf-"]
    assert TokenData(prepared[0]).tokenizer.eot_id == 0


@pytest.fixture
def llama3_dir(tmp_path):
    """A tiny random Llama 3.1: Llama 3's tiktoken-format tokenizer.model (Meta's 256 special tokens
    after ~350 ranks), rope theta 500000 with Llama 3.1's scaling, grouped-query attention."""
    directory, num_ranks = tokenizer_dirs.write_tiktoken(tmp_path / "llama3")
    theirs = hf_llama(
        directory,
        vocab_size=num_ranks + 256,
        max_position_embeddings=64,
        initializer_range=0.2,
        rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=16),
        bos_token_id=num_ranks,
        eos_token_id=num_ranks + 1,
    )
    return directory, theirs, tk.load_tokenizer(directory)


@pytest.mark.slow
def test_llama3_trains_samples_exports_and_comes_back_offline(tmp_path, corpus, llama3_dir):
    directory, theirs, tokenizer = llama3_dir
    vocab = tokenizer.vocab_size
    assert tokenizer.kind == "tiktoken" and theirs.config.vocab_size == vocab
    assert_same_logits(ours_from(directory), theirs, vocab, 24)
    args = [
        "--hf_model",
        directory,
        "--dataset",
        "text",
        "--input_file",
        corpus,
        "--data_dir",
        tmp_path / "data",
        "--seq_length",
        32,
        "--batch_size",
        2,
        "--max_steps",
        2,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--eval_batches",
        1,
        "--num_tokens",
        8,
        "--run_name",
        "llama3",
    ]
    out = launch(args, ranks=2, cwd=tmp_path, env=offline_env(tmp_path))
    sample = sample_of(out.stdout)
    assert (
        sample.startswith("ROMEO:")
        and len(tokenizer.encode(sample)) >= len(tokenizer.encode("ROMEO:")) + 8 - 2
    )
    # The first loss is transformers' on the same batches, tokenized by the tiktoken tokenizer.
    cfg = parse_args([str(a) for a in args])
    data = TokenData(dataset_dir(cfg, tokenizer))
    assert data.meta["tokenizer"] == "tiktoken"
    x, y = global_batch(data, 0, 2, 2, 32, cfg.seed)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(
            theirs(x).logits.reshape(-1, vocab), y.reshape(-1)
        ).item()
    assert logged_losses(tmp_path, "llama3")[0] == pytest.approx(expected, abs=1e-4)

    # Export the trained checkpoint: transformers gives our logits and our token ids.
    saved = find.latest(tmp_path / "checkpoints" / "llama3")
    command("export", *[str(saved), str(tmp_path / "export"), "--format", "hf"])
    trained = MODELS["llama"](LlamaConfig(**meta.read_meta(saved)["model"])).eval()
    trained.load_state_dict(safe_load.load_full_model_state(saved))
    assert_same_logits(
        trained,
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval(),
        vocab,
        24,
    )
    auto_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    for text in tokenizer_dirs.MIXED:
        assert auto_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (
        exported["eos_token_id"] == tokenizer.eot_id
        and exported["rope_parameters"]["rope_type"] == "llama3"
    )

    # ... and --hf_model on the export trains and samples, offline.
    out = launch(
        ["--hf_model", tmp_path / "export", *args[2:-2], "--run_name", "again"],
        ranks=2,
        cwd=tmp_path,
        env=offline_env(tmp_path),
    )
    assert sample_of(out.stdout).startswith("ROMEO:")
    # it starts trained
    assert logged_losses(tmp_path, "again")[0] < logged_losses(tmp_path, "llama3")[0]


@pytest.mark.slow
def test_a_broken_hugging_face_directory_is_one_line_for_training_and_sampling(tmp_path):
    """Each of these was a traceback (and the weights' header a huge allocation attempt): one
    `error:` line naming the file and the field, exit 2, on every path that reads the directory."""
    config = GPTConfig(vocab_size=53, seq_length=24, num_layers=2, num_heads=4, embed_size=32)
    model = MODELS["gpt"](config)
    init_weights(model, 0, torch.device("cpu"))
    good = write.save_hf(
        model.state_dict(),
        {"model": config.to_dict(), "model_type": "gpt"},
        tmp_path / "good",
        tk.CharTokenizer("ROMEO:\nabcdefghijklmnopqrstuvwxyz .,JULIETKNGS"),
    )
    (tmp_path / "corpus.txt").write_text(make_text(20_000))
    no_heads = json.dumps(dict(json.loads((good / "config.json").read_text()), n_head=0)).encode()
    broken = {
        "weights": (
            "model.safetensors",
            b"\xff" * 4096,
            "model.safetensors cannot be read as safetensors",
        ),
        "tokenizer": (
            "tokenizer.json",
            b"[" * 100_000,
            "tokenizer.json nests deeper than 32 levels",
        ),
        "heads": (
            "config.json",
            no_heads,
            "config.json: n_head is 0, not a whole number in [1, 4096]",
        ),
    }
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name, (file, content, problem) in broken.items():
        directory = shutil.copytree(good, tmp_path / name)
        (directory / file).write_bytes(content)
        if name == "weights":  # training: every rank reads the directory; one line, exit 2
            result = launch(
                [
                    "--hf_model",
                    directory,
                    "--dataset",
                    "text",
                    "--input_file",
                    "corpus.txt",
                    "--seq_length",
                    16,
                    "--batch_size",
                    2,
                    "--max_steps",
                    1,
                    "--num_tokens",
                    0,
                    "--run_name",
                    name,
                ],
                ranks=2,
                cwd=tmp_path,
                check=False,
                timeout=180,
            )
        else:
            result = subprocess.run(
                [sys.executable, "-m", "minimal_fsdp", "sample", directory, "--num_tokens", "3"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=180,
                env=env,
            )
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert len(errors) == 1 and errors[0].startswith(
            f"error: --hf_model {directory}: {problem}"
        ), errors
