"""Metrics: a tiny training run (in this process, one rank) leaves the same numbers in metrics.jsonl
and in TensorBoard's event file, a loadable config.toml, and a startup banner; wandb works offline;
plots."""

import dataclasses
import importlib.util
import json
import sys

import pytest
import torch
import torch.distributed as dist

from minimal_fsdp.backends.banner import state_bytes_per_rank
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.config.sections import Logging
from minimal_fsdp.metrics import TAGS, Metrics
from minimal_fsdp.tools.plot import read_metrics

from conftest import TINY_MODEL
from support import command

FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time", "peak_mem_gb"}


def rows_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_writes_jsonl_tensorboard_config_and_banner(
    single_process, tmp_path, corpus, capsys
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--max_steps",
        6,
        "--log_interval",
        2,
        "--eval_interval",
        3,
        "--run_name",
        "tb",
    ]
    command("train", *[str(a) for a in args])
    banner = capsys.readouterr().out
    assert (
        "launch: 1 rank(s) = 1 node(s) x 1 rank(s)/node, started by single, gloo on cpu; no FSDP: "
        "one rank" in banner
    )
    assert "M parameters; params + grads + AdamW take" in banner and "starting fresh" in banner
    assert "[train] max_steps = 6, batch_size = 4," in banner and "training 6 steps = " in banner
    # plain lines: stdout is no terminal
    assert "step 6/6: loss " in banner and "done: step 6 of 6" in banner

    run_dir = tmp_path / "logs" / "tb"
    rows = rows_of(run_dir)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6] and all(
        FIELDS <= set(r) for r in train_rows
    )
    assert [(r["step"], set(r)) for r in rows if "val_loss" in r] == [
        (3, {"step", "val_loss"}),
        (6, {"step", "val_loss"}),
    ]

    events = list(run_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1
    scalars = EventAccumulator(str(run_dir)).Reload()
    for name in FIELDS - {"step"} | {"val_loss"}:
        logged = [(r["step"], r[name]) for r in rows if name in r]
        board = [(e.step, e.value) for e in scalars.Scalars(TAGS[name])]
        assert [s for s, _ in board] == [s for s, _ in logged], name
        assert [v for _, v in board] == pytest.approx([v for _, v in logged], rel=1e-6), name

    saved = parse_args(["--config", run_dir / "config.toml"])  # the resolved config, reloadable
    assert (saved.max_steps, saved.eval_interval, saved.embed_size, saved.input_file) == (
        6,
        3,
        32,
        str(corpus),
    )


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_no_tensorboard_writes_only_jsonl(process_group, tmp_path):
    cfg = parse_args(["--log_dir", tmp_path, "--run_name", "quiet", "--no-tensorboard"])
    metrics = Metrics.open(Logging.of(cfg), dataclasses.asdict(cfg))
    metrics.log(1, loss=2.5)
    metrics.close()
    assert rows_of(tmp_path / "quiet") == [{"step": 1, "loss": 2.5}]
    assert not list((tmp_path / "quiet").glob("events.out.tfevents.*"))


def test_resumed_run_appends(process_group, tmp_path):
    cfg = parse_args(["--log_dir", tmp_path, "--run_name", "twice", "--no-tensorboard"])
    for step in (1, 2):
        metrics = Metrics.open(Logging.of(cfg), dataclasses.asdict(cfg))
        metrics.log(step, loss=float(step))
        metrics.close()
    assert [r["step"] for r in rows_of(tmp_path / "twice")] == [1, 2]


@pytest.mark.slow  # a training run in this process: seconds
def test_wandb_offline(process_group, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = parse_args(["--log_dir", tmp_path, "--run_name", "wb", "--wandb", "--no-tensorboard"])
    metrics = Metrics.open(Logging.of(cfg), dataclasses.asdict(cfg))
    metrics.log(1, loss=2.0, lr=1e-3)
    metrics.close()
    offline_runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and list(offline_runs[0].glob("*.wandb"))


def test_wandb_missing_is_a_flag_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match="--wandb needs the wandb package: pip install wandb"):
        parse_args(["--wandb"])


def test_state_estimate():
    # fp32 params + grads + two AdamW moments, over 4 ranks
    assert state_bytes_per_rank(1000, 4) == 4000


def write_jsonl(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_read_metrics_merges_rows_and_resumes(tmp_path):
    write_jsonl(
        tmp_path / "run",
        [
            {"step": 1, "loss": 3.0},
            {"step": 2, "loss": 2.0},
            {"step": 2, "val_loss": 2.5},
            {"step": 2, "loss": 1.9},
            {"step": 3, "loss": 1.5},
        ],
    )
    series = read_metrics(tmp_path / "run")
    assert series["loss"] == ([1, 2, 3], [3.0, 1.9, 1.5]) and series["val_loss"] == ([2], [2.5])


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_jsonl(
        tmp_path / "run", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "val_loss": 2.4}]
    )
    command("plot", *[str(tmp_path / "run")])
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_compares_several_runs(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    for name, loss in (("bf16", 2.0), ("fp8", 2.02)):
        write_jsonl(
            tmp_path / "logs" / name,
            [{"step": 1, "loss": 3.0}, {"step": 2, "loss": loss, "val_loss": 2.4}],
        )
    labels, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda ax, *a, **kw: labels.append(kw["label"]) or plot(ax, *a, **kw),
    )
    command("plot", *[str(tmp_path / "logs" / "bf16"), str(tmp_path / "logs" / "fp8")])
    assert (tmp_path / "logs" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels == ["bf16: train loss", "bf16: val loss", "fp8: train loss", "fp8: val loss"]


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys):
    write_jsonl(tmp_path / "run", [{"step": 1, "loss": 3.0}])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as e:
        command("plot", *[str(tmp_path / "run")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: plotting needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')"
    )


@pytest.mark.slow  # a training run in this process: seconds
def test_allocator_retries_warn_once_and_go_to_the_metrics(
    single_process, tmp_path, corpus, capsys, monkeypatch
):
    """A run at its GPU's memory limit does not fail, it slows down: the allocator's retries
    (counted since the log began) go to metrics.jsonl and TensorBoard, and one warning says what to
    do. The count is patched here; test_a_real_retry_is_counted makes one on a GPU."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from minimal_fsdp import metrics

    counts = iter([5, 5, 8, 9])  # at start, then at the rows of steps 2, 4 and 6
    monkeypatch.setattr(metrics, "allocator_retries", lambda device: next(counts))
    args = [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--max_steps",
        6,
        "--log_interval",
        2,
        "--eval_interval",
        0,
        "--run_name",
        "tight",
    ]
    command("train", *[str(a) for a in args])
    err = capsys.readouterr().err
    assert err.count("memory: by step 4 the CUDA allocator ran out of room 3 time(s)") == 1
    assert err.count("memory:") == 1 and "--batch_size" in err
    rows = [r for r in rows_of(tmp_path / "logs" / "tight") if "loss" in r]
    assert [(r["step"], r.get("alloc_retries")) for r in rows] == [(2, None), (4, 3), (6, 4)]
    scalars = EventAccumulator(str(tmp_path / "logs" / "tight")).Reload()
    assert [(e.step, e.value) for e in scalars.Scalars(TAGS["alloc_retries"])] == [(4, 3), (6, 4)]


@pytest.mark.slow  # a training run in this process: seconds
def test_no_retries_no_field(single_process, tmp_path, corpus, capsys):
    args = [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *TINY_MODEL,
        "--max_steps",
        2,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--run_name",
        "roomy",
    ]
    command("train", *[str(a) for a in args])
    assert "memory:" not in capsys.readouterr().err
    assert all("alloc_retries" not in r for r in rows_of(tmp_path / "logs" / "roomy"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_retry_is_counted():
    """A cached block too small for the next request, with no room beside it: the allocator frees
    its cache and asks again, which allocator_retries counts (expandable segments grow a segment
    instead: no retry to make)."""
    import os

    from minimal_fsdp.profiling import allocator_retries

    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        pytest.skip("expandable segments make no retry here")
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    before = allocator_retries(device)
    free = torch.cuda.mem_get_info(device)[0]
    block = torch.empty(int(free * 0.6), dtype=torch.uint8, device=device)
    del block  # cached, still held from the driver
    assert allocator_retries(device) == before
    bigger = torch.empty(int(free * 0.7), dtype=torch.uint8, device=device)
    assert allocator_retries(device) == before + 1
    del bigger
    torch.cuda.empty_cache()
