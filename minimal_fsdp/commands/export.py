"""`minimal-fsdp export CHECKPOINT OUT`: a checkpoint -> model.safetensors, config.json and the
tokenizer (hf/export.py), in one CPU process."""

from minimal_fsdp.hf.export import DTYPES, export


def main(flags):
    """ExportFlags -> the files, and where they went."""
    print(f"wrote {export(flags.checkpoint, flags.out, DTYPES.get(flags.dtype), flags.format)}")
