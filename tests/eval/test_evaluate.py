"""minimal-fsdp evaluate (commands/evaluate.py, eval/lm.py) and --eval_tasks. On the local tasks in
configs/eval (multiple choice; perplexity in rolling windows; generation), our backend on a
checkpoint loaded over 1, 2 and 4 ranks gives the scores of the harness's own Hugging Face backend
(lm_eval --model hf) on the same checkpoint exported with minimal-fsdp export --format hf: every
log-likelihood within 1e-4 relative, accuracies, greedy flags and generated text identical, for a
GPT-2-shape and a Llama-shape model. Offline throughout; bad input ends every rank with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.checkpoint import find
from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.eval import harness
from minimal_fsdp.hf import export

from conftest import ROOT, TINY_MODEL, launch_runs, make_text, mpiexec
from support import command

lm_eval = pytest.importorskip("lm_eval")  # pip install -e '.[dev]' installs it

DATA = ROOT / "configs" / "eval"
TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
# Two shapes: GPT with a 64-token context, Llama (grouped-query, rotary) with 32, so that prompts
# are truncated and the perplexity texts span several windows.
SHAPES = {
    "gpt": ["--seq_length", 64],
    "llama": ["--model", "llama", "--num_kv_heads", 1, "--seq_length", 32],
}
FLAGS = ["--tasks", ",".join(TASKS), "--include_path", DATA, "--batch_size", 3, "--log_samples"]


def hf_backend(directory):
    """The reference: lm_eval's own transformers backend, one sequence at a time (no padding), its
    templates rendered by the harness's own apply_template, not the one harness.harness()
    installs."""
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.utils, "apply_template", harness_apply_template())
        return lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={directory},dtype=float32",
            tasks=TASKS,
            task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
            batch_size=1,
            device="cpu",
            log_samples=True,
        )


def harness_apply_template():
    """lm_eval.utils.apply_template as the harness ships it (which compiles the template for every
    document)."""
    import lm_eval.utils

    return getattr(lm_eval.utils.apply_template, "__wrapped__", lm_eval.utils.apply_template)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per shape: a run trained on 2 ranks (sentencepiece), its checkpoint, and the hf backend's
    results on its export. The GPT run also evaluates tiny_mc and tiny_ppl as it trains
    (--eval_tasks, at steps 50 and 100). Both runs one after the other in one launch
    (tests/several_runs.py)."""
    work = tmp_path_factory.mktemp("evaluate")
    (work / "corpus.txt").write_text(make_text())
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE.items():
            patch.setenv(name, value)
        runs = []
        for shape, flags in SHAPES.items():
            during = (
                [
                    "--eval_tasks",
                    "tiny_mc,tiny_ppl",
                    "--eval_tasks_include_path",
                    DATA,
                    "--eval_tasks_interval",
                    50,
                ]
                if shape == "gpt"
                else []
            )
            runs.append(
                [
                    "--dataset",
                    "text",
                    "--input_file",
                    work / "corpus.txt",
                    *TINY_MODEL,
                    *flags,
                    "--tokenizer",
                    "sentencepiece",
                    "--vocab_size",
                    300,
                    "--max_steps",
                    100,
                    "--warmup_steps",
                    5,
                    "--eval_interval",
                    0,
                    "--checkpoint_dir",
                    work / "checkpoints",
                    "--log_dir",
                    work / "logs",
                    "--data_dir",
                    work / "data",
                    "--run_name",
                    shape,
                    *during,
                ]
            )
        launch_runs(runs, ranks=2, cwd=ROOT)
        for shape in SHAPES:
            step = find.resolve(work / "checkpoints" / shape)
            export.export(step, work / f"{shape}_hf", fmt="hf")
            patch.chdir(ROOT)  # the tasks' data_files are relative to the repository root
            found[shape] = dict(
                step=step, logs=work / "logs" / shape, reference=hf_backend(work / f"{shape}_hf")
            )
    return found


def results_of(out):
    """The harness's results file and samples files under --output_path (one model folder)."""
    (folder,) = out.iterdir()
    (results,) = folder.glob("results_*.json")
    samples = {
        task: [json.loads(line) for line in next(folder.glob(f"samples_{task}_*.jsonl")).open()]
        for task in TASKS
    }
    return json.loads(results.read_text()), samples


