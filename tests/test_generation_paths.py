"""The generation paths' shared parts: the attribute a path replaces for one call comes back exactly as it was, and
a path settles only after a call that returned."""

import pytest
import torch

pytest.importorskip("trl")

from gfpo_trainer.generation_paths import GenerationPath, replaced_attribute  # noqa: E402


class Engine:
    def generate(self):
        return "class"


def stand_in():
    return "stand-in"


def own():
    return "own"


def test_an_instance_attribute_comes_back_as_it_was():
    engine = Engine()
    engine.generate = own
    with replaced_attribute(engine, "generate", stand_in):
        assert engine.generate() == "stand-in"
    assert vars(engine)["generate"] is own and engine.generate() == "own"


def test_without_an_instance_attribute_the_class_shows_through_again():
    engine = Engine()
    with replaced_attribute(engine, "generate", stand_in):
        assert engine.generate() == "stand-in" and "generate" in vars(engine)
    assert "generate" not in vars(engine) and engine.generate() == "class"


def test_an_attribute_nothing_had_is_removed():
    engine = Engine()
    with replaced_attribute(engine, "stream", stand_in):
        assert engine.stream() == "stand-in"
    assert not hasattr(engine, "stream")


@pytest.mark.parametrize("instance_attribute", [None, own])
def test_restored_when_the_block_raises(instance_attribute):
    engine = Engine()
    if instance_attribute is not None:
        engine.generate = instance_attribute
    before = dict(vars(engine))
    with pytest.raises(KeyError, match="inside"), replaced_attribute(engine, "generate", stand_in):
        raise KeyError("inside")
    assert vars(engine) == before and engine.generate() == ("class" if instance_attribute is None else "own")


def test_a_module_keeps_its_own_generate():
    """A torch module (its __setattr__ and __delattr__ are its own): the method of its class again afterwards, no
    instance attribute left behind."""
    model = torch.nn.Linear(2, 2)
    forward = type(model).forward
    with replaced_attribute(model, "forward", stand_in):
        assert model.forward() == "stand-in"
    assert "forward" not in vars(model) and model.forward.__func__ is forward


class Recorded(GenerationPath):
    not_called = "the stand-in was not called"

    def __init__(self, engine):
        super().__init__()
        self.engine, self.settled = engine, 0

    def _target(self):
        def generate():
            self.called = True
            return "stand-in"

        return self.engine, "generate", generate

    def _settle(self):
        self.settled += 1
        self.stopped_rows = torch.tensor([self.called])


def test_a_path_replaces_for_its_block_and_settles_after_it():
    engine = Engine()
    with Recorded(engine) as path:
        assert engine.generate() == "stand-in" and path.settled == 0
    assert engine.generate() == "class" and "generate" not in vars(engine)
    assert path.called and path.settled == 1 and path.stopped_rows.tolist() == [True] and path.metrics == {}


def test_a_path_whose_block_raised_restores_and_does_not_settle():
    """A failed call leaves the original in place and reports nothing (the server path's settling is a collective
    that a failed process must not enter)."""
    engine = Engine()
    path = Recorded(engine)
    with pytest.raises(RuntimeError, match="TRL failed"), path:
        raise RuntimeError("TRL failed")
    assert engine.generate() == "class" and "generate" not in vars(engine)
    assert path.settled == 0 and not path.called and path.stopped_rows is None
