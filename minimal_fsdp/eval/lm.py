"""Our model as an lm-evaluation-harness backend (lm_eval's TemplateLM), sharded over the ranks as
it was loaded.

Rank 0 runs the harness; every other rank serves it (serve()). For the harness's log-likelihood
requests rank 0 broadcasts the token rows once, every rank scores an equal share of them, batch
after batch, and rank 0 gathers the scores once. So every rank makes the same forward calls (FSDP's
all-gathers meet), each batch is spread over the ranks as in training, and the harness runs exactly
as in one process: its own rank splitting would give ranks different numbers of requests and
batches, which the harness evens out only for some request types, and it would gather metrics again.

--batch_size is per rank, as lm_eval's hf backend counts it on each GPU. Log-likelihoods take one
forward call per batch; generate_until decodes one sequence per rank at a time with the KV cache
(its one position is shared by the batch, so sequences of different lengths cannot share it),
greedily, as the harness's tasks do.
"""

import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from torch.nn.attention import sdpa_kernel
from tqdm import tqdm

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.inference.generate import DECODE_ATTENTION
from minimal_fsdp.launch.failures import MainRankFailed

PAD = 0  # the id right-padding takes; its positions are never scored
# rows sent to the ranks at once: bounds the pickles and host memory of one broadcast
COMMAND_TOKENS = 1 << 22


def token_scores(x, weight, targets):
    """Stands in for the model's loss (forward calls it inside FSDP's hooks, on the gathered output
    weight). targets: (positions, wanted): the flat indices of the positions of x (B, T) to score,
    in row-major order, and the token wanted at each. Returns (log p(wanted), 1.0 if it is the most
    likely token) at each, computed in fp32. Only those positions are projected onto the vocabulary;
    indexed, not masked, so the host never waits."""
    positions, wanted = targets
    logits = F.linear(x.flatten(0, 1)[positions], weight).float()
    picked = logits.log_softmax(dim=-1).gather(-1, wanted[:, None])[:, 0]
    return torch.stack([picked, (logits.argmax(dim=-1) == wanted).float()], dim=-1)


@contextmanager
def scoring(model):
    """The model in eval mode with token_scores as its loss; as it was afterwards (training resumes
    from here)."""
    loss, was_training = model.loss, model.training
    model.loss = token_scores
    model.eval()
    try:
        yield
    finally:
        model.loss = loss
        model.train(was_training)


def prefix_token(tokenizer):
    """The token before a text scored from its start: BOS, else EOS, else a one-token newline."""
    for token in (tokenizer.bos_id, tokenizer.eot_id):
        if token is not None:
            return token
    try:
        newline = tokenizer.encode("\n")
    except ConfigError:  # a vocabulary without it
        return None
    return newline[0] if len(newline) == 1 else None


def prefix_kind(tokenizer, token):
    if token == tokenizer.bos_id:
        return "the tokenizer's begin-of-text token"
    if token == tokenizer.eot_id:
        return "the tokenizer's end-of-text token (it has no begin-of-text token)"
    return (
        f"the newline that separates documents (the {tokenizer.kind} tokenizer has no begin- "
        "or end-of-text token)"
    )


class PlainProgress:
    """tqdm's update() as plain lines on stderr: one at every tenth of the total, and at the end."""

    def __init__(self, total, desc):
        self.total, self.desc, self.done, self.shown = total, desc, 0, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.done += n
        tenth = max(self.total, 1)
        if self.done * 10 // tenth > self.shown * 10 // tenth or self.done == self.total:
            self.shown = self.done
            print(f"{self.desc}: {self.done}/{self.total}", file=sys.stderr, flush=True)


