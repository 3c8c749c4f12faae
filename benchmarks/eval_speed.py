"""Issue 39's evaluation speed: minimal-fsdp evaluate sharded over N GPUs against
lm-evaluation-harness's own hf backend on one GPU, on the same synthetic local multiple-choice task,
in one device call.

For each shape (gpt2: GPT-2 124M, vocab 50257; llama1b: Llama 3.2 1B's shape, vocab 128256; tiny:
for a CPU check) it trains one step from random weights (a byte-level BPE of 4096 pieces fitted on
data/shakespeare, the embedding rows padded to the shape's vocabulary), exports the checkpoint with
minimal-fsdp export --format hf, and scores ITEMS four-way items of hellaswag's lengths with
  ours      mpiexec -n N minimal-fsdp evaluate <checkpoint> --precision bf16 --batch_size B
  hf        what `lm_eval --model hf --model_args pretrained=<export>,dtype=bfloat16 --device
            cuda:0 --batch_size B` builds (HFLM.create_from_arg_string), run by the harness's
            simple_evaluate
Seconds are the evaluation's (the harness's total_evaluation_time_seconds, its tracker made once the
model is loaded, alike for both) and the whole command's (start, loading, evaluation; "outside": the
whole less the evaluation, in seconds, not per item). Each evaluation is split (per 1,000 items)
into the backend's share, the seconds inside the harness's calls of its loglikelihood (tokenizing,
batching, the model, the results; "tokens": of which tokenizing), and the harness's own, the rest
("requests": building them from the task's templates; "results": each item's metrics; the remainder
its aggregation and notes). The accuracies should agree; "same choice" is the share of items where
both backends pick the same answer (bf16 may flip near-ties).

    python3 benchmarks/eval_speed.py  # on the GPU machine: both shapes, N=4, 1000 items
    python3 benchmarks/eval_speed.py --shapes tiny --device cpu --ranks 2 --items 40 \
        --precision float32
    # here (with pip's index): .whl/eval/evalsite-cp312.tar.xz
    python3 benchmarks/eval_speed.py pack

The GPU machine has no lm-eval nor datasets and no package index: when lm_eval is missing, the
script unpacks .whl/eval/evalsite-*.tar.xz (carry .whl/eval) into /tmp/evalsite, made by `pack` from
the wheels of every package the hf run imports that the machine lacks (the wheels themselves are 82
MB, pyarrow's 55 MB of it; the packed, trimmed site is about 41 MB: no tests, no compiled caches, no
Arrow Flight, none of the harness's own task folders).
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "gpt2": ["--model_preset", "gpt2", "--vocab_size", "50257"],
    "llama1b": [
        "--model",
        "llama",
        "--num_layers",
        "16",
        "--num_heads",
        "32",
        "--num_kv_heads",
        "8",
        "--embed_size",
        "2048",
        "--intermediate_size",
        "8192",
        "--vocab_size",
        "128256",
        "--seq_length",
        "2048",
    ],
    # where the model's own work outweighs the harness's per item: one step of it needs 4 GPUs (fp32
    # + AdamW sharded), its export 32 GB of host memory, the hf backend 16 GB of one GPU in bf16
    "llama8b": ["--model_preset", "llama3-8b", "--activation_checkpoints"],
    "tiny": [
        "--num_layers",
        "2",
        "--num_heads",
        "2",
        "--embed_size",
        "32",
        "--seq_length",
        "128",
        "--vocab_size",
        "5000",
    ],
}
# Every distribution the hf run on a local task imports that the GPU machine (torch, transformers,
# tokenizers, huggingface_hub, numpy, jinja2, pyyaml, fsspec, ...) does not have; the versions
# tested here with lm-eval 0.4.13.
WHEELS = [
    "lm-eval==0.4.13",
    "datasets==5.2.0",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "xxhash==4.1.0",
    "pyarrow==26.0.1",
    "pandas==3.1.1",
    "python-dateutil==2.9.0.post0",
    "six==1.17.0",
    "sacrebleu==2.6.0",
    "portalocker==4.4.2",
    "tabulate==0.10.0",
    "colorama==0.4.6",
    "lxml==6.1.3",
    "pytablewriter==1.2.1",
    "dataproperty==1.1.1",
    "mbstrdecoder==1.1.5",
    "pathvalidate==3.3.1",
    "tabledata==1.3.5",
    "tcolorpy==0.1.7",
    "typepy==1.3.5",
    "chardet==6.0.0.post1",
    "pytz==2026.6",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
]
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
WORDS = (
    "the king queen lord lady good night sweet love death fair heart come go speak hear thou thee "
    "my our your sword crown day blood tears gentle noble hath doth shall upon heaven earth"
).split()


def pack(python_version):
    """Here: the packages the GPU machine lacks, installed for its Python into one folder, trimmed,
    as a tar.xz."""
    tag = python_version.replace(".", "")
    site, out = (
        Path(f"/tmp/evalsite-pack-{tag}"),
        ROOT / ".whl" / "eval" / f"evalsite-cp{tag}.tar.xz",
    )
    shutil.rmtree(site, ignore_errors=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            *platforms,
            "--target",
            str(site),
            *WHEELS,
        ],
        check=True,
    )
    for pattern in [
        "**/__pycache__",
        "pandas/tests",
        "pyarrow/tests",
        "pyarrow/include",
        "pyarrow/src",
        "pyarrow/*flight*",
        "lm_eval/tasks/*/",
        "bin",
    ]:
        for path in site.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        tar.add(site, arcname=".")
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB")


def harness_importable():
    """lm_eval here, or unpacked from .whl/eval into /tmp/evalsite (the PYTHONPATH of every command
    after)."""
    try:
        import lm_eval  # noqa: F401

        return os.environ.get("PYTHONPATH", "")
    except ImportError:
        pass
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    packed = ROOT / ".whl" / "eval" / f"evalsite-{tag}.tar.xz"
    if not packed.exists():
        sys.exit(
            f"error: no lm_eval here and no {packed} to unpack (python3 benchmarks/eval_speed.py "
            "pack, where pip reaches an index; then carry .whl/eval)"
        )
    site = Path("/tmp/evalsite")
    if not (site / "lm_eval").exists():
        with tarfile.open(packed) as tar:
            tar.extractall(site, filter="data")
    sys.path.insert(0, str(site))
    return f"{site}:{os.environ.get('PYTHONPATH', '')}"


def write_task(folder, items, seed=0):
    """A local four-way task of hellaswag's lengths (a 30-60 word context, 8-20 word endings),
    random answers."""
    rng = random.Random(seed)
    with open(folder / "speed_mc.jsonl", "w") as f:
        for _ in range(items):
            words = lambda lo, hi: " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))  # noqa: E731
            f.write(
                json.dumps(
                    {
                        "question": words(30, 60).capitalize() + ",",
                        "choices": [" " + words(8, 20) + "." for _ in range(4)],
                        "answer": rng.randrange(4),
                    }
                )
                + "\n"
            )
    (folder / "speed_mc.yaml").write_text(
        f"task: speed_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{folder / 'speed_mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n  - "
        "metric: acc_norm\n"
    )


def fit_tokenizer(folder):
    """A byte-level BPE (the tokenizers library's) fitted on Shakespeare: offline, with an
    end-of-text token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(ROOT / "data" / "shakespeare" / "input.txt")],
        trainers.BpeTrainer(
            vocab_size=4096,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))


