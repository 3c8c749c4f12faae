"""Polaris' queues three ways, held to agree: docs/launch.md's table, pbs/common.sh's list and the
stand-in PBS (fake_pbs.py, ALCF's documented limits); every qsub line the docs and scripts show is
accepted by the stand-in. Also the pieces of the job scripts that need no training: how ARGS and
ARGS_FILE reach the training command line, WORK_DIR, the default run, pbs/helper.py."""

import json
import re
import shlex
import subprocess
import sys

import pytest

import fake_pbs
from conftest import ROOT

LAUNCH_MD = ROOT / "docs" / "launch.md"
COMMON_SH = ROOT / "pbs" / "common.sh"
HOUR = 3600


def docs_queue_table():
    """{queue: (min nodes, max nodes, max walltime s)} of docs/launch.md's queue table."""
    text = LAUNCH_MD.read_text()
    table = text[text.index("| queue | nodes | walltime |") :].split("\n\n")[0]
    found = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = re.fullmatch(r"`([\w-]+)`.*", cells[0])[1]
        low, high = map(int, re.fullmatch(r"(\d+)-(\d+)", cells[1]).groups())
        hours = re.fullmatch(r"(\d+) h|", cells[2])[1]  # none for prod: its queues' limits apply
        found[name] = (low, high, int(hours) * HOUR if hours else None)
    return found


def common_sh_queues():
    """The same from pbs/common.sh's comment (prod's execution queues from its line too)."""
    text = COMMON_SH.read_text()
    found = {}
    for name, low, high, hours in re.findall(
        r"^#   ([\w-]+) +(\d+)-(\d+) nodes, up to (\d+) h", text, re.M
    ):
        found[name] = (int(low), int(high), int(hours) * HOUR)
    prod = re.search(r"^#   prod .*?(?=^#   \S|^#$)", text, re.M | re.S)[0]
    found["prod"] = tuple(map(int, re.search(r"(\d+)-(\d+) nodes", prod).groups())) + (0,)
    routes = re.findall(r"(\d+)-(\d+) (?:nodes )?(?:go )?to (\w+) \((?:up to )?(\d+) h\)", prod)
    for low, high, name, hours in routes:
        found[name] = (int(low), int(high), int(hours) * HOUR)
    return found


def stand_in(name):
    queue = fake_pbs.QUEUES[name]
    return (*queue.nodes, queue.walltime[1])


def test_the_docs_queue_table_is_alcfs():
    table = docs_queue_table()
    assert set(table) >= {
        "debug",
        "debug-scaling",
        "preemptable",
        "prod",
        "small",
        "medium",
        "large",
    }
    for name, limits in table.items():
        expected = stand_in(name)
        assert limits == (expected[:2] + (None,) if name == "prod" else expected), name


def test_common_sh_lists_the_same_queues():
    listed = common_sh_queues()
    assert set(listed) == {
        "debug",
        "debug-scaling",
        "preemptable",
        "prod",
        "small",
        "medium",
        "large",
    }
    for name, limits in listed.items():
        expected = stand_in(name)
        assert limits == (expected[:2] + (0,) if name == "prod" else expected), name


def submit(tmp_path, *argv, env=None, cwd=ROOT):
    state = fake_pbs.State(tmp_path / "pbs")
    job_id = fake_pbs.submit(list(argv), env or {"HOME": "/home/u"}, cwd, state)
    return state.get(job_id)


SCRIPT = "pbs/train_multi_node.sh"


@pytest.mark.parametrize(
    "options, queue",
    [
        (["-q", "prod", "-l", "select=10", "-l", "walltime=03:00:00"], "small"),
        (["-q", "prod", "-l", "select=24", "-l", "walltime=00:05:00"], "small"),
        (["-q", "prod", "-l", "select=25", "-l", "walltime=06:00:00"], "medium"),
        (["-q", "prod", "-l", "select=100", "-l", "walltime=24:00:00"], "large"),
        (["-q", "preemptable", "-l", "select=10", "-l", "walltime=72:00:00"], "preemptable"),
        ([], "debug-scaling"),  # the script's #PBS lines: 2 nodes, 1 h
    ],
)
def test_prod_routes_by_node_count(tmp_path, options, queue):
    job = submit(tmp_path, *options, SCRIPT)
    assert job["exec_queue"] == queue
    assert job["variables"]["PBS_O_QUEUE"] == (options[1] if options else "debug-scaling")


