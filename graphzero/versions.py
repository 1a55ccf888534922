"""The torch and DeepSpeed versions graphzero is tested with, checked when graphzero is imported.

graphzero relies on torch 2.13-2.15 and DeepSpeed 0.19.x internals; outside them import raises a
:class:`VersionError` (``GRAPHZERO_ALLOW_UNTESTED_VERSIONS=1``: a warning). Read from distribution
metadata; a package not installed is not checked.
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Mapping
from importlib import metadata

from .errors import VersionError

#: distribution -> (lowest tested version, first version of the next line): ``low <= v < high``.
#: Keep in step with the dependencies in pyproject.toml (tests/test_layout.py checks that they agree).
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.13", "2.16"),
    "deepspeed": ("0.19.8", "0.20"),
}
ALLOW_ENV = "GRAPHZERO_ALLOW_UNTESTED_VERSIONS"


def _release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); pre-releases and dev builds count as their release."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging comes with DeepSpeed; without it, read the leading numbers
        pass
    else:
        try:
            return Version(version).release
        except InvalidVersion:
            pass
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"cannot read version {version!r}")
    return tuple(int(part) for part in match.group().split("."))


def _padded(release: tuple[int, ...], n: int = 3) -> tuple[int, ...]:
    return release + (0,) * max(0, n - len(release))


def tested_range(package: str) -> str:
    """The tested range as a pip specifier, e.g. ``>=2.13,<2.16``."""
    low, high = TESTED[package]
    return f">={low},<{high}"


def installed_versions() -> dict[str, str | None]:
    """The installed version of every checked distribution (None where it is not installed)."""
    found: dict[str, str | None] = {}
    for package in TESTED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def check_versions(found: Mapping[str, str | None] | None = None) -> None:
    """Raise :class:`VersionError` for the first package in ``found`` (default: the installed
    versions) outside its tested range."""
    found = installed_versions() if found is None else found
    for package, version in found.items():
        if version is None or package not in TESTED:
            continue
        low, high = TESTED[package]
        try:
            inside = _padded(_release(low)) <= _padded(_release(version)) < _padded(_release(high))
        except ValueError:
            inside = False
        if inside:
            continue
        wanted = f"{package}{tested_range(package)}"
        message = (f"graphzero is tested with {wanted}, but {package} {version} is installed: install a "
                   f"version in that range (pip install '{wanted}'), "
                   f"or set {ALLOW_ENV}=1 to try this one anyway")
        if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            continue
        raise VersionError(message, package=package, version=version, tested=tested_range(package))
