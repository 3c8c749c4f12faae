"""The Llama model: decoding with its grouped-query KV cache, the paper's shapes, flags that pick
it, and FSDP2 training on 2 ranks (meta init + activation checkpointing) that matches one process
holding the whole model."""

import dataclasses
import json
import sys

import pytest
import torch

import tokenizer_dirs
from conftest import ROOT, launch
from support import (
    EMULATED,
    check_close_to_bf16,
    documents,
    logged_losses,
    losses_of,
    reference,
    reference_losses,
    run_dirs,
    sample_of,
)

sys.path.insert(0, str(ROOT))
from minimal_fsdp.checkpoint import (
    find,
    safe_load,  # noqa: E402
)
from minimal_fsdp.config.checks import model_family
from minimal_fsdp.config.flags import MODEL_PRESETS, ConfigError, parse_args
from minimal_fsdp.hf import read
from minimal_fsdp.models import llama  # noqa: E402
from minimal_fsdp.models.families import config_from_flags, make_config  # noqa: E402
from minimal_fsdp.models.gpt import PRESETS as GPT_PRESETS  # noqa: E402
from minimal_fsdp.models.llama import PRESETS, Llama, LlamaConfig  # noqa: E402
from minimal_fsdp.models.llama import rotary_frequencies as frequencies  # noqa: E402
from minimal_fsdp.parallel.parallelize import init_weights  # noqa: E402

STEPS = 5
# 6 heads sharing 2 kv heads; the MLP's 51 rows split unevenly over 2 ranks.
LLAMA_ARGS = [
    "--model",
    "llama",
    "--num_layers",
    2,
    "--num_heads",
    6,
    "--num_kv_heads",
    2,
    "--embed_size",
    36,
    "--intermediate_size",
    51,
    "--seq_length",
    32,
    "--batch_size",
    4,
    "--eval_batches",
    2,
    "--num_tokens",
    0,
    "--dropout",
    "0.0",
]


def tiny(**kw):
    return LlamaConfig(
        **dict(
            dict(
                vocab_size=50,
                seq_length=16,
                num_layers=2,
                num_heads=4,
                num_kv_heads=2,
                embed_size=32,
                intermediate_size=48,
            ),
            **kw,
        )
    )


def test_kv_cache_holds_kv_heads_not_query_heads():
    # Decoding with the cache equals the full forward: tests/models/test_model.py checks that for
    # both models.
    cache = Llama(tiny()).new_cache(1, "cpu", torch.float32)
    assert cache.k[0].shape == (1, 2, 16, 8)


def test_positions_matter_and_grouped_heads_share_keys():
    """Rotary embeddings make attention depend on order; with one kv head, every query head sees one
    k, v."""
    model = Llama(tiny(num_kv_heads=1)).eval()
    init_weights(model, 0, torch.device("cpu"))
    assert model.blocks[0].attn.k_proj.weight.shape == (8, 32)
    idx = torch.tensor([[3, 7, 11, 19, 5]])
    with torch.no_grad():
        assert not torch.allclose(model(idx), model(idx[:, [1, 0, 2, 3, 4]]), atol=1e-4)


def test_compiled_trunk_reads_the_rotary_tables_made_outside_its_graph():
    """Compiled whole, the trunk's graph takes cos and sin as inputs (made eagerly), so inductor
    cannot fold their arange, cos and sin into every kernel that rotates q or k; the output is the
    eager trunk's."""
    model = Llama(tiny()).eval()
    init_weights(model, 0, torch.device("cpu"))
    idx = torch.tensor([[3, 7, 11, 19, 5, 2]])
    explained = torch._dynamo.explain(model.trunk)(idx)
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert explained.graphs and not {op for op in ops if "cos" in op or "sin" in op}, ops
    compiled = torch.compile(model.trunk, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx), model.trunk(idx), rtol=0, atol=0)


def test_rotary_frequencies_reach_the_device_once(monkeypatch):
    """A copy per forward from host memory would make the host wait for the device every step (see
    the GPU test below): the frequencies are made once per config and device, as an ordinary tensor
    even when generation (inference mode) asks first."""
    config = tiny(rope_theta=1234.0)
    made = []
    monkeypatch.setattr(llama, "_FREQUENCIES", {})
    monkeypatch.setattr(llama, "rotary_frequencies", lambda c: made.append(c) or frequencies(c))
    model = Llama(config)
    init_weights(model, 0, torch.device("cpu"))
    idx = torch.tensor([[3, 7, 11, 19, 5, 2]])
    with torch.inference_mode():
        first = model(idx)
    model(idx, idx).backward()  # training after generation
    assert len(made) == 1
    cached = llama.frequencies_on(config, torch.device("cpu"))
    assert not cached.is_inference() and torch.equal(cached, frequencies(config))
    other = tiny(rope_theta=10000.0)
    assert not torch.equal(llama.frequencies_on(other, torch.device("cpu")), cached)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), first, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_forward_on_cuda_copies_nothing_from_the_host():
    model = Llama(tiny()).cuda()
    idx = torch.tensor([[3, 7, 11, 19, 5, 2]], device="cuda")
    model(idx)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(idx)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names and not [n for n in names if "HtoD" in n], names


