"""The reduced gradient is the mean of the ranks' own gradients, under every strategy that reduces them.

test_parallelize.py's reduce test compares --reduce_precision float32 with bf16 of the same strategy, which a
gradient left undivided by the world size passes (both wrong alike; AdamW then hides the constant scale). Here
each rank's own gradient is computed in this process, without any process group's help, and the gradient the
ranks of one launch (reduce_ranks.py) synchronized is compared with their mean."""
import pytest
import torch

from minimal_fsdp.config.flags import parse_args
from minimal_fsdp.launch.environment import DistEnv
from minimal_fsdp.models.gpt import GPT
from minimal_fsdp.parallel.parallelize import build_model
from minimal_fsdp.parallel.plan import make_plan
from sharding_ranks import CONFIG
from support import REDUCE_CASES, run_reduce_ranks

RANKS = 2


def own_gradient(rank):
    """Rank `rank`'s gradient of its own batch (as reduce_ranks.py draws it) on the model as built for
    training, in a world of one: nothing reduced, nothing divided."""
    env = DistEnv(0, 1, 0, 1, 1, torch.device("cpu"), "gloo", "single")
    cfg = parse_args(["--sharding", "no-shard", "--fsdp_unit", "block"])
    model = build_model(GPT, CONFIG, make_plan(cfg, env, CONFIG, fsdp_on_one_rank=False), env, cfg.seed)
    tokens = torch.randint(CONFIG.vocab_size, (2, CONFIG.seq_length + 1),
                           generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return {name: p.grad.detach().flatten() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    return run_reduce_ranks(tmp_path_factory.mktemp("reduce"), RANKS)


@pytest.mark.slow  # one 2-rank launch of every strategy: about 20 s
@pytest.mark.usefixtures("one_rank_group")
def test_the_reduced_gradient_is_the_mean_of_the_ranks_own_gradients(reduced):
    own = [own_gradient(rank) for rank in range(RANKS)]
    mean = {name: sum(g[name] for g in own) / RANKS for name in own[0]}
    assert any(not torch.allclose(mean[name], own[0][name]) for name in mean)  # the ranks' batches differ
    for case in (c for c in REDUCE_CASES if "bf16" not in c):  # bf16 compute: other gradients, not a mean's
        synced = {name: torch.tensor(g) for name, g in reduced[0][case]["float32"]["grads"].items()}
        assert synced.keys() == mean.keys(), case
        for name, expected in mean.items():  # a sum instead of the mean is off by a factor of RANKS
            torch.testing.assert_close(synced[name], expected, rtol=1e-4, atol=1e-6, msg=f"{case}: {name}")