@pytest.mark.parametrize(
    "options, refusal",
    [
        (["-q", "small", "-l", "select=10"], "Access to queue is denied"),
        (["-q", "large", "-l", "select=100"], "Access to queue is denied"),
        # 10 nodes route to small, whose limit is 3 h: the 24 h the docs once gave prod
        (["-q", "prod", "-l", "select=10", "-l", "walltime=24:00:00"], "rejected by all"),
        (["-q", "prod", "-l", "select=4"], "rejected by all"),
        (["-q", "debug", "-l", "select=3"], "violates queue"),
        (["-q", "debug", "-l", "walltime=01:00:01"], "violates queue"),
        (["-q", "preemptable", "-l", "select=11"], "violates queue"),
        (["-l", "walltime=00:04:59"], "violates queue"),  # 5 min at least
    ],
)
def test_qsub_refuses_what_polaris_refuses(tmp_path, options, refusal):
    with pytest.raises(fake_pbs.Refused, match=refusal):
        submit(tmp_path, *options, SCRIPT)


def test_v_settings_by_value_quoted_and_by_name(tmp_path):
    """-v A=1 splits on commas; a quoted value keeps them; -v NAME takes qsub's environment's value
    whatever it holds."""
    env = {"HOME": "/home/u", "ARGS": "--input_file 'a, b.txt' --prompt \"x\"", "EMPTY": ""}
    job = submit(tmp_path, "-v", "A=1,B='x,y',ARGS,EMPTY,UNSET", SCRIPT, env=env)
    mine = {k: v for k, v in job["variables"].items() if not k.startswith("PBS_O_")}
    assert mine == {"A": "1", "B": "x,y", "ARGS": env["ARGS"], "EMPTY": ""}
    assert job["rerunnable"] is True  # the script's #PBS -r y
    assert submit(tmp_path, "-r", "n", SCRIPT)["rerunnable"] is False


def qsub_examples():
    """Every qsub command line shown in docs/launch.md, the README and the pbs/ scripts' comments
    (backslash continuations joined), as (where, words after qsub)."""
    found = []
    for path in [LAUNCH_MD, ROOT / "README.md", *sorted((ROOT / "pbs").glob("*.sh"))]:
        text = re.sub(r"\\\n\s*#?\s*", " ", path.read_text())
        for line in text.splitlines():
            line = line.lstrip("#").strip()
            match = re.search(r"(?:^|[\s`])qsub (-[^`\n]*?\.sh)", line)
            if match and "qsub -I" not in line:
                found.append((f"{path.name}: {match[0].strip()}", match[1]))
    return found


def test_the_examples_are_ones_qsub_accepts(tmp_path):
    examples = qsub_examples()
    assert len(examples) >= 8
    for where, words in examples:
        argv = shlex.split(words.split("#")[0])
        try:
            submit(tmp_path, *argv, env={"HOME": "/home/u", "ARGS": "--max_steps 2"})
        except fake_pbs.Refused as e:
            pytest.fail(f"{where}: {e}")


def helper(*argv, stdin=None):
    return subprocess.run(
        [sys.executable, str(ROOT / "pbs" / "helper.py"), *argv],
        input=stdin,
        capture_output=True,
        text=True,
    )


def test_helper_splits_words_as_a_shell_and_refuses_an_open_quote(tmp_path):
    out = helper("words", "--input_file 'a, b.txt' --prompt \"ROMEO: it's\" x\\ y *")
    assert out.stdout.split("\0")[:-1] == [
        "--input_file",
        "a, b.txt",
        "--prompt",
        "ROMEO: it's",
        "x y",
        "*",
    ]
    bad = helper("words", "--prompt 'ROMEO")
    assert bad.returncode != 0 and bad.stderr.startswith("error: ARGS: No closing quotation")
    assert len(bad.stderr.splitlines()) == 1
    (tmp_path / "flags").write_text("--max_steps 3  # the run's length\n--run_name 'a b'\n")
    out = helper("words-file", str(tmp_path / "flags"))
    assert out.stdout.split("\0")[:-1] == ["--max_steps", "3", "--run_name", "a b"]


def test_helper_repeats_a_job_from_qstat_json(tmp_path):
    env = {"HOME": "/home/u", "ARGS": "--a 1,2"}
    job = submit(
        tmp_path, "-A", "P", "-q", "prod", "-l", "select=10", "-v", "X=1,ARGS", SCRIPT, env=env
    )
    out = helper("successor", stdin=fake_pbs.qstat_json(job))
    items = out.stdout.split("\0")[:-1]
    cut = items.index("--")
    assert items[:cut] == [
        "-A", "P",
        "-l", "select=10",
        "-l", "place=scatter",
        "-l", "walltime=01:00:00",
        "-l", "filesystems=home:eagle",
        "-r", "y",
    ]  # fmt: skip
    assert items[cut + 1 :] == ["X=1", "ARGS=--a 1,2"]  # no queue: the chain names it
    assert helper("walltime", stdin=fake_pbs.qstat_json(job)).stdout.strip() == "01:00:00"


