"""Where a --hf_model comes from: a local directory as it is, or a Hugging Face hub name taken from
the local cache or downloaded with huggingface_hub (if installed). The directory is then read by
read.py."""

from pathlib import Path

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data import tokenizer


def resolve(name_or_dir):
    """A local directory holding config.json and weights. A name that is not a directory is taken
    from the Hugging Face cache or fetched from the hub with huggingface_hub (if installed); run it
    on one rank."""
    path = Path(name_or_dir)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(
                f"--hf_model {path} has no config.json: pass a Hugging Face model directory"
            )
        if not any(path.glob("model*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
            raise ConfigError(
                f"--hf_model {path} has a config.json but no weights (model.safetensors, its "
                "shards, or pytorch_model.bin): download them too"
            )
        return str(path)
    if path.exists() or name_or_dir.startswith((".", "/", "~")) or name_or_dir.count("/") > 1:
        raise ConfigError(f"--hf_model {name_or_dir} is not a directory")
    try:
        from huggingface_hub import HfApi, constants, snapshot_download
    except ImportError:
        raise ConfigError(
            f"--hf_model {name_or_dir} is not a local directory, and fetching it from the Hugging "
            "Face hub needs huggingface_hub: pip install huggingface_hub "
            "(or download the model elsewhere and pass its directory)"
        ) from None
    patterns = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "model*.safetensors",
        "model.safetensors.index.json",
        "pytorch_model*.bin",
        "pytorch_model.bin.index.json",
    ]
    try:  # downloaded before: no network needed
        return snapshot_download(name_or_dir, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    # huggingface_hub retries an unreachable hub for half a minute; a quick look first gives a
    # quick answer.
    if constants.HF_HUB_OFFLINE or not tokenizer.reachable(constants.ENDPOINT):
        raise ConfigError(
            f"--hf_model {name_or_dir} is not a local directory nor in the Hugging Face cache, and "
            f"the hub ({constants.ENDPOINT}) is unreachable (offline?): download the model where "
            "the hub is reachable and pass its directory"
        )
    try:
        files = HfApi().list_repo_files(name_or_dir)
        if any(f.endswith(".safetensors") for f in files):  # fetch one format, not both
            patterns = [p for p in patterns if "pytorch_model" not in p]
        return snapshot_download(name_or_dir, allow_patterns=patterns)
    # unknown or gated repo, lost connection, ...: one line, whatever was raised
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            f"--hf_model {name_or_dir} could not be fetched from the Hugging Face hub "
            f"({type(e).__name__}: {reason})"
        ) from None
