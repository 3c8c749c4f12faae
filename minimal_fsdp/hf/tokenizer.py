"""Our tokenizers (tiktoken's BPE, sentencepiece, characters, a Hugging Face tokenizer.json) as a
`tokenizers` Tokenizer that encodes exactly as ours does: the tokenizer.json of an export
(write.write_hf_tokenizer checks that on a probe text)."""

from minimal_fsdp.config.choices import ConfigError

PROBE = "ROMEO:\nO  sweet night, thou art   fair!\n\n\tnaïve café, 42 or 1234567 — 😀 ẞ\r\nend. "


def _bytes_to_unicode():
    """GPT-2's table of printable stand-ins for the 256 bytes, which byte-level BPE vocabularies are
    written in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    extra = [b for b in range(256) if b not in printable]
    return {
        b: chr(c)
        for b, c in zip(printable + extra, printable + [256 + i for i in range(len(extra))])
    }


def _from_tiktoken(ranks, pattern, special_tokens):
    """tiktoken's BPE as a tokenizers byte-level BPE. tiktoken merges, at each step, the adjacent
    pair whose concatenation has the lowest rank; every split of a token into two tokens is
    therefore a merge, ranked by the token it makes (transformers' TikTokenConverter does the same).
    ignore_merges: tiktoken takes a piece that is itself a token whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    byte = _bytes_to_unicode()

    def text(token):
        return "".join(byte[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        splits = [
            (ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += [(text(left), text(right)) for _, _, left, right in sorted(splits)]
    tok = Tokenizer(models.BPE({text(t): r for t, r in ranks.items()}, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for name, i in sorted(special_tokens.items(), key=lambda item: item[1]):
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        # ids are handed out in turn: only a contiguous block after the ranks fits
        if tok.token_to_id(name) != i:
            raise ConfigError(
                f"special token {name} has id {i}, which tokenizer.json cannot give it"
            )
    return tok


def _from_sentencepiece(sp):
    """A sentencepiece BPE model (ours: identity normalization; Llama 2's) as a tokenizers BPE: the
    pieces by score give the merges (sentencepiece merges the adjacent pair that makes the
    highest-scoring piece), spaces become "▁" and a leading one is added, as sentencepiece's dummy
    prefix is; unknown characters fall back to bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    size = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(size)}
    special = [i for i in range(size) if sp.is_control(i) or sp.is_unknown(i)]
    normal = {
        sp.id_to_piece(i): i
        for i in range(size)
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i))
    }
    merges = []
    for piece, i in sorted(normal.items(), key=lambda item: (-sp.get_score(item[1]), item[1])):
        splits = [
            (normal[piece[:k]], normal[piece[k:]], piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in normal and piece[k:] in normal
        ]
        merges += [(left, right) for _, _, left, right in sorted(splits)]
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    tok = Tokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=any(sp.is_byte(i) for i in range(size)),
        )
    )
    dummy_prefix = sp.encode("x", out_type=str)[0].startswith("▁")
    tok.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if dummy_prefix else []) + [normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if dummy_prefix else [])
    )
    tok.add_special_tokens(
        [AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special]
    )
    return tok


def _from_chars(chars):
    """One token per character: a BPE without merges, whose decoder joins the characters as they
    are."""
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(chars)}, []))
    tok.decoder = decoders.Fuse()
    return tok


def hf_tokenizer(tokenizer):
    """(a tokenizers.Tokenizer that encodes as `tokenizer` does, {"eos_token": ..., ...} for
    tokenizer_config.json)."""
    kind = tokenizer.kind
    if kind == "hf":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(tokenizer.json)
    elif kind in ("gpt2", "tiktoken"):
        tok = _from_tiktoken(tokenizer.ranks, tokenizer.pattern, tokenizer.special_tokens)
    elif kind == "sentencepiece":
        tok = _from_sentencepiece(tokenizer.sp)
    elif kind == "char":
        tok = _from_chars(tokenizer.chars)
    else:
        raise ConfigError(f"no Hugging Face tokenizer.json for a {kind} tokenizer")
    names = {
        key: tok.id_to_token(i) if i is not None else None
        for key, i in (("eos_token", tokenizer.eot_id), ("bos_token", tokenizer.bos_id))
    }
    if kind == "sentencepiece" and tokenizer.sp.unk_id() >= 0:
        names["unk_token"] = tokenizer.sp.id_to_piece(tokenizer.sp.unk_id())
    return tok, names
