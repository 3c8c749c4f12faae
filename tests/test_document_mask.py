"""Document masks (minimal_fsdp/attention.py, --document_mask): a window packing several documents gives each
document's tokens the logits, loss and gradients of that document run alone, for GPT and Llama, through both
implementations (dense SDPA, and FlexAttention as CUDA runs it, here eagerly); a window without separators is
plain causal attention; a run trains with the flag (2 ranks) as one process does running every document alone;
the flag without an end-of-text token is a one-line error; the GPU benchmark's packed windows."""
import json
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, launch
from test_parallelize import logged_losses

sys.path.insert(0, str(ROOT))
import reference  # noqa: E402
import tokenizer_dirs  # noqa: E402
from minimal_fsdp import attention, checkpoint_find, checkpoint_meta  # noqa: E402
from minimal_fsdp.llama import Llama, LlamaConfig  # noqa: E402
from minimal_fsdp.model import GPT, GPTConfig  # noqa: E402
from minimal_fsdp.parallelize import init_weights  # noqa: E402

EOT = 0
# Two windows of 30 tokens: documents of 8, 12 and 10 tokens (the last cut by the window, no separator), and of 13,
# 1 (a lone end-of-text) and 16 tokens.
ENDS = ([7, 19], [12, 13])


def windows(vocab=50, T=30):
    idx = torch.randint(1, vocab, (2, T), generator=torch.Generator().manual_seed(0))
    for row, ends in enumerate(ENDS):
        idx[row, ends] = EOT
    return idx


def spans(ends, T=30):
    """(start, stop) of each document of a window whose end-of-text tokens are at `ends`."""
    starts = [0] + [e + 1 for e in ends]
    return [(a, b) for a, b in zip(starts, [e + 1 for e in ends] + [T]) if a < b]


def model_of(kind, eot=EOT, **kw):
    if kind == "gpt":
        config = GPTConfig(vocab_size=50, seq_length=32, num_layers=2, num_heads=4, embed_size=32,
                           document_eot_id=eot, **kw)
        model = GPT(config)
    else:  # grouped-query attention, Llama 3's rotary base and scaling at a scale where both matter
        config = LlamaConfig(vocab_size=50, seq_length=32, num_layers=2, num_heads=4, num_kv_heads=2, embed_size=32,
                             intermediate_size=48, rope_theta=500000.0, document_eot_id=eot,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8}, **kw)
        model = Llama(config)
    init_weights(model, 0, torch.device("cpu"))
    return model.eval()


def all_logits(model, idx):
    x = model.trunk(idx)
    return F.linear(x, model.wte.weight) if isinstance(model, GPT) else model.lm_head(x)


def alone(model, doc, start):
    """Logits of one document run by itself with plain causal attention (no mask at all), at the positions it has
    in its window: a Llama's rotary attention sees only distances, so there from 0; GPT's learned positions are
    the window's, so its embeddings are added here by hand."""
    if isinstance(model, Llama):
        plain = Llama(LlamaConfig(**dict(model.config.to_dict(), document_eot_id=None))).eval()
        plain.load_state_dict(model.state_dict())
        return all_logits(plain, doc[None])[0]
    x = model.wte(doc) + model.wpe(torch.arange(start, start + len(doc)))
    for block in model.blocks:
        x = block(x[None])[0]
    return F.linear(model.ln_f(x), model.wte.weight)


def test_document_ids_count_the_ends_before_each_token():
    idx = torch.tensor([[5, EOT, 3, 4, EOT, EOT, 7]])
    assert attention.document_ids(idx, EOT).tolist() == [[0, 0, 1, 1, 1, 2, 3]]


