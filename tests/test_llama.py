"""The Llama model: decoding with its grouped-query KV cache, the paper's shapes, flags that pick it, and FSDP2
training on 2 ranks (meta init + activation checkpointing) that matches one process holding the whole model."""
import json
import sys

import pytest
import torch

from conftest import ROOT, launch
from test_end_to_end import sample_of
from test_parallelize import logged_losses, reference

sys.path.insert(0, str(ROOT))
from minimal_fsdp import checkpoint_find, safe_load  # noqa: E402
from minimal_fsdp.config import MODEL_PRESETS, ConfigError, model_family, parse_args  # noqa: E402
from minimal_fsdp.llama import PRESETS, Llama, LlamaConfig  # noqa: E402
from minimal_fsdp.models import config_from_flags, make_config  # noqa: E402
from minimal_fsdp.model import PRESETS as GPT_PRESETS  # noqa: E402
from minimal_fsdp.parallelize import init_weights  # noqa: E402

STEPS = 5
# 6 heads sharing 2 kv heads; the MLP's 51 rows split unevenly over 2 ranks.
LLAMA_ARGS = ["--model", "llama", "--num_layers", 2, "--num_heads", 6, "--num_kv_heads", 2, "--embed_size", 36,
              "--intermediate_size", 51, "--seq_length", 32, "--batch_size", 4, "--eval_batches", 2,
              "--num_tokens", 0, "--dropout", "0.0"]


def tiny(**kw):
    return LlamaConfig(**dict(dict(vocab_size=50, seq_length=16, num_layers=2, num_heads=4, num_kv_heads=2,
                                   embed_size=32, intermediate_size=48), **kw))


def test_kv_cache_holds_kv_heads_not_query_heads():
    # Decoding with the cache equals the full forward: tests/test_model.py checks that for both models.
    cache = Llama(tiny()).new_cache(1, "cpu", torch.float32)
    assert cache.k[0].shape == (1, 2, 16, 8)


def test_positions_matter_and_grouped_heads_share_keys():
    """Rotary embeddings make attention depend on order; with one kv head, every query head sees one k, v."""
    model = Llama(tiny(num_kv_heads=1)).eval()
    init_weights(model, 0, torch.device("cpu"))
    assert model.blocks[0].attn.k_proj.weight.shape == (8, 32)
    idx = torch.tensor([[3, 7, 11, 19, 5]])
    with torch.no_grad():
        assert not torch.allclose(model(idx), model(idx[:, [1, 0, 2, 3, 4]]), atol=1e-4)


# Llama 2: the reference's table; Llama 3 8B: Meta's release.
@pytest.mark.parametrize("preset,shape,params", [
    ("llama2-7b", (11008, 32, 4096, 32, 32), 6_738_415_616),
    ("llama2-13b", (13824, 40, 5120, 40, 40), 13_015_864_320),
    ("llama2-70b", (28672, 8, 8192, 80, 64), 68_976_648_192),
    ("llama3-8b", (14336, 8, 4096, 32, 32), 8_030_261_248),
])
def test_presets_have_the_published_shapes(preset, shape, params):
    c = make_config("llama", preset)
    assert (c.intermediate_size, c.num_kv_heads, c.embed_size, c.num_layers, c.num_heads) == shape
    with torch.device("meta"):
        assert Llama(c).num_params(non_embedding=False) == params


def test_preset_names_in_the_flags_match_the_models():
    assert set(MODEL_PRESETS["gpt"]) == set(GPT_PRESETS) and set(MODEL_PRESETS["llama"]) == set(PRESETS)


def test_the_preset_picks_the_model_unless_model_is_given():
    assert model_family(parse_args(["--model_preset", "llama2-7b"])) == "llama"
    assert model_family(parse_args([])) == "gpt"
    assert model_family(parse_args(["--model", "llama"])) == "llama"  # Llama's tiny preset


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt", "--model_preset", "llama2-7b"], "--model_preset llama2-7b is not a gpt preset"),
    (["--model", "llama", "--model_preset", "gpt2"], "--model_preset gpt2 is not a llama preset"),
    (["--num_kv_heads", "2"], "--num_kv_heads is a llama flag"),
    (["--hf_model", "somewhere", "--num_layers", "2"], "--num_layers cannot change the shape of --hf_model"),
])
def test_model_flag_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(args)


def test_kv_heads_must_divide_heads(corpus):
    work = corpus.parent
    args = ["--dataset", "text", "--input_file", str(corpus), "--data_dir", str(work / "data"), "--model", "llama",
            "--num_heads", "4", "--num_kv_heads", "3"]
    with pytest.raises(ConfigError, match="--num_heads divisible by --num_kv_heads"):
        config_from_flags(parse_args(args), vocab_size=65)


def train_args(corpus, extra):
    work = corpus.parent
    return ["--dataset", "text", "--input_file", corpus, "--data_dir", work / "data", "--log_dir", work / "logs",
            "--checkpoint_dir", work / "checkpoints", *LLAMA_ARGS, "--max_steps", STEPS, "--log_interval", 1,
            "--eval_interval", 0, "--run_name", "run", "--warmup_steps", 2, *extra]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_llama_bf16_compiled_on_two_gpus_matches_fp32_reference(tmp_path, corpus, recompute):
    args = train_args(corpus, ["--precision", "bf16", "--compile", "--activation_checkpoints", "--recompute", recompute,
                               "--meta_init"])
    launch(args, ranks=2, cwd=tmp_path)
    ref_losses, _ = reference(args, world=2, device="cuda", steps=STEPS)
    assert logged_losses(tmp_path, "run") == pytest.approx(ref_losses, rel=2e-2)


def test_llama_full_shard_matches_single_process_then_generates(tmp_path, corpus):
    args = train_args(corpus, ["--sharding", "full-shard", "--meta_init", "--activation_checkpoints"])
    launch(args, ranks=2, cwd=tmp_path)
    losses = logged_losses(tmp_path, "run")
    ref_losses, ref_state = reference(args, world=2, steps=STEPS)
    assert losses == pytest.approx(ref_losses, abs=5e-6), (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]
    last = checkpoint_find.latest(tmp_path / "checkpoints" / "run")
    assert json.loads((last / "meta.json").read_text())["model_type"] == "llama"
    saved = safe_load.load_full_model_state(last)
    assert saved.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-5, msg=name)
    # Generation-only rebuilds a Llama from meta.json alone (no model flags) and decodes through its GQA cache.
    out = launch(["--max_epochs", -1, "--restart_checkpoint_file", last, "--num_tokens", 40, "--prompt", "KING:"],
                 ranks=1, cwd=tmp_path)
    assert len(sample_of(out.stdout)) == len("KING:") + 40  # char tokenizer; 40 tokens through a 32-token context
