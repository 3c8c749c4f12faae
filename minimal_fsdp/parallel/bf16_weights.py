"""bf16 weights beside fp32 master weights, on one GPU (--precision bf16 or fp8 with --compile on
CUDA, where ClippedAdamW steps): the model computes with bf16 copies of its fp32 parameters.

Why not autocast, which one GPU ran before: it casts every fp32 weight to bf16 in each forward and
every bf16 weight gradient back to fp32 in backward, 12 bytes a parameter a step. Here backward
leaves bf16 gradients on the copies; ClippedAdamW reads them as it steps the fp32 parameters and
writes the next copies in the same pass, and the grad norm reads half the bytes. The numbers are
FSDP2's mixed precision (param_dtype bf16, fp32 updates), as on more GPUs: weights, activations and
gradients in bf16. FSDP2 itself on one GPU costs more in its copies than it saves
(benchmarks/results/RESULTS.md, levers not kept), and torch has no optimizer that keeps master
weights.

Outside a step everything sees the fp32 parameters: the optimizer's groups, state_dict and
checkpoints, loads. The copies are installed in the modules by the forward and stay through backward
(activation checkpoints recompute from them) until the gradient sync ends the step (finish); a
forward without autograd gives the fp32 ones back at once. As whole_unit.py's gathered parameters,
the copies follow the fp32 ones without anyone having to say so: the first forward, and the first
after a load or an optimizer's step that did not write them, casts them anew.
"""

import weakref

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from minimal_fsdp.parallel.whole_unit import install, parameter_slots


class BF16Weights:
    """bf16 copies of `model`'s parameters, computed with in its forward and backward."""

    def __init__(self, model):
        self.params, self.slots = parameter_slots(model)
        self.copies = [
            nn.Parameter(torch.empty_like(p, dtype=torch.bfloat16), p.requires_grad)
            for p in self.params
        ]
        self.copy_of = dict(zip(self.params, self.copies))
        # fp32 sums of a step's earlier micro-steps: bf16 sums would drop each one's low bits
        self.sums = None
        self.writer = None  # the optimizer whose step writes the copies itself (ClippedAdamW)
        self.stale = True
        unit = weakref.ref(self)
        hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: unit() and unit()._stepped(optimizer)
        )
        weakref.finalize(self, hook.remove)
        model.register_forward_pre_hook(lambda module, args: self._before_forward())
        model.register_forward_hook(
            lambda module, args, out: None if torch.is_grad_enabled() else self.finish(),
            always_call=True,
        )
        model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self.finish())
        model.register_load_state_dict_post_hook(lambda module, keys: self._stale())

    def _stale(self):
        self.stale = True

    def _stepped(self, optimizer):
        if optimizer is not self.writer:
            self._stale()

    @torch.no_grad()
    def _before_forward(self):
        if self.stale:
            torch._foreach_copy_(self.copies, [p.detach() for p in self.params])
            self.stale = False
        install(self.copies, self.slots)

    def finish(self):
        """The fp32 parameters back in the modules (the step's forward and backward are done)."""
        install(self.params, self.slots)

    @torch.no_grad()
    def accumulate(self):
        """Adds the copies' gradients (the last micro-step's) to the step's fp32 sums, where it has
        several micro-steps."""
        grads = [c.grad for c in self.copies]
        if all(g is None for g in grads):
            return
        if self.sums is None:
            self.sums = [None if g is None else g.float() for g in grads]
        else:
            self.sums = [
                s if g is None else g.float() if s is None else s.add_(g)
                for s, g in zip(self.sums, grads)
            ]
        for c in self.copies:
            c.grad = None

    def grads(self):
        """Each parameter's gradient this step (None where it has none): its copy's, in bf16, or
        the fp32 sum over the micro-steps (the last one's added first)."""
        if self.sums is None:
            return [c.grad for c in self.copies]
        self.accumulate()
        return self.sums

    def zero_grad(self):
        self.sums = None
        for c in self.copies:
            c.grad = None
