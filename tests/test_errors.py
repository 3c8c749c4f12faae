"""Bad input: one clear line on stderr, non-zero exit, no rank left hanging (the launch timeout would fire)."""
import pytest

from conftest import TINY_MODEL, launch


def run_bad(args, tmp_path, ranks=2, env=None):
    result = launch(args, ranks=ranks, cwd=tmp_path, timeout=120, env=env, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]  # printed once, by rank 0
    assert "Traceback" not in result.stderr
    return errors[0]


@pytest.mark.parametrize("args,ranks,message", [
    (["--sharding", "zero-shard"], 2, "invalid choice: 'zero-shard'"),
    (["--precision", "fp16"], 2, "invalid choice: 'fp16'"),
    (["--batch_size", "0"], 2, "--batch_size must be positive"),
    (["--sharding", "hybrid-full-shard", "--shard_group_size", "2"], 3, "world size divisible"),
    (["--max_epochs", "-1", "--run_name", "never_trained"], 2, "has none: train first"),
    (["--dataset", "text", "--input_file", "missing.txt"], 2, "--input_file missing.txt does not exist"),
])
def test_bad_flags(tmp_path, args, ranks, message):
    assert message in run_bad(args, tmp_path, ranks)


def test_seq_length_longer_than_data(tmp_path):
    (tmp_path / "small.txt").write_text("to be or not to be, that is the question. " * 20)
    line = run_bad(["--dataset", "text", "--input_file", "small.txt", "--seq_length", "512"], tmp_path)
    assert "--seq_length 512 needs at least 513 tokens" in line


def test_vocab_smaller_than_tokenizer(tmp_path, corpus):
    line = run_bad(["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--vocab_size", "8"], tmp_path)
    assert "--vocab_size is 8" in line


def test_seq_length_longer_than_checkpoint_context(tmp_path, corpus):
    launch(["--dataset", "text", "--input_file", corpus, *TINY_MODEL, "--max_steps", 1, "--eval_interval", 0],
           ranks=1, cwd=tmp_path)
    line = run_bad(["--max_epochs", "-1", "--seq_length", "64"], tmp_path)
    assert "larger than the model's context of 32" in line


def test_gpt2_tokenizer_offline_without_cache(tmp_path, corpus):
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"), "HTTPS_PROXY": "http://127.0.0.1:9",
               "HTTP_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
    line = run_bad(["--dataset", "text", "--input_file", corpus, "--tokenizer", "gpt2"], tmp_path, env=offline)
    assert "--tokenizer gpt2" in line and "offline" in line
