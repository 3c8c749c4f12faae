"""ClippedAdamW: torch's AdamW, its step compiled with the gradient clip folded in (CUDA,
--compile).

torch's fused AdamW is one kernel, but the clip before it is two more passes over every gradient
(clip_grad_norm_'s multiply reads and writes them all), and fused AdamW's own grad_scale, which
could take the clip's factor, writes every unscaled gradient back. Compiled, the factor is applied
as each gradient is read for the update, so after the norm's pass a step reads parameters,
gradients and both moments once and writes parameters and moments once. On one H200 that saved
about 12 ms of a 241 ms step (Llama 3 8B's shape cut to 8 layers, T=8192:
benchmarks/results/RESULTS.md#clipped-adamw).

With bf16_weights.py's copies (one GPU), the gradients are the copies' (bf16, read as fp32) and the
step writes the next copies as it writes the parameters.

The state (step, exp_avg, exp_avg_sq per parameter, as fused AdamW keeps them: step a float32
tensor on the parameter's device) and param_groups are torch's AdamW's, so checkpoints are the same
either way. Sharded parameters (FSDP2's DTensors) are stepped on their local shards: the update is
elementwise. Those of weights FSDP all-gathers in float8 are stepped on the fp32 tensor inside
torchao's wrapper: torchao (0.17, 0.18) cannot trace its wrapper once the wrapper holds a
precomputed scale (its __tensor_flatten__ asks the scale tensor for its truth value), so the
compiled step failed from the second step on under --precision fp8 over more than one GPU. The
math is AdamW's (decoupled weight decay, bias-corrected moments).
"""

import torch

from minimal_fsdp.parallel.fp8 import plain_tensor


@torch.no_grad()
def adamw_update(groups, grad_norm, max_norm):
    """One AdamW step over groups = [(params, grads, exp_avgs, exp_avg_sqs, steps, lr, (beta1,
    beta2, eps, weight_decay), copies)], lr a 0-dim tensor; the gradients taken times min(1,
    max_norm / (grad_norm + 1e-6)) (clip_grad_norm_'s factor) where max_norm > 0; copies (or None):
    bf16 tensors that take the new parameters. Foreach ops, so that compiled they become a few
    horizontally fused kernels, not one per tensor."""
    if max_norm > 0:
        factor = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
    for params, grads, exp_avgs, exp_avg_sqs, steps, lr, hyper, copies in groups:
        beta1, beta2, eps, weight_decay = hyper
        if grads[0].dtype != params[0].dtype:  # bf16 copies' gradients, upcast as they are read
            grads = [g.to(params[0].dtype) for g in grads]
        if max_norm > 0:
            grads = torch._foreach_mul(grads, factor)
        torch._foreach_add_(steps, 1)
        if weight_decay:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        # p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
        first = [1 - torch.pow(beta1, t) for t in steps]
        second = [(1 - torch.pow(beta2, t)).sqrt() for t in steps]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, second)
        torch._foreach_add_(denominators, eps)
        step_sizes = [-lr / b for b in first]
        torch._foreach_mul_(denominators, torch._foreach_reciprocal(step_sizes))
        torch._foreach_addcdiv_(params, exp_avgs, denominators)
        if copies is not None:
            torch._foreach_copy_(copies, params)


class ClippedAdamW(torch.optim.AdamW):
    """AdamW whose step(grad_norm, max_norm) also applies the gradient clip (see the module's
    docstring). step() alone is a plain AdamW step (no clip), as a checkpoint loader's first step
    expects."""

    def __init__(self, params, compile=True, weights=None, **kwargs):
        super().__init__(params, **kwargs)
        self.update = torch.compile(adamw_update) if compile else adamw_update
        self.lrs = {}  # a device scalar per group that takes its lr: no step recompiles
        # bf16_weights.BF16Weights: the gradients are its copies', and the step writes them
        self.weights = weights
        if weights is not None:
            weights.writer = self

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        if self.weights is not None:
            self.weights.zero_grad()

    @torch.no_grad()
    def step(self, closure=None, grad_norm=None, max_norm=0.0):
        if closure is not None:
            raise ValueError("ClippedAdamW takes no closure")
        # the copies' gradients where they have them; else the parameter's own (DCP's loader steps
        # once with zero gradients on the parameters to create the state)
        copied = (
            {} if self.weights is None else dict(zip(self.weights.params, self.weights.grads()))
        )

        def grad(p):
            g = copied.get(p)
            return p.grad if g is None else g

        groups = []
        for i, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if grad(p) is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(
                        (), dtype=torch.float32, device=plain_tensor(p).device
                    )
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not params:
                continue
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            groups.append(
                (
                    [plain_tensor(p) for p in params],
                    [plain_tensor(grad(p)) for p in params],
                    [plain_tensor(s["exp_avg"]) for s in states],
                    [plain_tensor(s["exp_avg_sq"]) for s in states],
                    [s["step"] for s in states],
                    self._lr(i, group, states[0]["step"].device),
                    (beta1, beta2, group["eps"], group["weight_decay"]),
                    None if self.weights is None else [self.weights.copy_of[p] for p in params],
                )
            )
        if groups and grad_norm is None:  # a plain step (a checkpoint loader's first): eager
            adamw_update(groups, None, 0.0)
        elif groups:
            self.update(groups, grad_norm, float(max_norm))
        return None

    def _lr(self, i, group, device):
        if i not in self.lrs:
            self.lrs[i] = torch.zeros((), dtype=torch.float32, device=device)
        return self.lrs[i].fill_(group["lr"])
