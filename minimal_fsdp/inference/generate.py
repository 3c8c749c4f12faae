"""Prompt -> text with a KV cache. Every rank runs the (sharded) forward; rank 0 picks each token
and broadcasts it, so ranks never disagree and nobody waits on a rank that skipped a forward.
The text can be streamed as it is produced (TextStream): a long generation shows its progress."""

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from minimal_fsdp.config.choices import ConfigError

# Decoding attends over a key length that grows by one each token. cuDNN's attention (torch's first
# choice on H100) builds a plan for every new length, which made a short sample several times slower
# from a fresh process. The other kernels need no plan per shape.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Generation beyond one context continues from the newer half of the text, refilling the cache each
# time; this many contexts bound --num_tokens: a mistyped count is refused, not run for days.
MAX_CONTEXTS = 1000


def check_num_tokens(num_tokens, config):
    """Refuse more tokens than MAX_CONTEXTS contexts of the model, before anything runs."""
    most = MAX_CONTEXTS * config.seq_length
    if num_tokens > most:
        raise ConfigError(
            f"--num_tokens {num_tokens} is more than this model generates in "
            f"{MAX_CONTEXTS} contexts of {config.seq_length} tokens ({most}): "
            "ask for fewer"
        )


@torch.no_grad()
@sdpa_kernel(DECODE_ATTENTION)
def generate(
    model,
    tokenizer,
    prompt,
    num_tokens,
    temperature=0.8,
    top_k=50,
    seed=0,
    device="cpu",
    dtype=torch.float32,
    stream=None,
):
    """The prompt and num_tokens more tokens, as text. stream: write(text), called with each new
    piece of the text as it is produced (the prompt first), on the ranks that pass it."""
    config = model.config
    check_num_tokens(num_tokens, config)
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id or 0]
    outside = sorted({i for i in ids if not 0 <= i < config.vocab_size})
    if outside:  # the same prompt and tokenizer on every rank: raised alike, before any collective
        raise ConfigError(
            f"--prompt encodes to token ids {outside[:5]} outside the model's "
            f"vocabulary of {config.vocab_size}: the tokenizer does not fit this "
            "model"
        )
    shown = TextStream(tokenizer, ids, stream) if stream else None
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    context = ids[-config.seq_length :]
    out = list(ids)
    cache = None
    for done in range(num_tokens):
        if cache is None or cache.pos >= config.seq_length:
            # (Re)fill the cache; when the context is full, keep its newer half and continue
            # from there.
            if cache is not None:
                context = context[-max(1, config.seq_length // 2) :]  # a context of 1 keeps 1
            # Sized by what it will hold (the context and the tokens still to come), never more than
            # the model's context: a Llama config of 2^24 positions asked for gigabytes to sample 5
            # tokens.
            cache = model.new_cache(1, device, dtype, len(context) + num_tokens - done)
            logits = model(torch.tensor([context], device=device), cache=cache)
        else:
            logits = model(torch.tensor([[context[-1]]], device=device), cache=cache)
        token = _sample(logits.float(), temperature, top_k, generator)
        dist.broadcast(token, src=0)
        out.append(token.item())
        context.append(token.item())
        if shown:
            shown.add(out[-1])
    model.train()
    text = tokenizer.decode(out)
    if shown:
        shown.finish(text)
    return text


class TextStream:
    """Text written as tokens arrive. Each new piece is the decode of a short window of tokens less
    that of the window without the newest ones: a token's text can depend on its neighbours
    (sentencepiece's leading space, a UTF-8 character split over byte-level tokens, held back while
    it is incomplete)."""

    def __init__(self, tokenizer, ids, write):
        self.tok, self.write = tokenizer, write
        # ids[start:end]: the window already written
        self.ids, self.text, self.start, self.end = [], "", 0, 0
        self.add(*ids)  # the prompt, at once

    def add(self, *tokens):
        self.ids += tokens
        before = self.tok.decode(self.ids[self.start : self.end])
        now = self.tok.decode(self.ids[self.start :])
        if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
            self.write(now[len(before) :])
            self.text += now[len(before) :]
            self.start, self.end = self.end, len(self.ids)

    def finish(self, text):
        """What is still held back (an incomplete character at the end): the rest of the whole
        decode."""
        if text.startswith(self.text) and len(text) > len(self.text):
            self.write(text[len(self.text) :])


def _sample(logits, temperature, top_k, generator):
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).view(-1)
