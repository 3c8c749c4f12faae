"""Training across hosts, for real, on one machine: hosts are network namespaces
(minimal_fsdp.tools.virtual_cluster), each with its own hostname and /etc/hosts, joined by veth
links. Every launcher as a cluster runs it (mpiexec with a host list and ssh, our PBS script, SLURM-
and torchrun-style per-host variables, a Kubernetes PyTorchJob's torchrun), every strategy on 2
hosts x 2 ranks against the single-process reference, the data side (evaluation, --streaming
documents, the data position through an elastic resume 2x2 -> 1x2 -> 2x2), and the link's byte
counter shows that the ranks talked over it. Needs root (skipped elsewhere)."""

import os
import sys
from contextlib import contextmanager

import pytest
import torch

from minimal_fsdp.checkpoint import safe_load
from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.tools import virtual_cluster
from minimal_fsdp.tools.virtual_cluster import Cluster

import reference as plain
from conftest import ENTRY, ROOT, TINY_MODEL, mpiexec
from support import host_run_args, logged_rows, run_dirs

WHY = virtual_cluster.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no virtual hosts here: {WHY}")
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
    "HYDRA_",
    "PBS_",
    "TORCHELASTIC",
)
# bytes a 2-host run moves over host 1's link at the least (the model alone is ~120 KB)
TALKED = 100_000


def base_env(**extra):
    """This process's environment without any launcher's variables, for a process on a virtual
    host."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}
    return dict(
        env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **{k: str(v) for k, v in extra.items()}
    )


def torchrun_env(rank, local_rank, host, layout):
    return dict(
        MASTER_ADDR="10.77.0.1",
        MASTER_PORT=29500,
        WORLD_SIZE=sum(layout),
        RANK=rank,
        LOCAL_RANK=local_rank,
        LOCAL_WORLD_SIZE=layout[host],
    )


def slurm_env(rank, local_rank, host, layout):
    """What srun gives each task of a step over len(layout) nodes (its rendezvous: the first node's
    name)."""
    nodes = f"node[0-{len(layout) - 1}]"
    return dict(
        SLURM_JOB_ID=4242,
        SLURM_STEP_ID=0,
        SLURM_PROCID=rank,
        SLURM_LOCALID=local_rank,
        SLURM_NODEID=host,
        SLURM_STEP_NUM_TASKS=sum(layout),
        SLURM_NTASKS=sum(layout),
        SLURM_STEP_NUM_NODES=len(layout),
        SLURM_STEP_TASKS_PER_NODE=",".join(map(str, layout)),
        SLURM_STEP_NODELIST=nodes,
        SLURM_JOB_NODELIST=nodes,
    )


class Ranks:
    """Processes started on the hosts; each one's output in a file (a pipe left unread could fill
    and block)."""

    def __init__(self, cluster, work):
        self.cluster, self.work, self.procs = cluster, work, []

    def start(self, host, argv, env, cwd=None):
        name = f"{len(self.procs)}"
        out, err = open(self.work / f"p{name}.out", "w"), open(self.work / f"p{name}.err", "w")
        self.procs.append(
            self.cluster.run(host, argv, env=env, cwd=cwd or self.work, stdout=out, stderr=err)
        )
        return self

    def wait(self, timeout=300):
        """[(exit code, stdout, stderr)] of every process, in start order."""
        for proc in self.procs:
            proc.wait(timeout=timeout)
        return [
            (
                p.returncode,
                (self.work / f"p{i}.out").read_text(),
                (self.work / f"p{i}.err").read_text(),
            )
            for i, p in enumerate(self.procs)
        ]


def per_host_launch(cluster, work, layout, args, env_of, extra_env=None):
    """One process per rank, started on its host with the variables `env_of` gives it (rank 0
    first)."""
    ranks, rank = Ranks(cluster, work), 0
    for host, count in enumerate(layout):
        for local_rank in range(count):
            env = base_env(**env_of(rank, local_rank, host, layout), **(extra_env or {}))
            ranks.start(f"node{host}", [sys.executable, ENTRY, *map(str, args)], env)
            rank += 1
    return ranks.wait()


def mpi_launch(cluster, work, hosts, per_host, args, entry=ENTRY):
    """mpiexec (Hydra) on node0 with a host list; it reaches the other hosts through the cluster's
    ssh."""
    cmd = [
        mpiexec(),
        "-n",
        len(hosts) * per_host,
        "-ppn",
        per_host,
        "-hosts",
        ",".join(hosts),
        sys.executable,
        entry,
        *args,
    ]
    return (
        Ranks(cluster, work)
        .start("node0", list(map(str, cmd)), base_env(**cluster.job_env()))
        .wait()[0]
    )


def succeeded(results):
    for code, out, err in results:
        assert code == 0, f"exit {code}\n{out[-2000:]}\n{err[-4000:]}"
    return "".join(out for _, out, _ in results)


@contextmanager
def hosts(**kwargs):
    with Cluster(2, **kwargs) as cluster:
        yield cluster


def tiny_args(work, run_name, steps, *extra):
    return host_run_args(work, run_name, steps, *extra)


def metrics(work, run_name):
    return logged_rows(work, run_name)


def check_against_reference(work, run_name, args, world, steps):
    """Logged losses, the final val loss and the saved weights equal plain single-process
    training's."""
    cfg, data, model, ref_losses = plain.train(args, world, steps=steps)
    rows = metrics(work, run_name)
    assert [r["loss"] for r in rows if "loss" in r] == pytest.approx(ref_losses, abs=5e-6)
    assert ref_losses[-1] < ref_losses[0]
    val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    # every rank's val batches
    assert val == pytest.approx(plain.val_loss(model, data, cfg, world), abs=5e-6)
    saved = safe_load.load_full_model_state(work / "checkpoints" / run_name / f"step_{steps}")
    for name, value in model.state_dict().items():
        torch.testing.assert_close(saved[name], value.detach(), atol=1e-5, rtol=1e-5, msg=name)


