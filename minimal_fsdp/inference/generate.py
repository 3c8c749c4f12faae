"""Prompt -> text with a KV cache. Every rank runs the (sharded) forward; rank 0 picks each token and
broadcasts it, so ranks never disagree and nobody waits on a rank that skipped a forward."""
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

# Decoding attends over a key length that grows by one each token. cuDNN's attention (torch's first choice on H100)
# builds a plan for every new length, which made a short sample several times slower from a fresh process. The
# other kernels need no plan per shape.
DECODE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.no_grad()
@sdpa_kernel(DECODE_ATTENTION)
def generate(model, tokenizer, prompt, num_tokens, temperature=0.8, top_k=50, seed=0,
             device="cpu", dtype=torch.float32):
    model.eval()
    config = model.config
    ids = tokenizer.encode(prompt) or [tokenizer.eot_id or 0]
    generator = torch.Generator(device=device).manual_seed(seed)
    context = ids[-config.seq_length:]
    out = list(ids)
    cache = None
    for _ in range(num_tokens):
        if cache is None or cache.pos >= config.seq_length:
            # (Re)fill the cache; when the context is full, keep its newer half and continue from there.
            if cache is not None:
                context = context[-(config.seq_length // 2):]
            cache = model.new_cache(1, device, dtype)
            logits = model(torch.tensor([context], device=device), cache=cache)
        else:
            logits = model(torch.tensor([[context[-1]]], device=device), cache=cache)
        token = _sample(logits.float(), temperature, top_k, generator)
        dist.broadcast(token, src=0)
        out.append(token.item())
        context.append(token.item())
    model.train()
    return tokenizer.decode(out)


def _sample(logits, temperature, top_k, generator):
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).view(-1)
