"""The TRL version range and the surface checks in gfpo_trainer/_compat.py (no model, no training: fast)."""

import warnings

import pytest

trl = pytest.importorskip("trl")

from gfpo_trainer import _compat
from gfpo_trainer._compat import TRLSurfaceError, check_trl_surfaces, is_supported_trl


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_compat, "_warned_untested", set())


def _grpo_like(**overrides):
    """A GRPOTrainer subclass whose methods named in `overrides` take the given signatures."""
    return type("GRPOLike", (trl.GRPOTrainer,), overrides)


def test_supported_range_bounds():
    assert not is_supported_trl("1.14.1") and is_supported_trl("1.14.2")
    assert is_supported_trl("1.15.0") and is_supported_trl("1.16.0")
    assert is_supported_trl("1.16.3")
    assert not is_supported_trl("1.13.0")
    assert not is_supported_trl("1.17.0")
    assert not is_supported_trl("1.17.0.dev0")


def test_installed_trl_is_in_range_and_passes_silently(fresh_warnings):
    assert is_supported_trl(trl.__version__), trl.__version__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trl_surfaces()


def test_trl_1_14_forwarding_signature_is_accepted(fresh_warnings):
    # TRL 1.14: `_get_per_token_logps_and_entropies(self, model, *args, batch_size=None, compute_aux_loss=False,
    # **kwargs)` forwards the tensors through *args; GFPO passes batch_size by keyword, which reaches it.
    def logps_1_14(self, model, *args, batch_size=None, compute_aux_loss=False, **kwargs):
        raise AssertionError("not called")

    check_trl_surfaces(_grpo_like(_get_per_token_logps_and_entropies=logps_1_14))


def test_forwarding_signature_without_batch_size_is_refused(fresh_warnings):
    def logps(self, model, *args, **kwargs):
        raise AssertionError("not called")

    with pytest.raises(TRLSurfaceError, match="_get_per_token_logps_and_entropies"):
        check_trl_surfaces(_grpo_like(_get_per_token_logps_and_entropies=logps))


def test_untested_version_with_matching_surfaces_warns_once(monkeypatch, fresh_warnings):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.warns(UserWarning, match=r"trl 1\.17\.0 is untested.*1\.16\.0"):
        check_trl_surfaces()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trl_surfaces()  # once per version


def test_untested_version_with_moved_surface_raises_naming_it(monkeypatch, fresh_warnings):
    monkeypatch.setattr(trl, "__version__", "1.17.0")

    def rewards(self, inputs, prompts, completions):  # completion_ids_list dropped
        raise AssertionError("not called")

    with pytest.raises(TRLSurfaceError) as info:
        check_trl_surfaces(_grpo_like(_calculate_rewards=rewards))
    message = str(info.value)
    assert "trl 1.17.0" in message and "GRPOTrainer._calculate_rewards" in message
    assert ">=1.14.2,<1.17" in message and "1.14.2" in message and "1.16.0" in message


def test_untested_version_with_removed_surface_raises(monkeypatch, fresh_warnings):
    monkeypatch.setattr(trl, "__version__", "2.0.0")
    monkeypatch.delattr(trl.GRPOTrainer, "_generate_single_turn")
    with pytest.raises(TRLSurfaceError, match=r"trl 2\.0\.0: GRPOTrainer\._generate_single_turn no longer exists"):
        check_trl_surfaces()
