"""The environment report for bug reports: `python -m gfpo_trainer env`.

The kernel package's report (gfpo_kernels.env_report: versions, devices, the extension, the backends), then what only
the trainer knows: whether the installed TRL is a release gfpo supports, and the vLLM installed and whether that TRL
generates with it (the trainer refuses use_vllm=True outside its range). Needs neither TRL nor a GPU: without TRL
those two lines say they were not checked, and why.
"""

from __future__ import annotations

from gfpo_kernels.env_report import _version
from gfpo_kernels.env_report import environment_report as kernels_report


def trl_report(trl_version: str) -> str:
    """Whether TRL `trl_version` is in the range gfpo is tested on (gfpo_trainer._compat.TESTED_TRL)."""
    from . import _compat  # imports TRL: the caller has checked that it is installed

    tested = (f"gfpo is tested on trl {', '.join(_compat.TESTED_TRL)}, with "
              f"{', '.join(_compat.KNOWN_WORKING_TRL)}")
    if _compat.is_tested_trl(trl_version):
        return f"{trl_version}, tested ({tested})"
    return (f"{trl_version}, UNTESTED ({tested}; GFPOTrainer trains with a warning where the GRPOTrainer internals "
            f"it hooks match, and stops where they moved; {_compat.TESTED_TRL_INSTALL} installs a tested one)")


def vllm_report(trl_version: str) -> str:
    """The vLLM installed (gfpo_trainer._compat.vllm_version) and whether TRL `trl_version` generates with it (its
    range: gfpo_trainer._compat.vllm_range); the trainer refuses use_vllm=True outside that range."""
    from . import _compat  # imports TRL: the caller has checked that it is installed

    found, known = _compat.vllm_version(), _compat.vllm_range(trl_version)
    if known is None:
        tested = ", ".join(sorted(_compat.VLLM_RANGE_BY_TRL))
        return (f"{found or 'not installed'} (trl {trl_version} is not a release gfpo knows the vLLM range of: "
                f"trl {tested}; and its metadata declares none)")
    supported = f"trl {trl_version} generates with vllm {known.text}"
    if known.declared:
        supported += " (its metadata's range; gfpo has not tested that trl)"
    if found is None:
        return f"not installed ({supported}; {_compat.VLLM_INSTALL_HINT} installs one)"
    if known.contains(found):
        return f"{found}, supported ({supported})"
    return f"{found}, NOT supported ({supported}; {_compat.VLLM_INSTALL_HINT} installs one)"


def trainer_lines() -> list[str]:
    """The report's trainer lines: `trl support: ...` and `vllm: ...`."""
    trl_version = _version("trl")
    if trl_version == "not installed":
        return ["trl support: not checked (TRL is not installed)",
                "vllm: not checked (the check needs TRL, which is not installed)"]
    try:
        return [f"trl support: {trl_report(trl_version)}", f"vllm: {vllm_report(trl_version)}"]
    except ImportError as error:  # a TRL or transformers that does not import: the rest of the report still prints
        why = f"importing gfpo_trainer._compat failed: {type(error).__name__}: {error}"
        return [f"trl support: not checked ({why})", f"vllm: not checked ({why})"]


def environment_report() -> str:
    """The kernel package's report and the trainer's lines, one `name: value` per line."""
    return "\n".join([kernels_report(), *trainer_lines()])