class ShardedLM(TemplateLM):
    """model: built and loaded on every rank (load.load_model); tokenizer: ours (tokenizer.py)."""

    def __init__(self, model, tokenizer, device, dtype=torch.float32, batch_size=1, progress=True):
        """progress: bars where stderr is a terminal, else plain lines (a redirected log); False:
        neither."""
        # the harness's rank and world size stay 0 and 1: it runs on rank 0 alone
        super().__init__()
        self.model, self.tok, self._device, self.dtype = model, tokenizer, device, dtype
        self.batch_size, self.progress = batch_size, progress
        self.ranks, self.me = dist.get_world_size(), dist.get_rank()
        self._encoded = None  # {text: token ids} during loglikelihood
        self._prefix, self._prefix_named = prefix_token(tokenizer), False

    # --- what the harness asks of a model ---

    @property
    def eot_token_id(self):
        return self.tok.eot_id if self.tok.eot_id is not None else self.tok.bos_id

    @property
    def prefix_token_id(self):
        """What lm_eval's hf backend puts before a text scored from its start: BOS if there is one,
        else EOS; for a tokenizer with neither (a char model's), its newline, the separator of the
        documents it was trained on."""
        if self._prefix is None:
            raise ConfigError(
                f"the model's {self.tok.kind} tokenizer has no begin-of-text, "
                "end-of-text or newline token to put before a text scored whole: use "
                "tasks whose contexts are not empty"
            )
        if not self._prefix_named and self.me == 0:  # once, where it is first used
            self._prefix_named = True
            print(
                f"texts scored whole (or with no context) follow the prefix token {self._prefix} "
                f"({self.tok.decode([self._prefix])!r}), {prefix_kind(self.tok, self._prefix)}",
                file=sys.stderr,
                flush=True,
            )
        return self._prefix

    @property
    def max_length(self):
        return self.model.config.seq_length

    @property
    def max_gen_toks(self):
        return 256  # lm_eval's default, as its hf backend

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        if self._encoded is None:
            return self.tok.encode(string)
        if string not in self._encoded:
            self._encoded[string] = self.tok.encode(string)
        return self._encoded[string]

    def loglikelihood(self, requests, disable_tqdm=False):
        """The harness's own (TemplateLM's), each distinct text tokenized once (it tokenizes an
        item's context again for each of its choices), all of them first, in one call of the
        tokenizer library's batch encoder. The texts are those TemplateLM._encode_pair encodes: the
        context without its trailing spaces, and the context and continuation whole (a continuation
        alone when the context is empty). A text it asks for that is not among them is encoded when
        asked, so the scores never depend on this guess."""
        texts = {}
        for context, continuation in (request.args for request in requests):
            texts.update(
                dict.fromkeys(
                    (context.rstrip(), context + continuation) if context else (continuation,)
                )
            )
        self._encoded = dict(zip(texts, self.tok.encode_batch(list(texts))))
        try:  # the harness's bar over its tokenizing: left out where ours are plain lines
            return super().loglikelihood(requests, disable_tqdm or not self._bars())
        finally:
            self._encoded = None

    def tok_decode(self, tokens):
        return self.tok.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: (strings, context ids, continuation ids) -> (log p(continuation), greedy), as
        lm_eval's hf backend: context and continuation left-truncated to the context plus one token,
        the last one not fed."""
        rows = []
        for _, context, continuation in requests:
            if len(continuation) > self.max_length:
                raise ConfigError(
                    f"a continuation of {len(continuation)} tokens is longer than the model's "
                    f"context of {self.max_length}"
                )
            rows.append(((context + continuation)[-(self.max_length + 1) :], len(continuation)))
        return self.score(rows, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Each text scored whole in disjoint windows of the model's context (lm_eval's own
        windows)."""
        windows, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append(((None, None), context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        """Greedy continuations, one request per rank at a time, cut at the first stop string."""
        texts = []
        with self._progress(-(-len(requests) // self.ranks), "generate_until", disable_tqdm) as bar:
            for start in range(0, len(requests), self.ranks):
                batch = requests[start : start + self.ranks]
                prompts = [self._prompt(*request.args) for request in batch]
                texts += self._command("generate", prompts)
                bar.update()
        return texts

    def _prompt(self, context, gen_kwargs):
        """(context ids, stop strings, tokens to generate) of one request, checked on rank 0."""
        kwargs = dict(gen_kwargs)
        if kwargs.get("do_sample") and kwargs.get("temperature", 1.0) != 0:
            raise ConfigError(
                "a task asks to sample (do_sample with a temperature): this backend decodes "
                "greedily"
            )
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        num_tokens = kwargs.get("max_gen_toks", self.max_gen_toks)
        if num_tokens >= self.max_length:
            raise ConfigError(
                f"a task asks for {num_tokens} generated tokens, more than the model's context of "
                f"{self.max_length} leaves for its prompt"
            )
        return self.tok_encode(context)[-(self.max_length - num_tokens) :], until, num_tokens

    def _bars(self):
        return self.progress and sys.stderr.isatty()

    def _progress(self, total, desc, disable):
        """A bar where stderr is a terminal; in a redirected log, a plain line at every tenth, as
        training logs."""
        if disable or not self.progress:
            return tqdm(total=total, disable=True)
        return tqdm(total=total, desc=desc) if self._bars() else PlainProgress(total, desc)

    # --- rank 0 leads, the others serve ---

    def score(self, rows, disable_tqdm=True):
        """rows: (token ids, how many of the last ones to score) -> [(sum of their log-probs, all
        greedy)]. The longest first (as the hf backend), so a batch pads little; batch_size rows per
        rank and forward call. One command for up to COMMAND_TOKENS tokens of rows, not one per
        batch: each is a collective or two."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        step = self.batch_size * self.ranks
        results, start = [None] * len(rows), 0
        with self._progress(-(-len(rows) // step), "loglikelihood batches", disable_tqdm) as bar:
            while start < len(order):
                end, tokens = start, 0
                while end < len(order) and (end == start or tokens < COMMAND_TOKENS):
                    tokens += sum(len(rows[i][0]) for i in order[end : end + step])
                    end += step
                chunk = order[start:end]
                for i, result in zip(chunk, self._command("score", [rows[i] for i in chunk], bar)):
                    results[i] = result
                start = end
        return results

    def _command(self, kind, items, bar=None):
        """Rank 0: every rank works on its share of items; returns the results in the items'
        order."""
        if self.ranks > 1:
            dist.broadcast_object_list([(kind, items)], src=0)
        return self._share(kind, items, bar)

    def serve(self):
        """Ranks other than 0: do rank 0's commands until it is done; its error, if any, is raised
        here too."""
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
        """Rank 0: release the serving ranks; with rank 0's error, if evaluation failed there, for
        them to raise: ConfigError for bad input, else failures.MainRankFailed."""
        if self.ranks > 1:
            dist.broadcast_object_list(
                [("error", (error, bad_input)) if error else ("done", None)], src=0
            )

    def _share(self, kind, items, bar=None):
        """This rank's items are every ranks-th from its own index (sorted rows give every rank rows
        of similar length in each batch); a rank left short runs stand-ins, so every rank makes the
        same calls."""
        mine = items[self.me :: self.ranks]
        count = -(-len(items) // self.ranks)
        if kind == "score":
            stand_in = ([self._prefix or 0] * 2, 1)
            results = self._score_rows(mine + [stand_in] * (count - len(mine)), bar)[: len(mine)]
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
    def _score_rows(self, rows, bar=None):
        """One forward call per batch_size rows, queued without waiting for the device (the scores
        come back to the host once, at the end), so the host prepares a batch while the device
        computes the last one."""
        scores = []
        with scoring(self.model):
            for start in range(0, len(rows), self.batch_size):
                inputs, positions, wanted = map(
                    self._to_device, self._batch(rows[start : start + self.batch_size])
                )
                scores.append(self.model(inputs, (positions, wanted)))
                if bar is not None:
                    bar.update()
        scores = torch.cat(scores).cpu().double()
        row = torch.repeat_interleave(
            torch.arange(len(rows)), torch.tensor([scored for _, scored in rows])
        )
        sums = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, row, scores[:, 0])
        misses = torch.zeros(len(rows), dtype=torch.float64).index_add_(0, row, 1 - scores[:, 1])
        return list(zip(sums.tolist(), (misses == 0).tolist()))

    @staticmethod
    def _batch(rows):
        """Rows right-padded to the longest: (inputs (B, T), the flat positions to score, their
        wanted tokens)."""
        width = max(len(tokens) for tokens, _ in rows) - 1
        inputs = [tokens[:-1] + [PAD] * (width + 1 - len(tokens)) for tokens, _ in rows]
        positions = [
            i * width + p
            for i, (tokens, scored) in enumerate(rows)
            for p in range(len(tokens) - 1 - scored, len(tokens) - 1)
        ]
        wanted = [token for tokens, scored in rows for token in tokens[-scored:]]
        return torch.tensor(inputs), torch.tensor(positions), torch.tensor(wanted)

    def _to_device(self, tensor):
        if self._device.type != "cuda":
            return tensor.to(self._device)
        # a pageable copy would wait for the GPU
        return tensor.pin_memory().to(self._device, non_blocking=True)

    @torch.no_grad()
    @sdpa_kernel(DECODE_ATTENTION)
    def _generate(self, prompt):
        """One greedy continuation, or None for a stand-in (prompt None). A rank that is done makes
        the same forward calls as the busiest one, on one token without the cache, which it would
        overflow."""
        model, was_training = self.model, self.model.training
        model.eval()
        ids, until, num_tokens = prompt or ([self._prefix or 0], [], 0)
        # sized by what this request needs (_prompt keeps both within the context), not by
        # the model's whole context, as inference/generate.py does
        cache = model.new_cache(1, self._device, self.dtype, len(ids) + num_tokens)
        logits = model(torch.tensor([ids], device=self._device), cache=cache)
        out, done = [], prompt is None
        while True:
            token = logits.float().argmax(dim=-1).view(1, 1)
            if not done:
                out.append(token.item())
                done = (
                    out[-1] == self.eot_token_id
                    or len(out) == num_tokens
                    or any(stop in self.tok_decode(out) for stop in until)
                )
            if not self._anyone_busy(done):
                break
            logits = model(token) if done else model(token, cache=cache)
        model.train(was_training)
        if prompt is None:
            return None
        text = self.tok_decode([t for t in out if t != self.eot_token_id])
        cuts = [text.find(stop) for stop in until if stop in text]
        return text[: min(cuts)] if cuts else text

    def _anyone_busy(self, done):
        if self.ranks == 1:
            return not done
        busy = torch.tensor([0.0 if done else 1.0], device=self._device)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return busy.item() > 0
