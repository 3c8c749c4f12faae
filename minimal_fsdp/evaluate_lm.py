"""Our model as an lm-evaluation-harness backend (lm_eval's TemplateLM), sharded over the ranks as it was loaded.

Rank 0 runs the harness; every other rank serves it (serve()). For each batch rank 0 broadcasts the token rows,
every rank scores an equal share of them with one forward call, and rank 0 gathers the scores. So every rank
makes the same forward calls (FSDP's all-gathers meet), the batch is spread over the ranks as in training, and
the harness runs exactly as in one process: its own rank splitting would give ranks different numbers of requests
and batches, which the harness evens out only for some request types, and it would gather metrics again.

--batch_size is per rank, as lm_eval's hf backend counts it on each GPU. Log-likelihoods take one forward call
per batch; generate_until decodes one sequence per rank at a time with the KV cache (its one position is
shared by the batch, so sequences of different lengths cannot share it), greedily, as the harness's tasks do.
"""
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from torch.nn.attention import sdpa_kernel
from tqdm import tqdm

from .config import ConfigError
from .failures import MainRankFailed
from .generate import DECODE_ATTENTION

PAD = 0  # the id right-padding takes; its positions are never scored


def token_scores(x, weight, targets):
    """Stands in for the model's loss (forward calls it inside FSDP's hooks, on the gathered output weight):
    (log p(target), 1.0 if the target is the most likely token) at every position whose target is not -1, in
    row-major order, computed in fp32. Only the scored positions are projected onto the vocabulary."""
    keep = targets >= 0
    logits = F.linear(x[keep], weight).float()
    wanted = targets[keep]
    picked = logits.log_softmax(dim=-1).gather(-1, wanted[:, None])[:, 0]
    return torch.stack([picked, (logits.argmax(dim=-1) == wanted).float()], dim=-1)


@contextmanager
def scoring(model):
    """The model in eval mode with token_scores as its loss; as it was afterwards (training resumes from here)."""
    loss, was_training = model.loss, model.training
    model.loss = token_scores
    model.eval()
    try:
        yield
    finally:
        model.loss = loss
        model.train(was_training)