def assert_same_scores(results, samples, reference, tasks=TASKS):
    """Scores and every example's responses as the hf backend's: log-likelihoods within 1e-4
    relative."""
    for task in tasks:
        ours, theirs = results["results"][task], reference["results"][task]
        for key, value in theirs.items():
            if "_stderr" in key or key == "alias":
                continue
            if isinstance(value, str) or key.startswith(("acc", "exact_match", "sample_len")):
                assert ours[key] == value, (task, key)
            else:
                assert ours[key] == pytest.approx(value, rel=1e-4), (task, key)
    for task in tasks if samples else []:
        ours = sorted(samples[task], key=lambda s: s["doc_id"])
        theirs = sorted(reference["samples"][task], key=lambda s: s["doc_id"])
        assert len(ours) == len(theirs) > 0
        for mine, ref in zip(ours, theirs):
            # the samples file holds the harness's responses as strings: "-48.72", or
            # ["-48.72", "False"]
            for a, b in zip(mine["filtered_resps"], ref["filtered_resps"], strict=True):
                if task == "tiny_gen":
                    assert a == b
                elif task == "tiny_ppl":
                    assert float(a) == pytest.approx(b, rel=1e-4)
                else:  # (log-likelihood, greedy)
                    assert float(a[0]) == pytest.approx(b[0], rel=1e-4) and a[1] == str(b[1])
    generated = [s["filtered_resps"][0] for s in samples.get("tiny_gen", [])] if samples else []
    assert not generated or any(text.strip() for text in generated), (
        "no text was generated at all: a weak check"
    )


def run_evaluate(source, out, ranks, *flags, check=True):
    cmd = [mpiexec(), "-n", str(ranks)] if ranks > 1 else []
    cmd += [sys.executable, "-m", "minimal_fsdp", "evaluate", str(source), *map(str, flags)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **OFFLINE)
    result = subprocess.run(
        cmd + (["--output_path", str(out)] if out else []),
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
        )
    return result


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_one_rank_matches_the_hf_backend(
    trained, shape, single_process, monkeypatch, capsys, tmp_path
):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    command(
        "evaluate",
        *[str(trained[shape]["step"]), *map(str, FLAGS), "--output_path", str(tmp_path / "out")],
    )
    shown = capsys.readouterr()
    assert_same_scores(*results_of(tmp_path / "out"), trained[shape]["reference"])
    assert f"evaluating {trained[shape]['step']} (checkpoint, step 100) on 1 rank(s)" in shown.err
    assert "|tiny_mc |" in shown.out and "|tiny_ppl|" in shown.out  # the harness's table


SHARDED = [
    ("gpt", "full-shard", 2),
    ("gpt", "no-shard", 2),
    ("llama", "full-shard", 2),
    ("llama", "no-shard", 2),
    ("llama", "grad-shard", 4),
    ("gpt", "hybrid-full-shard", 4),
    ("llama", "hybrid-grad-shard", 4),
]
HYBRID = ["--shard_group_size", 2]  # 4 ranks on one node: shard over 2, replicate over 2


@pytest.fixture(scope="module")
def sharded(request, trained, tmp_path_factory):
    """Every selected case of SHARDED evaluated by `minimal-fsdp evaluate` under mpiexec, the cases
    of one world size one after the other in one launch (tests/several_evaluations.py: 2 launches,
    not 5). Per case: its folder (the harness's files under out/), and what its ranks printed,
    joined as mpiexec joins them."""
    selected = {
        tuple(item.callspec.params[key] for key in ("shape", "sharding", "ranks"))
        for item in request.session.items
        if item.originalname == "test_sharded_checkpoint_matches_the_hf_backend"
    }
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE.items():
            patch.setenv(name, value)
        for ranks in sorted({ranks for _, _, ranks in selected}):
            cases = [case for case in SHARDED if case in selected and case[2] == ranks]
            folders = {case: tmp_path_factory.mktemp("_".join(map(str, case))) for case in cases}
            launch_runs(
                [
                    [
                        trained[shape]["step"],
                        *FLAGS,
                        "--sharding",
                        sharding,
                        *(HYBRID if "hybrid" in sharding else []),
                        "--output_path",
                        folder / "out",
                    ]
                    for (shape, sharding, _), folder in folders.items()
                ],
                ranks=ranks,
                cwd=ROOT,
                timeout=600,
                entry=ROOT / "tests" / "several_evaluations.py",
            )
            for case, folder in folders.items():
                printed = {
                    name: "".join((folder / f"{name}_{rank}").read_text() for rank in range(ranks))
                    for name in ("stdout", "stderr")
                }
                found[case] = SimpleNamespace(out=folder / "out", **printed)
    return found