def timed(cmd, env, log):
    start = time.perf_counter()
    with open(log, "w") as f:
        result = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        sys.exit(
            f"error: {' '.join(map(str, cmd))} exited {result.returncode}; see {log}:\n"
            + "".join(open(log).readlines()[-20:])
        )
    return time.perf_counter() - start


def results(folder):
    """(the harness's results JSON, {doc_id: index of the highest log-likelihood}) under an
    --output_path."""
    (found,) = folder.rglob("results_*.json")
    (samples,) = folder.rglob("samples_speed_mc_*.jsonl")
    chosen = {}
    for line in samples.open():
        sample = json.loads(line)
        scores = [float(r[0]) for r in sample["filtered_resps"]]
        chosen[sample["doc_id"]] = max(range(len(scores)), key=scores.__getitem__)
    return json.loads(found.read_text()), chosen


# Both runs time their backend's share of the evaluation: the harness's calls of lm.loglikelihood
# (tokenizing, batching, the model, the results), of which tokenizing (tok_encode; ours also its
# tokenizer's encode_batch); and of the harness's own, building the requests
# (Task.build_all_requests: templates, few-shot contexts) and each item's metrics
# (Task.process_results); the rest of the evaluation is the harness's aggregation, logging and
# environment notes.
TIMERS = """
import atexit, json, sys, time
split_file = sys.argv.pop(1)
spent = {"backend_s": 0.0, "tokenize_s": 0.0, "requests_s": 0.0, "results_s": 0.0, \
"loglikelihood_calls": 0}
def timer(owner, name, key):
    inner = getattr(owner, name)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
            spent["loglikelihood_calls"] += name == "loglikelihood"
    setattr(owner, name, timed)
def timed_backend(cls, *tokenizing):
    from lm_eval.api.task import ConfigurableTask
    timer(cls, "loglikelihood", "backend_s")
    for owner, name in ((cls, "tok_encode"), *tokenizing):
        timer(owner, name, "tokenize_s")
    timer(ConfigurableTask, "build_all_requests", "requests_s")
    timer(ConfigurableTask, "process_results", "results_s")
    # rank 0 runs the harness; the other ranks of ours never call loglikelihood
    atexit.register(lambda: spent["loglikelihood_calls"] and open(split_file, \
"w").write(json.dumps(spent)))
"""
# The harness's add_env_info imports transformers inside the timed evaluation (0.6-2.4 s on the CPU
# machine); the hf backend has imported it while loading, ours never needs it: imported before, so
# both evaluations start alike.
OURS_RUN = (
    TIMERS
    + """
import transformers
import minimal_fsdp.__main__ as cli
from minimal_fsdp.data import tokenizer
from minimal_fsdp.data import tokenizer_files
from minimal_fsdp.eval.lm import ShardedLM
timed_backend(ShardedLM, *((cls, "encode_batch") for cls in (tokenizer.CharTokenizer, \
tokenizer.GPT2Tokenizer,
              tokenizer.SentencePieceTokenizer, tokenizer_files.HFTokenizer, \
tokenizer_files.TiktokenTokenizer)))
cli.main(["evaluate", *sys.argv[1:]])
"""
)
HF_RUN = (
    TIMERS
    + """
import lm_eval
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
timed_backend(HFLM)
export, dtype, device, batch, tasks, out = sys.argv[1:]
lm = HFLM.create_from_arg_string(f"pretrained={export},dtype={dtype}", {"batch_size": int(batch), \
"device": device})
tracker = EvaluationTracker(output_path=out)  # after loading, as commands/evaluate.py makes \
its own
r = lm_eval.simple_evaluate(model=lm, tasks=["speed_mc"], batch_size=int(batch), log_samples=True,
                            task_manager=TaskManager(include_path=tasks, include_defaults=False),
                            evaluation_tracker=tracker)
tracker.save_results_aggregated(results=r, samples=r["samples"])
tracker.save_results_samples(task_name="speed_mc", samples=r["samples"]["speed_mc"])
"""
)


