"""generate() in this process, on a one-rank group: what it asks of the attention kernels."""

import pytest
import torch

from minimal_fsdp.inference.generate import generate
from minimal_fsdp.models.gpt import GPT, GPTConfig
from minimal_fsdp.data.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_rank_group")


def test_decoding_never_picks_cudnn_attention():
    """cuDNN's attention builds a plan for every new key length, and decoding brings a new one each
    token (9.4 s of a 200-token sample on an H100): generate() leaves it out; training (outside
    generate) keeps every kernel."""
    model = GPT(GPTConfig(vocab_size=8, seq_length=16, num_layers=1, num_heads=2, embed_size=8))
    seen = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: (
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        or forward(*args, **kwargs)
    )
    text = generate(model, CharTokenizer("abcdefgh"), "ab", num_tokens=20)
    # the prefill, then one forward for each token after the first
    assert len(text) == 22 and len(seen) == 20
    assert set(seen) == {(False, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored once generation is done
