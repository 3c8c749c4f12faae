"""Which strategy at which inter-node bandwidth: training across hosts on one multi-GPU machine. H
hosts are made of network namespaces (minimal_fsdp.tools.virtual_cluster), G GPUs each
(CUDA_VISIBLE_DEVICES), their links shaped to each given bandwidth; basic_training.py runs under
each strategy, and one markdown row per run gives the median step time and tokens/s after the
warm-up steps, and the final val loss (decentralized against all-reduce at equal steps).

    # a 2-GPU machine
    python benchmarks/multihost.py --hosts 2 --gpus_per_host 1 --gbps 25,10,1 --models gpt2
    # a 4-GPU machine
    python benchmarks/multihost.py --hosts 2 --gpus_per_host 2 --gbps 10 --models llama-1b
    # the table so far
    python benchmarks/multihost.py --table multihost.jsonl
    # the logic, on CPU
    python benchmarks/multihost.py --tiny --gbps 1 --strategies full-shard,decentralized
    # where gossip should win, on any machine (gloo, 1 rank a host)
    python benchmarks/multihost.py --cpu --hosts 8 --models cpu-10m --gbps 0.1 \
        --strategies no-shard,decentralized
    # the link alone
    python benchmarks/multihost.py --gbps 25 --probe 512 --env NCCL_NCHANNELS_PER_NET_PEER=4

Each run appends its result to --out (JSON lines), so a grid too long for one command is run in
parts. Between hosts NCCL goes over TCP sockets on the veth (NCCL_NET=Socket, NCCL_IB_DISABLE=1,
NCCL_SOCKET_IFNAME=eth0). Inside a host NCCL keeps NVLink (P2P) and shared memory: each host has its
own hostname, which NCCL's host hash includes, so it never takes two hosts' GPUs for one node
(--no_p2p turns P2P and SHM off everywhere, to compare). tbf's rate is 32-bit (about 34 Gbit/s at
most): a faster --gbps, or 0, leaves the link unshaped; each row gives the link's measured speed
(one TCP stream, Python) next to the setting. --probe MB trains nothing: it times an all-reduce and
gossip's exchange of MB megabytes across the hosts (benchmarks/link_probe.py) at each rate; --env
passes NCCL settings to every rank, to try them on either. Needs root and pyroute2 (no iproute2).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minimal_fsdp.parallel.choose import reduce_precision  # noqa: E402
from minimal_fsdp.tools.virtual_cluster import TBF_MAX_BITS, Cluster, unavailable  # noqa: E402

# fmt: off
MODELS = {
    "gpt2":     "--model_preset gpt2 --vocab_size 50304 --batch_size 32".split(),
    # ~1.0B parameters, Llama 3.2 1B's shape: 16 blocks of 2048, 32 heads, 8 kv heads, vocab 32000
    "llama-1b": "--model llama --num_layers 16 --embed_size 2048 --num_heads 32 --num_kv_heads 8 --intermediate_size 8192 --vocab_size 32000 --seq_length 2048 --batch_size 4".split(),
    # ~10.6M parameters (6 blocks of 384, character vocabulary): the CPU regime the link bounds
    "cpu-10m":  "--num_layers 6 --num_heads 6 --embed_size 384 --seq_length 128 --batch_size 2".split(),
    "tiny":     "--num_layers 2 --num_heads 2 --embed_size 32 --seq_length 32 --batch_size 4".split(),
}
# fmt: on
STRATEGIES = {
    "full-shard": ["--sharding", "full-shard"],
    "hybrid-full-shard": ["--sharding", "hybrid-full-shard"],
    "no-shard": ["--sharding", "no-shard"],
    "decentralized": ["--data_parallel", "decentralized"],
    # gossip's other topologies (plain "decentralized" is the default, alternating-exp-ring)
    **{
        f"decentralized-{t}": ["--data_parallel", "decentralized", "--topology", t]
        for t in ("complete", "ring", "exp")
    },
}
LAUNCH_PREFIXES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_",
    "MASTER_",
    "SLURM_",
    "PMI",
    "OMPI_",
    "PET_",
    "GLOO_SOCKET",
    "NCCL_SOCKET",
    "TORCHELASTIC",
    "CUDA_VISIBLE_DEVICES",
)
HEADER = (
    "| hosts x GPUs | Gbit/s set | link measured | model | strategy | step ms | tok/s | val loss | "
    "steps |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def parse():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--gpus_per_host", type=int, default=1)
    parser.add_argument(
        "--gbps", default="25,10,1", help="link rates to run at, Gbit/s (0: unshaped)"
    )
    parser.add_argument("--models", default="gpt2", help=f"of {', '.join(MODELS)}")
    parser.add_argument(
        "--strategies",
        default="full-shard,hybrid-full-shard,no-shard,decentralized",
        help=f"of {', '.join(STRATEGIES)}",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--warmup", type=int, default=10, help="first steps left out of the medians"
    )
    parser.add_argument(
        "--log_interval",
        type=int,
        default=1,
        help="training's; a row's step time is its interval's mean, so a decentralized run's "
        "consensus all-reduce (each logging step) counts once per interval, as in training",
    )
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--extra", default="", help="more training flags, e.g. '--compile'")
    parser.add_argument(
        "--no_p2p", action="store_true", help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 everywhere"
    )
    parser.add_argument(
        "--env", default="", help="KEY=VALUE,... for every rank (e.g. NCCL settings)"
    )
    parser.add_argument(
        "--probe", type=float, metavar="MB", help="time collectives of MB megabytes, no training"
    )
    parser.add_argument(
        "--side_by_side",
        metavar="FLAGS",
        help="instead of training: decentdp_side_by_side.py "
        "FLAGS at each rate (the plain-PyTorch references, Decent-DP and ours in one launch); rank "
        "0's table, its rows into --out with the link",
    )
    parser.add_argument(
        "--out", default="multihost.jsonl", help="results are appended here, one JSON line a run"
    )
    parser.add_argument(
        "--work", default="/tmp/multihost", help="data, logs, checkpoints (removed after each run)"
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take")
    parser.add_argument(
        "--straggler",
        type=float,
        default=0,
        metavar="CORES",
        help="slow the last host: its ranks share CORES of CPU time (a cgroup's quota, as a "
        "competing process would leave them; 0: no straggler)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model on CPU (gloo): checks the logic only"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="train on the CPU (gloo), one rank a host, any --models"
    )
    parser.add_argument(
        "--table", metavar="JSONL", help="only print the table of the results in this file"
    )
    return parser.parse_args()


def row(r):
    measured = f"{r['link_gbps']:.2f}" if r.get("link_gbps") else "-"
    strategy = r["strategy"] + (f" {r['extra']}" if r.get("extra") else "")
    if r.get("straggler_cores"):
        strategy += f" (last host on {r['straggler_cores']:g} cores)"
    values = (
        f"{r['hosts']} x {r['gpus_per_host']}",
        r["gbps_set"] or "unshaped",
        measured,
        r["model"],
        strategy,
        f"{r['step_ms']:.1f}" if r.get("step_ms") else r.get("failed", "-"),
        f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-",
        f"{r['val_loss']:.4f}" if r.get("val_loss") else "-",
        r.get("steps", "-"),
    )
    return "| " + " | ".join(map(str, values)) + " |"


def rank_env(args, host, local_rank, world, master):
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}
    gpus = range(host * args.gpus_per_host, (host + 1) * args.gpus_per_host)
    env.update(
        RANK=str(host * args.gpus_per_host + local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(args.gpus_per_host),
        MASTER_ADDR=master,
        MASTER_PORT="29500",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1" if args.cpu else "8"),
        NCCL_NET="Socket",
        NCCL_IB_DISABLE="1",
        NCCL_SOCKET_IFNAME="eth0",
        GLOO_SOCKET_IFNAME="eth0",
    )
    env["CUDA_VISIBLE_DEVICES"] = "" if args.cpu else ",".join(map(str, gpus))
    if args.no_p2p:
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    env.update(item.split("=", 1) for item in args.env.split(",") if item)
    return env


def launch(args, cluster, argv, name):
    """argv on every rank of every host, each rank's output in WORK/name.rankR.log; returns (failure
    or None, logs)."""
    world = args.hosts * args.gpus_per_host
    procs, logs = [], []
    slow = CpuQuota(f"multihost{os.getpid()}", args.straggler) if args.straggler else None
    for host in range(args.hosts):
        for local_rank in range(args.gpus_per_host):
            logs.append(
                Path(args.work) / f"{name}.rank{host * args.gpus_per_host + local_rank}.log"
            )
            env = rank_env(args, host, local_rank, world, cluster.hosts[0].address)
            procs.append(
                cluster.run(
                    f"node{host}",
                    [sys.executable, *argv],
                    env=env,
                    cwd=ROOT,
                    stdout=open(logs[-1], "w"),
                    stderr=subprocess.STDOUT,
                )
            )
            if slow and host == args.hosts - 1:
                slow.add(procs[-1].pid)  # before it starts training: what it starts inherits
    deadline = time.monotonic() + args.timeout
    failed = None
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failed = "timeout"
        if proc.poll() is None:
            proc.kill()
        elif proc.returncode and not failed:
            failed = f"exit {proc.returncode}"
    if slow:
        slow.remove()
    if failed:
        print(f"  {name}: {failed}; see {logs[0]}", file=sys.stderr)
    return failed, logs


class CpuQuota:
    """A cgroup (v1 cpu controller, or v2) whose processes share `cores` of CPU time a period: the
    straggler's host. The kernel's quota is the tool; nothing in the training knows of it."""

    PERIOD_US = 100_000

    def __init__(self, name, cores):
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
        v1 = [m[1] for m in mounts if m[2] == "cgroup" and "cpu" in m[3].split(",")]
        quota = int(cores * self.PERIOD_US)
        if v1:
            self.path = Path(v1[0]) / name
            self.path.mkdir()
            (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:  # cgroup v2: one file, "QUOTA PERIOD"
            self.path = Path("/sys/fs/cgroup") / name
            self.path.mkdir()
            (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")

    def add(self, pid):
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self):
        """After its processes ended (a cgroup with processes cannot be removed)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def probe(args, cluster, gbps):
    """link_probe.py's JSON line (rank 0's), or {"failed": ...}."""
    failed, logs = launch(
        args, cluster, [ROOT / "benchmarks" / "link_probe.py", args.probe], f"probe-{gbps:g}g"
    )
    lines = [line for line in logs[0].read_text().splitlines() if line.startswith("{")]
    return {"failed": failed} if failed or not lines else json.loads(lines[-1])


