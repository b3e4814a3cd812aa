"""Optional dependencies: :func:`require`, the one way a feature imports a module that only one of
zarrlake's extras (``pip install 'zarrlake[s3]'`` and the others, ``pyproject.toml``) installs.

A feature calls it where it is first asked for — a storage's constructor, a helper's entry point
— so that a missing extra is a :class:`~zarrlake.errors.MissingDependency` naming what to
install, raised before any work starts, not a bare ``ModuleNotFoundError`` from deep inside a read.
Importing zarrlake itself imports none of them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from zarrlake.errors import MissingDependency

__all__ = ["require"]


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """The module ``module`` (``"boto3"``, ``"google.auth"``), imported.

    ``extra`` names the zarrlake extra that installs it and ``feature`` what needs it (``"the S3
    storage backend"``), for the message. Raises :class:`MissingDependency` when ``module`` (or
    a package it is in, or one of its own submodules) is not installed. A module that is
    installed but fails to import — it needs another module that is missing, or raises — raises
    what it raised: that names the actual problem, which "install the extra" would not fix.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not _is_part_of(e.name, module):
            raise
        raise MissingDependency(module, extra, feature) from e


def _is_part_of(missing: str | None, module: str) -> bool:
    """Whether the missing module ``missing`` is ``module``, a package it is in, or in it."""
    if not missing:
        return False
    return missing == module or module.startswith(missing + ".") or missing.startswith(module + ".")
