"""MODELS: each family's model class by the family's name, for the code that builds a model. The
families' table (families/) names the classes without importing them, since it is read without
torch; this module imports them."""

from minimal_fsdp.models.families import FAMILIES, model_class

MODELS = {name: model_class(name) for name in FAMILIES}