def run_one(args, cluster, model, strategy, run_name):
    """One training run over every host; returns its result (medians after --warmup steps, final val
    loss)."""
    work = Path(args.work)
    flags = [
        *MODELS[model],
        *STRATEGIES[strategy],
        "--max_steps",
        args.steps,
        "--log_interval",
        args.log_interval,
        "--eval_interval",
        0,
        "--num_tokens",
        0,
        "--checkpoint_interval",
        0,
        "--run_name",
        run_name,
        "--data_dir",
        work / "data",
        "--log_dir",
        work / "logs",
        "--checkpoint_dir",
        work / "checkpoints",
        *([] if args.cpu else ["--precision", args.precision]),
        *args.extra.split(),
    ]
    failed, _ = launch(args, cluster, [ROOT / "basic_training.py", *flags], run_name)
    shutil.rmtree(work / "checkpoints" / run_name, ignore_errors=True)  # a 1B model's is 12 GB
    metrics = work / "logs" / run_name / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    )
    timed = [r for r in rows if "step_time" in r and r["step"] > args.warmup]
    result = {"failed": failed} if failed else {}
    if timed:
        result.update(
            step_ms=1000 * statistics.median(r["step_time"] for r in timed),
            tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
            steps=rows[-1]["step"],
        )
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    if vals:
        result["val_loss"] = vals[-1]
    return result


