"""The whole model as one sharded unit, for models small enough to gather whole (parallelize's
--fsdp_unit rule).

FSDP2's layout, its numbers and its checkpoints, in a few collectives: every parameter is a DTensor
sharded on dim 0 (padded as FSDP2 pads), so the optimizer, clipping and torch.distributed.checkpoint
see what they see under fully_shard. Before the first forward, and the first after any optimizer's
step or a load (hooks: no caller has to say so), one all-gather fills persistent unsharded
parameters in the compute dtype (bf16 or fp32); the module holds them from forward to the end of
backward (or of a forward without autograd), its sharded ones otherwise. After backward, the
unsharded gradients are summed in fp32 over the micro-steps and averaged by one reduce-scatter into
the shards' gradients (then one all-reduce over replicas, hybrid meshes), in fp32 or, with
--reduce_precision bf16, in bf16. no-shard of such a model is this unit over a (world x 1) mesh:
each rank's "shard" is the whole model, so the gather is a cast and the reduce-scatter a copy; its
one collective is the all-reduce.

Why not fully_shard on the root module (what this replaced for small models): FSDP2 frees the
gathered parameters after backward and gathers the next step's at new addresses, so a compiled model
cannot replay as CUDA graphs, and its per-step hooks, copy-outs and DTensor bookkeeping cost
milliseconds of host time a small model's step cannot hide: on a small model FSDP2's step took about
three times one GPU's, this unit's about one GPU's. Here the gathered parameters keep their
addresses, and a step adds two collectives (three on hybrid meshes) and a few ops. The memory:
FSDP2's one unit holds the gathered parameters through forward and backward too; between steps these
stay, and so do the shards' fp32 gradients.
"""

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.adamw import adamw  # the functional AdamW that torch.optim.AdamW.step runs
from torch.optim.optimizer import register_optimizer_step_post_hook