@pytest.mark.parametrize("shape,sharding,ranks", SHARDED)
@pytest.mark.slow
def test_sharded_checkpoint_matches_the_hf_backend(sharded, trained, shape, sharding, ranks):
    out = sharded[shape, sharding, ranks]
    assert_same_scores(*results_of(out.out), trained[shape]["reference"])
    assert f"on {ranks} rank(s)" in out.stderr
    assert f"({sharding})" in out.stderr and ("replicate=2 x shard=2" in out.stderr) == (
        "hybrid" in sharding
    )
    assert out.stdout.count("|tiny_mc |") == 1  # rank 0 alone prints the table


@pytest.mark.slow
def test_eval_tasks_during_training_score_the_live_model(trained):
    rows = [json.loads(line) for line in (trained["gpt"]["logs"] / "metrics.jsonl").open()]
    scored = {row["step"]: row for row in rows if "eval/tiny_mc/acc" in row}
    assert sorted(scored) == [50, 100]  # every --eval_tasks_interval steps, and at the end
    reference = trained["gpt"]["reference"]["results"]  # of the step-100 checkpoint, exported
    for task in ("tiny_mc", "tiny_ppl"):
        for key, value in reference[task].items():
            metric = key.split(",")[0]
            if "_stderr" in key or isinstance(value, str) or metric == "sample_len":
                continue
            live = scored[100][f"eval/{task}/{metric}"]
            assert (
                live == value
                if metric.startswith("acc")
                else live == pytest.approx(value, rel=1e-4)
            ), key
    written = sorted((trained["gpt"]["logs"] / "eval_tasks").glob("step_*.json"))
    # the harness's results files
    assert sorted(p.name.split("_")[1] for p in written) == ["100", "50"]
    final = json.loads(next(p for p in written if p.name.startswith("step_100_")).read_text())
    assert final["results"]["tiny_mc"]["acc,none"] == scored[100]["eval/tiny_mc/acc"]


def write_task(folder, name, base="tiny_mc", data=None, **overrides):
    """A copy of a shipped task under another name, its data path absolute (or `data`), some fields
    changed."""
    text = (DATA / f"{base}.yaml").read_text().replace(f"task: {base}", f"task: {name}")
    text = text.replace("configs/eval/tiny_mc.jsonl", data or str(DATA / "tiny_mc.jsonl"))
    for key, value in overrides.items():
        text = text.replace(f"  {key}: ", f"  {key}: {value}  # was ")
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.yaml").write_text(text)


@pytest.mark.slow
def test_missing_data_is_one_line_on_every_rank(trained, tmp_path):
    write_task(tmp_path / "tasks", "gone", data=str(tmp_path / "absent.jsonl"))
    out = run_evaluate(
        trained["gpt"]["step"],
        None,
        2,
        "--tasks",
        "gone",
        "--include_path",
        tmp_path / "tasks",
        check=False,
    )
    assert out.returncode == 2
    assert [line for line in out.stderr.splitlines() if line.startswith("error")] == [
        f"error: task gone: its data is not here: Unable to find '{tmp_path / 'absent.jsonl'}' "
        f"(relative data_files are read from the working directory, {ROOT})"
    ]
    # stopped before loading the model
    assert "Traceback" not in out.stderr and "evaluating" not in out.stderr


def test_a_shard_group_that_does_not_divide_the_ranks_is_one_line(single_process, tmp_path, capsys):
    """Checked against the launch (validate_world, the same inputs on every rank) before anything is
    read: the source need not exist. Before, a bad group ended every rank in a device-mesh
    traceback."""
    with pytest.raises(SystemExit) as exit:
        command(
            "evaluate",
            *[
                str(tmp_path / "never_read"),
                "--tasks",
                "tiny_mc",
                "--include_path",
                str(DATA),
                "--sharding",
                "hybrid-full-shard",
                "--shard_group_size",
                "2",
            ],
        )
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --sharding hybrid-full-shard needs world size divisible by --shard_group_size (got "
        "1 and 2)"
    )


