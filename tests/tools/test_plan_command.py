"""`minimal-fsdp plan` for the cards a cluster has: A100 40 GB and 80 GB (Polaris: 4 x A100 40 GB a
node), H100, H200; bf16 by default; the shape a training --config sets; and no torch imported, so
it answers at once (its parameter counts come from the shape: models/counts.py, held here to the
count from a model built on the meta device)."""

import math
import re
import subprocess
import sys

import pytest

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.models.counts import count, parameter_shapes
from minimal_fsdp.models.families import FAMILIES, make_config
from minimal_fsdp.models.size import count_parameters

from conftest import ROOT
from support import command

SHAPES = [
    ("gpt", dict(num_layers=2, num_heads=3, embed_size=48, seq_length=40, vocab_size=101)),
    ("gpt", dict(num_layers=1, num_heads=1, embed_size=16, seq_length=8, vocab_size=7, bias=False)),
    (
        "llama",
        dict(
            num_layers=2,
            num_heads=6,
            num_kv_heads=2,
            embed_size=48,
            intermediate_size=100,
            seq_length=16,
            vocab_size=99,
        ),
    ),
    (
        "llama",
        dict(num_layers=1, num_heads=4, num_kv_heads=4, embed_size=32, intermediate_size=8),
    ),
]


@pytest.mark.parametrize(
    "family, preset",
    [(family, p) for family, f in FAMILIES.items() for p in f.PRESETS],
)
def test_counts_from_the_shape_equal_the_built_models(family, preset):
    config = make_config(family, preset)
    assert count(config) == count_parameters(config)


@pytest.mark.parametrize("family, shape", SHAPES)
def test_counts_of_other_shapes_equal_the_built_models(family, shape):
    config = make_config(family, "tiny", **shape)
    assert count(config) == count_parameters(config)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_shapes_are_the_built_models_matrices(family):
    """PowerSGD's cost in the planner: the matrices as the model has them, the rest as vectors."""
    import torch

    from minimal_fsdp.models.classes import MODELS

    config = make_config(family, "tiny")
    with torch.device("meta"):
        params = list(MODELS[family](config).parameters())
    shapes = parameter_shapes(config)
    built = sorted(tuple(p.shape) for p in params if p.dim() == 2)
    assert sorted(s for s in shapes if len(s) == 2) == built
    assert sum(p.numel() for p in params) == sum(math.prod(s) for s in shapes)


def plan(*argv):
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "minimal_fsdp", "plan", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpus", "4", "--gpu_type", "A100-40GB"],
        ["--config", "configs/gpt2_124m_owt.toml", "--gpus", "8", "--gpus_per_node", "4"]
        + ["--inter_node_gbps", "25", "--gpu_type", "H200"],
        ["--model_preset", "llama3-8b", "--gpus", "16", "--gpus_per_node", "4"],
    ],
)
def test_plan_imports_no_torch(argv):
    result = plan(*argv)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert imported and not [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert "numpy" not in imported


@pytest.mark.parametrize(
    "card, gib", [("A100-40GB", 40), ("A100-80GB", 80), ("H100", 80), ("H200", 140)]
)
def test_a_card_brings_its_memory_and_bf16_is_the_default(capsys, card, gib):
    command("plan", one_line=False, *["--gpus", "4", "--gpu_type", card])
    header = capsys.readouterr().out.splitlines()[2]
    assert header.startswith(f"4 GPU(s) of {gib} GiB ({card}), 4 per node;") and "; bf16;" in header
    command("plan", one_line=False, *["--gpus", "4", "--gpu_type", card, "--gpu_memory", "24GB"])
    assert capsys.readouterr().out.splitlines()[2].startswith("4 GPU(s) of 24 GiB, 4 per node;")


def test_an_unknown_card_lists_the_known_ones_with_a_guess():
    with pytest.raises(ConfigError) as e:
        command("plan", one_line=False, *["--gpu_type", "A100"])
    assert str(e.value) == (
        "argument --gpu_type: invalid choice: 'A100' (choose from 'A100-40GB', 'A100-80GB', "
        "'H100', 'H200') (did you mean A100-40GB or A100-80GB?)"
    )


def test_an_a100s_step_time_needs_an_mfu(capsys):
    """No A100 was measured: the step time says so instead of borrowing another card's MFU."""
    argv = ["--gpus", "8", "--gpus_per_node", "4", "--gpu_type", "A100-40GB"]
    with pytest.raises(ConfigError, match=r"--gpu_type A100-40GB: no MFU .* needs --mfu"):
        command("plan", one_line=False, *[*argv, "--inter_node_gbps", "25"])
    capsys.readouterr()
    command("plan", one_line=False, *[*argv, "--inter_node_gbps", "25", "--mfu", "0.4"])
    assert "A100-40GB at 40.0% MFU (125 TFLOP/s" in capsys.readouterr().out


def test_the_default_pbs_run_fits_a_polaris_node(capsys):
    """pbs/'s training scripts train configs/shakespeare_char.toml without ARGS: the planner reads
    its shape (10.7M parameters, 6 blocks of width 384) and it fits 4 x A100 40 GB."""
    command(
        "plan",
        one_line=False,
        *["--config", str(ROOT / "configs" / "shakespeare_char.toml"), "--gpus", "4"]
        + ["--gpu_type", "A100-40GB"],
    )
    out = capsys.readouterr().out
    assert "10,745,088 parameters" in out and "6 blocks of" in out
    assert re.search(r"^full-shard +none +no .* yes$", out, re.M)
    assert "--config \"$REPO/configs/shakespeare_char.toml\"" in (
        ROOT / "pbs" / "train_single_node.sh"
    ).read_text().replace("(--config", "--config")