# Llama 2: the reference's table; Llama 3 8B: Meta's release.
@pytest.mark.parametrize(
    "preset,shape,params",
    [
        ("llama2-7b", (11008, 32, 4096, 32, 32), 6_738_415_616),
        ("llama2-13b", (13824, 40, 5120, 40, 40), 13_015_864_320),
        ("llama2-70b", (28672, 8, 8192, 80, 64), 68_976_648_192),
        ("llama3-8b", (14336, 8, 4096, 32, 32), 8_030_261_248),
    ],
)
def test_presets_have_the_published_shapes(preset, shape, params):
    c = make_config("llama", preset)
    assert (c.intermediate_size, c.num_kv_heads, c.embed_size, c.num_layers, c.num_heads) == shape
    with torch.device("meta"):
        assert Llama(c).num_params(non_embedding=False) == params


def test_preset_names_in_the_flags_match_the_models():
    assert set(MODEL_PRESETS["gpt"]) == set(GPT_PRESETS) and set(MODEL_PRESETS["llama"]) == set(
        PRESETS
    )


def test_the_preset_picks_the_model_unless_model_is_given():
    assert model_family(parse_args(["--model_preset", "llama2-7b"])) == "llama"
    assert model_family(parse_args([])) == "gpt"
    assert model_family(parse_args(["--model", "llama"])) == "llama"  # Llama's tiny preset


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model", "gpt", "--model_preset", "llama2-7b"],
            "--model_preset llama2-7b is not a gpt preset",
        ),
        (
            ["--model", "llama", "--model_preset", "gpt2"],
            "--model_preset gpt2 is not a llama preset",
        ),
        (["--num_kv_heads", "2"], "--num_kv_heads is a llama flag"),
        (
            ["--hf_model", "somewhere", "--num_layers", "2"],
            "--num_layers cannot change the shape of --hf_model",
        ),
    ],
)
def test_model_flag_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(args)


def test_kv_heads_must_divide_heads(corpus):
    work = corpus.parent
    args = [
        "--dataset",
        "text",
        "--input_file",
        str(corpus),
        "--data_dir",
        str(work / "data"),
        "--model",
        "llama",
        "--num_heads",
        "4",
        "--num_kv_heads",
        "3",
    ]
    with pytest.raises(ConfigError, match="--num_heads divisible by --num_kv_heads"):
        config_from_flags(parse_args(args), vocab_size=65)


def train_args(corpus, extra):
    work = corpus.parent
    return [
        "--dataset",
        "text",
        "--input_file",
        corpus,
        *run_dirs(work),
        *LLAMA_ARGS,
        "--max_steps",
        STEPS,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--run_name",
        "run",
        "--warmup_steps",
        2,
        *extra,
    ]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(
    "recompute, unit", [("full", "auto"), ("selective", "auto"), ("full", "block")]
)
def test_llama_bf16_compiled_on_two_gpus_matches_fp32_reference(tmp_path, corpus, recompute, unit):
    """--fsdp_unit block: the layout of large models, the embedding and head units of their own."""
    args = train_args(
        corpus,
        [
            "--precision",
            "bf16",
            "--compile",
            "--activation_checkpoints",
            "--recompute",
            recompute,
            "--meta_init",
            "--fsdp_unit",
            unit,
        ],
    )
    launch(args, ranks=2, cwd=tmp_path)
    ref_losses, _ = reference(args, world=2, device="cuda", steps=STEPS)
    assert logged_losses(tmp_path, "run") == pytest.approx(ref_losses, rel=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("unit", ["auto", "block"])
def test_llama_full_shard_matches_single_process_then_generates(tmp_path, corpus, unit):
    """--fsdp_unit block: every block, the embedding and the output head units of their own."""
    args = train_args(
        corpus,
        [
            "--sharding",
            "full-shard",
            "--meta_init",
            "--activation_checkpoints",
            "--fsdp_unit",
            unit,
        ],
    )
    launch(args, ranks=2, cwd=tmp_path)
    losses = logged_losses(tmp_path, "run")
    ref_losses, ref_state = reference(args, world=2, steps=STEPS)
    assert losses == pytest.approx(ref_losses, abs=5e-6), (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]
    last = find.latest(tmp_path / "checkpoints" / "run")
    assert json.loads((last / "meta.json").read_text())["model_type"] == "llama"
    saved = safe_load.load_full_model_state(last)
    assert saved.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-5, msg=name)
    # Generation-only rebuilds a Llama from meta.json alone (no model flags) and decodes through its
    # GQA cache.
    out = launch(
        [
            "--max_epochs",
            -1,
            "--restart_checkpoint_file",
            last,
            "--num_tokens",
            40,
            "--prompt",
            "KING:",
        ],
        ranks=1,
        cwd=tmp_path,
    )
    # char tokenizer; 40 tokens through a 32-token context
    assert len(sample_of(out.stdout)) == len("KING:") + 40