@pytest.mark.slow
def test_a_failure_inside_the_harness_releases_every_rank(trained, tmp_path):
    """Rank 0 finds the problem while the harness runs: after the model is loaded, the other rank
    serving it."""
    write_task(tmp_path / "tasks", "too_long", base="tiny_gen", max_gen_toks=100)
    out = run_evaluate(
        trained["gpt"]["step"],
        None,
        2,
        "--tasks",
        "too_long",
        "--include_path",
        tmp_path / "tasks",
        check=False,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("error")] == [
        "error: a task asks for 100 generated tokens, more than the model's context of 64 leaves "
        "for its prompt"
    ]
    assert "Traceback" not in out.stderr and "evaluating" in out.stderr


def few_shipped_tasks(made):
    """lm_eval's TaskManager with one folder of the harness's own tasks (arc) standing in for all of
    them (14,683 in lm-eval 0.4.13, which take minutes to index on a busy machine): a name that is
    none of these is reported alike. Each manager made with the harness's own tasks goes to
    `made`."""
    import lm_eval.tasks

    class TaskManager(lm_eval.tasks.TaskManager):
        def __init__(self, include_path=None, include_defaults=True, **kwargs):
            paths = [Path(lm_eval.tasks.__file__).parent / "arc"] if include_defaults else []
            super().__init__(
                include_path=paths + ([include_path] if include_path else []),
                include_defaults=False,
                **kwargs,
            )
            if include_defaults:
                made.append(self)

    return TaskManager


@pytest.mark.slow
def test_unknown_task_and_missing_harness_are_one_line(
    trained, single_process, monkeypatch, capsys
):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    with_shipped = []
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", few_shipped_tasks(with_shipped))
    with pytest.raises(SystemExit) as exit:
        command(
            "evaluate",
            *[
                str(trained["gpt"]["step"]),
                "--tasks",
                "tiny_mc,nonesuch",
                "--include_path",
                str(DATA),
            ],
        )
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --tasks: nonesuch is not one of lm_eval's tasks nor in --include_path "
        f"{DATA}; lm_eval ls tasks lists them"
    )
    # before calling it unknown, the harness's own tasks were looked in (here: the
    # stand-in folder's)
    assert [{"arc_easy", "tiny_mc"} <= set(manager.all_tasks) for manager in with_shipped] == [True]
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'minimal_fsdp\[eval\]'"):
        harness.harness()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
def test_scores_of_a_padded_batch_are_each_sequence_alone(one_rank_group, device):
    """Independent of the harness: rows of different lengths in one forward call (right-padded, only
    the continuation projected onto the vocabulary) score as each row alone through the model's full
    logits. On a GPU the batches go from pinned memory without waiting, and the scores come back
    once."""
    from minimal_fsdp.eval.lm import ShardedLM
    from minimal_fsdp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=50, seq_length=16, num_layers=2, num_heads=2, embed_size=16)
    ).to(device)

    class Tokenizer:
        kind, eot_id, bos_id = "test", 0, None

    lm = ShardedLM(model, Tokenizer(), torch.device(device), batch_size=2)
    rows = [
        ([1, 2, 3, 4, 5], 2),
        ([7, 8], 1),
        (list(range(1, 18)), 16),
        ([9, 9, 9, 9], 3),
        ([5, 6, 7], 2),
    ]
    got = lm.score(rows)
    for (tokens, scored), (logprob, greedy) in zip(rows, got):
        hidden = model.trunk(torch.tensor([tokens[:-1]], device=device))
        logits = torch.log_softmax(hidden @ model.wte.weight.T, dim=-1)[0, -scored:]
        wanted = torch.tensor(tokens[-scored:], device=device)
        assert logprob == pytest.approx(logits.gather(-1, wanted[:, None]).sum().item(), rel=1e-5)
        assert greedy == bool((logits.argmax(-1) == wanted).all())
    assert model.training  # scoring puts the model back as it found it


def test_rows_reach_the_ranks_in_commands_of_many_batches(one_rank_group, monkeypatch):
    """score() hands the ranks one command (a broadcast and a gather when there are several ranks)
    per COMMAND_TOKENS tokens of rows, not one per batch; split into several commands the scores are
    the same."""
    from minimal_fsdp.eval.lm import ShardedLM
    from minimal_fsdp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_length=16, num_layers=2, num_heads=2, embed_size=16))

    class Tokenizer:
        kind, eot_id, bos_id = "test", 0, None

    lm = ShardedLM(model, Tokenizer(), torch.device("cpu"), batch_size=2)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(11):
        length = int(torch.randint(2, 17, (1,), generator=generator))
        rows.append(
            (torch.randint(1, 50, (length,), generator=generator).tolist(), 1 + length // 3)
        )
    commands = []
    command = lm._command
    monkeypatch.setattr(
        lm,
        "_command",
        lambda kind, items, *rest: commands.append(len(items)) or command(kind, items, *rest),
    )
    whole = lm.score(rows)
    assert commands == [11]  # 6 batches of 2, one command
    commands.clear()
    monkeypatch.setattr("minimal_fsdp.eval.lm.COMMAND_TOKENS", 30)
    assert [pytest.approx(result) for result in lm.score(rows)] == whole
    assert len(commands) > 2 and sum(commands) == 11 and all(n % 2 == 0 for n in commands[:-1])


def test_each_distinct_text_is_tokenized_once_per_loglikelihood_call(one_rank_group, monkeypatch):
    """The harness tokenizes an item's context once for each of its choices (and the context with
    each choice): our loglikelihood tokenizes each distinct text once, and hands
    _loglikelihood_tokens the same token ids."""
    from lm_eval.api.instance import Instance

    from minimal_fsdp.eval.lm import ShardedLM

    encoded = []

    class Tokenizer:
        kind, eot_id, bos_id = "test", 0, None

        def encode(self, text):
            encoded.append(text)
            return list(text.encode())

        def encode_batch(self, texts):
            return [self.encode(text) for text in texts]

    lm = ShardedLM(None, Tokenizer(), torch.device("cpu"))
    handed = []
    monkeypatch.setattr(
        lm,
        "_loglikelihood_tokens",
        lambda requests, disable_tqdm=False: (
            handed.extend(requests) or [(0.0, True)] * len(requests)
        ),
    )
    items = [
        ("The king said ", [" yes.", " no.", "nothing", " yes."]),
        ("A lady, ", [" good night", " sweet"]),
    ]
    requests = [
        Instance("loglikelihood", {}, (context, choice), i)
        for context, choices in items
        for i, choice in enumerate(choices)
    ]
    assert lm.loglikelihood(requests, disable_tqdm=True) == [(0.0, True)] * 6
    # the harness moves a context's trailing space to the continuation; each distinct text once
    assert sorted(encoded) == sorted(
        {
            "The king said",
            "A lady,",
            "The king said  yes.",
            "The king said  no.",
            "The king said nothing",
            "A lady,  good night",
            "A lady,  sweet",
        }
    )
    for (context, choice), context_ids, choice_ids in handed:
        context, choice = context.rstrip(), context[len(context.rstrip()) :] + choice
        assert (context_ids, choice_ids) == (list(context.encode()), list(choice.encode()))
    assert lm._encoded is None and lm.tok_encode("x") == [120]  # nothing kept after the call


def test_all_texts_encoded_at_once_as_one_at_a_time(tmp_path, monkeypatch):
    """encode_batch (the batch encoder of the library each of our tokenizers wraps, which the
    backend encodes a loglikelihood call's texts with) gives every text exactly as that tokenizer's
    encode does, for each kind, empty and whitespace-only texts too, and also where a tokenizer.json
    asks for padding and truncation (neither is applied, as in transformers unless asked)."""
    import tokenizers as tokenizers_lib

    from minimal_fsdp.data.tokenizer import CharTokenizer, GPT2Tokenizer, load_tokenizer

    import tokenizer_dirs

    texts = tokenizer_dirs.MIXED + [
        "",
        "   ",
        "The king said",
        "The king said  yes.",
        "<|endoftext|> x",
    ]
    tokenizer_dirs.stub_gpt2_encoding(monkeypatch)
    padded_dir = tokenizer_dirs.write_tokenizer_json(tmp_path / "padded")
    asking = tokenizers_lib.Tokenizer.from_file(str(padded_dir / "tokenizer.json"))
    asking.enable_padding()  # to the longest of a batch
    asking.enable_truncation(2)
    asking.save(str(padded_dir / "tokenizer.json"))
    padded = load_tokenizer(padded_dir)
    tokenizers = [
        load_tokenizer(tokenizer_dirs.write_tokenizer_json(tmp_path / "json")),
        padded,
        load_tokenizer(tokenizer_dirs.write_vocab_merges(tmp_path / "merges")),
        load_tokenizer(tokenizer_dirs.write_sentencepiece(tmp_path / "sp")),
        load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tiktoken")[0]),
        GPT2Tokenizer(),
        CharTokenizer(sorted(set("".join(texts)))),
    ]
    assert [tok.kind for tok in tokenizers] == ["hf"] * 3 + [
        "sentencepiece",
        "tiktoken",
        "gpt2",
        "char",
    ]
    for tok in tokenizers:
        assert tok.encode_batch(texts) == [tok.encode(text) for text in texts], tok.kind
        assert tok.encode_batch([]) == []
    assert padded.encode_batch(texts) == tokenizers[0].encode_batch(texts)


# A few-shot multiple-choice task whose templates use a filter, a condition and a description.
TEMPLATED = """task: tiny_templated
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA
test_split: test
output_type: multiple_choice
num_fewshot: 2
description: "Choose{% if answer > 1 %} late{% endif %}.\\n\\n"
doc_to_text: "{{question | regex_replace('[aeiou]', '*') | upper}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""


def test_templates_compiled_once_render_as_the_harness_renders(tmp_path, monkeypatch):
    """harness.harness() has lm_eval compile each distinct Jinja template once, not once per
    document: every request the harness builds for the shipped local tasks (and a few-shot task with
    a filter, a condition and a description) is the same as with the harness's own apply_template,
    and so is each document's text, target and choices."""
    import lm_eval.utils
    from lm_eval.tasks import TaskManager

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)  # the shipped tasks' data_files are relative to it
    (tmp_path / "tiny_templated.yaml").write_text(
        TEMPLATED.replace("DATA", str(DATA / "tiny_mc.jsonl"))
    )
    names = TASKS + ["tiny_templated"]
    compiled = []
    from_string = lm_eval.utils.env.from_string
    monkeypatch.setattr(
        lm_eval.utils.env,
        "from_string",
        lambda source, *rest: compiled.append(source) or from_string(source, *rest),
    )

    def built():
        tasks = TaskManager(include_path=[str(DATA), str(tmp_path)], include_defaults=False).load(
            names
        )["tasks"]
        found = {}
        for name in names:
            task = tasks[name]
            task.set_fewshot_seed(seed=1234)
            task.build_all_requests()
            found[name] = [(i.request_type, i.doc_id, i.idx, i.args) for i in task.instances]
            found[name] += [
                (
                    task.doc_to_text(doc),
                    task.doc_to_target(doc),
                    task.doc_to_choice(doc) if task.config.doc_to_choice else None,
                )
                for doc in task.eval_docs
            ]
        return found

    monkeypatch.setattr(lm_eval.utils, "apply_template", harness_apply_template())
    reference = built()
    documents = 24 * 3 + 8  # tiny_mc.jsonl for three tasks, tiny_ppl.txt
    assert len(compiled) > documents  # the harness's own: a compilation per document and template
    assert (
        len(reference["tiny_templated"]) == 24 * 5
        and "\nAnswer:" in reference["tiny_templated"][0][3][0]
    )
    compiled.clear()
    harness.compile_templates_once(lm_eval.utils)
    assert built() == reference
    assert sorted(compiled) == sorted(set(compiled)) and len(compiled) < 10  # each template once


def test_eval_tasks_that_cannot_run_stop_before_training():
    from minimal_fsdp.config import checks
    from minimal_fsdp.config.flags import Config
    from minimal_fsdp.config.sections import Evaluation

    # without --eval_tasks: nothing
    assert harness.TrainingTasks.for_run(Evaluation.of(Config()), None, None, None) is None
    for flags, message in [
        (dict(eval_tasks_interval=-1), "--eval_tasks_interval must be 0 or positive"),
        (dict(eval_tasks_limit=0), "--eval_tasks_limit positive"),
        (dict(data_parallel="decentralized"), "every rank trains a replica of its own"),
    ]:
        # refused with the other flags, before any build
        with pytest.raises(ConfigError, match=message):
            checks.validate(Config(eval_tasks="tiny_mc", **flags))
    with pytest.raises(ConfigError, match="needs the data's tokenizer"):
        harness.TrainingTasks.for_run(Evaluation.of(Config(eval_tasks="tiny_mc")), None, None, None)
    # a char tokenizer, refused here once, is scored (test_harness.py, test_char_model.py)
