"""models/families: one module per model family, FAMILIES the one table. The names config/choices.py
keeps for `--help` without torch (presets, the shape flags only some families take) agree with the
families, every family module has the whole surface, and no module outside models/families compares
a value with a family's name (the families' differences live in their modules)."""

import ast
import dataclasses
from pathlib import Path

import pytest

from minimal_fsdp.config.choices import MODEL_FLAGS, MODEL_PRESETS
from minimal_fsdp.models.classes import MODELS
from minimal_fsdp.models.families import FAMILIES, make_config, model_class

PACKAGE = Path(__file__).resolve().parents[2] / "minimal_fsdp"
SURFACE = (
    "Config",
    "PRESETS",
    "MODEL",
    "problem",
    "HF_TYPE",
    "HF_SIZES",
    "HF_TOKENIZER",
    "from_hf",
    "to_hf",
    "hf_names",
    "transposed",
    "stored_names",
    "activations_per_token",
    "float8_inputs_per_token",
    "kept_per_token",
    "final_norm_per_token",
)


def test_the_flags_name_the_families_presets_and_shape_flags():
    assert list(MODEL_PRESETS) == list(FAMILIES) == list(MODEL_FLAGS) == list(MODELS)
    optional = {name for names in MODEL_FLAGS.values() for name in names}
    for name, family in FAMILIES.items():
        assert set(MODEL_PRESETS[name]) == set(family.PRESETS), name
        fields = {f.name for f in dataclasses.fields(family.Config)}
        # a family takes exactly the optional shape flags its config has
        assert optional & fields == set(MODEL_FLAGS[name]), name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_has_the_whole_surface_and_its_presets_build(name):
    family = FAMILIES[name]
    assert all(hasattr(family, attribute) for attribute in SURFACE)
    assert family.Config.model_type == name and MODELS[name] is model_class(name)
    assert MODELS[name].config_class is family.Config
    for preset in family.PRESETS:
        assert make_config(name, preset).model_type == name


def family_comparisons(path):
    """(line, name) of each comparison of a value with a family's name in `path`."""
    names = set(FAMILIES)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                items = (
                    operand.elts
                    if isinstance(operand, (ast.Tuple, ast.List, ast.Set))
                    else [operand]
                )
                found += [
                    (node.lineno, item.value)
                    for item in items
                    if isinstance(item, ast.Constant) and item.value in names
                ]
    return found


def test_nothing_outside_the_families_branches_on_a_familys_name():
    families = PACKAGE / "models" / "families"
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in PACKAGE.rglob("*.py")
        if families not in path.parents and (hits := family_comparisons(path))
    }
    assert found == {}


def test_the_reader_sees_a_planted_comparison(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('if model_type == "llama" or kind in ("gpt", "x"):\n    pass\n')
    assert family_comparisons(planted) == [(1, "llama"), (1, "gpt")]
