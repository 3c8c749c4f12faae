"""Document masks (minimal_fsdp/models/attention.py, --document_mask): a window packing several
documents gives each document's tokens the logits, loss and gradients of that document run alone,
for GPT and Llama, through every kernel (dense SDPA; FlexAttention as CUDA runs it, here eagerly;
the varlen kernel's mask, which on the CPU in fp32 falls back to dense); a window without separators
is plain causal attention; the varlen kernel's packed document starts; the kernel choice; a run
trains with the flag (2 ranks) as one process does running every document alone; the flag without an
end-of-text token is a one-line error; the GPU benchmark's packed windows. On CUDA (marked gpu):
torch's varlen flash attention against dense SDPA and each document alone, eager and compiled, and a
training run with each CUDA kernel."""

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, launch
from support import documents, logged_losses, reference_losses, run_dirs, spans

sys.path.insert(0, str(ROOT))
from minimal_fsdp.checkpoint import find
from minimal_fsdp.checkpoint.meta import read_meta
from minimal_fsdp.config.choices import ConfigError  # noqa: E402
from minimal_fsdp.models import attention, families
from minimal_fsdp.models.gpt import GPT, GPTConfig  # noqa: E402
from minimal_fsdp.models.llama import Llama, LlamaConfig  # noqa: E402
from minimal_fsdp.parallel import parallelize  # noqa: E402
from minimal_fsdp.parallel.parallelize import init_weights  # noqa: E402

import tokenizer_dirs  # noqa: E402

EOT = 0
# Two windows of 30 tokens: documents of 8, 12 and 10 tokens (the last cut by the window, no
# separator), and of 13, 1 (a lone end-of-text) and 16 tokens.
ENDS = ([7, 19], [12, 13])


def windows(vocab=50, T=30):
    idx = torch.randint(1, vocab, (2, T), generator=torch.Generator().manual_seed(0))
    for row, ends in enumerate(ENDS):
        idx[row, ends] = EOT
    return idx


def model_of(kind, eot=EOT, **kw):
    if kind == "gpt":
        config = GPTConfig(
            vocab_size=50,
            seq_length=32,
            num_layers=2,
            num_heads=4,
            embed_size=32,
            document_eot_id=eot,
            **kw,
        )
        model = GPT(config)
    else:  # grouped-query attention, Llama 3's rotary base and scaling at a scale where both matter
        config = LlamaConfig(
            vocab_size=50,
            seq_length=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            embed_size=32,
            intermediate_size=48,
            rope_theta=500000.0,
            document_eot_id=eot,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
            **kw,
        )
        model = Llama(config)
    init_weights(model, 0, torch.device("cpu"))
    return model.eval()


def all_logits(model, idx):
    x = model.trunk(idx)
    return F.linear(x, model.wte.weight) if isinstance(model, GPT) else model.lm_head(x)


def alone(model, doc, start):
    """Logits of one document run by itself with plain causal attention (no mask at all), at the
    positions it has in its window: a Llama's rotary attention sees only distances, so there from 0;
    GPT's learned positions are the window's, so its embeddings are added here by hand."""
    if isinstance(model, Llama):
        plain = (
            Llama(LlamaConfig(**dict(model.config.to_dict(), document_eot_id=None)))
            .eval()
            .to(doc.device)
        )
        plain.load_state_dict(model.state_dict())
        return all_logits(plain, doc[None])[0]
    x = model.wte(doc) + model.wpe(torch.arange(start, start + len(doc), device=doc.device))
    for block in model.blocks:
        x = block(x[None])[0]
    return F.linear(model.ln_f(x), model.wte.weight)


def test_document_ids_count_the_ends_before_each_token():
    idx = torch.tensor([[5, EOT, 3, 4, EOT, EOT, 7]])
    assert attention.document_ids(idx, EOT).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_document_starts_pack_every_document_of_the_batch():
    """Row 0 begins with the tail of a document the window cut (tokens 0-1) and ends with a document
    the row's end cuts (tokens 6-7, no end-of-text): it ends there, and row 1 starts a new one.
    Starts over the flattened batch."""
    idx = torch.tensor([[4, EOT, 5, 6, EOT, EOT, 7, 8], [9, 3, EOT, 2, 2, 2, 2, EOT]])
    starts, longest = attention.document_starts(attention.document_ids(idx, EOT))
    # row 0: [0, 2) [2, 5) [5, 6) [6, 8); row 1: [8, 11) [11, 16)
    assert starts.dtype == torch.int32 and starts.tolist() == [0, 2, 5, 6, 8, 11, 16]
    assert longest == 5
    one, longest = attention.document_starts(attention.document_ids(torch.tensor([[3, 4, 5]]), EOT))
    assert one.tolist() == [0, 3] and longest == 3


