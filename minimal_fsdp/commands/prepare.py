"""`minimal-fsdp prepare`: a dataset tokenized into train.bin, val.bin and meta.json, for training's
--dataset_path, through data.prepare's one front end (which training uses too)."""

from pathlib import Path

from minimal_fsdp.config.choices import ConfigError
from minimal_fsdp.data import prepare
from minimal_fsdp.data.tokenizer import load_tokenizer


def main(flags):
    """PrepareFlags -> the prepared directory (printed, and returned)."""
    if flags.dataset in ("text", "hf") and not flags.input_file:
        raise ConfigError(f"--dataset {flags.dataset} needs --input_file PATH")
    if flags.tokenizer == "sentencepiece" and not flags.vocab_size and not flags.tokenizer_dir:
        raise ConfigError(
            "--tokenizer sentencepiece needs --vocab_size (the BPE vocabulary to train)"
        )
    val_fraction = flags.val_fraction
    if val_fraction is None:
        val_fraction = 0.0005 if flags.dataset == "openwebtext" else 0.1
    if not 0 < val_fraction < 1:
        raise ConfigError(f"--val_fraction must be in (0, 1) (got {val_fraction})")
    documents = prepare.open_source(flags.dataset, flags.input_file, flags.data_dir)
    name = "openwebtext" if flags.dataset == "openwebtext" else documents.name
    given = load_tokenizer(flags.tokenizer_dir) if flags.tokenizer_dir else None
    out = Path(flags.output or prepare.named_dir(
        flags.data_dir, name, flags.tokenizer, flags.vocab_size, given
    ))  # fmt: skip
    meta = prepare.prepare(
        documents,
        out,
        f"delete {out} to prepare it again, or pass another --output",
        flags.tokenizer,
        flags.vocab_size,
        val_fraction,
        flags.seed,
        flags.num_proc,
        tokenizer=given,
    )
    if meta is None:
        print(f"{out} is prepared already (delete it to prepare again)")
    else:
        print(
            f"{out}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens "
            f"({meta['dtype']}); train with: python basic_training.py --dataset_path {out}"
        )
    return out