ARGV_DUMP = """#!{python}
import json, sys
# mpiexec stand-in: the training command line, after `bash -c BIND_GPU bind-gpu`
argv = sys.argv[1:]
print("ARGV " + json.dumps(argv[argv.index("bind-gpu") + 3:]))
"""


def job_script(tmp_path, script="train_single_node.sh", home=None, **env):
    """A PBS training script with mpiexec stood in by one that prints the training flags."""
    (tmp_path / "nodefile").write_text("x1\n")
    (tmp_path / "mpiexec").write_text(ARGV_DUMP.format(python=sys.executable))
    (tmp_path / "mpiexec").chmod(0o755)
    environ = {
        "PATH": f"{ROOT / '.venv' / 'bin'}:{sys.prefix}/bin:/usr/bin:/bin",
        "HOME": str(home or tmp_path / "home"),
        "PBS_NODEFILE": str(tmp_path / "nodefile"),
        "PBS_O_WORKDIR": str(tmp_path),
        "PBS_JOBID": "7.polaris-pbs-01",
        "PBS_JOBNAME": "minimal_fsdp",
        "PBS_ENVIRONMENT": "PBS_BATCH",
        "REPO": str(ROOT),
        "CONDA_PREFIX": "skip-the-module",
        "MPIEXEC": str(tmp_path / "mpiexec"),
        "PYTHON": sys.executable,
        "AWS_OFI_NCCL": str(tmp_path / "none"),
        **env,
    }
    result = subprocess.run(
        ["bash", str(ROOT / "pbs" / script)], env=environ, capture_output=True, text=True
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("ARGV ")), None)
    return result, json.loads(line[5:]) if line else None


def test_args_reach_training_as_written(tmp_path):
    args = "--input_file 'corpus, v1.txt' --prompt \"ROMEO: it's $HOME\" --tag a,b,c"
    (tmp_path / "flags").write_text("--max_steps 3\n")
    result, argv = job_script(tmp_path, ARGS=args, ARGS_FILE=str(tmp_path / "flags"))
    assert result.returncode == 0, result.stderr
    assert argv[-8:] == [
        "--max_steps", "3",
        "--input_file", "corpus, v1.txt",
        "--prompt", "ROMEO: it's $HOME",
        "--tag", "a,b,c",
    ]  # fmt: skip
    bad, argv = job_script(tmp_path, ARGS="--prompt 'open")
    assert bad.returncode == 2 and argv is None
    assert [x for x in bad.stderr.splitlines() if x.startswith("error:")] == [
        x for x in bad.stderr.splitlines() if x.strip()
    ][:1]


def test_without_args_the_job_trains_a_gpu_recipe(tmp_path):
    result, argv = job_script(tmp_path)
    assert argv == [
        "--environment", "pbs", "--sharding", "full-shard",
        "--config", f"{ROOT}/configs/shakespeare_char.toml",
    ]  # fmt: skip
    assert "args: no ARGS or ARGS_FILE" in result.stdout


def test_work_dir_takes_checkpoints_data_and_logs_and_home_is_warned_of(tmp_path):
    work = tmp_path / "eagle" / "proj"
    result, argv = job_script(tmp_path, WORK_DIR=str(work), ARGS="--max_steps 2")
    assert result.returncode == 0, result.stderr
    assert argv[argv.index("--checkpoint_dir") :] == [
        "--checkpoint_dir", f"{work}/checkpoints",
        "--data_dir", f"{work}/data",
        "--log_dir", f"{work}/logs",
        "--max_steps", "2",
    ]  # fmt: skip
    assert work.is_dir() and "warning" not in result.stderr
    assert (
        f"this job's output goes to {tmp_path}/minimal_fsdp.o7 when the job ends" in result.stdout
    )
    # the default, the submit folder, under $HOME
    result, argv = job_script(tmp_path, home=tmp_path, ARGS="--max_steps 2")
    assert "--checkpoint_dir" not in argv
    assert "warning: WORK_DIR=" in result.stderr and "is under $HOME" in result.stderr
