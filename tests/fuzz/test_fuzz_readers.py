"""Fuzzing the readers of the files a run, a dataset or a model directory brings, in this
process: tokenizers (char, sentencepiece, Hugging Face), a prepared dataset (meta.json, the splits,
the largest-token cache), metrics.jsonl (plot), the run lock, a Hugging Face model's config.json,
safetensors headers and index, and the launcher's variables (discovery). Each either gives a value
that passes every check (stated per reader below), or one line naming the file (fuzzing.holds)."""

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minimal_fsdp.data import tokenizer as tk
from minimal_fsdp.data.tokens import TOKEN_CACHE, TokenData
from minimal_fsdp.launch import discovery
from minimal_fsdp.launch.run_lock import LOCK_NAME, RunLock
from minimal_fsdp.tools.plot import read_metrics

import fuzzing

TEXT = "the king and the queen.\nROMEO: good night, sweet love!\n" * 20


# ---- tokenizers ----


def works(tok):
    """A tokenizer every caller can use: its ids decode, and (char) encode back to themselves."""
    ids = list(range(min(tok.vocab_size, 300)))
    text = tok.decode(ids)
    assert isinstance(text, str)
    if tok.kind == "char":
        assert tok.encode(text) == ids, "a char tokenizer whose ids do not round-trip"
    tok.encode(TEXT[:40]) if tok.kind != "char" else None


def char_json():
    chars = st.one_of(
        st.lists(st.characters(), max_size=30),
        st.lists(fuzzing.json_values(4), max_size=8),
        st.lists(st.text(max_size=3), max_size=8),
    )
    return st.fixed_dictionaries(
        {"kind": st.just("char"), "chars": chars},
        optional={"vocab_size": fuzzing.hostile_ints()},
    )


@settings(max_examples=fuzzing.scaled(15, 1000))
@given(
    st.one_of(
        char_json().map(fuzzing.dumps), char_json().map(fuzzing.dumps).flatmap(fuzzing.mutated)
    )
)
def test_char_tokenizer(text):
    with tempfile.TemporaryDirectory() as d:
        raw = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
        Path(d, "tokenizer.json").write_bytes(raw)  # a lone surrogate: bytes no UTF-8 allows
        tok = fuzzing.holds(lambda: tk.load_tokenizer(d), "tokenizer.json")
        if tok is not None:
            fuzzing.holds(lambda: works(tok))


@pytest.fixture(scope="module")
def sentencepiece_model():
    return tk._train_sentencepiece(TEXT, 300).model_proto


@settings(max_examples=fuzzing.scaled(2, 200))
@given(data=st.data())
def test_sentencepiece_tokenizer(sentencepiece_model, data):
    blob = data.draw(fuzzing.mutated(sentencepiece_model))
    kind = data.draw(fuzzing.path_kinds())
    with tempfile.TemporaryDirectory() as d:
        meta = {"kind": "sentencepiece", "model_file": "tokenizer.model"}
        Path(d, "tokenizer.json").write_text(json.dumps(meta))
        fuzzing.place(Path(d, "tokenizer.model"), kind, blob)
        tok = fuzzing.holds(lambda: tk.load_tokenizer(d), "tokenizer.model")
        if tok is not None:
            fuzzing.holds(lambda: works(tok))


@pytest.fixture(scope="module")
def hf_tokenizer_json():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return json.loads(tok.to_str())


def hf_edit(template):
    """A Hugging Face tokenizer.json: the genuine one with a field replaced, merges that name other
    tokens, added tokens by the thousand (scaled up under --full), or raw mutations."""
    many = 2**21 if fuzzing.full_tier() else 2**10

    @st.composite
    def build(draw):
        tj = json.loads(json.dumps(template))
        kind = draw(st.sampled_from(["field", "merges", "added", "vocab", "raw"]))
        if kind == "field":
            tj[draw(st.sampled_from(sorted(tj)))] = draw(fuzzing.json_values(8))
        elif kind == "merges":
            merges = tj["model"]["merges"]
            merges[: draw(st.integers(1, 3))] = draw(
                st.lists(st.one_of(st.text(max_size=4), fuzzing.json_values(3)), max_size=3)
            )
        elif kind == "added":
            count = draw(st.integers(0, many))
            tj["added_tokens"] = [
                {
                    "id": 300 + i,
                    "content": f"<t{i}>",
                    "special": True,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                }
                for i in range(count)
            ]
        elif kind == "vocab":
            vocab = tj["model"]["vocab"]
            key = draw(st.sampled_from(sorted(vocab)))
            vocab[key] = draw(fuzzing.json_values(2))
        text = fuzzing.dumps(tj)
        return (
            draw(fuzzing.mutated(text)) if kind == "raw" else text.encode("utf-8", "surrogatepass")
        )

    return build()