# torch 2.13 renamed the two collectives (the old names warn there); torch 2.11, the GPU image's,
# has the old only.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def parameter_slots(model):
    """Each parameter once, with every (module, name) that holds it (a tied weight has several)."""
    params, slots = [], {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in slots:
                    params.append(param)
                    slots[id(param)] = []
                slots[id(param)].append((module, name))
    return params, [slots[id(p)] for p in params]


def install(params, slots):
    """Puts params[i] in each (module, name) of slots[i] (parameter_slots' order)."""
    for param, places in zip(params, slots):
        for module, name in places:
            module._parameters[name] = param


class WholeUnit:
    """Shards `model`'s parameters over the mesh's last dim ("shard") and gathers them for its
    forward."""

    def __init__(self, model, mesh, compute_dtype, device, reduce_dtype=torch.float32):
        self.shard_group = mesh.get_group("shard")
        self.replicate_group = mesh.get_group("replicate") if mesh.ndim == 2 else None
        self.ranks, self.world = mesh.size(mesh.ndim - 1), mesh.size()
        rank = mesh.get_local_rank("shard")
        placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        params, self.slots = parameter_slots(model)
        # One rank's piece of parameter i: ceil(rows / ranks) rows (torch.chunk's and FSDP2's
        # split), zero-padded to that many on the last ranks, so every rank's segment has the same
        # size and one collective moves all.
        chunks = [-(-p.shape[0] // self.ranks) for p in params]
        self.sizes = [c * p[0].numel() for c, p in zip(chunks, params)]
        total = sum(self.sizes)
        # fp32 master weights, this rank's segment of each
        self.shard = torch.zeros(total, device=device)
        self.grad = torch.zeros(total, device=device)
        # --reduce_precision: the dtype the sums across ranks travel and add in
        self.reduce_dtype = reduce_dtype
        # parameter-major
        self.gathered = torch.empty(self.ranks * total, dtype=compute_dtype, device=device)
        self.sharded, self.unsharded, self.gather_out, self.grads = [], [], [], []
        offset = 0
        for param, chunk, size in zip(params, chunks, self.sizes):
            rest = param.shape[1:]
            rows = max(0, min(chunk, param.shape[0] - rank * chunk))
            local = self.shard[offset : offset + rows * param[0].numel()].view(rows, *rest)
            if not param.is_meta:  # meta: init_weights fills the shard later
                local.copy_(param.detach()[rank * chunk : rank * chunk + rows])
            full = self.gathered[self.ranks * offset : self.ranks * (offset + size)]
            self.gather_out.append(full.view(self.ranks, size))
            self.unsharded.append(
                nn.Parameter(full.view(self.ranks * chunk, *rest)[: param.shape[0]])
            )
            self.sharded.append(nn.Parameter(self._dtensor(local, mesh, placements, param)))
            self.grads.append(
                self._dtensor(
                    self.grad[offset : offset + local.numel()].view_as(local),
                    mesh,
                    placements,
                    param,
                )
            )
            offset += size
        self.accumulated = None  # fp32 sum of earlier micro-steps' gradients, (ranks, total)
        # The gathered parameters follow the shards without anyone having to say so: the first
        # forward gathers (after init_weights or a Hugging Face load has filled the shards), and so
        # does the first after any optimizer's step (a post-step hook common to all optimizers, so
        # one built elsewhere and stepped outside train_step counts too) or a load (load_state_dict,
        # which DCP's set_model_state_dict calls). Tensor version counters cannot tell: torch's
        # fused AdamW, and writes through DTensor's dispatch, leave them as they were.
        self.stale = True
        unit = weakref.ref(self)
        hook = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: unit() and unit()._changed()
        )
        weakref.finalize(self, hook.remove)
        install(self.sharded, self.slots)
        model.register_forward_pre_hook(lambda module, args: self._before_forward())
        # Backward may recompute blocks (activation checkpoints) from the module's parameters: the
        # unsharded ones stay installed until reduce(), after backward; a forward without autograd
        # gives them back at once.
        model.register_forward_hook(
            lambda module, args, out: (
                None if torch.is_grad_enabled() else install(self.sharded, self.slots)
            ),
            always_call=True,
        )
        model.register_state_dict_pre_hook(
            lambda module, prefix, keep_vars: install(self.sharded, self.slots)
        )
        model.register_load_state_dict_post_hook(lambda module, keys: self._changed())

    @staticmethod
    def _dtensor(local, mesh, placements, like):
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
        )

    def _changed(self):
        self.stale = True

    @torch.no_grad()
    def _before_forward(self):
        # no-shard's replicas: the shard is the whole model, cast in place
        if self.stale and self.ranks == 1:
            self.gathered.copy_(self.shard)
        elif self.stale:
            send = self.shard.to(self.gathered.dtype)
            received = torch.empty_like(self.gathered)
            all_gather(received, send, group=self.shard_group)
            # Rank-major (each rank's segments in turn) into each parameter's rows, in one copy.
            torch.split_with_sizes_copy(
                received.view(self.ranks, -1), self.sizes, dim=1, out=self.gather_out
            )
        self.stale = False
        install(self.unsharded, self.slots)

    @torch.no_grad()
    def accumulate(self):
        """Adds the unsharded gradients of the last backward, in fp32, to those of the earlier
        micro-steps."""
        grads = [p.grad for p in self.unsharded]
        if all(g is None for g in grads):
            return
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.unsharded, grads)]
        chunked = torch.empty(self.ranks, self.grad.numel(), device=self.grad.device)
        # FSDP2's layout, padded, in fp32
        torch._chunk_cat(grads, dim=0, num_chunks=self.ranks, out=chunked)
        if self.accumulated is None:
            self.accumulated = chunked
        else:
            self.accumulated += chunked
        for p in self.unsharded:
            p.grad = None

    @torch.no_grad()
    def reduce(self):
        """The mean gradient over all ranks, this rank's segment of it, as the sharded parameters'
        gradients."""
        install(self.sharded, self.slots)
        self.accumulate()
        if self.accumulated is None:
            return
        send = self.accumulated.view(-1).to(self.reduce_dtype)  # fp32: the sum itself, no copy
        reduced = (
            self.grad
            if self.reduce_dtype == self.grad.dtype
            else torch.empty_like(self.grad, dtype=send.dtype)
        )
        if self.ranks == 1:
            reduced.copy_(send)
        else:
            reduce_scatter(reduced, send, group=self.shard_group)
        if self.replicate_group is not None:
            dist.all_reduce(reduced, group=self.replicate_group)
        if reduced is not self.grad:
            self.grad.copy_(reduced)
        self.grad.div_(self.world)
        self.accumulated = None
        for param, grad in zip(self.sharded, self.grads):
            param.grad = grad


def local_tensor(tensor):
    """A DTensor's local shard (no autograd on the way, unlike to_local()), or the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class LocalAdamW(torch.optim.AdamW):
    """torch's fused AdamW over the unit's DTensor parameters, stepped on their local tensors once
    its state exists (after its first step, or loaded from a checkpoint): the same functional AdamW,
    kernel and state as AdamW.step, without DTensor's dispatch over each tensor list, milliseconds
    of host time a step that a small model's step cannot hide. The state stays DTensors, so
    checkpoints see FSDP2's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # per group: local params, exp_avgs, exp_avg_sqs, steps; rebuilt after a load
        self._lists = None

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._lists = None

    def _local_lists(self):
        lists = []
        for group in self.param_groups:
            states = [self.state[p] for p in group["params"]]
            lists.append(
                (
                    [local_tensor(p) for p in group["params"]],
                    [local_tensor(s["exp_avg"]) for s in states],
                    [local_tensor(s["exp_avg_sq"]) for s in states],
                    [s["step"] for s in states],
                )
            )
        return lists

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        # The first step creates the state (AdamW's own step); a parameter without a gradient, or
        # amsgrad, takes AdamW's own step too. Gradients are read anew each step: whoever assigned
        # them, they are the ones used.
        if (
            closure is not None
            or any(p.grad is None or p not in self.state for p in params)
            or any(group["amsgrad"] for group in self.param_groups)
        ):
            self._lists = None
            return super().step(closure)
        if self._lists is None:
            self._lists = self._local_lists()
        for group, (local_params, exp_avgs, exp_avg_sqs, steps) in zip(
            self.param_groups, self._lists
        ):
            beta1, beta2 = group["betas"]
            grads = [local_tensor(p.grad) for p in group["params"]]
            adamw(
                local_params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [],
                steps,
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )
