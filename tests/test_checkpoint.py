import os
import pickle

import pytest

from conftest import TINY_MODEL, launch
from minimal_fsdp import checkpoint


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_with_code_is_refused_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        checkpoint.load_full_model_state(ckpt)
    assert not (tmp_path / "pwned").exists()


def test_save_writes_complete_checkpoint_and_latest(tmp_path, corpus):
    launch(["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--max_steps", 4, "--checkpoint_interval", 2,
            "--eval_interval", 0], ranks=2, cwd=tmp_path)
    run = tmp_path / "checkpoints" / "shakespeare"
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step_2", "step_4"]  # no temporary leftovers
    assert checkpoint.latest(run) == run / "step_4"
    meta = checkpoint.read_meta(run / "step_4")
    assert meta["step"] == 4 and meta["model"]["num_layers"] == 2 and meta["config"]["max_steps"] == 4
    assert (run / "step_4" / "tokenizer.json").exists()
    state = checkpoint.load_full_model_state(run / "step_4")
    assert state["wte.weight"].shape == (meta["model"]["vocab_size"], 32)


def test_resume_continues_from_latest(tmp_path, corpus):
    args = ["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--eval_interval", 0, "--log_interval", 1]
    launch([*args, "--max_steps", 3], ranks=2, cwd=tmp_path)
    out = launch([*args, "--max_steps", 5], ranks=2, cwd=tmp_path)
    assert "resuming from" in out.stdout
    steps = [line for line in (tmp_path / "logs" / "shakespeare" / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert [int(s.split('"step": ')[1].split(",")[0]) for s in steps] == [1, 2, 3, 4, 5]
