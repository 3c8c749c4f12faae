"""minimal-fsdp sample on each kind of SOURCE: a checkpoint (step directory, run directory, `best`
marker), both export formats, and a Hugging Face directory. Greedy text equals a plain
single-process PyTorch decode of the checkpoint (and transformers' for the Hugging Face model); the
same weights give the same text from every source and on 2 ranks; the banner shows the model and
tokenizer actually loaded."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.checkpoint import find, meta, safe_load
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.models.llama import Llama, LlamaConfig

import tokenizer_dirs
from conftest import ROOT, TINY_MODEL, launch, make_text, mpiexec
from support import command

PROMPT = "KING:"
GREEDY = ["--prompt", PROMPT, "--num_tokens", "10", "--temperature", "0"]


def sample(source, *args, ranks=None, check=True, cwd=None):
    """Run the sample command (under mpiexec when ranks is given); returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "minimal_fsdp", "sample", str(source), *map(str, args)]
    if ranks:
        cmd = [mpiexec(), "-n", str(ranks), *cmd]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
        )
    return result


@pytest.fixture
def sample_here(single_process, capfd, monkeypatch):
    """The sample command's main in this process (a world of one rank, as `minimal-fsdp sample`
    without mpiexec): what it prints to stdout and stderr, without starting Python and torch
    again."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def sample_in_this_process(source, *args):
        capfd.readouterr()
        command("sample", *[str(source), *map(str, args)])
        out, err = capfd.readouterr()
        return SimpleNamespace(stdout=out, stderr=err)

    return sample_in_this_process


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Llama with a sentencepiece tokenizer, trained on 2 ranks: checkpoints at steps 10 and
    20."""
    work = tmp_path_factory.mktemp("sample")
    (work / "corpus.txt").write_text(make_text())
    launch(
        [
            "--dataset",
            "text",
            "--input_file",
            "corpus.txt",
            *TINY_MODEL,
            "--model",
            "llama",
            "--num_kv_heads",
            1,
            "--tokenizer",
            "sentencepiece",
            "--vocab_size",
            300,
            "--max_steps",
            20,
            "--checkpoint_interval",
            10,
            "--eval_interval",
            0,
        ],
        ranks=2,
        cwd=work,
    )
    return work / "checkpoints" / "corpus"


@torch.no_grad()
def plain_greedy(step, prompt, num_tokens):
    """Reference: the checkpoint's weights in a plain module, the whole context re-run for every
    token."""
    model = Llama(LlamaConfig(**meta.read_meta(step)["model"])).eval()
    model.load_state_dict(safe_load.load_full_model_state(step))
    tokenizer = load_tokenizer(step)
    ids = tokenizer.encode(prompt)
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids]))[0]
        top = torch.topk(logits, 2).values
        assert top[0] - top[1] > 1e-4, "a near-tie: greedy decoding is not well defined here"
        ids.append(logits.argmax().item())
    return tokenizer.decode(ids)


@pytest.mark.slow
def test_checkpoint_sources_match_a_plain_decode(run, sample_here):
    step = find.latest(run)
    expected = plain_greedy(step, PROMPT, 10)
    out = sample(step, *GREEDY)  # the command as typed: `minimal-fsdp sample`
    assert out.stdout == expected + "\n"
    # the banner (stderr) shows what was loaded, not defaults: a 2-layer Llama with its
    # sentencepiece tokenizer
    assert f"generating from {step} (checkpoint, step 20)" in out.stderr
    assert "model: llama, 2 layers, 2 heads (1 kv), width 32, context 32, vocab 300" in out.stderr
    assert "tokenizer: sentencepiece, 300 tokens" in out.stderr
    # The other sources through the same main, in this process: no Python and torch to start again.
    assert sample_here(run, *GREEDY).stdout == out.stdout  # a run directory: its newest checkpoint
    best = find.resolve(run / "best")
    by_marker = sample_here(run / "best", *GREEDY)
    assert (
        by_marker.stdout == plain_greedy(best, PROMPT, 10) + "\n"
        and f"generating from {best}" in by_marker.stderr
    )


@pytest.mark.slow
def test_exports_give_the_checkpoint_text_also_sharded_over_two_ranks(run, tmp_path, sample_here):
    step = find.latest(run)
    # One rank's samples in this process (sample_here); the 2 ranks' under mpiexec.
    # sampled, not greedy
    expected = sample_here(step, *GREEDY, "--seed", 5, "--temperature", 0.9).stdout
    assert expected.startswith(PROMPT)
    command("export", *[str(step), str(tmp_path / "ours")])
    command("export", *[str(step), str(tmp_path / "hf"), "--format", "hf"])
    out = sample_here(tmp_path / "ours", *GREEDY, "--seed", 5, "--temperature", 0.9)
    assert out.stdout == expected and "(export)" in out.stderr
    out = sample_here(tmp_path / "hf", *GREEDY, "--seed", 5, "--temperature", 0.9)
    assert out.stdout == expected and "(Hugging Face model)" in out.stderr
    # each rank reads only its shard of our export (torch's Hugging Face storage reader)
    out = sample(tmp_path / "ours", *GREEDY, "--seed", 5, "--temperature", 0.9, ranks=2)
    assert out.stdout == expected and "on 2 rank(s)" in out.stderr


@pytest.mark.slow
def test_hugging_face_directory_matches_transformers_greedy(tmp_path, sample_here):
    from support import hf_llama

    directory, num_ranks = tokenizer_dirs.write_tiktoken(tmp_path / "llama3")
    theirs = hf_llama(
        directory, vocab_size=num_ranks + 256, max_position_embeddings=64, initializer_range=0.2
    )
    tokenizer = load_tokenizer(directory)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        for _ in range(10):
            ids.append(theirs(torch.tensor([ids])).logits[0, -1].argmax().item())
    out = sample_here(directory, *GREEDY)
    assert out.stdout == tokenizer.decode(ids) + "\n"
    assert f"tokenizer: tiktoken, {num_ranks + 256} tokens" in out.stderr


@pytest.mark.slow
def test_generation_banner_of_basic_training_shows_the_loaded_model(
    run, single_process, monkeypatch, capfd
):
    # `minimal-fsdp train` (what basic_training.py runs) in this process, one rank, in the run's
    # directory
    monkeypatch.chdir(run.parent.parent)
    capfd.readouterr()
    command(
        "train",
        *["--run_name", "corpus", "--max_epochs", "-1", "--num_tokens", "5", "--prompt", PROMPT],
    )
    out = capfd.readouterr().out
    assert "model: llama, 2 layers, 2 heads (1 kv), width 32, context 32, vocab 300" in out
    assert "tokenizer: sentencepiece, 300 tokens" in out
    assert 'model_preset = "tiny"' not in out and 'tokenizer = "char"' not in out


@pytest.mark.slow
def test_a_source_that_is_none_of_them_is_one_line(tmp_path):
    (tmp_path / "notes.d").mkdir()
    out = sample(tmp_path / "notes.d", check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'notes.d'} is not a checkpoint (a step_<N> "
        "directory, a run directory or its latest/best marker), an export, "
        "or a Hugging Face model directory (config.json + weights)"
    ]
