"""Prints, as a pip requirements file, what the installed `gfpo` package needs: its dependencies and those of
the extras named in argv[1] (comma-separated). scripts/setup.sh installs the package itself with
--no-deps (its extension must build without isolation) and then these with a plain `pip install -r`, so no
dependency is ever built without its own build tools."""

import re
import sys
from importlib.metadata import requires


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


if __name__ == "__main__":
    print("\n".join(requirements({e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e})))