@pytest.fixture
def work(tmp_path):
    from conftest import make_text

    (tmp_path / "corpus.txt").write_text(make_text())
    return tmp_path


@pytest.mark.slow
def test_mpiexec_across_hosts_full_shard(work):
    """Hydra's mpiexec on node0 starts node1's ranks through ssh; MPI's own shared-memory split
    counts the nodes."""
    args = tiny_args(work, "mpi", 4, "--sharding", "full-shard")
    with hosts() as cluster:
        out = succeeded([mpi_launch(cluster, work, ["node0", "node1"], 2, args)])
        assert cluster.bytes_moved("node1") > TALKED
    assert "launch: 4 rank(s) = 2 node(s) x 2 rank(s)/node, started by mpi" in out
    assert "mesh shard=4 (full-shard)" in out and "network: eth0 (10.77.0.1)" in out
    check_against_reference(work, "mpi", args, 4, 4)


@pytest.mark.slow
def test_bf16_sums_move_fewer_bytes_across_hosts(work):
    """--reduce_precision bf16 over 2 hosts x 1 rank (the one unit, bf16): each step the link
    carries half of the bf16 gather and half of the reduce-scatter, 2 + 4 bytes a parameter in fp32
    sums, 2 + 2 in bf16; the counted bytes (rendezvous and checkpoint traffic included) fall by over
    a fifth (measured: 8.79 to 5.45 MB over 30 steps), and the run trains as the fp32 one does, to
    bf16's rounding."""
    moved, losses = {}, {}
    for reduce in ("float32", "bf16"):
        args = tiny_args(
            work,
            f"sums-{reduce}",
            30,
            "--precision",
            "bf16",
            "--reduce_precision",
            reduce,
            "--checkpoint_interval",
            0,
        )
        with hosts() as cluster:
            out = succeeded(per_host_launch(cluster, work, [1, 1], args, torchrun_env))
            moved[reduce] = cluster.bytes_moved("node1")
        assert "the whole model as one unit" in out
        losses[reduce] = [r["loss"] for r in metrics(work, f"sums-{reduce}") if "loss" in r]
    assert moved["bf16"] < 0.8 * moved["float32"], moved
    assert losses["bf16"][-1] < losses["bf16"][0] and len(losses["bf16"]) == 30
    assert losses["bf16"] == pytest.approx(losses["float32"], rel=0.005)  # measured: within 1e-4


