"""Expiry: take snapshots outside retention out of history.

Expiry decides, garbage collection deletes. An expiry run writes one immutable record listing the
snapshots it expired; from then on ``log()`` stops at them (and says so), rebase and fsck treat
them as the end of history, and GC no longer marks through them. Branch heads and tagged snapshots
are never expired.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from zarrlake.core import RepositoryCore
from zarrlake.errors import RefNotFound
from zarrlake.maintenance.retention import RetentionRules


@dataclass(frozen=True)
class ExpireReport:
    """What an expiry run took out of history (or would have, with ``dry_run``)."""

    expired: list[str] = field(default_factory=list)  # snapshot ids, newest first
    retained: int = 0
    retained_by_branch: dict[str, int] = field(default_factory=dict)
    dry_run: bool = False
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The job-report form (``zarrlake expire --json``; the operator parses it)."""
        return {
            "expired_snapshots": len(self.expired),
            "expired": list(self.expired),
            "retained_snapshots": self.retained,
            "retained_by_branch": dict(self.retained_by_branch),
            "dry_run": self.dry_run,
            "duration_s": round(self.duration_s, 3),
        }

    def summary(self) -> str:
        """One line for people."""
        verb = "would expire" if self.dry_run else "expired"
        return (
            f"{verb} {len(self.expired)} snapshot(s), kept {self.retained} "
            f"in {self.duration_s:.2f}s"
        )


def all_journal_snapshots(core: RepositoryCore) -> dict[str, list[tuple[dt.datetime, str]]]:
    """Every branch's journal as (time, snapshot) pairs, newest first (deletions left out)."""
    out: dict[str, list[tuple[dt.datetime, str]]] = {}
    for name in core.journal.names():
        entries = core.journal.history(name)
        out[name] = [(e.time, e.snapshot) for e in entries if e.snapshot is not None]
    return out


def expire(
    core: RepositoryCore,
    rules: RetentionRules,
    *,
    dry_run: bool = False,
    now: dt.datetime | None = None,
) -> ExpireReport:
    """Expire every snapshot no rule retains; see :class:`RetentionRules` for what is kept.

    Writes one expiry record (unless ``dry_run`` or nothing expires) and returns what it
    expired. ``now`` is the time retention ages are measured at (default: the clock).
    """
    started = time.monotonic()
    now = now or dt.datetime.now(dt.UTC)
    # A branch at a time: a local branch folder that links elsewhere is listed too (one listing
    # of every journal does not follow links), and a head missed here would lose its retention.
    heads = core.journal.heads_branch_by_branch()
    tags = core.tags.all(records_only=True)  # the records themselves, as GC reads them
    already = core.expiry.expired(refresh=True)
    retained: set[str] = set(heads.values()) | set(tags.values())
    retained_by_branch: dict[str, int] = {}

    for name, head in heads.items():
        rule = rules.rule_for(name)
        kept = 0
        for position, info in enumerate(core.graph.log(head)):
            if rule.keeps(position, now - info.time):
                retained.add(info.id)
                kept += 1
            elif (rule.last is None or position >= rule.last) and (
                rule.days is None or now - info.time > dt.timedelta(days=rule.days)
            ):
                break  # history is newest first: nothing older can be kept by this rule
        retained_by_branch[name] = kept

    # Candidates: everything still in history, reached from any ref or journal entry.
    roots = set(heads.values()) | set(tags.values())
    for entries in all_journal_snapshots(core).values():
        roots.update(sid for _, sid in entries)
    seen: set[str] = set()
    stack = [r for r in roots if r not in already]
    order: list[tuple[dt.datetime, str]] = []
    while stack:
        sid = stack.pop()
        if sid in seen:
            continue
        seen.add(sid)
        try:
            snap = core.objects.snapshot(sid)
        except RefNotFound:
            continue
        order.append((snap.time, sid))
        stack.extend(p for p in snap.parents if p not in seen and p not in already)
    expired = [sid for _, sid in sorted(order, reverse=True) if sid not in retained]
    if expired and not dry_run:
        core.expiry.record(now, tuple(expired))
    return ExpireReport(
        expired=expired,
        retained=len(seen) - len(expired),
        retained_by_branch=retained_by_branch,
        dry_run=dry_run,
        duration_s=time.monotonic() - started,
    )