def main():
    args = parse()
    if args.table:
        print(HEADER)
        for line in Path(args.table).read_text().splitlines():
            print(row(json.loads(line)))
        return
    why = unavailable()
    if why:
        sys.exit(f"error: cannot make virtual hosts here: {why}")
    if args.tiny:
        args.models, args.cpu = "tiny", True
    if args.cpu:
        args.gpus_per_host = 1
    Path(args.work).mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        # a git archive
        text=True,
    ).stdout.strip() or os.environ.get("MINIMAL_FSDP_COMMIT", "")
    device = "cpu"
    if not args.cpu:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(
        f"commit {commit}, {device}, {time.strftime('%Y-%m-%d')}; {' '.join(sys.argv)}", flush=True
    )
    if not args.probe and args.side_by_side is None:
        print(HEADER, flush=True)
    with Cluster(args.hosts) as cluster:
        for gbps in [float(g) for g in args.gbps.split(",")]:
            shaped = 0 < gbps * 1e9 <= TBF_MAX_BITS
            for host in cluster.hosts:
                cluster.shape(host.name, rate=f"{gbps * 1e9:.0f}bit" if shaped else None)
            link = cluster.throughput(
                "node1", "node0", megabytes=64 if gbps >= 1 or not shaped else 8
            )
            if args.side_by_side is not None:
                rows = Path(args.work) / f"side-by-side-{gbps:g}g.jsonl"
                rows.unlink(missing_ok=True)
                script = [
                    ROOT / "benchmarks" / "decentdp_side_by_side.py",
                    *args.side_by_side.split(),
                    "--out",
                    rows,
                ]
                failed, logs = launch(args, cluster, script, f"side-by-side-{gbps:g}g")
                # rank 0's rows, with the link and launch they ran on, into --out
                with open(args.out, "a") as f:
                    for line in rows.read_text().splitlines() if rows.exists() else []:
                        result = dict(
                            json.loads(line),
                            hosts=args.hosts,
                            gpus_per_host=args.gpus_per_host,
                            gbps_set=gbps if shaped else 0,
                            link_gbps=link,
                            commit=commit,
                            device=device,
                            date=time.strftime("%Y-%m-%d"),
                            side_by_side=args.side_by_side,
                            **({"straggler_cores": args.straggler} if args.straggler else {}),
                        )
                        f.write(json.dumps(result) + "\n")
                print(
                    f"link {gbps:g} Gbit/s set, {link:.2f} measured"
                    + (f" ({failed})" if failed else "")
                )
                print(
                    "\n".join(
                        line for line in logs[0].read_text().splitlines() if line.startswith("|")
                    ),
                    flush=True,
                )
                continue
            if args.probe:
                result = dict(
                    hosts=args.hosts,
                    gpus_per_host=args.gpus_per_host,
                    gbps_set=gbps if shaped else 0,
                    link_gbps=link,
                    env=args.env,
                    commit=commit,
                    device=device,
                    date=time.strftime("%Y-%m-%d"),
                    **probe(args, cluster, gbps),
                )
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
                print(json.dumps(result), flush=True)
                continue
            for model in args.models.split(","):
                for strategy in args.strategies.split(","):
                    name = f"mh-{model}-{strategy}-{gbps:g}g-{int(time.time())}"
                    result = dict(
                        hosts=args.hosts,
                        gpus_per_host=args.gpus_per_host,
                        gbps_set=gbps if shaped else 0,
                        link_gbps=link,
                        model=model,
                        strategy=strategy,
                        commit=commit,
                        device=device,
                        p2p=not args.no_p2p,
                        date=time.strftime("%Y-%m-%d"),
                        **({"log_interval": args.log_interval} if args.log_interval != 1 else {}),
                        **({"extra": args.extra} if args.extra else {}),
                        **({"straggler_cores": args.straggler} if args.straggler else {}),
                        reduce_precision=summed_in(args),
                        **run_one(args, cluster, model, strategy, name),
                    )
                    with open(args.out, "a") as f:
                        f.write(json.dumps(result) + "\n")
                    print(row(result), flush=True)


def summed_in(args):
    """The dtype the run's gradients were summed in: its --reduce_precision (in --extra, else the
    default, auto) as training resolves it for these hosts and precision."""
    asked, words = "auto", args.extra.split()
    for i, word in enumerate(words):  # the last one given wins, as in argparse
        if word == "--reduce_precision" and i + 1 < len(words):
            asked = words[i + 1]
        elif word.startswith("--reduce_precision="):
            asked = word.partition("=")[2]
    return reduce_precision(asked, args.hosts, args.precision)


if __name__ == "__main__":
    main()
