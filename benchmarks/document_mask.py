"""What --document_mask costs: benchmarks/throughput.py's training step on windows that pack
documents (each ended by an end-of-text token, lengths drawn uniformly from 1 to twice
--document_length), with the document mask (block-causal attention; FlexAttention on CUDA) or,
without --document_mask, plain causal attention over the same tokens. Run it twice, with and without
the flag, and compare the rows.

    mpiexec -n 4 python benchmarks/document_mask.py --model_preset llama3-8b --precision bf16 \
        --compile --meta_init --activation_checkpoints --recompute selective --batch_size 1 \
        --document_length 2048 [--document_mask]

Prints throughput.py's row. MFU counts full causal attention as throughput.py does
(Decoder.flops_per_token), so a masked run, which skips the tiles between documents, does less work
than its MFU says.
"""

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402

from minimal_fsdp.launch import environment  # noqa: E402
from minimal_fsdp.profiling import peak_flops, peak_memory_gb
from minimal_fsdp.train import train_step  # noqa: E402

# Llama 3's <|end_of_text|>; the run's vocabulary must be larger (lowered to vocab - 1 if not)
EOT = 128001


def packed_windows(n, batch, seq, vocab, document_length, eot, seed):
    """n (inputs, targets) batches of random tokens in which only `eot`, placed after each document,
    ends one."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(vocab, (batch, seq + 1), generator=generator)
        tokens[tokens == eot] = eot - 1
        for row in tokens:
            end = int(torch.randint(1, 2 * document_length, (1,), generator=generator))
            while end <= seq:
                row[end - 1] = eot
                end += int(torch.randint(1, 2 * document_length, (1,), generator=generator))
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def main():
    options = dict(
        throughput.BENCH_OPTIONS, document_length=(int, 2048, "mean tokens of a packed document")
    )
    cfg, bench = throughput.parse(options)
    flags_config = throughput.config_from_flags
    eot = min(EOT, flags_config(cfg).vocab_size - 1)
    # throughput.build takes the flags' model; its end-of-text token is this benchmark's
    if cfg.document_mask:
        throughput.config_from_flags = lambda cfg: dataclasses.replace(
            flags_config(cfg), document_eot_id=eot
        )
    env, model_config, model, optimizer, sync = throughput.build(cfg, bench["fsdp_on_one_rank"])
    seq, batch = model_config.seq_length, cfg.batch_size
    n = bench["warmup"] + bench["steps"]
    batches = [
        [
            (x.to(env.device), y.to(env.device))
            for x, y in packed_windows(
                cfg.grad_accum_steps,
                batch,
                seq,
                model_config.vocab_size,
                bench["document_length"],
                eot,
                cfg.seed + env.rank + 1000 * step,
            )
        ]
        for step in range(n)
    ]
    cuda = env.device.type == "cuda"
    times = []
    for step, micro_batches in enumerate(batches):
        if step == bench["warmup"] and cuda:
            torch.cuda.reset_peak_memory_stats()
        start, end = (
            (torch.cuda.Event(enable_timing=True) for _ in range(2))
            if cuda
            else (time.perf_counter(), None)
        )
        if cuda:
            start.record()
        loss, _ = train_step(model, optimizer, micro_batches, sync, cfg.grad_clip, env.device, step)
        if cuda:
            end.record()
        times.append((start, end) if cuda else time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1000 for s, e in times]
    median = statistics.median(times[bench["warmup"] :])
    tok_s = batch * cfg.grad_accum_steps * seq * env.world_size / median
    peak = peak_flops(env.device)
    mfu = model.flops_per_token() * tok_s / (peak * env.world_size) if peak else float("nan")
    memory = max(throughput.environment_all_ranks(peak_memory_gb(env.device), env))
    if env.is_main:
        mode = "mask" if cfg.document_mask else "causal"
        print(
            f"documents of ~{bench['document_length']} tokens, {mode}; rank 0's last loss "
            f"{float(loss):.4f}"
        )
        print(throughput.HEADER)
        print(
            f"| {cfg.model_preset} | {env.world_size} | {cfg.sharding} | {cfg.precision}"
            f"{'-' + cfg.fp8_recipe if cfg.precision == 'fp8' else ''} | {mode}, docs "
            f"~{bench['document_length']} | {batch * cfg.grad_accum_steps} | {seq} | {tok_s:,.0f} "
            f"| {tok_s / env.world_size:,.0f} | {'-' if mfu != mfu else f'{mfu:.1%}'} | "
            f"{median * 1000:.1f} | {memory:.1f} |",
            flush=True,
        )
    # release the sharded state before its process groups (see environment.teardown)
    del model, optimizer
    environment.teardown()


if __name__ == "__main__":
    main()
