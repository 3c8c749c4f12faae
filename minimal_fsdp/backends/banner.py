"""Rank 0's startup banner of a training run: the launch and the plan's layout, the model's size
and a memory estimate, float8, how checkpoints are saved (and the host memory an asynchronous save
keeps), how long the restore took, every resolved flag. Each backend prints it (the XLA one with
its mesh in the first line)."""

from minimal_fsdp.config.flags import to_toml
from minimal_fsdp.launch import environment, hosts
from minimal_fsdp.parallel import fp8


def state_bytes_per_rank(num_params, shard_size):
    """Parameters, gradients and AdamW moments, all fp32 (bf16 keeps fp32 master weights too),
    divided over the ranks a parameter is sharded across. Activations, the gathered block being
    computed, and allocator slack come on top."""
    return num_params * (4 + 4 + 8) / shard_size


def _readable(num_bytes):
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.3g} TB"


def saving(checkpoint_mode, env, checkpointer):
    """The banner's line on checkpoints: synchronous or asynchronous (under --checkpoint_mode
    `checkpoint_mode`), and the host memory the latter keeps."""
    if checkpointer.mode == "sync":
        return (
            f"checkpoints: synchronous (--checkpoint_mode {checkpoint_mode}): training waits "
            "while they are written"
        )
    pinned = "pinned " if env.device.type == "cuda" else ""
    return (
        f"checkpoints: asynchronous (--checkpoint_mode {checkpoint_mode}): training waits "
        f"while a save is copied into {_readable(checkpointer.staging)} of {pinned}host memory per "
        "rank (kept for the run), then goes on while the files are written"
    )


def banner(flags, env, plan, model, resume_from=None, checkpointer=None):
    """Rank 0's startup summary of a training run: layout, model size, a memory estimate, how
    checkpoints are saved (and the host memory an asynchronous save keeps), how long the restore
    took, every resolved flag (`flags`: {name: value})."""
    num_params = sum(p.numel() for p in model.parameters())  # DTensor numel is the full size
    state = _readable(state_bytes_per_rank(num_params, plan.shard_ranks))
    where = "CPU memory (--cpu_offload)" if plan.cpu_offload else f"{env.device.type} memory"
    spread = (
        f"sharded over {plan.shard_ranks}" if plan.shard_ranks > 1 else "a whole copy on every rank"
    )
    layout = plan.describe() + (f", {plan.topology} topology" if plan.decentralized else "")
    lines = [
        f"launch: {hosts.layout_line(env)}, started by {env.launcher}, {env.backend} on "
        f"{env.device.type}; {layout}"
        + (f"; {environment.THREADS['line']}" if environment.THREADS["line"] else ""),
        f"model: {num_params / 1e6:.2f}M parameters; params + grads + AdamW take ~{state} of "
        f"{where} per rank ({spread}; activations not included)",
        *([fp8.describe(plan, model, env.device)] if plan.fp8 else []),
        *(
            [saving(flags["checkpoint_mode"], env, checkpointer)]
            if checkpointer is not None
            else []
        ),
        (
            f"resuming from {resume_from}"
            + (
                f" (restored in {checkpointer.restore_s:.2f} s)"
                if checkpointer is not None and checkpointer.restore_s is not None
                else ""
            )
            if resume_from
            else "starting fresh"
        ),
        "config" + (f" ({flags['config']} + command line)" if flags["config"] else "") + ":",
    ]
    # the Hugging Face model's own shape and tokenizer
    replaced = ("model_preset", "tokenizer") if flags["hf_model"] else ()
    for section in to_toml(flags).strip().split("\n\n"):
        header, *entries = section.splitlines()
        lines.append(
            f"  {header} " + ", ".join(e for e in entries if e.split(" = ")[0] not in replaced)
        )
    return "\n".join(lines)