def bench(shape, args, work, pythonpath):
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}:{pythonpath}".rstrip(":"),
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    run = work / shape
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    mpi = ["mpiexec", "-n", str(args.ranks)]
    timed(
        [
            *mpi,
            sys.executable,
            "basic_training.py",
            "--dataset",
            "text",
            "--input_file",
            "data/shakespeare/input.txt",
            "--tokenizer_dir",
            work / "tokenizer",
            *SHAPES[shape],
            "--meta_init",
            "--max_steps",
            "1",
            "--batch_size",
            "1",
            "--num_tokens",
            "0",
            "--eval_batches",
            "1",
            "--checkpoint_dir",
            run / "checkpoints",
            "--data_dir",
            run / "data",
            "--log_dir",
            run / "logs",
            "--run_name",
            shape,
        ],
        env,
        run / "train.log",
    )
    checkpoint = run / "checkpoints" / shape
    timed(
        [sys.executable, "-m", "minimal_fsdp", "export", checkpoint, run / "hf", "--format", "hf"],
        env,
        run / "export.log",
    )
    precision = {"bf16": "bf16", "float32": "float32"}[args.precision]
    ours_s = timed(
        [
            *mpi,
            sys.executable,
            "-c",
            OURS_RUN,
            run / "ours_split.json",
            checkpoint,
            "--tasks",
            "speed_mc",
            "--include_path",
            work,
            "--batch_size",
            str(args.batch_size),
            "--precision",
            precision,
            "--output_path",
            run / "ours",
            "--log_samples",
        ],
        env,
        run / "ours.log",
    )
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    device = "cuda:0" if args.device == "cuda" else "cpu"
    hf_s = timed(
        [
            sys.executable,
            "-c",
            HF_RUN,
            run / "hf_split.json",
            run / "hf",
            dtype,
            device,
            str(args.batch_size),
            work,
            run / "theirs",
        ],
        env,
        run / "hf.log",
    )
    (ours, ours_chosen), (theirs, their_chosen) = results(run / "ours"), results(run / "theirs")
    same = sum(ours_chosen[i] == their_chosen.get(i) for i in ours_chosen) / len(ours_chosen)
    rows = []
    for name, found, whole, gpus in (("ours", ours, ours_s, args.ranks), ("hf", theirs, hf_s, 1)):
        seconds = float(found["total_evaluation_time_seconds"])
        score = found["results"]["speed_mc"]
        split = json.loads((run / f"{name}_split.json").read_text())
        per_1000 = 1000 / args.items
        rows.append(
            dict(
                shape=shape,
                backend=name,
                gpus=gpus,
                items=args.items,
                eval_s=seconds,
                whole_s=whole,
                items_per_s=args.items / seconds,
                s_per_1000=per_1000 * seconds,
                harness_s_per_1000=per_1000 * (seconds - split["backend_s"]),
                requests_s_per_1000=per_1000 * split["requests_s"],
                results_s_per_1000=per_1000 * split["results_s"],
                backend_s_per_1000=per_1000 * split["backend_s"],
                tokenize_s_per_1000=per_1000 * split["tokenize_s"],
                outside_eval_s=whole - seconds,
                acc=score["acc,none"],
                acc_norm=score["acc_norm,none"],
                same_choice=same,
            )
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", choices=("bench", "pack"), default="bench")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["gpt2", "llama1b"])
    parser.add_argument(
        "--ranks", type=int, default=4, help="ranks (GPUs) for ours; the hf backend runs on one"
    )
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument(
        "--batch_size", type=int, default=32, help="sequences per GPU in one forward call, for both"
    )
    parser.add_argument("--precision", choices=("bf16", "float32"), default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--work", default="/tmp/eval_speed", help="checkpoints, exports and logs go here"
    )
    parser.add_argument(
        "--out", default=os.environ.get("OUT", "gpu_out"), help="eval_speed.jsonl goes here"
    )
    parser.add_argument(
        "--python_version", default="3.12", help="pack: the Python of the machine it is for"
    )
    args = parser.parse_args()
    if args.command == "pack":
        return pack(args.python_version)
    pythonpath = harness_importable()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    fit_tokenizer(work / "tokenizer")
    write_task(work, args.items)
    print(
        f"{'shape':8} {'backend':7} {'GPUs':>4} {'items':>5} {'eval s':>8} {'whole s':>8} "
        f"{'items/s':>8} {'s/1000':>7} {'harness':>7} {'requests':>8} {'results':>7} "
        f"{'backend':>7} {'tokens':>7} {'outside':>7} {'acc':>6} {'acc_norm':>8} "
        f"{'same choice':>11}",
        flush=True,
    )
    for shape in args.shapes:
        for row in bench(shape, args, work, pythonpath):
            with open(out / "eval_speed.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{row['shape']:8} {row['backend']:7} {row['gpus']:4d} {row['items']:5d} "
                f"{row['eval_s']:8.2f} {row['whole_s']:8.1f} {row['items_per_s']:8.1f} "
                f"{row['s_per_1000']:7.2f} {row['harness_s_per_1000']:7.2f} "
                f"{row['requests_s_per_1000']:8.2f} {row['results_s_per_1000']:7.2f} "
                f"{row['backend_s_per_1000']:7.2f} {row['tokenize_s_per_1000']:7.2f} "
                f"{row['outside_eval_s']:7.1f} {row['acc']:6.3f} {row['acc_norm']:8.3f} "
                f"{row['same_choice']:11.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
