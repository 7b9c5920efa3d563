"""GFPOConfig's fields known without TRL (gfpo_trainer/config_fields.py): the committed table against the installed
TRL and transformers, the fallback where it does not describe them, and a config checked before the training stack
is imported."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from gfpo_trainer import config_fields  # noqa: E402
from gfpo_trainer.config import GFPOConfig  # noqa: E402

REPO = Path(__file__).parents[1]


def test_the_table_names_every_gfpo_config_field():
    table = config_fields.committed_table()
    assert set(table["fields"]) == {field.name for field in dataclasses.fields(GFPOConfig) if field.init}


def test_the_table_is_what_the_installed_trl_gives():
    """Regenerate with `python -m gfpo_trainer.config_fields` after a TRL/transformers upgrade or a GFPOConfig field
    change; in an environment with other versions (CI's oldest TRL) the CLI reads the parser instead."""
    table, key = config_fields.committed_table(), config_fields.installation_key()
    if (table["key"]["trl"], table["key"]["transformers"]) != (key["trl"], key["transformers"]):
        pytest.skip(f"the table is for {table['key']}, this environment has {key}: field_specs reads the parser")
    assert table["key"] == key, "GFPOConfig's fields changed: run python -m gfpo_trainer.config_fields"
    assert table["fields"] == config_fields.specs_from_parser()
    assert config_fields.field_specs() is table["fields"]  # and the CLI uses it


def test_specs_say_what_the_fields_take():
    specs = config_fields.specs_from_parser()
    assert specs["max_steps"] == ("int", None, False) and specs["learning_rate"] == ("float", None, False)
    assert specs["bf16"][0] == "bool" and specs["use_gfpo_kernels"] == ("bool", None, False)
    assert specs["adaptive_num_remains"] == ("int", None, True)  # list[int] | None
    assert specs["output_dir"] == (None, None, False) and specs["group_filter"] == (None, None, False)
    kind, choices, _ = specs["lr_scheduler_type"]
    assert kind == "choice" and {"linear", "cosine", "constant"} <= set(choices)
    assert specs["debug"][0] == "choice" and "underflow_overflow" in specs["debug"][1]  # an Enum's values


def test_field_specs_read_the_parser_where_the_table_is_for_another_installation(monkeypatch):
    monkeypatch.setattr(config_fields, "committed_table",
                        lambda: {"key": {"trl": "0.0.1", "transformers": "0.0.1", "gfpo_config_fields": "x"},
                                 "fields": {"max_steps": ("float", None, False)}})
    assert config_fields.field_specs() == config_fields.specs_from_parser()
    assert config_fields.field_specs()["max_steps"] == ("int", None, False)


def test_the_digest_follows_the_field_declarations_only(tmp_path):
    source = (REPO / "gfpo_trainer" / "config.py").read_text()
    digest = config_fields.gfpo_fields_digest(str(REPO / "gfpo_trainer" / "config.py"))
    edited = tmp_path / "config.py"
    edited.write_text(source.replace("Configuration of [`GFPOTrainer`]", "The configuration of [`GFPOTrainer`]"))
    assert config_fields.gfpo_fields_digest(str(edited)) == digest  # a docstring edit
    anchor = "    def __post_init__(self):\n"
    edited.write_text(source.replace(anchor, "    gfpo_new_field: int = 3\n\n" + anchor, 1))
    assert config_fields.gfpo_fields_digest(str(edited)) != digest  # a new field
    edited.write_text(source.replace("num_remains_in_group: int | None", "num_remains_in_group: float | None", 1))
    assert config_fields.gfpo_fields_digest(str(edited)) != digest  # a retyped one


def test_bool_words_are_transformers_string_to_bool():
    from transformers.hf_argparser import string_to_bool

    from gfpo_trainer.cli import ConfigError, _convert_value

    for word in ("yes", "true", "t", "y", "1", "no", "false", "f", "n", "0", "maybe", "2", "on", ""):
        for text in (word, word.upper()):
            try:
                expected = string_to_bool(text)
            except Exception:  # ArgumentTypeError
                with pytest.raises(ConfigError, match=r"cannot be read as a bool"):
                    _convert_value("bf16", text, "bool", None)
            else:
                assert _convert_value("bf16", text, "bool", None) is expected


@pytest.mark.parametrize("args, error", [
    ("  max_stepz: 3\n", "error: unknown GFPOConfig fields ['max_stepz'] under 'args' (did you mean 'max_steps'?)"),
    ("  learning_rate: 1e-6x\n", "error: args: learning_rate='1e-6x' cannot be read as float"),
    ("  group_filter: shortest\n  num_remains_in_group: 2\n",
     "error: args: group_filter must be None or one of ('length', 'token_efficiency'), got group_filter='shortest' "
     "(did you mean 'length'? the filter the paper calls 'shortest', which keeps the k completions with the fewest "
     "tokens)"),
    ("  lr_scheduler_type: cosin\n", "error: args: lr_scheduler_type='cosin' is not one of ['linear', "),
])
def test_a_config_mistake_is_reported_before_the_training_stack_is_imported(tmp_path, args, error):
    """The error line, and neither torch, transformers, TRL nor datasets imported: the report takes a fraction of a
    second, not the seconds of those imports."""
    (tmp_path / "model").mkdir()
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp_path / "bad.yaml").write_text("model: model\ndataset: data.jsonl\nreward_funcs: [rewards:digits]\nargs:\n"
                                       "  num_generations: 4\n" + args)
    probe = ("import sys, runpy\nsys.argv = ['gfpo_trainer', 'train', '--config', sys.argv[1]]\n"
             "try:\n    runpy.run_module('gfpo_trainer', run_name='__main__')\nexcept SystemExit as done:\n"
             "    print('exit', done.code)\n"
             "print(sorted(m for m in ('trl', 'transformers', 'datasets', 'torch') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "bad.yaml")], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.stdout.splitlines() == ["exit 2", "[]"], done.stderr
    assert done.stderr.startswith(error) and done.stderr.count("\n") == 1, done.stderr