needs_varlen = pytest.mark.skipif(
    attention.varlen_attn is None, reason="this torch has no varlen attention"
)


@needs_varlen
def test_the_kernel_choice(monkeypatch):
    """flex on CUDA without dropout, varlen when the variable names it; dense on the CPU or with
    dropout."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(attention.KERNEL_VARIABLE, raising=False)
    assert attention.document_kernel(cuda, 0.0) == "flex"
    assert attention.document_kernel(cuda, 0.1) == "dense"
    assert attention.document_kernel(cpu, 0.0) == "dense"
    monkeypatch.setenv(attention.KERNEL_VARIABLE, "varlen")
    assert attention.document_kernel(cuda, 0.0) == "varlen"
    assert attention.document_kernel(cuda, 0.1) == attention.document_kernel(cpu, 0.0) == "dense"
    # FlexAttention's CUDA kernel takes heads of 16 or more (a head of 8 failed to compile on an
    # H200); varlen, 8
    assert attention.document_kernel(cuda, 0.0, head_size=8) == "varlen"
    monkeypatch.delenv(attention.KERNEL_VARIABLE)
    assert attention.document_kernel(cuda, 0.0, head_size=8) == "dense"
    assert attention.document_kernel(cuda, 0.0, head_size=16) == "flex"
    monkeypatch.setenv(attention.KERNEL_VARIABLE, "flash")
    with pytest.raises(
        attention.KernelError, match="MINIMAL_FSDP_DOCUMENT_KERNEL=flash is not a document-mask"
    ):
        attention.document_kernel(cuda, 0.0)
    # checked as a run builds its model config with --document_mask, before any collective
    flags, tokenizer = SimpleNamespace(document_mask=True), SimpleNamespace(eot_id=EOT, kind="gpt2")
    with pytest.raises(ConfigError, match="MINIMAL_FSDP_DOCUMENT_KERNEL=flash"):
        families.with_document_mask(model_of("gpt", eot=None).config, flags, tokenizer)
    monkeypatch.setenv(attention.KERNEL_VARIABLE, "varlen")
    assert (
        families.with_document_mask(
            model_of("gpt", eot=None).config, flags, tokenizer
        ).document_eot_id
        == EOT
    )


def test_varlen_needs_a_torch_that_has_it(monkeypatch):
    """torch 2.9 (torch_xla's) has no torch.nn.attention.varlen: the package still imports, and
    naming the kernel is one line as the run starts."""
    monkeypatch.setattr(attention, "varlen_attn", None)
    monkeypatch.setenv(attention.KERNEL_VARIABLE, "varlen")
    with pytest.raises(
        attention.KernelError, match="MINIMAL_FSDP_DOCUMENT_KERNEL=varlen needs torch 2.10"
    ):
        attention.document_kernel(torch.device("cuda"), 0.0)
    monkeypatch.delenv(attention.KERNEL_VARIABLE)
    assert attention.document_kernel(torch.device("cuda"), 0.0) == "flex"


@needs_varlen
def test_selective_recompute_keeps_both_cuda_kernels_outputs():
    for op in (torch._higher_order_ops.flex_attention, torch.ops.torch_attn._varlen_attn.default):
        assert parallelize.keep_matmuls(None, op) == parallelize.CheckpointPolicy.MUST_SAVE


@needs_varlen
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_varlen_attention_traces_into_one_graph(autocast):
    """Inside a compiled block the varlen kernel is one graph with varlen_attn in it (fullgraph: no
    break), in bf16 or from fp32 under bf16 autocast. Traced only, by a compiler backend that stops
    there: varlen_attn runs on CUDA alone."""
    graphs = []

    def stop(graph_module, example_inputs):
        graphs.append(graph_module)
        raise RuntimeError("traced")

    ids = attention.document_ids(windows(), EOT)
    mask = attention.Documents(*attention.document_starts(ids), ids)
    dtype = torch.float32 if autocast else torch.bfloat16
    q, k, v = (torch.randn(2, heads, 30, 8, dtype=dtype) for heads in (4, 2, 2))
    torch._dynamo.reset()
    attend = torch.compile(attention.attend_documents, fullgraph=True, backend=stop)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        pytest.raises(Exception, match="traced"),
    ):
        attend(q, k, v, mask, 0.0)
    assert len(graphs) == 1
    assert "torch_attn._varlen_attn" in [str(node.target) for node in graphs[0].graph.nodes]


def varlen_by_hand(
    q,
    k,
    v,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    window_size=(-1, -1),
    is_causal=False,
    enable_gqa=False,
):
    """torch.nn.attention.varlen.varlen_attn as its documentation describes it, in plain SDPA: q
    (total, H, D) and k, v (total, K, D) cut into sequences at cu_seq, each attended alone; causal
    for window_size (-1, 0) (torch 2.11 on) or is_causal (2.9); K < H only with enable_gqa, each
    group of H / K query heads sharing one k, v head."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k and cu_seq_q.dtype == torch.int32
    assert (tuple(window_size) == (-1, 0)) != is_causal
    bounds = cu_seq_q.tolist()
    assert (
        bounds[0] == 0
        and bounds[-1] == q.size(0)
        and max_q == max(b - a for a, b in zip(bounds, bounds[1:]))
    )
    assert enable_gqa or k.size(1) == q.size(1)
    out = torch.empty_like(q)
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(q.size(1) // k.size(1), dim=0) for t in (ks, vs))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


@pytest.mark.parametrize("version", ["first", "2.11", "2.13"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_varlen_kernel_packs_the_documents_for_varlen_attn(monkeypatch, version, kv_heads):
    """What the varlen kernel hands varlen_attn (q, k, v packed as (B*T, heads, D), the document
    starts, the longest, causal, grouped-query heads as each torch version takes them) gives the
    dense mask's attention, with varlen_attn done by hand (the real one runs on CUDA alone: the GPU
    tests below)."""
    monkeypatch.setattr(attention, "varlen_attn", varlen_by_hand)
    monkeypatch.setattr(
        attention,
        "_VARLEN_CAUSAL",
        {"is_causal": True} if version == "first" else {"window_size": (-1, 0)},
    )
    monkeypatch.setattr(attention, "_VARLEN_GQA", version == "2.13")
    ids = attention.document_ids(windows(), EOT)
    mask = attention.Documents(*attention.document_starts(ids), ids)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, heads, 30, 8, generator=generator) for heads in (4, kv_heads, kv_heads)
    )
    expected = attention.attend_documents(
        q, k, v, attention.document_mask(windows(), EOT, kernel="dense"), 0.0
    )
    torch.testing.assert_close(
        attention._attend_varlen(q, k, v, mask), expected, atol=1e-6, rtol=1e-5
    )


def use_kernel(monkeypatch, kernel):
    monkeypatch.setattr(attention, "document_kernel", lambda device, dropout, head_size: kernel)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["dense", "flex", "varlen"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@torch.no_grad()
def test_each_packed_document_has_its_logits_alone(monkeypatch, kind, kernel):
    model = model_of(kind)
    use_kernel(monkeypatch, kernel)
    idx = windows()
    packed = all_logits(model, idx)
    unmasked = all_logits(model_of(kind, eot=None), idx)
    for row, ends in enumerate(ENDS):
        for start, stop in spans(ends):
            expected = alone(model, idx[row, start:stop], start)
            torch.testing.assert_close(packed[row, start:stop], expected, atol=2e-5, rtol=1e-5)
            if start > 0:  # without the mask, later documents see the earlier ones
                assert not torch.allclose(unmasked[row, start:stop], expected, atol=1e-3)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["dense", "flex", "varlen"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@torch.no_grad()
def test_a_window_without_separators_is_plain_causal(monkeypatch, kind, kernel):
    use_kernel(monkeypatch, kernel)
    idx = torch.randint(1, 50, (2, 30), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        all_logits(model_of(kind), idx),
        all_logits(model_of(kind, eot=None), idx),
        atol=2e-6,
        rtol=1e-6,
    )


def test_the_packed_loss_and_gradients_are_those_of_the_documents_alone():
    """Llama (rotary): the mean loss over a packed batch, and its gradients, equal the
    token-weighted mean of each document's loss run alone."""
    model, plain = model_of("llama").train(), model_of("llama", eot=None).train()
    idx = windows()
    targets = torch.randint(1, 50, idx.shape, generator=torch.Generator().manual_seed(2))
    model(idx, targets).backward()
    total = 0
    for row, ends in enumerate(ENDS):
        for start, stop in spans(ends):
            total += plain(idx[row : row + 1, start:stop], targets[row : row + 1, start:stop]) * (
                stop - start
            )
    (total / idx.numel()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_decoding_with_a_cache_stays_causal():
    """Generation continues one text: with a cache, no document mask is built."""
    model = model_of("llama")
    assert model.attention_mask(windows(), cache=model.new_cache(2, "cpu", torch.float32)) is None
    assert model.attention_mask(windows()) is not None


def test_the_config_records_the_token_only_when_on():
    """Checkpoints from before document masks record no document_eot_id: they compare equal to a run
    without."""
    assert "document_eot_id" not in model_of("gpt", eot=None).config.to_dict()
    assert model_of("llama", eot=7).config.to_dict()["document_eot_id"] == 7


def train_args(tmp_path, run, extra=()):
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
        "--num_layers",
        2,
        "--num_heads",
        4,
        "--num_kv_heads",
        2,
        "--embed_size",
        32,
        "--intermediate_size",
        48,
        "--seq_length",
        32,
        "--batch_size",
        4,
        "--max_steps",
        4,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--eval_batches",
        1,
        "--num_tokens",
        0,
        "--warmup_steps",
        2,
        "--dropout",
        "0.0",
        *extra,
    ]


@pytest.mark.slow
def test_training_with_document_mask_on_two_ranks_matches_documents_alone(tmp_path):
    args = train_args(tmp_path, "masked", ["--document_mask", "--sharding", "full-shard"])
    launch(args, ranks=2, cwd=tmp_path)
    meta = read_meta(find.latest(tmp_path / "checkpoints" / "masked"))
    eot = meta["model"]["document_eot_id"]
    assert (
        eot
        == json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    )
    losses = logged_losses(tmp_path, "masked")
    assert losses == pytest.approx(reference_losses(args, 2, eot, 4), abs=2e-5)
    launch(train_args(tmp_path, "plain"), ranks=2, cwd=tmp_path)
    # the mask acts
    assert logged_losses(tmp_path, "plain")[0] != pytest.approx(losses[0], abs=1e-4)


def test_document_mask_refuses_a_tokenizer_without_an_end_of_text_token():
    """A char vocabulary has no end-of-text token to keep documents apart at: the run's model
    config is refused in one line, before any collective (below: the same through the entry)."""
    from minimal_fsdp.data.tokenizer import CharTokenizer

    flags = SimpleNamespace(document_mask=True)
    with pytest.raises(ConfigError) as error:
        families.with_document_mask(model_of("gpt", eot=None).config, flags, CharTokenizer("ab "))
    assert str(error.value).startswith(
        "--document_mask needs a tokenizer with an end-of-text token, and char has none: use "
        "--tokenizer gpt2 or sentencepiece"
    )
    unmasked = model_of("gpt", eot=None).config
    assert families.with_document_mask(unmasked, SimpleNamespace(document_mask=False), None) is (
        unmasked
    )


@pytest.mark.slow  # quick in process: above
def test_document_mask_needs_an_end_of_text_token(tmp_path, corpus):
    out = launch(
        [
            "--dataset",
            "text",
            "--input_file",
            corpus,
            "--data_dir",
            tmp_path / "data",
            "--document_mask",
            "--max_steps",
            1,
        ],
        ranks=1,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --document_mask needs a tokenizer with an end-of-text")
    )


def test_the_benchmarks_windows_pack_documents_of_the_asked_length():
    """benchmarks/document_mask.py's windows: documents of 1 to 2 x document_length - 1 tokens, each
    ended by the token; targets are the inputs shifted by one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from document_mask import packed_windows

    ((x, y),) = packed_windows(1, 4, 256, 20, 8, 7, seed=0)
    rows = torch.cat([x, y[:, -1:]], dim=1)
    for row in rows:
        ends = (row == 7).nonzero().flatten().tolist()
        lengths = [b - a for a, b in zip([-1] + ends, ends)]
        assert len(ends) > 10 and all(1 <= n < 16 for n in lengths)
    assert torch.equal(x[:, 1:], y[:, :-1])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def logits_and_grads(model, idx, targets, monkeypatch, kernel, bf16=True):
    """Logits and parameter gradients of the mean loss through `kernel`, under bf16 autocast (a
    one-GPU run's precision) or in fp32; varlen_attn's calls are counted, so a silent fall back to
    dense SDPA fails the test."""
    from torch.nn.attention.varlen import varlen_attn

    use_kernel(monkeypatch, kernel)
    calls = []
    monkeypatch.setattr(
        attention, "varlen_attn", lambda *a, **kw: calls.append(1) or varlen_attn(*a, **kw)
    )
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = all_logits(model, idx)
    F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
    assert len(calls) == (model.config.num_layers if kernel == "varlen" else 0)
    return [logits.float()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_varlen_on_cuda_matches_dense_and_each_document_alone(monkeypatch, kind):
    """torch's varlen flash attention in bf16 (Llama: grouped-query, 4 heads over 2): its logits and
    gradients as close to fp32 dense SDPA's as dense SDPA's under the same autocast (within twice
    its error, or 1%); each document's logits those of the document alone (fp32, plain causal
    attention), within bf16 rounding."""
    model = model_of(kind).cuda()
    idx = windows().cuda()
    targets = torch.randint(1, 50, idx.shape, generator=torch.Generator().manual_seed(2)).cuda()
    exact = logits_and_grads(model, idx, targets, monkeypatch, "dense", bf16=False)
    dense = logits_and_grads(model, idx, targets, monkeypatch, "dense")
    varlen = logits_and_grads(model, idx, targets, monkeypatch, "varlen")
    names = ["logits"] + [name for name, _ in model.named_parameters()]
    for name, got, rounded, expected in zip(names, varlen, dense, exact):
        assert relative_error(got, expected) < max(2 * relative_error(rounded, expected), 1e-2), (
            name
        )
    unmasked = all_logits(model_of(kind, eot=None).cuda(), idx).detach()
    with torch.no_grad():
        for row, ends in enumerate(ENDS):
            for start, stop in spans(ends):
                expected = alone(model, idx[row, start:stop], start)
                assert relative_error(varlen[0][row, start:stop], expected) < 2e-2, (row, start)
                # the mask acts: without it, later documents see the earlier ones (10% or more)
                if start > 0:
                    assert relative_error(unmasked[row, start:stop], expected) > 5e-2, (row, start)


@pytest.mark.gpu
@cuda
@torch.no_grad()
def test_varlen_in_compiled_blocks_under_selective_recompute(monkeypatch):
    """As training runs it: each Llama block compiled around selective recompute
    (parallelize.build_model's wrapping), two batches of different document counts and lengths (the
    second recompiles with them dynamic); each gives eager varlen's logits."""
    model = model_of("llama").cuda()
    use_kernel(monkeypatch, "varlen")
    batches = [windows().cuda(), windows().cuda()]
    batches[1][0, 3] = EOT  # one more document, the longest shorter
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = [all_logits(model, idx).float() for idx in batches]
        for block in model.blocks:
            block.forward = torch.compile(parallelize.recomputed(block.forward, "selective"))
        with torch.enable_grad():
            compiled = [all_logits(model, idx).float() for idx in batches]
    for got, expected in zip(compiled, eager):
        assert relative_error(got, expected) < 1e-2


@pytest.mark.gpu
@cuda
def test_training_with_each_cuda_kernel_gives_the_same_losses(tmp_path):
    """One GPU, bf16, compiled, selective recompute: --document_mask through FlexAttention (the
    default) and through varlen (MINIMAL_FSDP_DOCUMENT_KERNEL=varlen) log the same losses within
    bf16 rounding."""
    extra = [
        "--document_mask",
        "--precision",
        "bf16",
        "--compile",
        "--activation_checkpoints",
        # heads of 16: the narrowest FlexAttention takes
        "--recompute",
        "selective",
        "--embed_size",
        "64",
    ]
    losses = {}
    for kernel in attention.CUDA_KERNELS:
        launch(
            train_args(tmp_path, kernel, extra),
            ranks=1,
            cwd=tmp_path,
            env={attention.KERNEL_VARIABLE: kernel},
        )
        losses[kernel] = logged_losses(tmp_path, kernel)
    assert len(losses["varlen"]) == 4
    assert losses["varlen"] == pytest.approx(losses["flex"], rel=2e-2)


@pytest.mark.slow  # compiles: seconds
def test_without_gradients_the_mask_is_built_outside_the_compiled_graph(monkeypatch):
    """A model compiled whole (one GPU, CUDA graphs) evaluates with its mask built outside the
    graph: inductor failed to lower FlexAttention in a no-grad graph that computes the mask's
    documents itself (H200, torch 2.11). Training keeps the mask inside the graph, as trained on the
    GPU. (GPT builds it in the same place, layers.py.)"""
    traced = []
    document_ids = attention.document_ids

    def recording(idx, eot_id):
        traced.append(torch.compiler.is_compiling())
        return document_ids(idx, eot_id)

    monkeypatch.setattr(attention, "document_ids", recording)
    model, idx = model_of("llama"), windows()
    with torch.no_grad():
        expected = model(idx)[0]
        traced.clear()
        got = torch.compile(model, backend="eager")(idx)[0]
    assert traced == [False]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    traced.clear()
    torch.compile(model, backend="eager")(idx)
    assert traced == [True]
