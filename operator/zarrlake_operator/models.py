"""The custom resource kinds the operator serves, and how their CRDs present them.

The resource models themselves live in :mod:`zarrlake.resources`, shared with the client (which
reads a ``Repository`` through the same model when it opens one from Kubernetes); this module
re-exports them for the operator and adds what only a CRD needs: plural and short names, printer
columns and name limits (:data:`KINDS`; :mod:`zarrlake_operator.crds` writes ``crds/*.yaml``).
"""

from __future__ import annotations

from typing import Any, TypedDict

from zarrlake.resources import (
    API_VERSION,
    CATEGORY,
    GROUP,
    VERSION,
    Branch,
    BranchSpec,
    BranchStatus,
    Condition,
    JobRun,
    Mirror,
    MirrorRefStatus,
    MirrorSpec,
    MirrorStatus,
    Repository,
    RepositorySpec,
    RepositoryStatus,
    ResourceModel,
    RetentionPolicy,
    RetentionPolicySpec,
    RetentionPolicyStatus,
    ServeSpec,
    ServeStatus,
    Tag,
    TagSpec,
    TagStatus,
)

__all__ = [
    "API_VERSION",
    "CATEGORY",
    "GROUP",
    "KINDS",
    "VERSION",
    "Branch",
    "BranchSpec",
    "BranchStatus",
    "Condition",
    "JobRun",
    "Kind",
    "Mirror",
    "MirrorRefStatus",
    "MirrorSpec",
    "MirrorStatus",
    "Repository",
    "RepositorySpec",
    "RepositoryStatus",
    "RetentionPolicy",
    "RetentionPolicySpec",
    "RetentionPolicyStatus",
    "ServeSpec",
    "ServeStatus",
    "Tag",
    "TagSpec",
    "TagStatus",
]


class _KindRequired(TypedDict):
    model: type[ResourceModel]
    plural: str
    short: list[str]
    columns: list[dict[str, Any]]


class Kind(_KindRequired, total=False):
    """One row of :data:`KINDS`: the resource model and its CRD presentation."""

    name_max: int  # a CEL limit on metadata.name, for names that end up in label values
    # Fields a list may select on (CRD selectableFields): the operator asks for one Repository's
    # dependents, or the Repositories of one bucket, without listing the whole namespace.
    selectable: list[str]


def _col(
    name: str, path: str, type_: str = "string", priority: int = 0, desc: str = ""
) -> dict[str, Any]:
    col: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path}
    if priority:
        col["priority"] = priority
    if desc:
        col["description"] = desc
    return col


READY = '.status.conditions[?(@.type=="Ready")].status'
AGE = _col("Age", ".metadata.creationTimestamp", "date")

KINDS: dict[str, Kind] = {
    "Repository": {
        "model": Repository,
        "selectable": [".spec.storage.bucket"],
        "name_max": 63,  # the name goes into label values of the lock service objects
        "plural": "repositories",
        "short": ["zlrepo"],
        "columns": [
            _col("Ready", READY),
            _col("Phase", ".status.phase"),
            _col("Provider", ".spec.storage.provider"),
            _col("Bucket", ".spec.storage.bucket"),
            _col("Lock", ".spec.lockService.mode"),
            _col("Branches", ".status.branches", "integer"),
            _col("Tags", ".status.tags", "integer"),
            _col("URL", ".status.url", priority=1),
            _col("Serve", ".status.serve.url", priority=1, desc="Where spec.serve answers."),
            AGE,
        ],
    },
    "Branch": {
        "model": Branch,
        "selectable": [".spec.repository"],
        "plural": "branches",
        "short": ["zlbranch"],
        "columns": [
            _col("Repository", ".spec.repository"),
            _col("Branch", ".status.branch"),
            _col("Ready", READY),
            _col("Head", ".status.head"),
            _col("Last Commit", ".status.lastCommitTime", "date"),
            _col("Message", ".status.lastCommitMessage", priority=1),
            AGE,
        ],
    },
    "Tag": {
        "model": Tag,
        "selectable": [".spec.repository"],
        "plural": "tags",
        "short": ["zltag"],
        "columns": [
            _col("Repository", ".spec.repository"),
            _col("Tag", ".status.tag"),
            _col("Ready", READY),
            _col("Ref", ".spec.ref"),
            _col("Snapshot", ".status.snapshot"),
            AGE,
        ],
    },
    "RetentionPolicy": {
        "model": RetentionPolicy,
        "selectable": [".spec.repository"],
        "name_max": 63,  # the name goes into label values of the CronJobs
        "plural": "retentionpolicies",
        "short": ["zlretention"],
        "columns": [
            _col("Repository", ".spec.repository"),
            _col("Ready", READY),
            _col("GC Schedule", ".spec.gc.schedule"),
            _col("Last GC", ".status.lastGC.time", "date"),
            _col("Result", ".status.lastGC.result"),
            _col("Freed", ".status.lastGC.bytesFreed", "integer"),
            AGE,
        ],
    },
    "Mirror": {
        "model": Mirror,
        "selectable": [".spec.repository"],
        "name_max": 63,  # the name goes into label values of the replicator Deployment
        "plural": "mirrors",
        "short": ["zlmirror"],
        "columns": [
            _col("Source", ".spec.repository"),
            _col("Bucket", ".spec.destination.bucket"),
            _col("Prefix", ".spec.destination.prefix", priority=1),
            _col("Mode", ".spec.mode"),
            _col("Behind", ".status.commitsBehind", "integer", desc="Commits not yet mirrored."),
            _col("Missing", ".status.missingObjects", "integer", priority=1),
            _col("Ready", READY),
            _col("Stalled", '.status.conditions[?(@.type=="Stalled")].status'),
            _col("Last Progress", ".status.lastProgressTime", "date", priority=1),
            _col("URL", ".status.destination", priority=1),
            AGE,
        ],
    },
}
