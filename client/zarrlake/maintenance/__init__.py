"""Retention, expiry, garbage collection and compaction — safe to run against a live repository."""

from zarrlake.maintenance.compact import CompactReport
from zarrlake.maintenance.expire import ExpireReport
from zarrlake.maintenance.gc import GCReport, GraceTooShort
from zarrlake.maintenance.retention import InvalidRetentionRules, Keep, RetentionRules

__all__ = [
    "CompactReport",
    "ExpireReport",
    "GCReport",
    "GraceTooShort",
    "InvalidRetentionRules",
    "Keep",
    "RetentionRules",
]