# Meta's config.json of Llama 3.1 8B (meta-llama/Llama-3.1-8B, as transformers 4.43 wrote it), less
# the token ids.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def write_config(directory, fields):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory


def test_llama3_8b_preset_is_meta_llama31_8b_at_its_training_context(tmp_path):
    _, config = read.read_config(write_config(tmp_path / "meta", LLAMA31_8B), seq_length=8192)
    assert config == make_config("llama", "llama3-8b")
    assert (config.rope_theta, config.rope_scaling["factor"], config.norm_eps) == (
        500000.0,
        8.0,
        1e-5,
    )


@torch.no_grad()
def test_llama3_logits_equal_transformers(tmp_path):
    """The llama3-tiny preset's family as transformers builds it from Llama 3.1's config.json (rope
    theta 500000, its llama3 rope scaling, GQA 4:1): weights imported through hf/read.py give
    transformers' logits at every position of a 256-token window, where the scaling matters."""
    import transformers

    fields = dict(
        LLAMA31_8B,
        hidden_size=256,
        intermediate_size=896,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        torch_dtype="float32",
    )
    directory = write_config(tmp_path / "tiny", fields)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(
        transformers.AutoConfig.from_pretrained(directory)
    ).eval()
    theirs.save_pretrained(directory)
    model_type, config = read.read_config(directory)
    assert config == make_config(
        "llama", "llama3-tiny", num_layers=2, vocab_size=512, seq_length=256
    )
    ours = Llama(config).eval()
    read.load_weights(ours, directory, model_type)
    idx = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(1))
    expected = theirs(idx).logits
    torch.testing.assert_close(ours.lm_head(ours.trunk(idx)), expected, atol=1e-4, rtol=1e-4)
    unscaled = Llama(dataclasses.replace(config, rope_scaling=None)).eval()
    unscaled.load_state_dict(ours.state_dict())
    # 10x the tolerance above
    assert (unscaled.lm_head(unscaled.trunk(idx)) - expected).abs().max() > 1e-3


def llama3_args(tmp_path, run, extra, steps=8):
    """llama3-tiny (2 of its blocks, a 64-token window) on short documents packed several to a
    window."""
    return [
        "--dataset",
        "text",
        "--input_file",
        documents(tmp_path / "docs.jsonl"),
        "--tokenizer_dir",
        tokenizer_dirs.write_tokenizer_json(tmp_path / "tok"),
        *run_dirs(tmp_path),
        "--run_name",
        run,
        "--model",
        "llama",
        "--model_preset",
        "llama3-tiny",
        "--num_layers",
        2,
        "--seq_length",
        64,
        "--batch_size",
        2,
        "--max_steps",
        steps,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--eval_batches",
        1,
        "--num_tokens",
        0,
        "--lr",
        "1e-3",
        "--warmup_steps",
        2,
        "--document_mask",
        "--meta_init",
        "--activation_checkpoints",
        "--recompute",
        "selective",
        "--fsdp_unit",
        "block",
        *extra,
    ]


@pytest.mark.slow
def test_llama3_tiny_trains_as_the_8b_runs(tmp_path):
    """What the 8B runs with on GPUs, on 2 CPU ranks: document mask, meta init, selective recompute,
    FSDP2 per block. In fp32 it matches one process running every document alone; in fp8 (torchao
    emulating the float8 matmuls) it trains close to bf16."""
    args = llama3_args(tmp_path, "fp32", [])
    launch(args, ranks=2, cwd=tmp_path)
    assert logged_losses(tmp_path, "fp32") == pytest.approx(
        reference_losses(args, 2, 0, 8), abs=2e-5
    )
    launch(llama3_args(tmp_path, "bf16", ["--precision", "bf16"]), ranks=2, cwd=tmp_path)
    launch(
        llama3_args(tmp_path, "fp8", ["--precision", "fp8", "--fp8_layers", "all"]),
        ranks=2,
        cwd=tmp_path,
        entry=EMULATED,
    )
    check_close_to_bf16(losses_of(tmp_path, "fp8"), losses_of(tmp_path, "bf16"))
