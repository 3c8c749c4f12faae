"""Where does a training step's time go? torch.profiler over a few steps of the real train_step.

    mpiexec -n 1 python benchmarks/profile_step.py --model_preset gpt2 --vocab_size 50304 --precision bf16 \
        --batch_size 16 [--compile] [--out DIR]
Prints the host (CPU) time per step next to the device (CUDA) time per step, then the top operators by self
CPU time and by device time. Host time above device time means the GPU waits on Python and launches.
"""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minimal_fsdp import environment  # noqa: E402
from minimal_fsdp.config import Config, build_parser, validate  # noqa: E402
from minimal_fsdp.model import GPT, make_config  # noqa: E402
from minimal_fsdp.parallelize import build_mesh, build_model  # noqa: E402
from minimal_fsdp.train import build_optimizer, train_step  # noqa: E402


def main():
    parser = build_parser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="write a Chrome trace here")
    args = vars(parser.parse_args())
    steps, out = args.pop("steps"), args.pop("out")
    cfg = Config(**args)
    validate(cfg)
    env = environment.setup(cfg)
    config = make_config(cfg.model_preset, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                         embed_size=cfg.embed_size, seq_length=cfg.seq_length, vocab_size=cfg.vocab_size)
    model = build_model(GPT, config, cfg, env, build_mesh(cfg, env))
    optimizer = build_optimizer(model, cfg)
    tokens = torch.randint(config.vocab_size, (cfg.batch_size, config.seq_length + 1), device=env.device)
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    for _ in range(5):
        train_step(model, optimizer, batch, cfg.grad_clip, env.device)
    torch.cuda.synchronize()
    # Host time: how long Python takes to issue a step when it never waits for the device.
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, batch, cfg.grad_clip, env.device)
    host = (time.perf_counter() - t0) / steps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            train_step(model, optimizer, batch, cfg.grad_clip, env.device)
        torch.cuda.synchronize()
    if env.is_main:
        events = prof.key_averages()
        device_total = sum(e.self_device_time_total for e in events) / steps / 1e3
        print(f"per step: host issue {host * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms, "
              f"device busy {device_total:.1f} ms (sum of kernel times)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))
        if out:
            prof.export_chrome_trace(str(Path(out) / "trace.json"))
    environment.teardown()


if __name__ == "__main__":
    main()
