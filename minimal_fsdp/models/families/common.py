"""What the families' config classes share: the dict a config is recorded as."""

import dataclasses


def config_fields(config):
    """A model config as the dict checkpoints record. document_eot_id is left out when off, so a
    checkpoint written before document masks existed records the same model as a run without one."""
    fields = dataclasses.asdict(config)
    return {k: v for k, v in fields.items() if k != "document_eot_id" or v is not None}