@settings(max_examples=fuzzing.scaled(3, 100))
@given(data=st.data())
def test_hf_tokenizer(hf_tokenizer_json, data):
    blob = data.draw(hf_edit(hf_tokenizer_json))
    with tempfile.TemporaryDirectory() as d:
        Path(d, "tokenizer.json").write_bytes(blob)
        tok = fuzzing.holds(lambda: tk.load_tokenizer(d), "tokenizer.json")
        if tok is not None:
            fuzzing.holds(lambda: works(tok))


# ---- a prepared dataset ----


def prepared(d, meta, train, val, cache, forged, kinds):
    """A prepared dataset in d: its char tokenizer, meta.json, the splits' bytes, and the cache of
    each split's largest token id (forged: under the split's true fingerprint)."""
    tk.CharTokenizer("abcdefgh").save(d)
    fuzzing.place(
        Path(d, "meta.json"), kinds[0], fuzzing.dumps(meta).encode("utf-8", "surrogatepass")
    )
    fuzzing.place(Path(d, "train.bin"), kinds[1], train)
    fuzzing.place(Path(d, "val.bin"), kinds[2], val)
    if forged:
        for name in ("train.bin", "val.bin"):
            try:
                info = os.stat(Path(d, name))
            except OSError:
                continue
            entry = cache.get(name)
            top = entry[3] if isinstance(entry, list) and len(entry) > 3 else 0
            # the fingerprint anyone can read, and a maximum that passes the vocabulary check
            cache[name] = [
                info.st_size,
                info.st_mtime_ns,
                info.st_ino,
                top if top in range(8) else 0,
            ]
    fuzzing.place(
        Path(d, TOKEN_CACHE), kinds[3], fuzzing.dumps(cache).encode("utf-8", "surrogatepass")
    )


def dataset_example():
    tokens = st.lists(st.integers(0, 20), min_size=0, max_size=64).map(
        lambda ids: np.array(ids, np.uint16).tobytes()
    )
    meta = st.fixed_dictionaries(
        {
            "vocab_size": st.one_of(st.just(8), fuzzing.hostile_ints()),
            "train_tokens": st.one_of(st.integers(0, 64), fuzzing.hostile_ints()),
            "val_tokens": st.one_of(st.integers(0, 64), fuzzing.hostile_ints()),
            "tokenizer": st.just("char"),
            "dtype": st.sampled_from(["uint16", "uint32", "int8", "float32", ""]),
        }
    )
    cache = st.dictionaries(
        st.sampled_from(["train.bin", "val.bin", "x"]),
        st.one_of(
            st.lists(st.integers(0, 2**64), min_size=4, max_size=4),
            st.lists(st.integers(0, 7), min_size=4, max_size=4),
            fuzzing.json_values(4),
        ),
        max_size=3,
    )
    return st.tuples(
        meta,
        tokens,
        tokens,
        cache,
        st.booleans(),
        st.tuples(*[fuzzing.path_kinds()] * 4),
        st.booleans(),
    )


def consistent(meta, train, val):
    """meta.json's counts fitted to the splits drawn (most examples should get past the counts)."""
    return dict(meta, train_tokens=len(train) // 2, val_tokens=len(val) // 2)


@settings(max_examples=fuzzing.scaled(12, 800))
@given(dataset_example())
def test_prepared_dataset(example):
    meta, train, val, cache, forged, kinds, fit = example
    if fit:
        meta = consistent(meta, train, val)
    with tempfile.TemporaryDirectory() as d:
        prepared(d, meta, train, val, cache, forged, kinds)
        data = fuzzing.holds(lambda: TokenData(d), d)
        if data is not None:
            for split, tokens in data.splits.items():
                if len(tokens):
                    assert int(np.max(tokens)) < data.meta["vocab_size"], (
                        f"{split}.bin holds a token id past the vocabulary, and was accepted"
                    )


# ---- metrics.jsonl (plot) ----


def metrics_lines():
    row = st.one_of(
        st.fixed_dictionaries(
            {"step": st.one_of(st.integers(0, 100), fuzzing.json_values(2))},
            optional={"loss": fuzzing.json_values(2), "val_loss": st.floats()},
        ),
        fuzzing.json_values(6),
    )
    text = st.lists(row, max_size=6).map(lambda rows: "\n".join(map(fuzzing.dumps, rows)) + "\n")
    return st.one_of(
        text.map(str.encode),
        text.flatmap(fuzzing.mutated),
        st.integers(1, 3000).map(lambda n: fuzzing.deep(n).encode("utf-8", "surrogatepass")),
    )


@settings(max_examples=fuzzing.scaled(20, 1000))
@given(metrics_lines(), fuzzing.path_kinds())
def test_plot_metrics(blob, kind):
    with tempfile.TemporaryDirectory() as d:
        fuzzing.place(Path(d, "metrics.jsonl"), kind, blob)
        series = fuzzing.holds(lambda: read_metrics(d), "metrics.jsonl")
        for name, (steps, values) in (series or {}).items():
            assert all(type(s) is int for s in steps), f"{name}: steps {steps!r} accepted"
            assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values), (
                f"{name}: values {values!r} accepted"
            )


