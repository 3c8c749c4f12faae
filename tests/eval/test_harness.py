"""eval/harness.py and the backend's manners: the training loop reaches no command module; the
shipped tasks in configs/eval load without the harness's warnings; in a redirected log progress is
plain lines, not bars; the token before a text scored whole is BOS, else EOS, else a newline (a char
model's), and said once."""

import ast
import logging

import pytest
import torch

from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.data.tokenizer import CharTokenizer

from conftest import ROOT

lm_eval = pytest.importorskip("lm_eval")

PACKAGE = ROOT / "minimal_fsdp"
TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]


def module_file(name):
    path = PACKAGE.joinpath(*name.split(".")[1:])
    return (
        path.with_suffix(".py")
        if path.with_suffix(".py").exists()
        else path / "__init__.py"
        if path.is_dir()
        else None
    )


def package_imports(path):
    """The package's modules that `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("minimal_fsdp")
        ):
            found |= {
                f"{node.module}.{a.name}" if module_file(f"{node.module}.{a.name}") else node.module
                for a in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("minimal_fsdp.")}
    return found


def test_the_training_loop_imports_no_command_module():
    """A command module (one with a main: evaluate, sample, export, run, ...) is where flags are
    parsed and a process is ended; training reaches none of them, however indirectly."""
    seen, todo = set(), ["minimal_fsdp.train"]
    while todo:
        name = todo.pop()
        if name not in seen and module_file(name):
            seen.add(name)
            todo += package_imports(module_file(name))
    assert "minimal_fsdp.eval.harness" in seen, (
        "the import reader found nothing: it no longer reads the imports"
    )
    commands = sorted(name for name in seen if "\ndef main(" in module_file(name).read_text())
    assert not commands


def test_the_shipped_tasks_load_without_warnings_and_draw_no_bars_into_a_log(monkeypatch, capsys):
    from minimal_fsdp.eval import harness

    monkeypatch.chdir(ROOT)
    for name, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    logger = logging.getLogger("lm_eval")
    logger.addHandler(handler)
    try:
        harness.harness()  # stderr here is pytest's capture, not a terminal
        _, tasks = harness.load_tasks(TASKS, str(ROOT / "configs" / "eval"))
        assert len(tasks) == 3
        capsys.readouterr()
        for task in tasks:
            task.build_all_requests(limit=2, rank=0, world_size=1)
    finally:
        logger.removeHandler(handler)
    assert not [
        message for message in warned if "is defined, but" in message
    ]  # 12 before: none now
    err = capsys.readouterr().err
    assert "\r" not in err and "it/s" not in err


class NoSpecialTokens:
    kind, eot_id, bos_id, vocab_size = "test", None, None, 50

    def encode(self, text):
        raise ConfigError("character '\\n' is not in the vocabulary")

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def tiny_gpt():
    from minimal_fsdp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, seq_length=16, num_layers=1, num_heads=2, embed_size=16))


def test_a_char_model_is_scored_after_its_newline(one_rank_group, capsys):
    from minimal_fsdp.eval.lm import ShardedLM

    tokenizer = CharTokenizer("abc \nxyz")  # no BOS, no EOS: before, the backend refused it
    lm = ShardedLM(tiny_gpt(), tokenizer, torch.device("cpu"))
    assert (
        lm.prefix_token_id == tokenizer.encode("\n")[0] and lm.prefix_token_id == lm.prefix_token_id
    )
    err = capsys.readouterr().err
    assert (
        err.count("prefix token") == 1
        and "'\\n'" in err
        and "no begin- or end-of-text token" in err
    )
    (score,) = lm.loglikelihood_rolling([type("R", (), {"args": ("abc xyz",)})()])
    assert score < 0


def test_without_bos_eos_or_newline_only_whole_text_scoring_is_refused(one_rank_group):
    from minimal_fsdp.eval.lm import ShardedLM

    lm = ShardedLM(tiny_gpt(), NoSpecialTokens(), torch.device("cpu"))
    assert lm.score([([1, 2, 3], 2)])  # a context given: scored
    with pytest.raises(ConfigError, match="no begin-of-text, end-of-text or newline token"):
        lm.prefix_token_id


def test_progress_in_a_redirected_log_is_plain_lines(one_rank_group, capsys):
    from minimal_fsdp.eval.lm import ShardedLM

    lm = ShardedLM(tiny_gpt(), NoSpecialTokens(), torch.device("cpu"), batch_size=1)
    capsys.readouterr()
    lm.score([([1, 2, 3, 4], 2)] * 20, disable_tqdm=False)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[-1] == "loglikelihood batches: 20/20" and 5 <= len(lines) <= 11
    assert all(line.startswith("loglikelihood batches: ") for line in lines)


def test_rolling_perplexity_sums_every_token_once_in_disjoint_context_windows(one_rank_group):
    """loglikelihood_rolling of a text two contexts long (32 tokens, context 16) against the sum
    written out here: the prefix token then tokens 0-14 predict tokens 0-15, tokens 15-30 predict
    tokens 16-31; every token counted once."""
    from minimal_fsdp.eval.lm import ShardedLM

    tokenizer = CharTokenizer("abc \nxyz")
    model = tiny_gpt()
    lm = ShardedLM(model, tokenizer, torch.device("cpu"), progress=False)
    text = "abc xyz zyx cba " * 2
    (score,) = lm.loglikelihood_rolling([type("R", (), {"args": (text,)})()])
    full = [lm.prefix_token_id, *tokenizer.encode(text)]
    expected = 0.0
    with torch.no_grad():
        for start in (0, 16):
            inputs, targets = full[start : start + 16], full[start + 1 : start + 17]
            logits = model.trunk(torch.tensor([inputs])) @ model.wte.weight.T
            picked = logits[0].log_softmax(-1).gather(-1, torch.tensor(targets)[:, None])
            expected += picked.sum().item()
    assert score == pytest.approx(expected, rel=1e-5)
