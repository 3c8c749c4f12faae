"""The parts of a training run that depend on what computes it, for CUDA and CPU through
torch.distributed (plan.backend "torch"): the model as the plan lays it out, the batches the loop
reads, the gradient sync and the checkpointer. run.train_model wires them into train.train; xla.py's
XLA gives the same parts for --device xla."""

import torch

from minimal_fsdp.backends.banner import banner
from minimal_fsdp.checkpoint.background import for_run
from minimal_fsdp.checkpoint.checkpointer import Checkpointer
from minimal_fsdp.hf import read
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.parallel.parallelize import build_model, gradient_sync


class Torch:
    """Every rank one data-parallel member of --batch_size sequences; the model laid out by
    parallelize.py."""

    samples_on_host = False  # the sample at the end comes from the trained model itself

    def __init__(self, backend, checkpoint, flags, env, plan):
        """As backends.for_plan gives them."""
        # env: where the loop computes (the launch's own here)
        self.settings, self.env, self.plan = backend, env, plan
        self.checkpoint, self.flags = checkpoint, flags
        # data-parallel members: in all, and fed by this process
        self.ranks, self.local_ranks = env.world_size, 1

    def build_model(self, model_config, hf_dir=None):
        """Built, laid out as the plan says and initialized (parallelize.build_model); then the
        Hugging Face model's weights, if given (None when resuming: the checkpoint's come
        instead)."""
        model = build_model(
            MODELS[model_config.model_type], model_config, self.plan, self.env, self.settings.seed
        )
        if hf_dir:
            read.load_weights(model, hf_dir, model_config.model_type)
        return model

    def checkpointer(self, model_config, tokenizer_dir, model):
        """Collective: every rank agrees on saving in the background or not (background.for_run)
        first."""
        background = for_run(self.checkpoint, self.env, model, self.plan.decentralized)
        return Checkpointer(
            self.checkpoint,
            self.flags,
            model_config,
            tokenizer_dir,
            self.plan.decentralized,
            background,
        )

    def batches(self, data):
        return data  # train_step copies each host batch to the device

    def gradient_sync(self, model):
        """Made once the model is restored, as always (gossip's moves the parameters into one flat
        buffer)."""
        return gradient_sync(model, self.plan)

    def synchronize(self):
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def seed(self, step):
        """Nothing to do: torch's generators were seeded at the start (run.run) or restored with the
        checkpoint."""

    def banner(self, model, start, checkpointer):
        return banner(self.flags, self.env, self.plan, model, start, checkpointer)
