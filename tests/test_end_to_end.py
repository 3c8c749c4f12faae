"""The README's commands, shrunk: train with mpiexec, print a sample, then generate alone on 1 and 4
ranks. Every sample is checked against sampling written plainly in one process from the saved
checkpoint. And the README's quick start walked command by command, in order, in a fresh copy of the
repository."""

import os
import re

import pytest
import torch

from minimal_fsdp.checkpoint import find, meta, safe_load
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.data.tokenizer import load_tokenizer
from minimal_fsdp.models.gpt import GPT, GPTConfig

from conftest import ROOT, TINY_MODEL, launch, launch_runs, make_text
from support import sample_of, sample_of_each


@torch.no_grad()
def plain_sample(run_dir, prompt, num_tokens, seed):
    """The run's newest checkpoint sampled in one process, without a KV cache: each token from a
    full forward over the context (cut to its newer half once it outgrows the model's seq_length),
    the default temperature and top-k, and a generator seeded with `seed`."""
    path = find.latest(run_dir)
    model = GPT(GPTConfig(**meta.read_meta(path)["model"])).eval()
    model.load_state_dict(safe_load.load_full_model_state(path))
    defaults = parse_args([])
    tokenizer = load_tokenizer(path)
    generator = torch.Generator().manual_seed(seed)
    seq = model.config.seq_length
    out = tokenizer.encode(prompt)
    context = out[-seq:]
    for _ in range(num_tokens):
        if len(context) > seq:
            context = context[-(seq // 2) :]
        logits = model(torch.tensor([context])) / defaults.temperature  # the last position's
        # k-th most likely
        kth = torch.topk(logits, min(defaults.top_k, logits.size(-1))).values[..., -1, None]
        probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        token = torch.multinomial(probs, 1, generator=generator).item()
        out.append(token)
        context.append(token)
    return tokenizer.decode(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The README's training command as a user types it, shrunk: 2 ranks, 40 steps, a sample at the
    end."""
    work = tmp_path_factory.mktemp("end_to_end")
    corpus = work / "corpus.txt"
    corpus.write_text(make_text())
    out = launch(
        [
            "--dataset",
            "text",
            "--input_file",
            corpus,
            "--prompt",
            "ROMEO:",
            "--seed",
            7,
            *TINY_MODEL,
            "--max_steps",
            40,
            "--num_tokens",
            60,
            "--eval_interval",
            20,
        ],
        ranks=2,
        cwd=work,
    )
    return work, out


@pytest.mark.slow
def test_train_then_generate_on_any_number_of_ranks(trained):
    work, out = trained
    run = work / "checkpoints" / "corpus"
    assert (run / "latest").read_text().strip() == "step_40"
    # the trained model, in memory
    assert sample_of(out.stdout) == plain_sample(run, "ROMEO:", 60, seed=7)
    # Generation-only reads the model shape from the checkpoint: no model flags are repeated.
    gen = [
        "--run_name",
        "corpus",
        "--max_epochs",
        -1,
        "--prompt",
        "ROMEO:",
        "--num_tokens",
        80,
        "--seed",
        3,
    ]
    one = sample_of(launch(gen, ranks=1, cwd=work).stdout)  # the README's command, on one rank
    # The same on 4 ranks, sharded then hybrid, and another seed: one after the other in one launch.
    four, hybrid, other_seed = sample_of_each(
        launch_runs(
            [
                gen,
                [*gen, "--sharding", "hybrid-grad-shard", "--shard_group_size", 2],
                [*gen[:-1], 4],
            ],
            ranks=4,
            cwd=work,
        ).stdout
    )
    assert one == plain_sample(run, "ROMEO:", 80, seed=3)  # 80 tokens through a 32-token context
    assert one == four == hybrid
    assert other_seed != one


@pytest.mark.slow
def test_generation_past_the_context_refills_the_cache(trained):
    work, _ = trained
    out = launch(
        ["--run_name", "corpus", "--max_epochs", -1, "--num_tokens", 100, "--prompt", "KING:"],
        ranks=2,
        cwd=work,
    )
    sample = sample_of(out.stdout)
    assert len(sample) == len("KING:") + 100  # char tokenizer: one char per token
    assert sample == plain_sample(
        work / "checkpoints" / "corpus", "KING:", 100, seed=parse_args([]).seed
    )


# Beyond any step a run reaches: at a tiny model's ~10 ms a step, a look STOP_LATENCY (10 s) on can
# land 1000 steps on.
FAR = 10**9


@pytest.mark.slow
def test_ctrl_c_under_mpiexec_saves_a_checkpoint_and_exits_0(tmp_path, corpus):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group: mpiexec and every
    rank. The run stops as for SIGTERM: a checkpoint, one line, exit 0, no traceback. Logging and
    checkpoint steps are out of reach (FAR), so the stop comes from the looks bounded in time
    (resilience.STOP_LATENCY), however fast the steps."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, mpiexec

    cmd = [
        mpiexec(),
        "-n",
        "2",
        sys.executable,
        str(ROOT / "basic_training.py"),
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--max_steps",
        FAR,
        "--log_interval",
        FAR,
        "--checkpoint_interval",
        FAR,
        "--eval_interval",
        "2",
        "--eval_batches",
        "1",
        "--no-tensorboard",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        run = subprocess.Popen(
            list(map(str, cmd)),
            cwd=tmp_path,
            stdout=out,
            stderr=err,
            env=env,
            start_new_session=True,
        )  # its own process group, as a terminal's job
        try:
            metrics = tmp_path / "logs" / "corpus" / "metrics.jsonl"
            deadline = time.monotonic() + 240  # a hang guard only
            # the loop is running
            while not (metrics.exists() and "val_loss" in metrics.read_text()):
                assert run.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "err"
                ).read_text()[-3000:]
                time.sleep(0.2)
            os.killpg(run.pid, signal.SIGINT)
            assert run.wait(timeout=240) == 0, (tmp_path / "err").read_text()[-3000:]
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    stdout, stderr = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    # after a Ctrl-C a rank's stdout (a pipe to mpiexec) follows its stderr: resilience.py says why
    stopped = [
        line
        for line in (stdout + stderr).splitlines()
        if "SIGINT received; saved a checkpoint" in line
    ]
    assert len(stopped) == 1 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    step = int(stopped[0].split(":")[0].split()[1])
    assert 2 <= step < FAR  # a time-bounded look, not a logging step
    assert meta.read_meta(find.latest(tmp_path / "checkpoints" / "corpus"))["step"] == step


@pytest.mark.slow
def test_a_run_prints_no_deprecation_noise_and_imports_torchao_only_for_fp8(tmp_path, corpus):
    """torchao, when imported, prints 'Failed to load ...so' lines and torch's _pytree deprecation
    warnings; a run that does not ask for --precision fp8 must not import it, and our own start
    prints no such warning."""
    from conftest import ROOT

    wrapper = tmp_path / "modules.py"
    wrapper.write_text(
        "import runpy, sys\n"
        f"sys.argv[0] = {str(ROOT / 'basic_training.py')!r}\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        # one write of the whole line: the ranks share the job's stdout, where print's separate
        # writes of "imported:" and the list interleaved
        "finally:\n    found = sorted(m for m in ('torchao', 'transformers') if m in sys.modules)\n"
        "    sys.stdout.write(f'imported: {found}\\n'); sys.stdout.flush()\n"
    )
    result = launch(
        ["--input_file", corpus, *TINY_MODEL, "--max_steps", 2, "--num_tokens", 5],
        ranks=2,
        cwd=tmp_path,
        entry=wrapper,
    )
    assert result.stdout.count("imported: []") == 2
    assert "Deprecat" not in result.stderr and "Failed to load" not in result.stderr, result.stderr[
        -3000:
    ]


def test_the_banner_leaves_out_what_hf_model_replaces():
    """--hf_model's shape and tokenizer replace --model_preset and --tokenizer: the banner does not
    show them."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from minimal_fsdp.backends import banner

    plan = SimpleNamespace(
        shard_ranks=1, cpu_offload=False, decentralized=False, fp8=None, describe=lambda: "no FSDP"
    )
    env = SimpleNamespace(
        world_size=1,
        num_nodes=1,
        local_world_size=1,
        launcher="single",
        backend="gloo",
        device=torch.device("cpu"),
    )
    model = torch.nn.Linear(2, 2)
    text = banner.banner(asdict(parse_args(["--hf_model", "some/dir"])), env, plan, model)
    assert "hf_model = " in text and "model_preset" not in text and "tokenizer = " not in text
    assert "model_preset = \"tiny\"" in banner.banner(asdict(parse_args([])), env, plan, model)


# The README's commands, walked in order in a fresh copy of the repository (what a new user does
# first). the quick start's shape, fewer steps
QUICK_TRAINING = ["--max_steps", "30", "--eval_batches", "2"]
COMMAND = re.compile(r"(mpiexec|python|minimal-fsdp|pip|pytest)\b")


def readme_steps(text):
    """The Quick start section's fenced blocks and inline code, in order: ("command", text) for each
    command (a line of a fenced block, or an inline span, that starts with one), ("output", block)
    for a fenced block with no command in it (what the command before it prints)."""
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    steps = []
    for fenced, inline in re.findall(r"```[^\n]*\n(.*?)```|`([^`]+)`", section, flags=re.S):
        if fenced:
            commands = [line.strip() for line in fenced.splitlines() if COMMAND.match(line)]
            steps += [("command", c) for c in commands] if commands else [("output", fenced)]
        elif COMMAND.match(inline) and " " in inline.strip():
            steps.append(("command", " ".join(inline.split())))
    return steps


def skipped(command):
    """Why the walk does not run a command, or None."""
    if command.startswith("pip "):
        return "the test runs in the installed environment"
    if command.split()[0] == "pytest":
        return "the test suite itself"
    if any(word.isalpha() and word.isupper() for word in command.split()):
        return "a form with a placeholder (COMMAND, FILE), not a command"
    if "configs/shakespeare_char.toml" in command:
        return "a GPU recipe (the README: on a CPU it may not reach its first step for a long time)"
    return None


def doc_command(doc, starts):
    """The first command of a fenced block in `doc` that starts with `starts`: continuation lines
    joined, comments cut."""
    lines = (ROOT / "docs" / doc).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(starts))
    command = []
    for line in lines[first:]:
        line = line.split("  #", 1)[0].rstrip()
        command.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            return " ".join(command)


@pytest.mark.slow
def test_the_readmes_commands_run_in_order_in_a_fresh_clone(tmp_path):
    """Each command of the README's quick start that runs on a CPU, in the README's order, in a copy
    of the committed repository (git archive HEAD): training shortened by an appended --max_steps,
    sampling again, training on your own text right after, the evaluate command the README points to
    in docs/evaluate.md. Each exits 0 and prints what the README says it prints."""
    import shlex
    import subprocess
    import sys

    from conftest import mpiexec

    archive = subprocess.run(
        ["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", tmp_path], input=archive, check=True)
    (tmp_path / "my.txt").write_text(make_text(20_000, seed=1))
    # The copy's package, not the installed one, for `minimal-fsdp` too; one thread per rank,
    # as launch().
    env = dict(os.environ, PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1")
    programs = {
        "mpiexec": [mpiexec()],
        "python": [sys.executable],
        "minimal-fsdp": [sys.executable, "-m", "minimal_fsdp"],
    }

    def run(command):
        words = shlex.split(command)
        argv = programs[words[0]] + words[1:]
        if "basic_training.py" in words and "--max_epochs" not in words and "--help" not in words:
            argv += QUICK_TRAINING  # a training run: the README's, shorter
        result = subprocess.run(
            argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, (
            f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        return result.stdout

    ran, printed, samples = [], None, {}
    for kind, text in readme_steps((tmp_path / "README.md").read_text()):
        if kind == "output":  # the sample the command before it printed: the same first line
            assert printed is not None and sample_of(printed).startswith(text.splitlines()[0]), text
            continue
        if skipped(text):
            continue
        printed = run(text)
        ran.append(text)
        if "basic_training.py" in text and "--help" not in text or " sample " in text:
            prompt = re.search(r'--prompt "([^"]*)"', text)
            # the command: text alone
            samples[text] = printed[:-1] if " sample " in text else sample_of(printed)
            assert samples[text].startswith(prompt[1] if prompt else "ROMEO:"), printed[-2000:]
        if "basic_training.py" in text and "--max_epochs" not in text and "--help" not in text:
            assert re.search(
                r"^done: step 30 of 30; this launch trained 30 steps", printed, re.M
            ), printed
        if text.endswith("--help"):
            assert printed.startswith("usage:"), printed[:500]
    quick, own, again, alone = (
        next(c for c in ran if test(c))
        for test in (
            lambda c: c.endswith("basic_training.py"),
            lambda c: "--input_file my.txt" in c,
            lambda c: "--max_epochs -1" in c,
            lambda c: c.startswith("minimal-fsdp sample"),
        )
    )
    # training on your own text right after the quick start
    assert ran.index(quick) < ran.index(own)
    # The quick start's run directories (the default --run_name); your text prepared once
    # into data/my/char.
    assert (tmp_path / "checkpoints" / "shakespeare" / "latest").exists()
    assert (tmp_path / "logs" / "shakespeare" / "metrics.jsonl").exists()
    assert (tmp_path / "data" / "my" / "char").is_dir()
    assert samples[again] != samples[alone]  # --seed 7 against the default 1337: another text
    # The README points to docs/evaluate.md for benchmarks: its first command, on the quick
    # start's run.
    assert "docs/evaluate.md" in (tmp_path / "README.md").read_text()
    evaluate = doc_command("evaluate.md", "minimal-fsdp evaluate checkpoints/shakespeare")
    printed = run(evaluate)
    assert all(task in printed for task in ("tiny_mc", "tiny_ppl", "tiny_gen")), printed[-3000:]
