"""Print `name==version` for the lowest version pyproject.toml declares of each package named on the command line.

    python .ci/lowest_versions.py transformers peft accelerate   # -> transformers==5.23.0 peft==0.21.0 ...

CI installs these next to the package to test the lower ends of the ranges it declares (`.ci/run`).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def lowest(requirements: list[str], name: str) -> str:
    for requirement in requirements:
        match = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?\s*(?P<spec>[^;]*)", requirement.strip())
        if match:
            bound = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", match["spec"])
            if bound is None:
                raise SystemExit(f"{PYPROJECT.name}: {requirement!r} declares no lower bound (>=); add one")
            return f"{name}=={bound.group(1)}"  # declared as a full release (x.y.z): the one CI installs
    raise SystemExit(f"{PYPROJECT.name}: no requirement names {name!r}")


def main(names: list[str]) -> None:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(requirement for extra in extras for requirement in extra)]
    print(" ".join(lowest(requirements, name) for name in names))


if __name__ == "__main__":
    main(sys.argv[1:])
