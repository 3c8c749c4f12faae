"""checkpoint.py: what a save writes, what survives damage, what a resume picks, and that loading runs no code."""
import dataclasses
import json
import os
import pickle
import random
import shutil
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import TINY_MODEL, launch, make_text
from faults import launch_with_faults
from minimal_fsdp import checkpoint, checkpoint_find, checkpoint_meta, safe_load
from minimal_fsdp.config import ConfigError, parse_args
from minimal_fsdp.environment import DistEnv
from minimal_fsdp.model import GPT, GPTConfig
from minimal_fsdp.parallelize import build_model, gradient_sync
from minimal_fsdp.plan import make_plan
from minimal_fsdp import metrics, train as train_module
from minimal_fsdp.train import build_optimizer


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_with_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        safe_load.load_full_model_state(ckpt)
    assert not (tmp_path / "pwned").exists()


def train_args(corpus, work, *extra):
    return ["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--max_steps", 4, "--checkpoint_interval", 2,
            "--eval_interval", 0, "--log_interval", 1, "--checkpoint_dir", work / "checkpoints", "--log_dir",
            work / "logs", *extra]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A 2-rank, 4-step run that saves at steps 2 and 4."""
    work = tmp_path_factory.mktemp("four_steps")
    corpus = work / "corpus.txt"
    corpus.write_text(make_text())
    launch(train_args(corpus, work), ranks=2, cwd=work)
    return work, corpus


def all_tensors(path):
    """Every tensor of a checkpoint (model weights, optimizer moments and step counts), read in this process."""
    return safe_load.read_tensors(path, [name for name, _, _ in safe_load.tensor_names(path, "")], "")


def test_save_writes_complete_checkpoint_and_latest(four_steps):
    work, _ = four_steps
    run = work / "checkpoints" / "shakespeare"
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_2", "step_4"]  # no temporary leftovers
    assert checkpoint_find.latest(run) == run / "step_4"
    meta = checkpoint_meta.read_meta(run / "step_4")
    assert meta["format"] == 2 and json.loads((run / "step_4" / "meta.json").read_text())["format"] == 2
    assert meta["step"] == 4 and meta["model"]["num_layers"] == 2 and meta["config"]["max_steps"] == 4
    assert meta["world_size"] == 2 and meta["state"]["schedule"] == {"lr_decay_steps": 4, "last_step": 4}
    assert meta["state"]["data"] == {"train_blocks_seen": 4 * 2 * 4}  # steps x ranks x batch
    assert {"rng_0.pt", "rng_1.pt"} <= {p.name for p in (run / "step_4").iterdir()}
    assert (run / "step_4" / "tokenizer.json").exists()
    state = safe_load.load_full_model_state(run / "step_4")
    assert state["wte.weight"].shape == (meta["model"]["vocab_size"], 32)


@pytest.mark.slow
def test_resume_restores_weights_moments_step_and_data_position(four_steps):
    """A run whose newest checkpoint is step_2 resumes from it: the live model and optimizer equal the files
    right after loading, and its step_4 equals the uninterrupted run's bitwise, in every weight, Adam moment
    and step count (so steps 3 and 4 also read the same batches)."""
    work, corpus = four_steps
    whole, resumed = work / "checkpoints" / "shakespeare", work / "resumed" / "checkpoints" / "shakespeare"
    resumed.mkdir(parents=True)
    shutil.copytree(whole / "step_2", resumed / "step_2")
    (resumed / "latest").write_text("step_2\n")
    report = work / "load.json"
    out = launch_with_faults(train_args(corpus, work / "resumed"), cwd=work, check_load=report)
    assert "resuming from" in out.stdout and "step_2" in out.stdout
    verdict = json.loads(report.read_text())
    assert verdict["checked"] > 50 and verdict["only_live"] == verdict["only_saved"] == verdict["different"] == []

    expected, got = all_tensors(whole / "step_4"), all_tensors(resumed / "step_4")
    assert expected.keys() == got.keys() and any(k.endswith("exp_avg_sq") for k in got)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert all(got[k].item() == 4 for k in got if k.endswith(".step"))
    for key in ("step", "state"):
        read = checkpoint_meta.read_meta
        assert read(resumed / "step_4")[key] == read(whole / "step_4")[key], key
    logged = (work / "resumed" / "logs" / "shakespeare" / "metrics.jsonl").read_text().splitlines()
    assert [row["step"] for row in map(json.loads, logged) if "loss" in row] == [3, 4]


ONE_RANK_MODEL = GPTConfig(vocab_size=16, seq_length=8, num_layers=1, num_heads=2, embed_size=8)


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank process group in this process and a tiny sharded model: enough to save, damage and load."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    cfg = parse_args([])
    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    plan = make_plan(cfg, env, ONE_RANK_MODEL, fsdp_on_one_rank=True)
    model = build_model(GPT, ONE_RANK_MODEL, plan, env, cfg.seed)
    yield model, build_optimizer(model, cfg, plan)
    dist.destroy_process_group()


def save_steps(run, model, optimizer, val_losses, keep_last=0):
    meta = {"format": 2, "model_type": "gpt", "model": model.config.to_dict(), "config": {},
            "state": {"schedule": {}, "data": {"train_blocks_seen": 0}}}
    for step, val_loss in enumerate(val_losses, start=1):
        checkpoint.save(run, step, model, optimizer, dict(meta, val_loss=val_loss), keep_last=keep_last)


def test_keep_last_prunes_older_checkpoints_but_spares_best(one_rank, tmp_path):
    run = tmp_path / "run"
    save_steps(run, *one_rank, [3.0, 2.0, 2.5, None, 2.7], keep_last=2)
    assert sorted(p.name for p in run.iterdir()) == ["best", "latest", "step_2", "step_4", "step_5"]
    assert (run / "latest").read_text().strip() == "step_5" and (run / "best").read_text().strip() == "step_2"
    assert checkpoint_find.resolve(run / "best") == run / "step_2"
    assert checkpoint_find.find(parse_args(["--restart_checkpoint_file", str(run / "best")])) == run / "step_2"


def test_damaged_checkpoints_are_reported_in_one_line_and_skipped(one_rank, tmp_path, capsys):
    run = tmp_path / "run"
    save_steps(run, *one_rank, [None] * 5)
    (run / ".tmp-step_6").mkdir()  # a save that died before its rename
    (run / ".tmp-step_6" / "__0_0.distcp").write_bytes(b"half")
    rng = run / "step_5" / "rng_0.pt"
    rng.write_bytes(rng.read_bytes()[:1000])
    shard = run / "step_4" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    metadata = run / "step_3" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:50])
    (run / "step_2" / "meta.json").write_text('{"step": 2, "mod')
    capsys.readouterr()
    cfg = parse_args(["--checkpoint_dir", str(tmp_path), "--run_name", "run"])
    assert checkpoint_find.find(cfg) == run / "step_1"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    assert "step_5: rng_0.pt is missing or unreadable" in lines[0]
    assert "step_4: __0_0.distcp is truncated (100 of" in lines[1]
    assert "step_3: .metadata is missing or unreadable" in lines[2]
    assert "step_2: meta.json is not JSON" in lines[3]
    with pytest.raises(ConfigError, match="--restart_checkpoint_file .*step_4 is not a complete checkpoint"):
        checkpoint_find.find(parse_args(["--restart_checkpoint_file", str(run / "step_4")]))


def test_rng_states_come_back(one_rank, tmp_path):
    run = tmp_path / "run"
    save_steps(run, *one_rank, [None])
    expected = (torch.rand(4), np.random.rand(4), random.random())
    assert checkpoint.restore_rng(run / "step_1", rank=0, world_size=1, seed=0)
    again = (torch.rand(4), np.random.rand(4), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]
    # Written by one rank, resumed on two: no stream is "this rank's", so reseed rather than replay.
    assert not checkpoint.restore_rng(run / "step_1", rank=0, world_size=2, seed=0)
    assert not torch.equal(torch.rand(4), expected[0])


def test_resume_never_refuses_a_run_that_has_checkpoints(tmp_path):
    args = ["--checkpoint_dir", str(tmp_path), "--run_name", "run", "--resume", "never"]
    assert checkpoint_find.find(parse_args(args)) is None
    (tmp_path / "run" / "step_3").mkdir(parents=True)
    with pytest.raises(ConfigError, match="--resume never, but .*run already holds checkpoints"):
        checkpoint_find.find(parse_args(args))


class RandomTokens:
    """Random tokens for training, with the data interface of data.TokenData."""
    directory = None

    def steps_per_epoch(self):
        return 1000

    def train_batches(self, step):
        tokens = torch.randint(16, (2, 9), generator=torch.Generator().manual_seed(step))
        return [(tokens[:, :-1], tokens[:, 1:])]

    def state_dict(self, step):
        return {}


def test_logged_throughput_leaves_out_evaluation_and_saving(one_rank, tmp_path, monkeypatch):
    """On a fake clock where a training step takes 1 s, an evaluation 100 s and a save 10 s, every logged
    step time is 1 s: the evaluations and saves inside each logging window are left out."""
    model, optimizer = one_rank
    clock = [0.0]

    def advance(seconds, then):
        def run(*args, **kwargs):
            clock[0] += seconds
            return then(*args, **kwargs)
        return run

    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(train_module, "train_step", advance(1.0, train_module.train_step))
    monkeypatch.setattr(train_module, "evaluate", advance(100.0, lambda *args: 1.0))
    saver = SimpleNamespace(save=advance(10.0, lambda *args: None), saving=nullcontext, poll=lambda: None,
                            wait=lambda: None, reports=lambda: [], restore_s=None)  # synchronous saves
    cfg = dataclasses.replace(parse_args(["--max_steps", "6", "--eval_interval", "1", "--log_interval", "2",
                                          "--checkpoint_interval", "3", "--batch_size", "2",
                                          "--log_dir", str(tmp_path / "logs")]), tensorboard=False)
    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    plan = make_plan(cfg, env, ONE_RANK_MODEL, fsdp_on_one_rank=True)
    stop = SimpleNamespace(agreed=lambda step=None: None, due=lambda step: False)
    parts = train_module.RunParts(model, optimizer, RandomTokens(), gradient_sync(model, plan), saver, ranks=1)
    train_module.train(parts, cfg, env, plan, stop)
    rows = [json.loads(line) for line in (tmp_path / "logs" / cfg.run_name / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "step_time" in r]
    assert [r["step"] for r in timed] == [2, 4, 6]
    assert [r["step_time"] for r in timed] == [1.0, 1.0, 1.0]
    assert [r["tokens_per_s"] for r in timed] == [2 * 8] * 3  # batch 2 x seq 8 tokens per 1-s step