@pytest.mark.slow
def test_torchrun_style_across_hosts_whose_names_do_not_resolve(work):
    """No host resolves another's name (nor its own): gloo would advertise 127.0.0.1 and the job
    would hang; the interface on the route to MASTER_ADDR is picked instead, and the run trains."""
    args = tiny_args(work, "torchrun", 4, "--sharding", "hybrid-grad-shard")
    with hosts(resolve="none") as cluster:
        out = succeeded(per_host_launch(cluster, work, [2, 2], args, torchrun_env))
        assert cluster.bytes_moved("node1") > TALKED
    assert "launch: 4 rank(s) = 2 node(s) x 2 rank(s)/node, started by torchrun" in out
    # shard within a host, replicate across
    assert "mesh replicate=2 x shard=2 (hybrid-grad-shard)" in out
    check_against_reference(work, "torchrun", args, 4, 4)


@pytest.mark.slow
def test_kubernetes_pytorchjob_pods_run_torchrun(work):
    """Each pod (host) runs the manifest's torchrun command with the variables the training operator
    sets."""
    yaml = pytest.importorskip("yaml")
    from support import envsubst, kubelet_expand

    train = tiny_args(work, "k8s", 4, "--sharding", "no-shard")
    values = {
        "JOB_NAME": "tiny",
        "IMAGE_URI": "x",
        "NUM_WORKERS": "1",
        "GPU_PER_NODE": "2",
        "INSTANCE_TYPE": "cpu",
        "SHARED_PVC": "claim",
        "SHARED_DIR": str(work),
        "TRAINING_ARGS": " ".join(map(str, train)),
    }
    job = yaml.safe_load(envsubst((ROOT / "k8s" / "pytorchjob.yaml").read_text(), values))
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    torchrun_dir = os.path.dirname(sys.executable)
    with hosts() as cluster:
        ranks = Ranks(cluster, work)
        for pod in range(2):
            pod_env = {
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
                "PET_NODE_RANK": str(pod),
                "MASTER_ADDR": "node0",
                "MASTER_PORT": "29500",
            }
            command = [*container["command"], kubelet_expand(container["args"][0], pod_env)]
            env = base_env(**pod_env, PATH=f"{torchrun_dir}:{os.environ['PATH']}")
            ranks.start(f"node{pod}", command, env, cwd=ROOT)
        out = succeeded(ranks.wait())
        assert cluster.bytes_moved("node1") > TALKED
    assert "launch: 4 rank(s) = 2 node(s) x 2 rank(s)/node, started by torchrun" in out
    assert "(no-shard)" in out
    check_against_reference(work, "k8s", train, 4, 4)


def stream_reference(args, world, steps):
    """Plain training on the global batch of every rank's --streaming batches (rank r of `world`
    reads the documents r, r + world, ...; StreamingData, which test_streaming checks against
    prepared tokens)."""
    from minimal_fsdp.data.documents import open_documents
    from minimal_fsdp.data.streaming import StreamingData
    from minimal_fsdp.data.tokenizer import load_tokenizer

    cfg = parse_args([str(a) for a in args])
    tokenizer = load_tokenizer(cfg.tokenizer_dir)
    streams = []
    for rank in range(world):
        stream = StreamingData(
            open_documents(cfg.dataset_path, "--dataset_path"),
            tokenizer,
            cfg.tokenizer_dir,
            rank,
            world,
            cfg.val_fraction,
            cfg.seed,
        )
        stream.bind(cfg.seq_length, cfg.batch_size, 1, rank, world, cfg.seed)
        streams.append(stream)
    model = plain.build(cfg, tokenizer.vocab_size, "cpu")
    optimizer, lr = plain.adamw(model, cfg), plain.schedule(cfg, cfg.lr_decay_steps)
    losses = []
    for step in range(steps):
        x, y = (torch.cat(parts) for parts in zip(*[s.train_batches(step)[0] for s in streams]))
        for group in optimizer.param_groups:
            group["lr"] = lr(step)
        loss = model(x, y)
        loss.backward()
        plain.apply_gradients(model, optimizer, cfg)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_slurm_style_tasks_stream_documents_across_hosts(work):
    """srun's per-task variables on two nodes (the rendezvous at the first node's name),
    --streaming: each rank reads the documents of its global rank, not of its local rank."""
    from support import make_documents, run_cli, write_jsonl

    source = write_jsonl(work / "docs", make_documents())
    tokenizer = run_cli(
        "--dataset",
        "text",
        "--input_file",
        source,
        "--tokenizer",
        "char",
        "--output",
        work / "prep",
    )
    args = [
        "--dataset_path",
        source,
        "--streaming",
        "--tokenizer_dir",
        tokenizer,
        *run_dirs(work),
        *TINY_MODEL,
        "--max_steps",
        4,
        "--log_interval",
        1,
        "--eval_interval",
        0,
        "--run_name",
        "slurm",
        "--lr",
        "3e-3",
        "--warmup_steps",
        2,
        "--lr_decay_steps",
        10,
        "--dropout",
        "0.0",
        "--sharding",
        "grad-shard",
    ]
    with hosts() as cluster:
        out = succeeded(per_host_launch(cluster, work, [2, 2], args, slurm_env))
        assert cluster.bytes_moved("node1") > TALKED
    assert "launch: 4 rank(s) = 2 node(s) x 2 rank(s)/node, started by srun" in out
    assert "mesh shard=4 (grad-shard)" in out
    losses = [r["loss"] for r in metrics(work, "slurm") if "loss" in r]
    assert losses == pytest.approx(stream_reference(args, 4, 4), abs=5e-6)