def test_the_choice_is_flex_on_cuda_without_dropout_only():
    assert attention.uses_flex(torch.device("cuda"), 0.0)
    assert not attention.uses_flex(torch.device("cuda"), 0.1)
    assert not attention.uses_flex(torch.device("cpu"), 0.0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@torch.no_grad()
def test_each_packed_document_has_its_logits_alone(monkeypatch, kind, flex):
    model = model_of(kind)
    monkeypatch.setattr(attention, "uses_flex", lambda device, dropout: flex)
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
@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@torch.no_grad()
def test_a_window_without_separators_is_plain_causal(monkeypatch, kind, flex):
    monkeypatch.setattr(attention, "uses_flex", lambda device, dropout: flex)
    idx = torch.randint(1, 50, (2, 30), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(all_logits(model_of(kind), idx), all_logits(model_of(kind, eot=None), idx),
                               atol=2e-6, rtol=1e-6)


def test_the_packed_loss_and_gradients_are_those_of_the_documents_alone():
    """Llama (rotary): the mean loss over a packed batch, and its gradients, equal the token-weighted mean of each
    document's loss run alone."""
    model, plain = model_of("llama").train(), model_of("llama", eot=None).train()
    idx = windows()
    targets = torch.randint(1, 50, idx.shape, generator=torch.Generator().manual_seed(2))
    model(idx, targets).backward()
    total = 0
    for row, ends in enumerate(ENDS):
        for start, stop in spans(ends):
            total += plain(idx[row:row + 1, start:stop], targets[row:row + 1, start:stop]) * (stop - start)
    (total / idx.numel()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_decoding_with_a_cache_stays_causal():
    """Generation continues one text: with a cache, no document mask is built."""
    model = model_of("llama")
    assert model.attention_mask(windows(), cache=model.new_cache(2, "cpu", torch.float32)) is None
    assert model.attention_mask(windows()) is not None


def test_the_config_records_the_token_only_when_on():
    """Checkpoints from before document masks record no document_eot_id: they compare equal to a run without."""
    assert "document_eot_id" not in model_of("gpt", eot=None).config.to_dict()
    assert model_of("llama", eot=7).config.to_dict()["document_eot_id"] == 7


def documents(path, n=300):
    """A .jsonl corpus of short documents (a few BPE tokens to a few dozen): several per 32-token window."""
    text = tokenizer_dirs.training_text().split("\n\n")
    path.write_text("".join(json.dumps({"text": t.strip()}) + "\n" for t in text[:n] if t.strip()))
    return path


def train_args(tmp_path, run, extra=()):
    return ["--dataset", "text", "--input_file", documents(tmp_path / "docs.jsonl"),
            "--tokenizer_dir", tokenizer_dirs.write_tokenizer_json(tmp_path / "tok"), "--data_dir", tmp_path / "data",
            "--log_dir", tmp_path / "logs", "--checkpoint_dir", tmp_path / "checkpoints", "--run_name", run,
            "--model", "llama", "--num_layers", 2, "--num_heads", 4, "--num_kv_heads", 2, "--embed_size", 32,
            "--intermediate_size", 48, "--seq_length", 32, "--batch_size", 4, "--max_steps", 4, "--log_interval", 1,
            "--eval_interval", 0, "--eval_batches", 1, "--num_tokens", 0, "--warmup_steps", 2, "--dropout", "0.0",
            *extra]


def reference_losses(args, world, eot, steps):
    """tests/reference.py's single-process training, its loss summed over every document of each window run
    alone (the plain model knows no document masks)."""
    cfg = reference.parse_args([str(a) for a in args])
    data = reference.PreparedTokens(cfg.data_dir)
    model = reference.build(cfg, data.vocab_size, torch.device("cpu"))
    optimizer = reference.adamw(model, cfg)
    lr = reference.schedule(cfg, cfg.max_steps)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        x, y = data.global_batch("train", step, world, cfg.batch_size, cfg.seq_length, cfg.seed)
        total = 0
        for row in range(x.size(0)):
            ends = (x[row] == eot).nonzero().flatten().tolist()
            for start, stop in spans(ends, cfg.seq_length):
                total = total + model(x[row:row + 1, start:stop], y[row:row + 1, start:stop]) * (stop - start)
        loss = total / x.numel()
        loss.backward()
        reference.apply_gradients(model, optimizer, cfg)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_training_with_document_mask_on_two_ranks_matches_documents_alone(tmp_path):
    args = train_args(tmp_path, "masked", ["--document_mask", "--sharding", "full-shard"])
    launch(args, ranks=2, cwd=tmp_path)
    meta = checkpoint_meta.read_meta(checkpoint_find.latest(tmp_path / "checkpoints" / "masked"))
    eot = meta["model"]["document_eot_id"]
    assert eot == json.loads((tmp_path / "tok" / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    losses = logged_losses(tmp_path, "masked")
    assert losses == pytest.approx(reference_losses(args, 2, eot, 4), abs=2e-5)
    launch(train_args(tmp_path, "plain"), ranks=2, cwd=tmp_path)
    assert logged_losses(tmp_path, "plain")[0] != pytest.approx(losses[0], abs=1e-4)  # the mask acts


def test_document_mask_needs_an_end_of_text_token(tmp_path, corpus):
    out = launch(["--dataset", "text", "--input_file", corpus, "--data_dir", tmp_path / "data", "--document_mask",
                  "--max_steps", 1], ranks=1, cwd=tmp_path, check=False)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: --document_mask needs a tokenizer with an end-of-text")


def test_the_benchmarks_windows_pack_documents_of_the_asked_length():
    """benchmarks/document_mask.py's windows: documents of 1 to 2 x document_length - 1 tokens, each ended by the
    token; targets are the inputs shifted by one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from document_mask import packed_windows
    (x, y), = packed_windows(1, 4, 256, 20, 8, 7, seed=0)
    rows = torch.cat([x, y[:, -1:]], dim=1)
    for row in rows:
        ends = (row == 7).nonzero().flatten().tolist()
        lengths = [b - a for a, b in zip([-1] + ends, ends)]
        assert len(ends) > 10 and all(1 <= n < 16 for n in lengths)
    assert torch.equal(x[:, 1:], y[:, :-1])
