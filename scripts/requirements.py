"""Prints, as a pip requirements file, what the installed `gfpo` package needs: its dependencies and those of
the extras named in argv[1] (comma-separated). scripts/setup.sh installs the package itself with
--no-deps (its extension must build without isolation) and then these with a plain `pip install -r`, so no
dependency is ever built without its own build tools.

With --check after the extras, it prints nothing and exits 0 when every one of those requirements is installed at a
version it accepts, else prints the others on one line and exits 1 (`scripts/setup.sh --if-stale` asks this).
With --pyproject after the extras, it reads them from this checkout's pyproject.toml instead of the installed
package (Python >= 3.11: tomllib), so another environment can be built before .venv is (scripts/test_vllm_cpu.sh)."""

import re
import sys
from importlib.metadata import PackageNotFoundError, requires, version


def requirements(extras: set[str]) -> list[str]:
    lines = []
    for requirement in requires("gfpo") or []:
        spec, _, marker = requirement.partition(";")
        wanted = set(re.findall(r"""extra\s*==\s*["']([^"']+)["']""", marker))
        if wanted and not wanted & extras:
            continue
        # the extra clause means nothing to pip outside this package; keep any other marker
        marker = re.sub(r"""(\s+and\s+)?extra\s*==\s*["'][^"']+["'](\s+and\s+)?""", " ", marker).strip()
        lines.append(f"{spec.strip()}; {marker}" if marker else spec.strip())
    return lines


def requirements_in_pyproject(extras: set[str]) -> list[str]:
    """What pyproject.toml's [project] asks for: its dependencies and those of `extras`."""
    import tomllib
    from pathlib import Path

    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    optional = project.get("optional-dependencies", {})
    return list(project.get("dependencies", [])) + [line for extra in sorted(extras) for line in optional[extra]]


def unsatisfied(lines: list[str]) -> list[str]:
    """The requirements of `lines` (requirement strings, markers allowed) that this environment does not meet."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # an environment without packaging still has pip's copy
        from pip._vendor.packaging.requirements import Requirement

    missing = []
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            missing.append(f"{line} (not installed)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            missing.append(f"{line} (installed: {installed})")
    return missing


if __name__ == "__main__":
    extras = {e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e}
    if "--check" in sys.argv[2:]:
        try:
            missing = unsatisfied(requirements(extras))
        except PackageNotFoundError:
            missing = ["gfpo (not installed)"]
        print("; ".join(missing))
        sys.exit(1 if missing else 0)
    print("\n".join(requirements_in_pyproject(extras) if "--pyproject" in sys.argv[2:] else requirements(extras)))