# ---- the run lock ----


def lock_content():
    holder = st.fixed_dictionaries(
        {},
        optional={
            "host": st.one_of(st.just(socket.gethostname()), fuzzing.json_values(2)),
            "pid": st.one_of(st.just(os.getpid()), st.just(2**22 + 7), fuzzing.json_values(2)),
            "start": fuzzing.json_values(2),
            "boot": fuzzing.json_values(2),
            "token": fuzzing.json_values(2),
            "job": fuzzing.json_values(2),
            "started": fuzzing.json_values(2),
        },
    )
    text = holder.map(fuzzing.dumps)
    return st.one_of(text.map(str.encode), text.flatmap(fuzzing.mutated))


@settings(max_examples=fuzzing.scaled(5, 500))
@given(lock_content(), fuzzing.path_kinds())
def test_run_lock(blob, kind):
    with tempfile.TemporaryDirectory() as d:
        run = Path(d, "run")
        run.mkdir()
        fuzzing.place(run / LOCK_NAME, kind, blob)
        lock = RunLock({"--checkpoint_dir": run})
        taken = fuzzing.holds(lambda: lock.acquire(wait=0) or True, str(run))
        if taken:
            lock.release()


# ---- a Hugging Face model directory ----


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    from support import hf_gpt2

    d = tmp_path_factory.mktemp("hf") / "gpt2"
    hf_gpt2(d)
    return d


def header_of(file):
    data = Path(file).read_bytes()
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size]), data[8 + size :]


def with_header(header, rest, raw=None):
    text = raw if raw is not None else fuzzing.dumps(header).encode("utf-8", "surrogatepass")
    return len(text).to_bytes(8, "little") + text + rest


def hf_example(template):
    config = json.loads((template / "config.json").read_text())
    header, rest = header_of(template / "model.safetensors")

    @st.composite
    def build(draw):
        part = draw(st.sampled_from(["config.json", "model.safetensors", "index"]))
        if part == "config.json":
            edited = dict(config)
            for _ in range(draw(st.integers(1, 3))):
                key = draw(st.sampled_from(sorted(config) + ["n_positions", "vocab_size"]))
                edited[key] = draw(fuzzing.json_values(3))
            text = fuzzing.dumps(edited).encode("utf-8", "surrogatepass")
            return part, draw(st.one_of(st.just(text), fuzzing.mutated(text)))
        if part == "model.safetensors":
            edited = json.loads(json.dumps(header))
            name = draw(st.sampled_from(sorted(edited)))
            if name != "__metadata__":
                field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
                edited[name][field] = draw(
                    st.one_of(
                        fuzzing.json_values(3),
                        st.lists(fuzzing.hostile_ints(), max_size=3),
                    )
                )
            raw = draw(st.one_of(st.none(), fuzzing.mutated(fuzzing.dumps(edited))))
            return part, with_header(edited, rest, raw)
        index = {
            "weight_map": {name: "model.safetensors" for name in header if name != "__metadata__"}
        }
        edited = draw(
            st.one_of(
                st.just(index),
                st.fixed_dictionaries({"weight_map": fuzzing.json_values(6)}),
                fuzzing.json_values(4),
            )
        )
        return part, fuzzing.dumps(edited).encode("utf-8", "surrogatepass")

    return build()


@settings(max_examples=fuzzing.scaled(4, 300))
@given(data=st.data())
def test_hf_model_directory(hf_directory, data):
    from minimal_fsdp.hf import read as hf

    part, blob = data.draw(hf_example(hf_directory))
    with tempfile.TemporaryDirectory() as d:
        d = Path(d, "model")
        shutil.copytree(hf_directory, d)
        if part == "index":
            (d / "model.safetensors.index.json").write_bytes(blob)
        else:
            (d / part).write_bytes(blob)

        def read():
            model_type, config = hf.read_config(d)
            hf.check_weights(d, model_type, config)
            return model_type, config

        fuzzing.holds(read, str(d))


# ---- the launcher's variables ----

