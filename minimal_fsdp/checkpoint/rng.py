"""Each rank's RNG states in a checkpoint (rng_<rank>.pt), so dropout masks continue exactly after a
resume: written at save, every field checked before a checkpoint is chosen (rng_problem, called by
find.verify), put back by checkpointer.restore_rng. A file that fails the check makes its checkpoint
be skipped in one line, as any other damage does; restore_rng never meets one."""

import io
import math
import random
from pathlib import Path

import numpy as np
import torch

from minimal_fsdp.checkpoint.safe_load import load_quietly
from minimal_fsdp.files import open_regular

MAX_RNG_BYTES = 2**20  # torch, CUDA, numpy and python states: about 17 KB
MT_WORDS = 624  # the Mersenne Twister's state, numpy's and Python's


def rng_file(rank):
    return f"rng_{rank}.pt"


def rng_bytes():
    """Tensors and plain numbers only, so torch.load(weights_only=True) reads it back."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, mt_state, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached_gaussian": cached_gaussian,
        },
        "python": {
            "version": version,
            "state": torch.tensor(mt_state, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def read_rng(path, rank):
    """The state rng_bytes wrote, as torch.load(weights_only=True) gives it back (unchecked)."""
    with open_regular(Path(path) / rng_file(rank), MAX_RNG_BYTES) as f:
        return load_quietly(f)


def _words(tensor, count, high=2**32):
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype == torch.int64
        and tuple(tensor.shape) == (count,)
        and bool(((tensor >= 0) & (tensor < high)).all())
    )


def _bytes_state(tensor, size):
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dtype == torch.uint8
        and tensor.dim() == 1
        and (size is None or tensor.numel() == size)
    )


def _whole(value, low, high):
    return type(value) is int and low <= value <= high


def _float(value):
    return type(value) is float and math.isfinite(value)


def rng_problem(state):
    """Why `state` (read_rng's) is not one restore_rng can put back, or None: every key present,
    each of the type and range the generator's own set_state takes (what a missing key or a wrong
    type would otherwise raise on every rank, mid-restore)."""
    cuda = torch.cuda.get_rng_state().numel() if torch.cuda.is_available() else None
    checks = [
        (
            "torch",
            lambda s: _bytes_state(s, torch.get_rng_state().numel()),
            "the CPU generator's bytes",
        ),
        (
            "cuda",
            lambda s: s is None or _bytes_state(s, cuda),
            "null or the CUDA generator's bytes",
        ),
        ("numpy.keys", lambda s: _words(s, MT_WORDS), f"{MT_WORDS} words of 32 bits"),
        ("numpy.pos", lambda s: _whole(s, 0, MT_WORDS), f"a whole number in [0, {MT_WORDS}]"),
        ("numpy.has_gauss", lambda s: _whole(s, 0, 1), "0 or 1"),
        ("numpy.cached_gaussian", _float, "a finite number"),
        ("python.version", lambda s: _whole(s, 3, 3), "3"),
        (
            "python.state",
            lambda s: _words(s, MT_WORDS + 1) and int(s[-1]) <= MT_WORDS,
            f"{MT_WORDS} words of 32 bits and a position",
        ),
        ("python.gauss_next", lambda s: s is None or _float(s), "null or a finite number"),
    ]
    if not isinstance(state, dict):
        return f"holds {type(state).__name__}, not the generators' states"
    for key, fits, wanted in checks:
        value, where = state, key.split(".")
        for part in where:
            if not isinstance(value, dict) or part not in value:
                return f"has no {key}"
            value = value[part]
        if not fits(value):
            return f"{key} is not {wanted}"
    return None
