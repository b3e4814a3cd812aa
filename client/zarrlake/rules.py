"""Branch protection rules, as the repository's marker records them (see
``docs/design/governance.md``).

A repository's rules are one :class:`Protection`: a rule per protected branch, and a generation
that grows with every change, so that of two records the newer is always known (the marker is
replaced by compare-and-set, and the published root carries a copy). This module only says what
a rule is and how it is written down; :mod:`zarrlake.governance` applies them.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zarrlake.errors import CorruptObject, InvalidArgument

#: A check's name: what ``required_checks`` lists and the ``zarrlake.checks`` entry point is
#: called (lower case, digits, ``-``, ``_``, ``.``).
CHECK_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")

_FLAGS = ("require_merge", "allow_delete", "allow_reset")


@dataclass(frozen=True)
class BranchRule:
    """What a protected branch allows.

    ``require_merge``: no direct commits, only merges into it (:meth:`Repository.merge`).
    ``allow_delete``: whether the branch may be deleted. ``allow_reset``: whether it may be
    moved by force (:meth:`Repository.reset_branch`). ``required_checks``: the checks (by
    name, entry points of the group ``zarrlake.checks``) every commit or merge into it must
    pass; ``check_options``: keyword options per check name (e.g. ``{"required-attributes":
    {"attributes": ["units"]}}``)."""

    require_merge: bool = True
    allow_delete: bool = False
    allow_reset: bool = False
    required_checks: tuple[str, ...] = ()
    check_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise InvalidArgument(f"{flag} must be True or False, not {getattr(self, flag)!r}")
        checks = self.required_checks
        if isinstance(checks, str) or not isinstance(checks, tuple | list):
            raise InvalidArgument(f"required_checks must be a list of check names, not {checks!r}")
        for name in checks:
            if not isinstance(name, str) or not CHECK_NAME.fullmatch(name):
                raise InvalidArgument(
                    f"{name!r} is not a check name (lower case letters, digits, '.', '_', '-')"
                )
        if len(set(checks)) != len(checks):
            raise InvalidArgument(f"required_checks names a check twice: {list(checks)}")
        object.__setattr__(self, "required_checks", tuple(checks))
        options = self.check_options
        if not isinstance(options, Mapping):
            raise InvalidArgument(f"check_options must be a dict by check name, not {options!r}")
        for name, opts in options.items():
            if name not in checks:
                raise InvalidArgument(f"check_options names {name!r}, which is not required")
            if not isinstance(opts, Mapping) or not all(isinstance(k, str) for k in opts):
                raise InvalidArgument(f"the options of check {name!r} must be a dict")
            try:
                json.dumps(dict(opts))
            except (TypeError, ValueError):
                raise InvalidArgument(
                    f"the options of check {name!r} must be JSON values (strings, numbers, "
                    "lists, dicts)"
                ) from None
        # A copy of plain values: the record is written as it is now.
        object.__setattr__(
            self, "check_options", {n: json.loads(json.dumps(dict(o))) for n, o in options.items()}
        )

    def options(self, check: str) -> dict[str, Any]:
        """The keyword options of required check ``check`` (empty if none were given)."""
        return dict(self.check_options.get(check, {}))

    def describe(self) -> str:
        """One line for people: what the rule refuses and requires."""
        parts = [
            "merges only" if self.require_merge else "direct commits allowed",
            "delete allowed" if self.allow_delete else "no delete",
            "reset allowed" if self.allow_reset else "no reset",
        ]
        if self.required_checks:
            parts.append("checks: " + ", ".join(self.required_checks))
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "require_merge": self.require_merge,
            "allow_delete": self.allow_delete,
            "allow_reset": self.allow_reset,
            "required_checks": list(self.required_checks),
            "check_options": {n: dict(o) for n, o in self.check_options.items()},
        }

    @classmethod
    def from_json(cls, value: Any) -> BranchRule:
        """A rule from :meth:`to_json`'s form. Raises :class:`InvalidArgument`."""
        if not isinstance(value, dict):
            raise InvalidArgument(f"a branch rule is a dict, not {value!r}")
        known = {*_FLAGS, "required_checks", "check_options"}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise InvalidArgument(f"a branch rule has no setting(s) {', '.join(unknown)}")
        return cls(
            value.get("require_merge", True),
            value.get("allow_delete", False),
            value.get("allow_reset", False),
            tuple(value.get("required_checks", ())),
            value.get("check_options", {}),
        )


@dataclass(frozen=True)
class Protection:
    """A repository's branch rules: ``branches`` (name -> rule), ``generation`` (0: never set;
    each change adds one), and who changed them last, when (``changed_by`` as the client that
    wrote it says: an audit trail a client cannot forge needs the commit service the design
    note describes)."""

    branches: Mapping[str, BranchRule] = field(default_factory=dict)
    generation: int = 0
    changed: dt.datetime | None = None
    changed_by: str | None = None

    def rule(self, branch: str) -> BranchRule | None:
        return self.branches.get(branch)

    def to_record(self) -> dict[str, Any]:
        """The form the marker stores (msgpack-able)."""
        return {
            "generation": self.generation,
            "branches": {n: r.to_json() for n, r in sorted(self.branches.items())},
            "changed": None if self.changed is None else self.changed.isoformat(),
            "changed_by": self.changed_by,
        }

    @classmethod
    def from_record(cls, value: Mapping[str, Any] | None, key: str = "repo") -> Protection:
        """The rules a marker records (none for a marker without). Raises
        :class:`CorruptObject`: a stored record that is not rules is damage, not input."""
        if value is None:
            return cls()
        try:
            branches = value.get("branches") or {}
            generation = value.get("generation", 0)
            if not isinstance(branches, dict) or type(generation) is not int or generation < 0:
                raise InvalidArgument("branches must be a dict and generation a count")
            changed = value.get("changed")
            by = value.get("changed_by")
            if by is not None and not isinstance(by, str):
                raise InvalidArgument("changed_by must be a string")
            return cls(
                {str(n): BranchRule.from_json(r) for n, r in branches.items()},
                generation,
                None if changed is None else dt.datetime.fromisoformat(str(changed)),
                by,
            )
        except (InvalidArgument, ValueError, AttributeError) as e:
            raise CorruptObject(key, f"its branch protection: {e}") from None
