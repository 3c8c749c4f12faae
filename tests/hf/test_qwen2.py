"""Qwen2 / Qwen2.5 (models/families/qwen2.py, models/qwen2.py) against transformers' own
Qwen2ForCausalLM: a small Qwen2-shaped model written by transformers (random weights, biases
included) reads in with its logits (fp32, max abs diff < 1e-4), ours exports to a directory that
transformers reloads with the same logits, and --model_preset qwen2.5-0.5b is the published shape
(transformers' model of that config.json has as many parameters as ours)."""

import json

import pytest
import torch

from minimal_fsdp.config.checks import model_family
from minimal_fsdp.config.flags import ConfigError, parse_args
from minimal_fsdp.hf import read, write
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import config_from_flags, make_config
from minimal_fsdp.models.families.qwen2 import Qwen2Config
from minimal_fsdp.models.qwen2 import Qwen2
from minimal_fsdp.models.size import count_parameters
from minimal_fsdp.parallel.parallelize import init_weights

from support import assert_same_logits, ours_from

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SMALL = dict(
    vocab_size=53,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=24,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)


@torch.no_grad()
def randomized(model, seed):
    """Every parameter drawn at random, so zero-initialized biases and unit norms count too."""
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen2_written_by_transformers_reads_in_with_its_logits(tmp_path, tied):
    theirs = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SMALL, tie_word_embeddings=tied)
    )
    randomized(theirs, 0).eval().save_pretrained(tmp_path)
    model_type, config = read.read_config(tmp_path)
    assert model_type == "qwen2" and config.tie_embeddings is tied
    assert (config.rope_theta, config.norm_eps, config.num_kv_heads) == (1e6, 1e-6, 2)
    ours = ours_from(tmp_path)
    assert isinstance(ours, Qwen2) and (ours.lm_head is None) is tied
    assert ours.blocks[0].attn.q_proj.bias is not None and ours.blocks[0].attn.o_proj.bias is None
    assert_same_logits(ours, theirs, SMALL["vocab_size"], SMALL["max_position_embeddings"])


@pytest.mark.parametrize("tied", [True, False])
def test_our_qwen2_exports_to_a_directory_transformers_reloads_with_the_same_logits(tmp_path, tied):
    config = Qwen2Config(
        vocab_size=53,
        seq_length=24,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        embed_size=48,
        intermediate_size=72,
        tie_embeddings=tied,
    )
    ours = MODELS["qwen2"](config).eval()
    init_weights(ours, 0, torch.device("cpu"))
    randomized(ours, 1)
    meta = {"model": config.to_dict(), "model_type": "qwen2"}
    write.save_hf(ours.state_dict(), meta, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["tie_word_embeddings"]) == ("qwen2", tied)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    assert_same_logits(ours, theirs, 53, 24)
    # and back in through --hf_model's reader, unchanged
    again = ours_from(tmp_path / "out")
    assert again.config == config
    for name, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_the_qwen2_5_0_5b_preset_is_the_published_shape(tmp_path):
    config = make_config("qwen2", "qwen2.5-0.5b")
    shape = (
        config.embed_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.intermediate_size,
        config.vocab_size,
    )
    assert shape == (896, 24, 14, 2, 4864, 151936)
    assert (config.tie_embeddings, config.rope_theta, config.norm_eps) == (True, 1e6, 1e-6)
    # its config.json, as the export writes it, is what transformers builds a 494M model from
    (tmp_path / "config.json").write_text(json.dumps(write.hf_config("qwen2", config)))
    assert read.read_config(tmp_path) == ("qwen2", config)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path)
        )
    total = count_parameters(config).total
    assert total == sum(p.numel() for p in theirs.parameters()) == 494_032_768


def test_the_flags_pick_qwen2_and_refuse_gpts_flags():
    assert model_family(parse_args(["--model_preset", "qwen2.5-0.5b"])) == "qwen2"
    tiny = config_from_flags(parse_args(["--model", "qwen2", "--num_kv_heads", "1"]), 65)
    assert isinstance(tiny, Qwen2Config) and (tiny.num_kv_heads, tiny.vocab_size) == (1, 65)
    with pytest.raises(ConfigError, match="--bias/--no-bias is a gpt flag"):
        parse_args(["--model", "qwen2", "--bias"])
    with pytest.raises(ConfigError, match="--num_kv_heads is a llama flag \\(also qwen2\\)"):
        parse_args(["--num_kv_heads", "2"])


def test_a_qwen2_config_json_with_sliding_windows_is_refused(tmp_path):
    fields = dict(SMALL, model_type="qwen2", use_sliding_window=True)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ConfigError, match="sliding-window attention"):
        read.read_config(tmp_path)
