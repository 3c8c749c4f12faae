"""The README's commands, shrunk: train with mpiexec, print a sample, then generate alone on 1 and 4 ranks."""
from conftest import TINY_MODEL, launch

SAMPLE = "-" * 40


def sample_of(stdout):
    return stdout.split(SAMPLE + "\n", 1)[1].rsplit("\n" + SAMPLE, 1)[0]


def test_train_then_generate_on_any_number_of_ranks(tmp_path, corpus):
    common = ["--dataset", "text", "--input_file", corpus, "--prompt", "ROMEO:", "--seed", 7]
    trained = launch([*common, *TINY_MODEL, "--max_steps", 40, "--num_tokens", 60, "--eval_interval", 20],
                     ranks=2, cwd=tmp_path)
    assert (tmp_path / "checkpoints" / "shakespeare" / "latest").exists()
    assert sample_of(trained.stdout).startswith("ROMEO:")
    # Generation-only reads the model shape from the checkpoint: no model flags are repeated.
    gen = ["--max_epochs", -1, "--prompt", "ROMEO:", "--num_tokens", 80, "--seed", 3]
    one = sample_of(launch(gen, ranks=1, cwd=tmp_path).stdout)
    four = sample_of(launch(gen, ranks=4, cwd=tmp_path).stdout)
    hybrid = sample_of(launch([*gen, "--sharding", "hybrid-grad-shard", "--shard_group_size", 2], ranks=4,
                              cwd=tmp_path).stdout)
    assert one.startswith("ROMEO:") and len(one) == len("ROMEO:") + 80  # char tokenizer: one char per token
    assert one == four == hybrid
    other_seed = sample_of(launch([*gen[:-1], 4], ranks=1, cwd=tmp_path).stdout)
    assert other_seed != one


def test_generation_past_the_context_refills_the_cache(tmp_path, corpus):
    launch(["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--max_steps", 2, "--eval_interval", 0],
           ranks=1, cwd=tmp_path)
    out = launch(["--max_epochs", -1, "--num_tokens", 100, "--prompt", "KING:"], ranks=2, cwd=tmp_path)
    assert len(sample_of(out.stdout)) == len("KING:") + 100  # 100 tokens through a 32-token context
