"""torchtitan v0.2.2 and ours on the same shape, sequence, batch and precision in one launch; prints
both rows (and, with --profile, each one's kernel time by kind, trace_breakdown.py).

    python benchmarks/titan_side_by_side.py --layers 8 --seq 8192 --batch 1 \
        --precision bf16 --ac none [--profile] [--ours_root DIR,...] [--work DIR] [--gpus N] \
        [--rounds R]

torchtitan runs as its user gets it on one GPU (torchrun, its own train.py, autocast without FSDP,
its compile of model and loss), on Llama 3 8B's flavor cut to --layers blocks (registered here as
the flavor 8B_<L>L: its wheel has no train configs), a small JSON-lines dataset and a word-level
tokenizer written into --work (its vocab stays 128256: the tokenizer only feeds ids). Its tokens/s
is the median of its logged `tps` after --warmup steps (host clock between steps); its memory is
its `memory:` (the allocator's peak reserved, GiB). Ours is benchmarks/throughput.py
--model_preset llama3-8b (median of CUDA-event step times; peak allocated, GB). --ours_root runs
ours from each of several checkouts (e.g. a copy of an earlier commit), for a before/after in the
same launch. --gpus N: both shard over N GPUs of this host (torchtitan under torchrun with its
default FSDP over every rank; ours under mpiexec -n N, full-shard); the rows give tokens/s per GPU.
--rounds R runs them all R times, every second round in reverse order, and compares the medians:
the same kernels' times move by a percent or two between the runs of one launch, with the card's
clock under its power limit (each row gives the SM clock and temperature nvidia-smi read while it
ran), so one run each decides nothing at a margin of 1%.

torchtitan is a benchmark-only dependency: on the GPU machine, which has no package index, install
its wheels first (torchtitan==0.2.2, torchdata, tyro, docstring-parser, typeguard, tomli, datasets,
dill, multiprocess; torchao for fp8), e.g. pip install --no-deps --target /tmp/site .whl/*.whl.
"""

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = 2000  # the tokenizer's vocabulary: word0 .. word1999 and the special tokens


def prepare(work):
    """A JSON-lines dataset and a word-level tokenizer for torchtitan's loader, in `work`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    data, tok = work / "data", work / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with open(data / "train.jsonl", "w") as f:
        for _ in range(400):  # 400 x 2000 words: 800K tokens, looped over (infinite)
            text = " ".join(f"word{rng.randrange(WORDS)}" for _ in range(2000))
            f.write(json.dumps({"text": text}) + "\n")
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{f"word{i}": i + 3 for i in range(WORDS)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"})
    )
    return data, tok


def titan_child(argv):
    """Inside torchrun: torchtitan's own main, after registering Llama 3 8B cut to `layers`."""
    layers = int(os.environ["TITAN_LAYERS"])
    # before torchtitan's import: its ConfigManager.parse_args defaults to sys.argv[1:] as imported
    sys.argv = [sys.argv[0], *argv]
    import dataclasses

    from torchtitan.models import llama3
    from torchtitan.train import Trainer, main

    llama3.llama3_args[f"8B_{layers}L"] = dataclasses.replace(
        llama3.llama3_args["8B"], n_layers=layers
    )
    main(Trainer)


def titan_flags(args, data, tok, dump):
    flags = [
        "--model.name", "llama3",
        "--model.flavor", f"8B_{args.layers}L",
        "--model.hf_assets_path", str(tok),
        "--training.dataset", "c4_test",
        "--training.dataset_path", str(data),
        "--training.local_batch_size", str(args.batch),
        "--training.seq_len", str(args.seq),
        "--training.steps", str(args.steps),
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--job.dump_folder", str(dump),
        "--activation_checkpoint.mode", args.ac,
        "--activation_checkpoint.selective_ac_option", "op",
    ]  # fmt: skip
    if args.compile:
        flags += ["--compile.enable"]
    if args.precision == "fp8":
        # tensorwise (its default recipe), the output head left in bf16 as ours leaves it (its
        # Llama 3 8B config does the same; without a filter it would convert the head too)
        flags += ["--model.converters", "quantize.linear.float8"]
        flags += ["--quantize.linear.float8.filter_fqns", "output"]
    if args.profile:
        # one traced step, the last: profile_freq = steps, after 3 warm-up steps of the profiler
        flags += ["--profiling.enable_profiling", "--profiling.profile_freq", str(args.steps)]
        flags += ["--profiling.profiler_active", "1", "--profiling.profiler_warmup", "3"]
    return flags + args.titan_flags


