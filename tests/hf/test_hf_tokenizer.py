"""py: our tokenizers (char, sentencepiece, tokenizer.json, tiktoken, GPT-2's) written
as a tokenizer.json that transformers' AutoTokenizer reads and that gives our token ids,
transformers' byte table, special tokens on decoding, and the probe's warning where a written
tokenizer.json would encode otherwise."""

import json
from types import SimpleNamespace

import pytest
import torch

from minimal_fsdp.config.flags import ConfigError
from minimal_fsdp.data.tokenizer import (
    CharTokenizer,
    GPT2Tokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    train_tokenizer,
)
from minimal_fsdp.hf import read, write
from minimal_fsdp.hf.tokenizer import PROBE, _bytes_to_unicode, _from_tiktoken, hf_tokenizer
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.llama import LlamaConfig
from minimal_fsdp.parallel.parallelize import init_weights

import tokenizer_dirs

transformers = pytest.importorskip("transformers")


def stub_gpt2(monkeypatch):
    """A GPT2Tokenizer over a tiny tiktoken encoding with GPT-2's split pattern (no gpt2 files
    offline)."""
    tokenizer_dirs.stub_gpt2_encoding(monkeypatch)
    return GPT2Tokenizer()


def tokenizer_of_kind(kind, tmp_path, monkeypatch):
    if kind == "char":
        return train_tokenizer(
            "char",
            tokenizer_dirs.training_text() + "".join(tokenizer_dirs.MIXED),
            None,
            tmp_path / "tok",
        )
    if kind == "sentencepiece":
        return load_tokenizer(tokenizer_dirs.write_sentencepiece(tmp_path / "tok"))
    if kind == "hf":
        return load_tokenizer(tokenizer_dirs.write_tokenizer_json(tmp_path / "tok"))
    if kind == "tiktoken":
        return load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tok")[0])
    return stub_gpt2(monkeypatch)


@pytest.mark.parametrize("kind", ["char", "sentencepiece", "hf", "tiktoken", "gpt2"])
def test_export_carries_a_tokenizer_that_transformers_reads_as_ours(tmp_path, monkeypatch, kind):
    tokenizer = tokenizer_of_kind(kind, tmp_path, monkeypatch)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        seq_length=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        embed_size=16,
        intermediate_size=32,
    )
    ours = MODELS["llama"](config)
    init_weights(ours, 0, torch.device("cpu"))
    write.save_hf(
        ours.state_dict(),
        {"model": config.to_dict(), "model_type": "llama"},
        tmp_path / "out",
        tokenizer,
    )
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in tokenizer_dirs.MIXED:
        ids = tokenizer.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids, text
        assert theirs.decode(ids) == tokenizer.decode(ids) == text
    # bos/eos in config.json are ours, and are tokens of the vocabulary (or absent, for char)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (tokenizer.bos_id, tokenizer.eot_id)
    assert theirs.eos_token_id == tokenizer.eot_id and theirs.bos_token_id == tokenizer.bos_id
    for i in (tokenizer.bos_id, tokenizer.eot_id):
        assert i is None or i < tokenizer.vocab_size and theirs.convert_ids_to_tokens(i) is not None
    if kind != "char":
        assert tokenizer.eot_id is not None
    # and --hf_model reads the export's tokenizer back, with the same ids
    again = read.load_tokenizer(tmp_path / "out")
    assert all(again.encode(t) == tokenizer.encode(t) for t in tokenizer_dirs.MIXED)
    assert again.eot_id == tokenizer.eot_id


# -----------------------------------------------------------------------------
# out: the tokenizer


def test_byte_table_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert _bytes_to_unicode() == bytes_to_unicode()


