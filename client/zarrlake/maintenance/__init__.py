"""Retention, expiry, garbage collection and compaction — safe to run against a live repository."""

from zarrlake.errors import GraceTooShort, InvalidRetentionRules
from zarrlake.maintenance.compact import CompactReport
from zarrlake.maintenance.expire import ExpireReport
from zarrlake.maintenance.gc import GCReport, KindCount
from zarrlake.maintenance.retention import Keep, RetentionRules

__all__ = [
    "CompactReport",
    "ExpireReport",
    "GCReport",
    "GraceTooShort",
    "InvalidRetentionRules",
    "Keep",
    "KindCount",
    "RetentionRules",
]
