"""GFPOConfig's batch-size error in the fields the config set: TRL's check names generation_batch_size, which a config
that sets per_device_train_batch_size and num_generations never set."""

import re

import pytest

pytest.importorskip("trl")

from gfpo_trainer.config import GFPOConfig  # noqa: E402


def _config(tmp_path, **fields):
    return GFPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)


@pytest.mark.parametrize("fields, message", [
    # 6 completions hold 1.5 groups of 4; a multiple of 4 works: 4 or 8 per device, or 2 steps (12), or groups of
    # 2, 3 or 6 (the divisors of 6 nearest 4)
    (dict(per_device_train_batch_size=6, num_generations=4),
     "per_device_train_batch_size=6 x 1 process x gradient_accumulation_steps=1 = 6 completions per generation "
     "batch, which must hold whole groups of num_generations=4: make that product a multiple of 4, e.g. "
     "per_device_train_batch_size=4 or 8 (or gradient_accumulation_steps=2, or num_generations=2, 3 or 6)"),
    # 6 x 3 = 18; 4 steps give 24
    (dict(per_device_train_batch_size=6, num_generations=4, steps_per_generation=3),
     "per_device_train_batch_size=6 x 1 process x steps_per_generation=3 = 18 completions per generation batch, "
     "which must hold whole groups of num_generations=4: make that product a multiple of 4, e.g. "
     "per_device_train_batch_size=4 or 8 (or steps_per_generation=4, or num_generations=2, 3 or 6)"),
    # k = 8: no num_generations above 8 divides 8
    (dict(per_device_train_batch_size=8, num_generations=16, num_remains_in_group=8, group_filter="length"),
     "per_device_train_batch_size=8 x 1 process x gradient_accumulation_steps=1 = 8 completions per generation "
     "batch, which must hold whole groups of num_generations=16: make that product a multiple of 16, e.g. "
     "per_device_train_batch_size=16 (or gradient_accumulation_steps=2)"),
])
def test_batch_error_names_the_fields_set_and_values_that_work(tmp_path, fields, message):
    with pytest.raises(ValueError) as error:
        _config(tmp_path, **fields)
    assert str(error.value) == message
    # every value it offers builds
    suggestions = re.findall(r"(per_device_train_batch_size|gradient_accumulation_steps|steps_per_generation|"
                             r"num_generations)=((?:\d+(?:, | or )?)+)", message.split(": make", 1)[1])
    assert suggestions
    for name, values in suggestions:
        for value in map(int, re.findall(r"\d+", values)):
            changed = dict(fields, **{name: value})
            if changed.get("num_remains_in_group", 0) >= changed["num_generations"]:
                continue
            assert _config(tmp_path, **changed).generation_batch_size % changed["num_generations"] == 0


def test_a_generation_batch_size_set_keeps_trls_message(tmp_path):
    with pytest.raises(ValueError, match=r"^generation_batch_size \(18\) must be divisible by num_generations \(4\)"):
        _config(tmp_path, per_device_train_batch_size=6, num_generations=4, generation_batch_size=18)