def sentencepiece(**options):
    """A sentencepiece BPE trained here with trainer options of a Llama 2 tokenizer.model's kind."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(tokenizer_dirs.training_text().splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=320 if options.get("byte_fallback") else 200,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        num_threads=1,
        minloglevel=2,
        **options,
    )
    return SentencePieceTokenizer(model.getvalue())


def assert_encodes_as(tok, tokenizer, texts):
    for text in texts:
        ids = tokenizer.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids), text


@pytest.mark.parametrize(
    "options",
    [
        dict(byte_fallback=True),
        dict(byte_fallback=False),
        dict(byte_fallback=True, add_dummy_prefix=False),
        dict(byte_fallback=False, add_dummy_prefix=False, unk_id=3, bos_id=-1, eos_id=1, pad_id=0),
    ],
)
def test_sentencepiece_as_tokenizer_json(tmp_path, options):
    tokenizer = sentencepiece(**options)
    tok, names = hf_tokenizer(tokenizer)
    texts = tokenizer_dirs.MIXED + ["the king", "  two  spaces ", "中文 テキスト"]
    if options["byte_fallback"]:
        assert_encodes_as(tok, tokenizer, texts)
    else:  # unknown characters: one unk for a run of them, as sentencepiece
        for text in texts:
            assert tok.encode(text, add_special_tokens=False).ids == tokenizer.encode(text), text
        assert tokenizer.encode("中文") == [tokenizer.sp.unk_id()] or tokenizer.encode("中文")[
            -1:
        ] == [tokenizer.sp.unk_id()]
    sp = tokenizer.sp
    assert names == {
        "eos_token": sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None,
        "bos_token": sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None,
        "unk_token": sp.id_to_piece(sp.unk_id()),
    }
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    assert specials == {
        sp.id_to_piece(i)
        for i in range(sp.get_piece_size())
        if sp.is_control(i) or sp.is_unknown(i)
    }


def test_tiktoken_as_tokenizer_json(tmp_path, monkeypatch):
    llama3 = load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tok")[0])
    tok, names = hf_tokenizer(llama3)
    assert_encodes_as(tok, llama3, tokenizer_dirs.MIXED + ["aaaa bbb"])
    assert names == {"eos_token": "<|end_of_text|>", "bos_token": "<|begin_of_text|>"}
    assert (
        tok.token_to_id("<|end_of_text|>") == llama3.eot_id
        and tok.get_vocab_size() == llama3.vocab_size
    )
    stub_gpt2(monkeypatch)
    gpt2 = GPT2Tokenizer()
    tok, names = hf_tokenizer(gpt2)
    assert_encodes_as(tok, gpt2, tokenizer_dirs.MIXED)
    assert names == {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    with pytest.raises(ConfigError) as error:
        _from_tiktoken(gpt2.ranks, gpt2.pattern, {"<|endoftext|>": len(gpt2.ranks) + 1})
    assert str(error.value) == (
        f"special token <|endoftext|> has id {len(gpt2.ranks) + 1}, which tokenizer.json "
        "cannot give it"
    )
    n = len(gpt2.ranks)  # ids handed out in id order, whatever the names' order
    tok = _from_tiktoken(gpt2.ranks, gpt2.pattern, {"<|a|>": n + 1, "<|b|>": n, "<|c|>": n + 2})
    assert [tok.token_to_id(t) for t in ("<|b|>", "<|a|>", "<|c|>")] == [n, n + 1, n + 2]


def test_tiktoken_takes_a_piece_that_is_a_token_whole():
    """Merging by rank alone would stop at a, bc, d: tiktoken takes "abcd" whole, as it is in the
    vocabulary."""
    import tiktoken

    ranks = {b"a": 0, b"b": 1, b"c": 2, b"d": 3, b"bc": 4, b"ab": 5, b"cd": 6, b"abcd": 7, b" ": 8}
    pattern = r" ?[a-z]+"
    enc = tiktoken.Encoding(
        name="crafted", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
    )
    tok = _from_tiktoken(ranks, pattern, {})
    for text in ("abcd", "abcd abc bcd", "dcba"):
        assert tok.encode(text).ids == enc.encode_ordinary(text), text
    assert enc.encode_ordinary("abcd") == [7]


def test_hf_and_char_tokenizers_as_tokenizer_json(tmp_path):
    hf_tok = load_tokenizer(tokenizer_dirs.write_tokenizer_json(tmp_path / "tok"))
    tok, names = hf_tokenizer(hf_tok)
    assert tok.to_str() == hf_tok.json
    assert names == {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    chars = CharTokenizer("ba \n")
    tok, names = hf_tokenizer(chars)
    assert_encodes_as(tok, chars, ["ab  a\nb", "a"])
    assert names == {"eos_token": None, "bos_token": None}
    with pytest.raises(ConfigError) as error:
        hf_tokenizer(SimpleNamespace(kind="bytes"))
    assert str(error.value) == "no Hugging Face tokenizer.json for a bytes tokenizer"


def test_tokenizer_files_transformers_reads(tmp_path, capsys):
    tokenizer = sentencepiece()
    write.write_hf_tokenizer(tokenizer, tmp_path, 77)
    assert capsys.readouterr().err == ""
    assert (tmp_path / "tokenizer.model").read_bytes() == tokenizer.model_proto
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert type(theirs).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert theirs.model_max_length == 77 and theirs.clean_up_tokenization_spaces is False
    assert theirs.unk_token == tokenizer.sp.id_to_piece(tokenizer.sp.unk_id())
    ids = tokenizer.encode("the king  and . of")
    assert theirs.decode(ids) == tokenizer.decode(ids)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # stated: transformers 4 defaults to cleaning up spaces, which decodes "a ." as "a."
    assert (
        config["tokenizer_class"] == "PreTrainedTokenizerFast"
        and config["clean_up_tokenization_spaces"] is False
    )
    chars = CharTokenizer("xyz")  # the probe text is its own alphabet (it cannot encode ours)
    (tmp_path / "c").mkdir()
    write.write_hf_tokenizer(chars, tmp_path / "c", 5)
    assert capsys.readouterr().err == "" and not (tmp_path / "c" / "tokenizer.model").exists()


def test_a_tokenizer_json_that_encodes_otherwise_is_reported(tmp_path, capsys, monkeypatch):
    tokenizer = sentencepiece()
    monkeypatch.setattr(tokenizer, "encode", lambda text: [0])
    write.write_hf_tokenizer(tokenizer, tmp_path, 16)
    assert capsys.readouterr().err == (
        "warning: the exported tokenizer.json encodes a test text differently from "
        "our sentencepiece tokenizer: check it before relying on it\n"
    )
    probes = []
    monkeypatch.setattr(
        tokenizer, "encode", lambda text: probes.append(text) or tokenizer.sp.encode(text)
    )
    write.write_hf_tokenizer(tokenizer, tmp_path, 16)
    assert probes == [PROBE] and capsys.readouterr().err == ""


def test_special_tokens_are_skipped_when_decoding_asks_to(tmp_path):
    """transformers' generation decodes with skip_special_tokens=True: the eos must go, the text
    must stay."""
    llama3 = load_tokenizer(tokenizer_dirs.write_tiktoken(tmp_path / "tiktoken")[0])
    for tokenizer in (llama3, sentencepiece(byte_fallback=True)):
        tok, _ = hf_tokenizer(tokenizer)
        ids = [tokenizer.bos_id, *tokenizer.encode("the king"), tokenizer.eot_id]
        assert tok.decode(ids, skip_special_tokens=True) == "the king", tokenizer.kind


def test_a_tokenizer_json_that_adds_a_bos_is_not_reported(tmp_path, capsys):
    """Hub tokenizer.json files (Llama's) add BOS in a post-processor; ours encodes without it, as
    the probe does."""
    from tokenizers import processors

    tok = tokenizer_dirs.bpe_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eos)]
    )
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tok.encode("hi").ids[0] == eos and tokenizer.encode("hi")[0] != eos
    write.write_hf_tokenizer(tokenizer, tmp_path, 16)
    assert capsys.readouterr().err == ""
