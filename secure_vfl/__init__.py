"""secure-vfl: privacy-hardened vertical federated learning.

The core (this package) says what vertical federated learning computes: data, partitions,
missingness, models, methods and the party-boundary seam they talk through. The privacy layer
(``protocols``) and the attack suite (``attacks``) plug into that seam.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path


def _version() -> str:
    """The installed package's version (its metadata); in a source checkout that is not
    installed, the version its ``pyproject.toml`` declares; ``0+unknown`` without either."""
    try:
        return metadata.version("secure-vfl")
    except metadata.PackageNotFoundError:
        pass
    import tomllib

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    if project.get("name") != "secure-vfl" or not isinstance(project.get("version"), str):
        return "0+unknown"
    return str(project["version"])


__version__ = _version()
