"""throughput.py's row for no-shard under DDP (`--fsdp_unit block`: a model this small is otherwise
whole_unit.py's unit) under one of DDP's own settings, to see which of them moves a small model's
step. DDP_VARIANT names them, joined by "_": noopt (torch._dynamo.config.optimize_ddp off: the
compiled model is not split at DDP's bucket boundaries; the product's own setting where DDP replays
graphs), copies (gradient_as_bucket_view off, as DDP's default), onebucket (one 200 MB bucket),
static (static_graph), graphs (CUDA graphs forced on, as --cuda_graphs: under no-shard and
full-shard's one unit, whole_unit.py, the size rule already turns them on for this model; under
FSDP2's units the product keeps them off), ca (compiled autograd with DDP's Python reducer: the
whole backward, DDP's all-reduces included, traced into one graph, compiled in the trunk's mode, so
on CUDA replayed as a CUDA graph with no per-parameter reducer work on the host; one capture on 2
CPU ranks trained as the default, last-step loss equal).

    DDP_VARIANT=noopt mpiexec -x DDP_VARIANT -n 2 python benchmarks/ddp_variants.py
        --sharding no-shard --fsdp_unit block \\
        --num_layers 6 --num_heads 6 --embed_size 384 --seq_length 256 --vocab_size 65
            --batch_size 64 \\
        --no-bias --dropout 0.2 --precision bf16 --compile --warmup 10 --steps 60
Without DDP_VARIANT it is throughput.py, labelled "default".
"""

import dataclasses
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import throughput  # noqa: E402

import minimal_fsdp.parallel.parallelize as parallelize  # noqa: E402

variant = os.environ.get("DDP_VARIANT", "default")
names = set(variant.split("_"))
if "noopt" in names:
    torch._dynamo.config.optimize_ddp = False
options = {
    key: value
    for name, (key, value) in {
        "copies": ("gradient_as_bucket_view", False),
        "onebucket": ("bucket_cap_mb", 200),
        "static": ("static_graph", True),
    }.items()
    if name in names
}
if options:  # over the product's own arguments
    replicate = parallelize.replicate
    parallelize.replicate = lambda module, **kwargs: replicate(module, **{**kwargs, **options})
# private API (torch._dynamo.compiled_autograd._enable), torch 2.11 to 2.13: an experiment
if "ca" in names:
    step = throughput.train_step

    def compiled_autograd_step(model, *args, **kwargs):
        # Set on every call: the product turns Dynamo's DDP splitting off at build where graphs
        # replay, and DDP (built lazily by replicate() at the first forward) reads this mode then.
        torch._dynamo.config.optimize_ddp = "python_reducer"
        mode = "reduce-overhead" if torch.cuda.is_available() else None
        with torch._dynamo.compiled_autograd._enable(functools.partial(torch.compile, mode=mode)):
            return step(model, *args, **kwargs)

    throughput.train_step = compiled_autograd_step
if "graphs" in names:
    plan = throughput.make_plan
    throughput.make_plan = lambda *args, **k: dataclasses.replace(
        plan(*args, **k), cuda_graphs=True
    )

if __name__ == "__main__":
    sys.argv += ["--label", variant]
    throughput.main()