@pytest.mark.slow
def test_decentralized_gossip_across_hosts(work):
    from support import DECENTRALIZED, decentralized_reference

    # an fp32 wire, as the reference mixes; the hosts average their two replicas, then gossip
    args = tiny_args(
        work, "gossip", 4, *DECENTRALIZED, "--accum_steps", 1, "--gossip_dtype", "float32"
    )
    with hosts() as cluster:
        out = succeeded([mpi_launch(cluster, work, ["node0", "node1"], 2, args)])
        assert cluster.bytes_moved("node1") > TALKED
    assert "launch: 4 rank(s) = 2 node(s) x 2 rank(s)/node" in out and "gossip" in out
    rows, _ = decentralized_reference(args, 4, 4, hosts=[(0, 1), (2, 3)])
    logged = [r for r in metrics(work, "gossip") if "loss" in r]
    assert [r["loss"] for r in logged] == pytest.approx([loss for loss, _ in rows], abs=5e-6)


def elastic_reference(args, phases):
    """Plain training through world-size changes: phases [(world, steps)], each step's global batch
    the next world * batch_size blocks of the one block stream (the data position carries over,
    whatever the world)."""
    cfg = parse_args([str(a) for a in args])
    data = plain.PreparedTokens(cfg.data_dir)
    model = plain.build(cfg, data.vocab_size, "cpu")
    optimizer, lr = plain.adamw(model, cfg), plain.schedule(cfg, cfg.lr_decay_steps)
    losses, position, step = [], 0, 0
    for world, steps in phases:
        for _ in range(steps):
            blocks = [
                data.batch("train", position + i, 0, 1, 1, cfg.seq_length, cfg.seed)
                for i in range(world * cfg.batch_size)
            ]
            position += world * cfg.batch_size
            x, y = torch.cat([b[0] for b in blocks]), torch.cat([b[1] for b in blocks])
            for group in optimizer.param_groups:
                group["lr"] = lr(step)
            loss = model(x, y)
            loss.backward()
            plain.apply_gradients(model, optimizer, cfg)
            losses.append(loss.item())
            step += 1
    return losses