class ShardedLM(TemplateLM):
    """model: built and loaded on every rank (sample.load_model); tokenizer: ours (tokenizer.py)."""

    def __init__(self, model, tokenizer, device, dtype=torch.float32, batch_size=1, progress=True):
        super().__init__()  # the harness's rank and world size stay 0 and 1: it runs on rank 0 alone
        if tokenizer.eot_id is None and tokenizer.bos_id is None:
            raise ConfigError(f"the model's {tokenizer.kind} tokenizer has no end-of-text or begin-of-text token, "
                              "which the harness puts before a text it scores whole; train with --tokenizer gpt2 "
                              "or sentencepiece")
        self.model, self.tok, self._device, self.dtype = model, tokenizer, device, dtype
        self.batch_size, self.progress = batch_size, progress
        self.ranks, self.me = dist.get_world_size(), dist.get_rank()

    # --- what the harness asks of a model ---

    @property
    def eot_token_id(self):
        return self.tok.eot_id if self.tok.eot_id is not None else self.tok.bos_id

    @property
    def prefix_token_id(self):
        """What lm_eval's hf backend puts before a text scored from its start: BOS if there is one, else EOS."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eot_id

    @property
    def max_length(self):
        return self.model.config.seq_length

    @property
    def max_gen_toks(self):
        return 256  # lm_eval's default, as its hf backend

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        return self.tok.encode(string)

    def tok_decode(self, tokens):
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: (strings, context ids, continuation ids) -> (log p(continuation), greedy), as lm_eval's hf
        backend: context and continuation left-truncated to the context plus one token, the last one not fed."""
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ConfigError(f"a continuation of {len(continuation)} tokens is longer than the model's "
                                  f"context of {self.max_length}")
            rows.append(((context + continuation)[-(self.max_length + 1):], len(continuation)))
        return self.score(rows, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each text scored whole in disjoint windows of the model's context (lm_eval's own windows)."""
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((None, None), context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations, one request per rank at a time, cut at the first stop string."""
        texts = []
        for start in tqdm(range(0, len(requests), self.ranks), disable=disable_tqdm or not self.progress,
                          desc="generate_until"):
            prompts = [self._prompt(*request.args) for request in requests[start:start + self.ranks]]
            texts += self._command("generate", prompts)
        return texts

    def _prompt(self, context, gen_kwargs):
        """(context ids, stop strings, tokens to generate) of one request, checked on rank 0."""
        kwargs = dict(gen_kwargs)
        if kwargs.get("do_sample") and kwargs.get("temperature", 1.0) != 0:
            raise ConfigError("a task asks to sample (do_sample with a temperature): this backend decodes greedily")
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        num_tokens = kwargs.get("max_gen_toks", self.max_gen_toks)
        if num_tokens >= self.max_length:
            raise ConfigError(f"a task asks for {num_tokens} generated tokens, more than the model's context of "
                              f"{self.max_length} leaves for its prompt")
        return self.tok_encode(context)[-(self.max_length - num_tokens):], until, num_tokens

    # --- rank 0 leads, the others serve ---

    def score(self, rows, disable_tqdm=True):
        """rows: (token ids, how many of the last ones to score) -> [(sum of their log-probs, all greedy)]. The
        longest first (as the hf backend), so a batch pads little; batch_size rows per rank and forward call."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        step = self.batch_size * self.ranks
        results = [None] * len(rows)
        for start in tqdm(range(0, len(order), step), disable=disable_tqdm or not self.progress,
                          desc="loglikelihood batches"):
            chunk = order[start:start + step]
            for i, result in zip(chunk, self._command("score", [rows[i] for i in chunk])):
                results[i] = result
        return results

    def _command(self, kind, items):
        """Rank 0: every rank works on its share of items; returns the results in the items' order."""
        if self.ranks > 1:
            dist.broadcast_object_list([(kind, items)], src=0)
        return self._share(kind, items)

    def serve(self):
        """Ranks other than 0: do rank 0's commands until it is done; its error, if any, is raised here too."""
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            kind, items = message[0]
            if kind == "done":
                return
            if kind == "error":
                text, bad_input = items
                raise (ConfigError if bad_input else MainRankFailed)(text)
            self._share(kind, items)

    def finish(self, error=None, bad_input=True):
        """Rank 0: release the serving ranks; with rank 0's error, if evaluation failed there, for them to raise:
        ConfigError for bad input, else failures.MainRankFailed."""
        if self.ranks > 1:
            dist.broadcast_object_list([("error", (error, bad_input)) if error else ("done", None)], src=0)

    def _share(self, kind, items):
        """This rank's items are every ranks-th from its own index (a sorted batch gives every rank rows of
        similar length); a rank left without one runs a stand-in, so every rank makes the same calls."""
        mine = items[self.me::self.ranks]
        count = -(-len(items) // self.ranks)
        if kind == "score":
            stand_in = ([self.prefix_token_id] * 2, 1)
            results = self._score_rows(mine + [stand_in] * (count - len(mine)))[:len(mine)]
        else:
            text = self._generate(mine[0] if mine else None)
            results = [text] if mine else []
        if self.ranks == 1:
            return results
        gathered = [None] * self.ranks
        dist.all_gather_object(gathered, results)
        # interleave back: item j came from rank j % ranks, its (j // ranks)-th
        return [gathered[j % self.ranks][j // self.ranks] for j in range(len(items))]

    @torch.no_grad()
    def _score_rows(self, rows):
        width = max(len(tokens) for tokens, _ in rows) - 1
        inputs = torch.full((len(rows), width), PAD, dtype=torch.long)
        targets = torch.full((len(rows), width), -1, dtype=torch.long)
        for i, (tokens, scored) in enumerate(rows):
            inputs[i, :len(tokens) - 1] = torch.tensor(tokens[:-1])
            targets[i, len(tokens) - 1 - scored:len(tokens) - 1] = torch.tensor(tokens[-scored:])
        with scoring(self.model):
            scores = self.model(inputs.to(self._device), targets.to(self._device)).cpu().double()
        results, at = [], 0
        for _, scored in rows:
            logprobs, greedy = scores[at:at + scored].unbind(-1)
            results.append((logprobs.sum().item(), bool(greedy.all())))
            at += scored
        return results

    @torch.no_grad()
    @sdpa_kernel(DECODE_ATTENTION)
    def _generate(self, prompt):
        """One greedy continuation, or None for a stand-in (prompt None). A rank that is done makes the same
        forward calls as the busiest one, on one token without the cache, which it would overflow."""
        model, was_training = self.model, self.model.training
        model.eval()
        ids, until, num_tokens = prompt or ([self.prefix_token_id], [], 0)
        cache = model.new_cache(1, self._device, self.dtype)
        logits = model(torch.tensor([ids], device=self._device), cache=cache)
        out, done = [], prompt is None
        while True:
            token = logits.float().argmax(dim=-1).view(1, 1)
            if not done:
                out.append(token.item())
                done = out[-1] == self.eot_token_id or len(out) == num_tokens or \
                    any(stop in self.tok_decode(out) for stop in until)
            if not self._anyone_busy(done):
                break
            logits = model(token) if done else model(token, cache=cache)
        model.train(was_training)
        if prompt is None:
            return None
        text = self.tok_decode([t for t in out if t != self.eot_token_id])
        cuts = [text.find(stop) for stop in until if stop in text]
        return text[:min(cuts)] if cuts else text

    def _anyone_busy(self, done):
        if self.ranks == 1:
            return not done
        busy = torch.tensor([0.0 if done else 1.0], device=self._device)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return busy.item() > 0
