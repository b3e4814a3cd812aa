"""The job report: what a maintenance run tells whoever started it, in one small JSON object.

Kubernetes runs ``zarrlake gc``, ``expire`` and ``compact`` as Jobs with ``$ZARRLAKE_REPORT_FILE``
pointing at ``/dev/termination-log``. The CLI writes :meth:`JobReport.to_message` there; the
operator reads the container's termination message back with :meth:`JobReport.parse` and shows
the counts in the ``JobRun`` entries of a RetentionPolicy's status. This module is the one
definition of that message, for both sides.

The message is the run's ``--json`` document (:func:`job_document`) with every list left out,
compact: the counts, not e.g. the id of each expired snapshot. A GC run that expired snapshots
first carries the expiry's counts under ``"expire"``::

    {"deleted_objects":12,"deleted_bytes":12288,...,"expire":{"expired_snapshots":4,...}}
    {"expired_snapshots":3,"retained_snapshots":1,...}                   (expire)
    {"branch":"main","dry_run":false,"packed_chunks":40,...}             (compact)

Operators released before this module parse the same text with ``json.loads``, so the shape must
not change: new counts may be added, none renamed or moved. The kubelet keeps at most 4 KiB of a
termination message; a document too large for that (thousands of branches, each with its count)
loses its nested per-branch and per-kind counts before it loses a count the operator shows.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

#: The most a Kubernetes termination message keeps, in bytes.
MAX_MESSAGE_BYTES = 4096

Count: TypeAlias = "int | float | str | bool | dict[str, Count] | None"
"""A value of the message: a JSON scalar, or an object of counts (never a list)."""


class MaintenanceReport(Protocol):
    """A maintenance run's report (``GCReport``, ``ExpireReport``, ``CompactReport``)."""

    def to_json(self) -> Mapping[str, Any]: ...


def job_document(
    report: MaintenanceReport, expire: MaintenanceReport | None = None
) -> dict[str, Any]:
    """The full JSON document of a maintenance run, as ``--json`` prints it: ``report``'s, with
    ``expire`` (the expiry a GC run did first, if any) nested under ``"expire"``."""
    doc = dict(report.to_json())
    if expire is not None:
        doc[_EXPIRE] = expire.to_json()
    return doc


@dataclass(frozen=True)
class JobReport:
    """The counts of one maintenance run, as its Kubernetes Job reports them.

    Build one with :meth:`from_reports` (the CLI) or :meth:`parse` (the operator); ``counts`` is
    the message's JSON object, and the four fields below are read from it: None when the run
    had nothing of the kind to report (a compaction deletes no objects, a GC without retention
    rules expires no snapshot). Raises ``ValueError`` when ``counts`` is not a JSON object or
    one of the four is not a count (a non-negative integer).
    """

    counts: Mapping[str, Count] = field(hash=False)
    #: snapshots taken out of history (``expired_snapshots``; a GC run's under ``expire``).
    snapshots_expired: int | None = field(init=False)
    #: objects a GC run deleted (``deleted_objects``).
    objects_deleted: int | None = field(init=False)
    #: bytes those objects held (``deleted_bytes``).
    bytes_freed: int | None = field(init=False)
    #: small chunks a compaction packed (``packed_chunks``).
    chunks_packed: int | None = field(init=False)

    def __post_init__(self) -> None:
        counts = _counts_only(self.counts)
        expire = counts.get(_EXPIRE)
        expiry = expire if isinstance(expire, dict) else counts
        # A frozen dataclass sets its derived fields through object.__setattr__.
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "snapshots_expired", _count(expiry, "expired_snapshots"))
        object.__setattr__(self, "objects_deleted", _count(counts, "deleted_objects"))
        object.__setattr__(self, "bytes_freed", _count(counts, "deleted_bytes"))
        object.__setattr__(self, "chunks_packed", _count(counts, "packed_chunks"))

    @classmethod
    def from_reports(
        cls, report: MaintenanceReport, expire: MaintenanceReport | None = None
    ) -> JobReport:
        """The job report of a run that produced ``report`` (GC, expiry or compaction), after
        ``expire`` when a GC run expired snapshots first."""
        return cls(job_document(report, expire))

    @classmethod
    def parse(cls, text: str) -> JobReport | None:
        """The report in a container's termination message, or None when ``text`` is not one:
        with ``FallbackToLogsOnError`` a crashed container's message is the tail of its log,
        which may even be valid JSON (``42``, ``null``) without being a report."""
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(doc, dict):
            return None
        try:
            return cls(doc)
        except ValueError:
            return None

    def to_message(self) -> str:
        """Compact JSON of the counts, at most :data:`MAX_MESSAGE_BYTES` bytes (ASCII)."""
        for doc in (self.counts, _without_nested_counts(self.counts)):
            text = _compact(doc)
            if len(text) <= MAX_MESSAGE_BYTES:
                return text
        return _compact(self._shown())  # four numbers at most: always fits

    def _shown(self) -> dict[str, Count]:
        """Only the counts the operator shows, where it looks for them."""
        doc: dict[str, Count] = {}
        for key, value in (
            ("deleted_objects", self.objects_deleted),
            ("deleted_bytes", self.bytes_freed),
            ("packed_chunks", self.chunks_packed),
        ):
            if value is not None:
                doc[key] = value
        if self.snapshots_expired is not None:
            if isinstance(self.counts.get(_EXPIRE), dict):
                doc[_EXPIRE] = {"expired_snapshots": self.snapshots_expired}
            else:
                doc["expired_snapshots"] = self.snapshots_expired
        return doc


# -- the message's values ------------------------------------------------------------------------

_EXPIRE = "expire"  # the object a GC run nests the expiry's counts in


def _counts_only(doc: Mapping[str, Any]) -> dict[str, Count]:
    """``doc`` without its lists (and other collections), as plain JSON values."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"a job report is a JSON object, not {type(doc).__name__}")
    out: dict[str, Count] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping):
            out[str(key)] = _counts_only(value)
        elif value is None or isinstance(value, str | int | float):  # bool is an int
            out[str(key)] = value
        elif isinstance(value, dt.date):
            out[str(key)] = value.isoformat()
        elif not isinstance(value, list | tuple | set | frozenset):
            out[str(key)] = str(value)
    return out


def _count(doc: Mapping[str, Count], key: str) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} is not a count: {value!r}")
    return value


def _without_nested_counts(counts: Mapping[str, Count]) -> dict[str, Count]:
    """The top-level counts and the expiry's, without the objects nested in them (per branch,
    per kind of object)."""
    doc: dict[str, Count] = {k: v for k, v in counts.items() if not isinstance(v, dict)}
    expire = counts.get(_EXPIRE)
    if isinstance(expire, dict):
        doc[_EXPIRE] = {k: v for k, v in expire.items() if not isinstance(v, dict)}
    return doc


def _compact(doc: Mapping[str, Count]) -> str:
    return json.dumps(doc, separators=(",", ":"))