def run_titan(args, data, tok, log):
    dump = args.work / "titan"
    env = dict(os.environ, TITAN_LAYERS=str(args.layers), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.gpus),
           __file__, "--titan_child", *titan_flags(args, data, tok, dump)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write(result.stdout + result.stderr)
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + result.stderr)
    rows = re.findall(r"step:\s*(\d+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)", text)
    if result.returncode or not rows:
        print(f"torchtitan failed (exit {result.returncode}):\n{text[-4000:]}", flush=True)
        return None
    steps = [(int(s), float(m), int(t.replace(",", ""))) for s, m, t in rows]
    timed = [t for s, _, t in steps if s > args.warmup] or [t for _, _, t in steps]
    traces = sorted(dump.rglob("*trace.json")) if args.profile else []
    return dict(
        who="torchtitan v0.2.2",
        tok_s=statistics.median(timed),
        memory=f"{max(m for _, m, _ in steps):.1f} GiB reserved",
        step_ms=args.batch * args.seq / statistics.median(timed) * 1e3,
        trace=str(traces[-1]) if traces else None,
    )


def run_ours(args, root, log):
    root = Path(root).resolve()  # the command runs inside it
    label = root.name
    run_name = f"ours-{label}-{args.precision}-{args.ac}"
    out = args.work / f"{run_name}.jsonl"
    out.unlink(missing_ok=True)
    launch = ["mpiexec", "-n", str(args.gpus)] if args.gpus > 1 else []
    cmd = [*launch, sys.executable, str(root / "benchmarks" / "throughput.py"),
           "--model_preset", "llama3-8b", "--num_layers", str(args.layers),
           "--seq_length", str(args.seq), "--batch_size", str(args.batch),
           "--precision", args.precision, "--meta_init",
           "--warmup", str(args.warmup), "--steps", str(args.steps - args.warmup),
           "--out", str(out), "--log_dir", str(args.work / "logs"), "--run_name", run_name,
           *args.ours_flags]  # fmt: skip
    if args.compile:
        cmd += ["--compile"]
    if args.ac != "none":
        cmd += ["--activation_checkpoints", "--recompute", args.ac]
    if args.profile:
        cmd += ["--profile", "0:1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(root), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    log.write(result.stdout + result.stderr)
    if result.returncode or not out.exists():
        print(f"ours ({root}) failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
        return None
    row = json.loads(out.read_text().splitlines()[-1])
    traces = sorted((args.work / "logs" / run_name).rglob("*trace.json"))
    return dict(
        who=f"ours ({label})",
        tok_s=row["tok_s_gpu"],
        memory=f"{row['peak_gb']:.1f} GB allocated",
        step_ms=row["step_ms"],
        trace=str(traces[-1]) if traces else None,
    )


def orders(trainers, rounds):
    """Each round runs every trainer once; every second round in reverse order, so that none always
    runs first on a cool card."""
    return [trainers if r % 2 == 0 else trainers[::-1] for r in range(rounds)]


class Clocks:
    """nvidia-smi's SM clock and temperature once a second while a run lasts (nothing where there is
    no nvidia-smi)."""

    QUERY = "--query-gpu=clocks.sm,temperature.gpu,utilization.gpu"

    def __enter__(self):
        self.text = ""
        cmd = ["nvidia-smi", self.QUERY, "--format=csv,noheader,nounits", "-lms", "1000", "-i", "0"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            self.text = self.proc.communicate()[0]

    def busy(self):
        return busy_clocks(self.text)


def busy_clocks(text):
    """{'mhz': median SM clock, 'celsius': hottest} over the samples at 90% utilization or more."""
    samples = []
    for line in text.splitlines():
        try:
            mhz, celsius, util = (float(v) for v in line.split(","))
        except ValueError:
            continue
        if util >= 90:
            samples.append((mhz, celsius))
    if not samples:
        return {"mhz": None, "celsius": None}
    return {"mhz": statistics.median(m for m, _ in samples), "celsius": max(c for _, c in samples)}


def print_rows(rows, rounds):
    print("| round | trainer | tok/s | step ms | peak memory | SM MHz busy | max C | vs first |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        first = next(f for f in rows if f["round"] == r["round"])
        mhz = f"{r['mhz']:.0f}" if r["mhz"] else "-"
        celsius = f"{r['celsius']:.0f}" if r["celsius"] else "-"
        ratio = r["tok_s"] / first["tok_s"]
        print(f"| {r['round']} | {r['who']} | {r['tok_s']:,.0f} | {r['step_ms']:.1f} "
              f"| {r['memory']} | {mhz} | {celsius} | {ratio:.3f}x |")  # fmt: skip
    if rounds > 1:
        print("\n| trainer | median tok/s | vs first |\n|---|---|---|")
        medians = median_rows(rows)
        for who, tok_s in medians.items():
            print(f"| {who} | {tok_s:,.0f} | {tok_s / next(iter(medians.values())):.3f}x |")


def median_rows(rows):
    """{trainer: median tok/s over its rounds}, in the order the trainers first ran."""
    by = {}
    for r in sorted(rows, key=lambda r: r["order"]):
        by.setdefault(r["who"], []).append(r["tok_s"])
    return {who: statistics.median(v) for who, v in by.items()}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--titan_child":
        return titan_child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gpus", type=int, default=1, help="GPUs of this host, both sharded over them")
    p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none")
    p.add_argument("--steps", type=int, default=30, help="steps of each run, warm-up included")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    p.add_argument("--no_compile", dest="compile", action="store_false")
    p.add_argument("--profile", action="store_true", help="trace one step of each, break it down")
    p.add_argument("--top", type=int, default=0, help="with --profile: N longest kernels")
    p.add_argument("--gaps", type=int, default=0, help="with --profile: N longest idle stretches")
    p.add_argument(
        "--exposed", type=int, default=0, help="with --profile: N NCCL kernels least hidden"
    )
    p.add_argument("--ours_root", default=str(ROOT), help="checkouts of ours, comma-separated")
    p.add_argument("--ours_flags", default="", help="more flags for ours, space-separated")
    p.add_argument("--titan_flags", default="", help="more flags for torchtitan, space-separated")
    p.add_argument("--skip_titan", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="run all R times, alternating the order")
    p.add_argument("--work", type=Path, default=Path("side_by_side"))
    args = p.parse_args()
    args.ours_flags, args.titan_flags = args.ours_flags.split(), args.titan_flags.split()
    args.work = args.work.resolve()  # ours runs inside each --ours_root and writes here
    args.work.mkdir(parents=True, exist_ok=True)
    data, tok = prepare(args.work)
    trainers = ([] if args.skip_titan else [None]) + args.ours_root.split(",")  # None: torchtitan
    rows = []
    with open(args.work / f"log-{args.precision}-{args.ac}.txt", "a") as log:
        for n, order in enumerate(orders(trainers, args.rounds)):
            for who in order:
                with Clocks() as clocks:
                    row = run_ours(args, who, log) if who else run_titan(args, data, tok, log)
                if row:
                    rows.append(dict(row, round=n + 1, order=trainers.index(who), **clocks.busy()))
    shape = f"Llama 3 8B shape, {args.layers} layers, T={args.seq}, batch {args.batch} a GPU"
    shape += f", {args.gpus} GPUs (tokens/s per GPU)" if args.gpus > 1 else ""
    print(f"\n{shape}, {args.precision}, AC {args.ac}, compile {args.compile}")
    print_rows(rows, args.rounds)
    if args.profile:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import trace_breakdown as tb

        for r in rows[-len(trainers) :]:  # the last round's
            if r["trace"]:
                tb.print_breakdown(r["who"], tb.breakdown(r["trace"]), r["step_ms"])
                if args.top:
                    tb.print_top(tb.top_kernels(r["trace"], args.top))
                if args.gaps:
                    tb.print_gaps(tb.gaps(r["trace"], args.gaps))
                if args.exposed:
                    tb.print_exposed(tb.exposed(r["trace"], args.exposed))


if __name__ == "__main__":
    main()
