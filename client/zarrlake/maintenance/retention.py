"""Retention rules: which commits of which branch to keep.

The same shape as the ``RetentionPolicy`` resource's ``spec.rules``::

    {"default": {"last": 100},
     "branches": {"main": {"last": 1000, "days": 90}, "dev-*": {"days": 7}}}

A rule keeps a commit that is among the branch's ``last`` N commits **or** newer than ``days``
days; a rule with neither keeps everything. Branch rules match by exact name first, then by glob
(the first matching pattern in the order given); other branches use ``default``. Branch heads and
tagged snapshots are always kept.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zarrlake.errors import InvalidRetentionRules
from zarrlake.refs import branch_glob_problem

__all__ = ["InvalidRetentionRules", "Keep", "RetentionRules"]


@dataclass(frozen=True)
class Keep:
    """Keep the last ``last`` commits and/or those newer than ``days`` days (None: no limit)."""

    last: int | None = None
    days: float | None = None

    def __post_init__(self) -> None:
        if self.last is not None and (
            isinstance(self.last, bool) or not isinstance(self.last, int) or self.last < 1
        ):
            raise InvalidRetentionRules(f"last must be a whole number >= 1, got {self.last!r}")
        if self.days is not None and (
            isinstance(self.days, bool) or not isinstance(self.days, int | float) or self.days < 0
        ):
            raise InvalidRetentionRules(f"days must be a number >= 0, got {self.days!r}")

    @property
    def keeps_everything(self) -> bool:
        return self.last is None and self.days is None

    def keeps(self, position: int, age: dt.timedelta) -> bool:
        """Whether the commit at ``position`` (0 = head) and of ``age`` is retained."""
        if self.keeps_everything:
            return True
        if self.last is not None and position < self.last:
            return True
        return self.days is not None and age <= dt.timedelta(days=self.days)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("last", self.last), ("days", self.days)) if v is not None}

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> Keep:
        if not isinstance(doc, Mapping):
            raise InvalidRetentionRules(f"{where}: expected a mapping with 'last' and/or 'days'")
        unknown = set(doc) - {"last", "days"}
        if unknown:
            raise InvalidRetentionRules(f"{where}: unknown field(s) {sorted(unknown)}")
        try:
            return cls(last=doc.get("last"), days=doc.get("days"))
        except InvalidRetentionRules as e:
            raise InvalidRetentionRules(f"{where}: {e}") from None


@dataclass(frozen=True)
class RetentionRules:
    """A default rule and per-branch rules by exact name or glob."""

    default: Keep = field(default_factory=Keep)
    branches: Mapping[str, Keep] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.default, Keep):
            raise InvalidRetentionRules("default must be a zarrlake.Keep")
        for name, rule in self.branches.items():
            problem = branch_glob_problem(name)
            if problem is not None:
                raise InvalidRetentionRules(f"branch pattern: {problem}")
            if not isinstance(rule, Keep):
                raise InvalidRetentionRules(f"rule for {name!r} must be a zarrlake.Keep")

    def rule_for(self, branch: str) -> Keep:
        if branch in self.branches:
            return self.branches[branch]
        for pattern, rule in self.branches.items():
            if fnmatch.fnmatchcase(branch, pattern):
                return rule
        return self.default

    def to_dict(self) -> dict[str, Any]:
        return {
            "default": self.default.to_dict(),
            "branches": {k: v.to_dict() for k, v in self.branches.items()},
        }

    @classmethod
    def from_dict(cls, doc: Any) -> RetentionRules:
        """Parse the JSON/YAML shape above; :class:`InvalidRetentionRules` says what is wrong."""
        if not isinstance(doc, Mapping):
            raise InvalidRetentionRules("retention rules must be a mapping of 'default'/'branches'")
        unknown = set(doc) - {"default", "branches"}
        if unknown:
            raise InvalidRetentionRules(f"unknown field(s) {sorted(unknown)}")
        default = Keep.from_dict(doc.get("default") or {}, "default")
        branches_doc = doc.get("branches") or {}
        if not isinstance(branches_doc, Mapping):
            raise InvalidRetentionRules("branches: expected a mapping of branch name/glob to rule")
        branches = {
            str(name): Keep.from_dict(rule, f"branches.{name}")
            for name, rule in branches_doc.items()
        }
        return cls(default, branches)

    @classmethod
    def from_file(cls, path: str | Path) -> RetentionRules:
        """Load rules from a ``.json``, ``.yaml`` or ``.yml`` file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise InvalidRetentionRules(f"cannot read rules file {path}: {e.strerror}") from None
        try:
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml

                doc = yaml.safe_load(text)
            else:
                doc = json.loads(text)
        except Exception as e:
            raise InvalidRetentionRules(f"{path}: not valid {path.suffix or 'JSON'}: {e}") from None
        return cls.from_dict(doc)
