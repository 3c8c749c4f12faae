"""AccumAdamW: AdamW whose moment estimates are refreshed only every `accum_steps` steps, from the
mean gradient of those steps, while the parameters still move every step.

Decentralized training takes one optimizer step per local batch, so each step's gradient is a
small-batch, high-variance one. Feeding the mean of k gradients to Adam's moments gives them the
variance of a k-times larger batch, without waiting k steps to move (gossip keeps running every
step). This is the accumulation of the decentralized GPT-2 reference (Wang et al., "From promise to
practice", ICLR 2025).

With step t = 1, 2, ..., window r = ceil(t / k), g_t the gradient, and m, v the moments after r - 1
completed windows (m = v = 0 at first):
    p     <- p * (1 - lr * weight_decay)    decoupled decay, as AdamW
    m~    =  beta1 * m + (1 - beta1) * g_t  moments as if g_t ended the window
    v~    =  beta2 * v + (1 - beta2) * g_t^2
    p     <- p - lr * (m~ / (1 - beta1^r)) / (sqrt(v~ / (1 - beta2^r)) + eps)
    and when t is a multiple of k, with a = mean of g over the window's k steps:
    m     <- beta1 * m + (1 - beta1) * a,   v <- beta2 * v + (1 - beta2) * a^2
So at every step the update is the AdamW update whose gradient history is the means of the completed
windows followed by g_t. With accum_steps = 1 this is exactly torch.optim.AdamW.
"""

import torch


class AccumAdamW(torch.optim.Optimizer):
    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0, accum_steps=1
    ):
        if accum_steps < 1:
            raise ValueError(f"accum_steps must be at least 1 (got {accum_steps})")
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, accum_steps=accum_steps),
        )

    def _group_state(self, group):
        params, grads, states = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                # a CPU tensor, as AdamW keeps it, so checkpoints agree
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["accum_grad"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            states.append(state)
        return params, grads, states

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, states = self._group_state(group)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lr, k = group["lr"], group["accum_steps"]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            accum = [s["accum_grad"] for s in states]
            torch._foreach_add_([s["step"] for s in states], 1)
            step = int(states[0]["step"].item())  # a CPU tensor: no device sync
            window = (step + k - 1) // k

            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_add_(accum, grads, alpha=1 / k)
            m = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
            v = torch._foreach_mul(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
            denom = torch._foreach_sqrt(v)
            del v
            torch._foreach_div_(denom, (1 - beta2**window) ** 0.5)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, m, denom, -lr / (1 - beta1**window))
            del m, denom

            if step % k == 0:  # the window is complete: its mean gradient enters the moments
                torch._foreach_lerp_(exp_avgs, accum, 1 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, accum, accum, 1 - beta2)
                torch._foreach_zero_(accum)
        return loss