LAUNCH_VARIABLES = {
    "RANK": None,
    "WORLD_SIZE": None,
    "LOCAL_RANK": None,
    "LOCAL_WORLD_SIZE": None,
    "PET_NPROC_PER_NODE": None,
    "PET_NNODES": None,
    "SLURM_PROCID": None,
    "SLURM_STEP_NUM_TASKS": None,
    "SLURM_STEP_NUM_NODES": None,
    "SLURM_NNODES": None,
    "SLURM_NODEID": None,
    "SLURM_LOCALID": None,
    "SLURM_STEP_TASKS_PER_NODE": None,
    "SLURM_TASKS_PER_NODE": None,
    "TORCHELASTIC_RUN_ID": None,
}


def env_value():
    return st.one_of(
        st.integers(-3, 5).map(str),
        fuzzing.hostile_ints().map(str),
        st.sampled_from(["", " 1", "1.5", "$(PET_NNODES)", "2(x3)", "4,2(x2)", "١", "0x10"]),
        st.text(alphabet="0123456789(),x ", max_size=10),
    )


def launch_env():
    return st.dictionaries(st.sampled_from(sorted(LAUNCH_VARIABLES)), env_value(), max_size=8).map(
        lambda env: dict(env, MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"))
    )


@settings(max_examples=fuzzing.scaled(30, 2000))
@given(launch_env(), st.booleans(), st.binary(max_size=40), fuzzing.path_kinds())
def test_launcher_variables(env, pbs, nodefile, kind):
    launcher = discovery.launcher_of(env)
    assume(launcher != "mpi")
    with tempfile.TemporaryDirectory() as d:
        if pbs:
            env["PBS_NODEFILE"] = fuzzing.place(Path(d, "nodefile"), kind, nodefile)
        old = os.environ.get("PBS_NODEFILE")
        os.environ["PBS_NODEFILE"] = env.get("PBS_NODEFILE", "")
        try:
            found = fuzzing.holds(lambda: discovery.discover(launcher, env, pbs=pbs))
        finally:
            if old is None:
                os.environ.pop("PBS_NODEFILE", None)
            else:
                os.environ["PBS_NODEFILE"] = old
    if found is not None:
        rank, world, local_rank, local_world, nodes = found
        assert 0 <= rank < world and 0 <= local_rank < local_world <= world, found
        assert 1 <= nodes <= world, found


# ---- a Hugging Face config.json's context, and what sample allocates for it ----

LLAMA_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "intermediate_size": 16,
    "vocab_size": 8,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def context_fields():
    """A tiny Llama's config.json with its context and positional fields at and past their caps
    (max_position_embeddings up to 2^24 and beyond), and a request: (config, prompt, num_tokens)."""
    positions = st.one_of(
        st.sampled_from([2**24, 2**24 - 1, 2**24 + 1, 2**20, 2**31, 1, 2, 0, -1]),
        st.integers(1, 2**24),
        fuzzing.hostile_ints(),
    )
    config = st.fixed_dictionaries(
        {"max_position_embeddings": positions},
        optional={
            "rope_theta": st.one_of(st.just(500000.0), fuzzing.hostile_floats()),
            "num_hidden_layers": st.integers(1, 2),
        },
    ).map(lambda fields: dict(LLAMA_CONFIG, **fields))
    return st.tuples(
        config, st.text(alphabet="abcdefgh", min_size=1, max_size=6), st.integers(1, 6)
    )


@settings(max_examples=fuzzing.scaled(2, 100))
@given(context_fields())
def test_sample_allocates_what_the_request_needs(one_rank_group, example):
    """config.json read (or refused in one line), the model built, a few tokens sampled: the KV
    cache holds at most the prompt and the new tokens, whatever context config.json claims (2^24
    positions made sample ask for over 8 GB to write 5 tokens)."""
    import torch

    from minimal_fsdp.hf import read as hf
    from minimal_fsdp.inference.generate import generate
    from minimal_fsdp.models.llama import Llama

    config, prompt, num_tokens = example
    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(fuzzing.dumps(config))
        read = fuzzing.holds(lambda: hf.read_config(d), "config.json")
    if read is None:
        return
    _, model_config = read
    torch.manual_seed(0)
    model = fuzzing.holds(lambda: Llama(model_config))
    lengths, new_cache = [], model.new_cache

    def recorded(*args):
        cache = new_cache(*args)
        lengths.append(cache.k[0].size(2))
        return cache

    model.new_cache = recorded
    tokenizer = tk.CharTokenizer("abcdefgh")
    fuzzing.holds(lambda: generate(model, tokenizer, prompt, num_tokens, temperature=0))
    needed = len(tokenizer.encode(prompt)) + num_tokens
    assert lengths and max(lengths) <= needed, (
        f"a KV cache of {max(lengths)} positions for {needed}: config.json's context is "
        f"{model_config.seq_length}"
    )