@pytest.mark.slow
def test_elastic_resume_two_hosts_to_one_and_back(work):
    """2 hosts x 2 ranks (our PBS job script, hybrid-full-shard), then 1 host x 2 (mpiexec,
    grad-shard), then 2 x 2 again (mpiexec, hybrid-grad-shard): each resumes the one before; the
    losses are those of one process that trained on the same block stream, the data position carried
    across the world-size changes."""
    args = tiny_args(work, "elastic", 3, "--lr_decay_steps", 10)
    with hosts() as cluster:
        pbs_env = dict(
            cluster.job_env(slots=2),
            PBS_O_WORKDIR=work,
            REPO=ROOT,
            MPIEXEC=mpiexec(),
            NRANKS_PER_NODE=2,
            NDEPTH=1,
            CPU_BIND="",
            PYTHON=sys.executable,
            ARGS=" ".join(map(str, args)),
        )
        first = (
            Ranks(cluster, work)
            .start("node0", ["bash", ROOT / "pbs" / "train_multi_node.sh"], base_env(**pbs_env))
            .wait()
        )
        out = succeeded(first)
        assert "2 node(s) x 2 rank(s) = 4 rank(s)" in out  # the script's own count of PBS_NODEFILE
        assert "launch: 4 rank(s) = 2 node(s) x 2 rank(s)/node" in out
        assert "mesh replicate=2 x shard=2 (hybrid-full-shard)" in out
        moved = cluster.bytes_moved("node1")
        assert moved > TALKED
        resumed = [*args, "--max_steps", 5, "--sharding", "grad-shard"]
        out = succeeded([mpi_launch(cluster, work, ["node0"], 2, resumed)])
        assert "launch: 2 rank(s) = 1 node(s) x 2 rank(s)/node" in out and "resuming from" in out
        assert cluster.bytes_moved("node1") - moved < TALKED  # node1 took no part
        out = succeeded(
            [
                mpi_launch(
                    cluster,
                    work,
                    ["node0", "node1"],
                    2,
                    [*args, "--max_steps", 7, "--sharding", "hybrid-grad-shard"],
                )
            ]
        )
        assert "mesh replicate=2 x shard=2 (hybrid-grad-shard)" in out and "resuming from" in out
    losses = {r["step"]: r["loss"] for r in metrics(work, "elastic") if "loss" in r}
    assert sorted(losses) == list(range(1, 8))
    expected = elastic_reference(args, [(4, 3), (2, 2), (4, 2)])
    assert [losses[s] for s in range(1, 8)] == pytest.approx(expected, abs=5e-6)


def doc_command(doc, starts):
    """The shell command of a fenced block in `doc` that starts with `starts`, its continuation
    lines joined."""
    lines = (ROOT / "docs" / doc).read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(starts))
    command = []
    for line in lines[first:]:
        command.append(line.rstrip("\\").strip())
        if not line.endswith("\\"):
            return " ".join(command)


@pytest.mark.slow
def test_the_docs_rehearsal_trains_across_hosts_after_a_finished_run_and_says_what_it_proved(work):
    """docs/launch.md's rehearsal command used to resume the quick start's finished run, train 0
    steps, send no collective across the hosts and exit 0. After a finished run of the default name
    it trains a run of its own across both hosts and reports the hosts, ranks, interface and
    bytes."""
    import subprocess

    subprocess.run(
        [sys.executable, ENTRY, *TINY_MODEL, "--max_steps", "2", "--eval_interval", "0"],
        cwd=work,
        # the quick start, short
        env=base_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (work / "checkpoints" / "shakespeare" / "step_2").is_dir()
    # the command runs from a checkout; the run's files stay here
    (work / "pbs").symlink_to(ROOT / "pbs")
    command = doc_command("launch.md", "minimal-fsdp cluster --hosts 2 --slots 2")
    command = command.replace("minimal-fsdp", f"{sys.executable} -m minimal_fsdp", 1)
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=work,
        env=base_env(REPO=ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )  # a bound on a hang only
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = [line for line in result.stdout.splitlines() if line.startswith("rehearsal: ")]
    assert len(report) == 1 and report[0].startswith(
        "rehearsal: trained across 2 hosts (node0, node1): 4 rank(s) "
        "= 2 node(s) x 2 rank(s)/node; network eth0 (10.77.0.1); "
    )
    assert float(report[0].split("; ")[2].split(" MB")[0]) * 1e6 > TALKED and report[0].endswith(
        "20 steps trained"
    )
    assert len(list((work / "checkpoints").glob("rehearsal-*/step_20"))) == 1
    # every client of c10d's store is named from the hosts' own /etc/hosts: no reverse lookup
    # falls through to a DNS server the namespaces cannot reach (a warning per client, it was)
    assert "cannot be retrieved" not in result.stdout + result.stderr
