"""A small Kubernetes API server for tests, on top of KMock's ``KubernetesEmulator``.

There is no cluster in the test environment, so the operator's tests and the e2e scenario talk
over real HTTP on 127.0.0.1 to this server. KMock (PyPI ``kmock``) supplies the foundation: the
aiohttp server (``kmock.Server``), the request objects and their routing DSL (reactions with
priorities, KMock's own endpoints as the low-priority fallback), response and stream rendering
(``kmock.Response``), the Kubernetes ``Status`` errors (``kmock.KubernetesError``) and the
resource registry behind discovery (``kmock.ResourceInfo`` in ``emulator.resources``).

What KMock ships is not enough for Kopf and kubectl (no resource versions, uids, generations,
real patch semantics, status subresources, selectors, finalizers or discovery of CRDs), so
:class:`KubeEmulator` keeps its own object store and adds:

* ``metadata.resourceVersion`` (a cluster-wide counter), ``uid``, ``creationTimestamp`` and
  ``generation`` (+1 when anything outside ``metadata`` changes, ``status`` not counted where
  it is a subresource, and +1 when the object is marked for deletion);
* create (201, 409 AlreadyExists), get, list (``<Kind>List``), ``labelSelector`` (equality and
  set-based) and ``fieldSelector`` (``=``/``==``/``!=``; any dotted field of a built-in kind,
  but of a custom resource only ``metadata.name``, ``metadata.namespace`` and the CRD's
  ``selectableFields``, as kube-apiserver: any other is 400 BadRequest);
* watch streams with ``resourceVersion`` replay, ``timeoutSeconds``, ``sendInitialEvents`` and
  selector-aware ADDED/MODIFIED/DELETED transitions; with ``allowWatchBookmarks=true``, BOOKMARK
  events carrying the current resourceVersion, as kube-apiserver sends them: about every minute
  and 2 s before the watch's ``timeoutSeconds`` ends it (so a client resumes from a fresh one);
* PUT and PATCH (merge, JSON patch with ``test``, strategic merge for built-ins, server-side
  apply as a merge) with optimistic concurrency: a stale ``resourceVersion`` is 409 Conflict and
  a failed JSON-patch operation is 422, as on a real API server;
* the ``status`` subresource, finalizers, namespace termination, owner-reference garbage
  collection (background, foreground-as-background, orphan);
* discovery of built-ins and of CRDs applied at runtime, ``meta.k8s.io/v1`` Tables with the
  CRDs' ``additionalPrinterColumns`` (for ``kubectl get``);
* custom resources validated as kube-apiserver validates them (:mod:`zarrlake_testkit.crdschema`):
  pruning and defaults, the OpenAPI v3 schema, the CEL rules of ``x-kubernetes-validations``
  (transition rules on updates), a DNS-subdomain name, ``fieldValidation`` for unknown fields;
  a refusal is 422 Invalid with one cause per problem, worded as the real server words it. A CRD
  whose rules do not compile is refused, and so is an update of a CRD that drops a version still
  in its ``status.storedVersions``. Built-in kinds are not validated;
* bounded memory: the request log, the event history and each watch queue are capped.

:class:`KubeAPI` runs the server in a child process (``python -m zarrlake_testkit.kubeapi``)
and writes a kubeconfig that kubectl, the ``kubernetes`` client and Kopf can use.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import datetime
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp.web
import kmock
import yaml

from zarrlake_testkit.crdschema import (
    FieldError,
    aggregate,
    apply_schema,
    name_errors,
    rule_problems,
    validate,
)
from zarrlake_testkit.servers import free_port, spawn_on_free_port, stop, wait_for_port

JSON = dict[str, Any]

REQUEST_LOG_LIMIT = 32  # requests kept in KMock's request history (per handler and per reaction)
HISTORY_LIMIT = 5_000  # watch events kept for resourceVersion replay; older ones are "410 Gone"
WATCH_QUEUE_LIMIT = 10_000  # undelivered events per watch before the watch is closed
BOOKMARK_INTERVAL = 60.0  # seconds between a watch's periodic bookmarks (kube-apiserver: ~1 min)
BOOKMARK_BEFORE_TIMEOUT = 2.0  # and one this long before its timeoutSeconds, if that is ahead
SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-zarrlake-kubeapi",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}
VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
STATUS_VERBS = ["get", "patch", "update"]
CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY = ("", "namespaces")
# Kinds whose immediate DELETE answers a ``Status`` (kube-apiserver returns the deleted object
# only for kinds whose storage asks for it: pods, services, namespaces, CRDs, custom resources...).
STATUS_ON_DELETE = {
    ("", "secrets"),
    ("", "configmaps"),
    ("", "events"),
    ("events.k8s.io", "events"),
    ("coordination.k8s.io", "leases"),
    ("rbac.authorization.k8s.io", "roles"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("rbac.authorization.k8s.io", "clusterroles"),
    ("rbac.authorization.k8s.io", "clusterrolebindings"),
}


# --------------------------------------------------------------------------------------------
# Resources
# --------------------------------------------------------------------------------------------


@dataclass
class Resource:
    """One served resource: a built-in or one defined by a CustomResourceDefinition."""

    group: str
    plural: str
    kind: str
    namespaced: bool
    versions: list[str]  # served versions, the preferred one first
    singular: str = ""
    short_names: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    status: bool = False  # has the status subresource
    scale: JSON | None = None  # the scale subresource: specReplicasPath, statusReplicasPath
    columns: dict[str, list[JSON]] = field(default_factory=dict)  # printer columns per version
    schema: JSON | None = None  # the CRD's openAPIV3Schema (of the preferred version)
    list_kind: str = ""
    crd: str | None = None  # the name of the CRD that defines it
    # A custom resource's fields a field selector may name besides metadata.name/namespace (its
    # CRD's selectableFields, as dotted paths); None for built-ins (any field here).
    selectable: frozenset[str] | None = None

    def __post_init__(self) -> None:
        self.singular = self.singular or self.kind.lower()
        self.list_kind = self.list_kind or f"{self.kind}List"

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def group_resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def api_version(self, version: str) -> str:
        return f"{self.group}/{version}" if self.group else version


def _builtin(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    status: bool = False,
    short: Iterable[str] = (),
    categories: Iterable[str] = (),
) -> Resource:
    return Resource(
        group=group,
        plural=plural,
        kind=kind,
        namespaced=namespaced,
        versions=[version],
        status=status,
        short_names=list(short),
        categories=list(categories),
    )


BUILTINS = [
    _builtin("", "v1", "namespaces", "Namespace", namespaced=False, status=True, short=["ns"]),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "configmaps", "ConfigMap", short=["cm"]),
    _builtin("", "v1", "services", "Service", status=True, short=["svc"], categories=["all"]),
    _builtin("", "v1", "pods", "Pod", status=True, short=["po"], categories=["all"]),
    _builtin("", "v1", "events", "Event", short=["ev"]),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short=["sa"]),
    _builtin(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", status=True, short=["pvc"]
    ),
    _builtin("events.k8s.io", "v1", "events", "Event", short=["ev"]),
    Resource(
        group="apps",
        plural="deployments",
        kind="Deployment",
        namespaced=True,
        versions=["v1"],
        status=True,
        scale={"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"},
        short_names=["deploy"],
        categories=["all"],
    ),
    _builtin("batch", "v1", "cronjobs", "CronJob", status=True, short=["cj"], categories=["all"]),
    _builtin("batch", "v1", "jobs", "Job", status=True, categories=["all"]),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin(
        "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", status=True, short=["pdb"]
    ),
    _builtin("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short=["netpol"]),
    _builtin("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _builtin(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
    _builtin(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        status=True,
        short=["crd", "crds"],
        categories=["api-extensions"],
    ),
]
BUILTIN_GROUP_ORDER = [
    "",
    "apps",
    "events.k8s.io",
    "batch",
    "coordination.k8s.io",
    "policy",
    "networking.k8s.io",
    "rbac.authorization.k8s.io",
    "apiextensions.k8s.io",
]
# Printer columns of built-ins beyond NAME and AGE (kubectl prints what the server's Table has).
BUILTIN_COLUMNS: dict[tuple[str, str], list[JSON]] = {
    NAMESPACE_KEY: [{"name": "Status", "type": "string", "jsonPath": ".status.phase"}],
    ("", "pods"): [{"name": "Status", "type": "string", "jsonPath": ".status.phase"}],
    ("", "events"): [
        {"name": "Type", "type": "string", "jsonPath": ".type"},
        {"name": "Reason", "type": "string", "jsonPath": ".reason"},
        {"name": "Object", "type": "string", "jsonPath": ".involvedObject.name"},
        {"name": "Message", "type": "string", "jsonPath": ".message"},
    ],
    ("apps", "deployments"): [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    ],
    ("batch", "cronjobs"): [
        {"name": "Schedule", "type": "string", "jsonPath": ".spec.schedule"},
        {"name": "Suspend", "type": "boolean", "jsonPath": ".spec.suspend"},
        {"name": "Last Schedule", "type": "date", "jsonPath": ".status.lastScheduleTime"},
    ],
    ("", "services"): [
        {"name": "Type", "type": "string", "jsonPath": ".spec.type"},
        {"name": "Cluster-IP", "type": "string", "jsonPath": ".spec.clusterIP"},
    ],
}


def _version_priority(version: str) -> tuple[int, int, int, str]:
    """Kubernetes' version ordering: GA > beta > alpha, higher numbers first, then by name."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (3, 0, 0, version)
    major, stage, minor = int(m[1]), m[2], int(m[3] or 0)
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -major, -minor, version)


# --------------------------------------------------------------------------------------------
# Errors (Kubernetes Status objects via kmock.KubernetesError)
# --------------------------------------------------------------------------------------------


def _error(
    code: int, reason: str, message: str, details: JSON | None = None
) -> kmock.KubernetesError:
    return kmock.KubernetesError(code, reason, message, details if details is not None else {})


def _details(res: Resource, name: str | None) -> JSON:
    details: JSON = {"kind": res.plural}
    if res.group:
        details["group"] = res.group
    if name:
        details["name"] = name
    return details


def _not_found(res: Resource, name: str) -> kmock.KubernetesError:
    return _error(404, "NotFound", f'{res.group_resource} "{name}" not found', _details(res, name))


def _bad_request(message: str) -> kmock.KubernetesError:
    return _error(400, "BadRequest", message)


def _conflict(res: Resource, name: str, why: str) -> kmock.KubernetesError:
    message = f'Operation cannot be fulfilled on {res.group_resource} "{name}": {why}'
    return _error(409, "Conflict", message, _details(res, name))


STALE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)


def _invalid(res: Resource, name: str, fld: str, message: str) -> kmock.KubernetesError:
    kind = res.kind
    details = {
        **_details(res, name),
        "kind": kind,
        "causes": [{"reason": "FieldValueInvalid", "message": message, "field": fld}],
    }
    return _error(
        422, "Invalid", f'{kind}.{res.group or "core"} "{name}" is invalid: {message}', details
    )


def _refused(res: Resource, name: str, errors: list[FieldError]) -> kmock.KubernetesError:
    """422 Invalid with one cause per error, worded as kube-apiserver's ``errors.NewInvalid``."""
    qualified = f"{res.kind}.{res.group}" if res.group else res.kind
    details: JSON = {"name": name, "kind": res.kind, "causes": [e.cause() for e in errors]}
    if res.group:
        details["group"] = res.group
    message = f'{qualified} "{name}" is invalid: {aggregate(errors)}'
    return _error(422, "Invalid", message, details)


def _unknown_fields(res: Resource, version: str, unknown: list[str]) -> kmock.KubernetesError:
    """400 for unknown fields under ``fieldValidation=Strict`` (kubectl's default)."""
    fields = ", ".join(f'unknown field "{f}"' for f in unknown)
    message = (
        f'{res.kind} in version "{version}" cannot be handled as a {res.kind}: '
        f"strict decoding error: {fields}"
    )
    return _bad_request(message)


def _status_body(code: int, reason: str, message: str, details: JSON | None) -> JSON:
    body: JSON = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


# --------------------------------------------------------------------------------------------
# Selectors
# --------------------------------------------------------------------------------------------

_LABEL_REQ = re.compile(
    r"""^\s*(?:
        (?P<neg>!)\s*(?P<nkey>[^\s!=<>(),]+)
      | (?P<key>[^\s!=<>(),]+)\s*(?:
            (?P<op>==|=|!=|>|<)\s*(?P<value>[^\s,()]*)
          | \s(?P<setop>in|notin)\s*\((?P<values>[^()]*)\)
        )?
    )\s*$""",
    re.X,
)


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # eq, ne, in, notin, exists, notexists, gt, lt
    values: tuple[str, ...] = ()

    def __call__(self, labels: JSON) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        match self.op:
            case "exists":
                return present
            case "notexists":
                return not present
            case "eq" | "in":
                return present and value in self.values
            case "ne" | "notin":
                return not present or value not in self.values
            case "gt" | "lt":
                try:
                    have, want = int(str(value)), int(self.values[0])
                except ValueError:
                    return False
                return present and (have > want if self.op == "gt" else have < want)
        return False  # pragma: no cover


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p for p in (p.strip() for p in parts) if p]


def parse_label_selector(text: str | None) -> list[LabelRequirement]:
    reqs: list[LabelRequirement] = []
    for part in _split_top(text or ""):
        m = _LABEL_REQ.match(part)
        if not m:
            raise _bad_request(f"unable to parse requirement: {part!r}")
        if m["neg"]:
            reqs.append(LabelRequirement(m["nkey"], "notexists"))
        elif m["setop"]:
            values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
            reqs.append(LabelRequirement(m["key"], m["setop"], values))
        elif m["op"]:
            op = {"=": "eq", "==": "eq", "!=": "ne", ">": "gt", "<": "lt"}[m["op"]]
            reqs.append(LabelRequirement(m["key"], op, (m["value"],)))
        else:
            reqs.append(LabelRequirement(m["key"], "exists"))
    return reqs


@dataclass(frozen=True)
class FieldRequirement:
    path: tuple[str, ...]
    equal: bool
    value: str

    def __call__(self, obj: JSON) -> bool:
        cur: Any = obj
        for part in self.path:
            cur = cur.get(part) if isinstance(cur, dict) else None
        if cur is None:
            text = ""
        elif isinstance(cur, bool):
            text = "true" if cur else "false"
        else:
            text = str(cur)
        return (text == self.value) == self.equal


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    reqs: list[FieldRequirement] = []
    for part in _split_top(text or ""):
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-/]+)\s*(==|=|!=)\s*(.*?)\s*", part)
        if not m:
            raise _bad_request(f"invalid field selector: {part!r}")
        reqs.append(FieldRequirement(tuple(m[1].split(".")), m[2] != "!=", m[3]))
    return reqs


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------


class PatchError(Exception):
    """A patch could not be applied (JSON-patch failures are 422 on kube-apiserver)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge recursively, ``null`` deletes, the rest replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _list_index(container: list[Any], token: str, *, adding: bool) -> int:
    if token == "-" and adding:
        return len(container)
    if not re.fullmatch(r"0|[1-9]\d*", token):
        raise PatchError(f"invalid array index {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not adding):
        raise PatchError(f"array index {index} out of bounds")
    return index


def _resolve(doc: Any, tokens: list[str]) -> Any:
    cur = doc
    for token in tokens:
        if isinstance(cur, dict):
            if token not in cur:
                raise PatchError(f"missing path /{'/'.join(tokens)}")
            cur = cur[token]
        elif isinstance(cur, list):
            cur = cur[_list_index(cur, token, adding=False)]
        else:
            raise PatchError(f"missing path /{'/'.join(tokens)}")
    return cur


def _add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_list_index(parent, last, adding=True), value)
    else:
        raise PatchError(f"cannot add to a scalar at /{'/'.join(tokens)}")
    return doc


def _remove(doc: Any, tokens: list[str]) -> tuple[Any, Any]:
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"missing path /{'/'.join(tokens)}")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_list_index(parent, last, adding=False))
    raise PatchError(f"missing path /{'/'.join(tokens)}")


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, move, copy and test."""
    if not isinstance(ops, list):
        raise TypeError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise TypeError(f"invalid JSON patch operation: {op!r}")
        kind, path = op["op"], _pointer(op["path"])
        if kind in ("add", "replace", "test") and "value" not in op:
            raise TypeError(f"operation {kind!r} needs a value")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            if path:
                doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            source = _pointer(op.get("from", ""))
            if kind == "move":
                doc, value = _remove(doc, source)
            else:
                value = copy.deepcopy(_resolve(doc, source))
            doc = _add(doc, path, value)
        elif kind == "test":
            actual = _resolve(doc, path)
            if actual != op["value"]:
                raise PatchError(
                    f"testing value /{'/'.join(path)} failed: {actual!r} != {op['value']!r}"
                )
        else:
            raise TypeError(f"unknown JSON patch operation {kind!r}")
    return doc


# Merge keys of the lists that strategic merge patches merge item by item (a subset of the Go
# struct tags of the built-in types; every other list is replaced as a whole).
SMP_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "conditions": "type",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
}
SMP_PRIMITIVE_SETS = {"finalizers"}
_DELETE = object()


def _smp_list(key: str, current: list[Any], patch: list[Any]) -> list[Any]:
    if key in SMP_PRIMITIVE_SETS:
        merged = list(current)
        merged.extend(item for item in patch if item not in merged)
        return merged
    merge_key = SMP_MERGE_KEYS.get(key)
    if key == "ports":
        items = [*current, *patch]
        merge_key = "containerPort" if any("containerPort" in p for p in items) else "port"
    if merge_key is None or not all(isinstance(p, dict) for p in patch):
        return copy.deepcopy(patch)
    if any(p.get("$patch") == "replace" for p in patch):
        return [copy.deepcopy(p) for p in patch if p.get("$patch") != "replace"]
    result = copy.deepcopy(current)
    for item in patch:
        index = next(
            (
                i
                for i, cur in enumerate(result)
                if isinstance(cur, dict) and cur.get(merge_key) == item.get(merge_key)
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is not None:
            result[index] = strategic_merge_patch(result[index], item)
        else:
            result.append(strategic_merge_patch({}, item))
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch without the Go schemas: known merge keys, directives honoured."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "delete":
        return _DELETE
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    deletions: list[tuple[str, list[Any]]] = []
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions.append((key.split("/", 1)[1], value or []))
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is _DELETE:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _smp_list(key, result[key], value)
        elif isinstance(value, list):
            result[key] = _smp_list(key, [], value)
        else:
            result[key] = copy.deepcopy(value)
    for key, values in deletions:
        if isinstance(result.get(key), list):
            result[key] = [v for v in result[key] if v not in values]
    if isinstance(patch.get("$retainKeys"), list):
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
    return result


# --------------------------------------------------------------------------------------------
# JSONPath (the subset printer columns need) and Tables
# --------------------------------------------------------------------------------------------

_JSONPATH_TOKEN = re.compile(
    r"""
      \.(?P<field>[A-Za-z0-9_\-$]+)
    | \.\*
    | \[(?P<index>-?\d+|\*)\]
    | \[(?P<quote>['"])(?P<qfield>.*?)(?P=quote)\]
    | \[\?\(@\.(?P<fpath>[A-Za-z0-9_.\-]+)\s*(?P<fop>==|!=)\s*
        (?:"(?P<fdq>[^"]*)"|'(?P<fsq>[^']*)'|(?P<fraw>[^)\s]+))\s*\)\]
    """,
    re.X,
)


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """A JSONPath subset: ``.a.b``, ``[N]``, ``[*]``, ``['k']``, ``[?(@.f=="v")]``, ``.*``."""
    expr = expression.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1].strip()
    expr = expr.removeprefix("$")
    if expr and not expr.startswith((".", "[")):
        expr = "." + expr
    nodes: list[Any] = [obj]
    pos = 0
    while pos < len(expr):
        m = _JSONPATH_TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath {expression!r} at {expr[pos:]!r}")
        pos = m.end()
        out: list[Any] = []
        for node in nodes:
            if m["field"] is not None or m["qfield"] is not None:
                name = m["field"] if m["field"] is not None else m["qfield"]
                if isinstance(node, dict) and name in node:
                    out.append(node[name])
            elif m["index"] is not None:
                if isinstance(node, list):
                    if m["index"] == "*":
                        out.extend(node)
                    elif -len(node) <= int(m["index"]) < len(node):
                        out.append(node[int(m["index"])])
                elif isinstance(node, dict) and m["index"] == "*":
                    out.extend(node.values())
            elif m["fpath"] is not None:
                want = next(v for v in (m["fdq"], m["fsq"], m["fraw"]) if v is not None)
                for item in node if isinstance(node, list) else []:
                    got = jsonpath(item, "." + m["fpath"])
                    text = _scalar_text(got[0]) if got else None
                    if (text == want) == (m["fop"] == "=="):
                        out.append(item)
            elif isinstance(node, dict):  # .*
                out.extend(node.values())
            elif isinstance(node, list):
                out.extend(node)
        nodes = out
    return nodes


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _parse_time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """A short age like kubectl's: 42s, 5m3s, 17m, 4h10m, 20h, 3d4h, 40d, 2y30d."""
    s = int(seconds)
    if s < 0:
        return "0s"
    minutes, hours, days = s // 60, s // 3600, s // 86400
    if s < 120:
        return f"{s}s"
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 365 * 2:
        return f"{days}d"
    years = days // 365
    return f"{years}y{days % 365}d" if years < 8 and days % 365 else f"{years}y"


def _age(timestamp: Any) -> str:
    when = _parse_time(timestamp)
    if when is None:
        return "<unknown>"
    return human_duration((datetime.datetime.now(datetime.UTC) - when).total_seconds())


def _cell(column: JSON, obj: JSON) -> Any:
    try:
        values = jsonpath(obj, column.get("jsonPath", ""))
    except ValueError:
        return None
    if not values or values[0] is None:
        return None
    value, kind = values[0], column.get("type", "string")
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
        if kind == "boolean":
            return value if isinstance(value, bool) else str(value).lower() == "true"
        if kind == "date":
            return _age(value)
    except (TypeError, ValueError):
        return _scalar_text(value)
    return _scalar_text(value)


def _columns(res: Resource, version: str) -> list[JSON]:
    extra = res.columns.get(version) if res.crd else BUILTIN_COLUMNS.get(res.key, [])
    columns: list[JSON] = [
        {
            "name": "Name",
            "type": "string",
            "jsonPath": ".metadata.name",
            "priority": 0,
            "name_col": True,
        }
    ]
    columns.extend(extra or [])
    has_age = any(
        c.get("name", "").lower() == "age" or c.get("jsonPath") == ".metadata.creationTimestamp"
        for c in columns
    )
    if not has_age:
        columns.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
    return columns


def make_table(
    res: Resource, version: str, objs: list[JSON], rv: str, include: str = "Metadata"
) -> JSON:
    """A ``meta.k8s.io/v1`` Table of the objects, as kube-apiserver answers ``kubectl get``."""
    columns = _columns(res, version)
    definitions = []
    for c in columns:
        definitions.append(
            {
                "name": c["name"] if not c.get("name_col") else "Name",
                "type": "string" if c.get("type") == "date" else c.get("type", "string"),
                "format": "name" if c.get("name_col") else c.get("format", ""),
                "description": c.get("description", ""),
                "priority": int(c.get("priority", 0)),
            }
        )
    rows = []
    for obj in objs:
        row: JSON = {"cells": [_cell(c, obj) for c in columns]}
        if include == "Object":
            row["object"] = obj
        elif include != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj.get("metadata", {}),
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": definitions,
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------
# Protobuf request bodies (kubectl's typed clients)
# --------------------------------------------------------------------------------------------

# ``kubectl create namespace|configmap|secret`` send ``application/vnd.kubernetes.protobuf``
# bodies (client-go falls back to JSON only after a 415 to CBOR, never to protobuf). Field
# numbers of the few kinds those commands build; other kinds answer 415.
_PB_META: JSON = {
    1: ("name", "str"),
    2: ("generateName", "str"),
    3: ("namespace", "str"),
    6: ("resourceVersion", "str"),
    11: ("labels", "map"),
    12: ("annotations", "map"),
    14: ("finalizers", "list"),
}
_PB_KINDS: dict[str, JSON] = {
    "Namespace": {1: ("metadata", _PB_META), 2: ("spec", {1: ("finalizers", "list")})},
    "ConfigMap": {
        1: ("metadata", _PB_META),
        2: ("data", "map"),
        3: ("binaryData", "bytesmap"),
        4: ("immutable", "bool"),
    },
    "Secret": {
        1: ("metadata", _PB_META),
        2: ("data", "bytesmap"),
        3: ("type", "str"),
        4: ("stringData", "map"),
        5: ("immutable", "bool"),
    },
}


def _pb_fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """The (field number, value) pairs of a protobuf message: varints and length-delimited."""

    def varint(pos: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value, pos

    pos = 0
    while pos < len(data):
        key, pos = varint(pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(pos)
            yield number, value
        elif wire == 2:
            size, pos = varint(pos)
            yield number, data[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _pb_message(data: bytes, schema: JSON) -> JSON:
    out: JSON = {}
    for number, value in _pb_fields(data):
        if number not in schema:
            continue
        name, kind = schema[number]
        if isinstance(kind, dict):
            assert isinstance(value, bytes)
            out[name] = _pb_message(value, kind)
        elif kind == "str":
            assert isinstance(value, bytes)
            if value:
                out[name] = value.decode()
        elif kind == "bool":
            out[name] = bool(value)
        elif kind == "list":
            assert isinstance(value, bytes)
            out.setdefault(name, []).append(value.decode())
        else:  # map entries: {1: key, 2: value}
            assert isinstance(value, bytes)
            entry = dict(_pb_fields(value))
            key, item = bytes(entry.get(1, b"")).decode(), bytes(entry.get(2, b""))
            text = base64.b64encode(item).decode() if kind == "bytesmap" else item.decode()
            out.setdefault(name, {})[key] = text
    return out


def decode_protobuf(body: bytes) -> JSON:
    """A ``k8s\\x00``-prefixed ``runtime.Unknown`` envelope decoded into a JSON object."""
    if not body.startswith(b"k8s\x00"):
        raise ValueError("not a Kubernetes protobuf envelope")
    envelope = dict(_pb_fields(body[4:]))
    type_meta = dict(_pb_fields(bytes(envelope.get(1, b""))))
    api_version = bytes(type_meta.get(1, b"")).decode()
    kind = bytes(type_meta.get(2, b"")).decode()
    if kind not in _PB_KINDS:
        raise LookupError(kind)
    obj = _pb_message(bytes(envelope.get(2, b"")), _PB_KINDS[kind])
    return {"apiVersion": api_version, "kind": kind, **obj}


# --------------------------------------------------------------------------------------------
# Object helpers
# --------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(obj: JSON) -> JSON:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _normalize_meta(meta: JSON) -> None:
    """Drop empty collections, as the Go ObjectMeta's ``omitempty`` does."""
    for key in ("labels", "annotations", "finalizers", "ownerReferences", "managedFields"):
        if key in meta and not meta[key]:
            del meta[key]


def _without(obj: JSON, keys: Iterable[str]) -> JSON:
    drop = set(keys)
    return {k: v for k, v in obj.items() if k not in drop}


_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"


@dataclass
class StoredEvent:
    rv: int
    key: tuple[str, str]
    type: str  # ADDED, MODIFIED, DELETED
    obj: JSON
    prev: JSON | None


@dataclass(eq=False)
class Watch:
    """One open watch stream: its filters and the queue of events not yet sent."""

    key: tuple[str, str]
    namespace: str | None
    name: str | None
    labels: list[LabelRequirement]
    fields: list[FieldRequirement]
    queue: asyncio.Queue[tuple[str, JSON] | None] = field(default_factory=asyncio.Queue)
    closed: bool = False

    def matches(self, obj: JSON) -> bool:
        meta = _meta(obj)
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        if self.name is not None and meta.get("name") != self.name:
            return False
        labels = meta.get("labels") or {}
        return all(r(labels) for r in self.labels) and all(r(obj) for r in self.fields)

    def translate(self, event: StoredEvent) -> tuple[str, JSON] | None:
        """What this watch sees of a change: selectors turn changes into ADDED/DELETED."""
        if event.type == "DELETED":
            return ("DELETED", event.obj) if self.matches(event.obj) else None
        now = self.matches(event.obj)
        before = event.prev is not None and self.matches(event.prev)
        if event.type == "ADDED" or not before:
            return ("ADDED", event.obj) if now else None
        return ("MODIFIED" if now else "DELETED", event.obj)

    def offer(self, event: StoredEvent) -> None:
        if self.closed:
            return
        seen = self.translate(event)
        if seen is None:
            return
        if self.queue.qsize() >= WATCH_QUEUE_LIMIT:  # a stuck client: end its stream
            self.close()
            return
        self.queue.put_nowait(seen)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)


# --------------------------------------------------------------------------------------------
# The emulator
# --------------------------------------------------------------------------------------------

_RESOURCE_PATH = re.compile(
    r"/(?:api/(?P<core>[^/]+)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))(?P<rest>/.*)?"
)


def parse_api_path(
    path: str,
) -> tuple[str, str, str | None, str | None, str | None, str | None] | None:
    """``/api/v1/namespaces/ns/pods/x/status`` -> (group, version, plural, ns, name, sub)."""
    m = _RESOURCE_PATH.fullmatch(path.rstrip("/") if path != "/" else path)
    if not m:
        return None
    group, version = ("", m["core"]) if m["core"] is not None else (m["group"], m["version"])
    parts = [p for p in (m["rest"] or "").split("/") if p]
    namespace = None
    if (
        len(parts) >= 3
        and parts[0] == "namespaces"
        and not (len(parts) == 3 and parts[2] in ("status", "finalize"))
    ):
        namespace, parts = parts[1], parts[2:]
    if not parts:
        return (group, version, None, namespace, None, None)
    plural = parts[0]
    name = parts[1] if len(parts) > 1 else None
    sub = "/".join(parts[2:]) or None
    return (group, version, plural, namespace, name, sub)


class KubeEmulator(kmock.KubernetesEmulator):
    """KMock's ``KubernetesEmulator`` grown into a small stateful Kubernetes API server.

    All state changes are synchronous (no ``await`` between reading and writing the store), so
    there is no locking: each request's mutation is atomic within the event loop, and watch
    queues are fed in the same step, in resource-version order.
    """

    history_limit = HISTORY_LIMIT  # a subclass may keep fewer events (to test "410 Gone")

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # KMock's own endpoints stay as the lowest-priority fallback
        self.server_address = "127.0.0.1:0"
        self._registry: dict[tuple[str, str], Resource] = {}
        self._store: dict[tuple[str, str], dict[tuple[str, str], JSON]] = {}
        self._uids: set[str] = set()
        self._rv = 0
        self._history: deque[StoredEvent] = deque(maxlen=self.history_limit)
        self._history_floor = 0  # events up to this resourceVersion are forgotten
        self._watches: set[Watch] = set()
        self._request_count = 0
        #: An audit log (see :meth:`audit_to`), or None.
        self._audit: Any = None
        # Per write request (all synchronous): kubectl's ``fieldValidation`` and the warnings
        # to answer with. Writes of the server's own (garbage collection) ignore unknown fields.
        self._field_validation = "Ignore"
        self._warnings: list[str] = []
        for res in BUILTINS:
            self._register(copy.deepcopy(res))

        # Routing with KMock's DSL; all of these outrank KMock's own (fallback) endpoints. KMock
        # tries reactions by priority, and a reaction that does not match scans the whole request
        # history to find that out, so the busiest routes go first: object requests, then
        # discovery of resources, then the rest.
        (self**3)[kmock.resource()] << self._serve_resource_request  # any resource at all
        get = kmock.method.GET
        (self**2)[get, re.compile(r"/api/[^/]+|/apis/[^/]+/[^/]+")] << self._serve_resources
        (self**1)["get /api"] << self._serve_core_versions
        (self**1)["get /apis"] << self._serve_groups
        self["get /version"] << self._serve_server_version
        self[get, re.compile(r"/openapi/v3(?:/.*)?")] << self._serve_openapi_v3
        self[get, re.compile(r"/apis/[^/]+")] << self._serve_group_info
        self[re.compile(r"/openapi/.*")] << self._serve_no_openapi
        self[re.compile(r"/(?:healthz|livez|readyz)(?:/.*)?")] << b"ok"
        self["get /"] << self._serve_root_paths

        for ns in ("default", "kube-system", "kube-public"):
            self._create_object(
                self._registry[NAMESPACE_KEY], "v1", None, {"metadata": {"name": ns}}
            )

    # --- HTTP plumbing -----------------------------------------------------------------------

    def audit_to(self, path: str | os.PathLike[str]) -> None:
        """Append one JSON line per request received to ``path``, as a real API server's audit
        log records who asked what: ``{"time", "user", "verb", "path", "watch"}``, where the user
        is the bearer token (each test client can bring its own kubeconfig and token) and the
        verb the HTTP method. A refused request is recorded too: it was still attempted."""
        self._audit = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115  (server's)

    def _audit_request(self, raw: aiohttp.web.BaseRequest) -> None:
        if self._audit is None:
            return
        auth = raw.headers.get("Authorization", "")
        entry = {
            "time": time.time(),
            "user": auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else "",
            "verb": raw.method.upper(),
            "path": raw.path,
            "watch": raw.query.get("watch", "").lower() in ("true", "1"),
        }
        self._audit.write(json.dumps(entry) + "\n")

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        self._audit_request(raw_request)
        body = await raw_request.read()
        try:
            request = self._make_request(raw_request, body)
            self._remember(request)
            return await self._handle(request)
        except Exception as exc:
            if not isinstance(exc, kmock.KubernetesError):
                traceback.print_exc(file=sys.stderr)
            prepared = next(
                (a for a in exc.args if isinstance(a, aiohttp.web.StreamResponse) and a.prepared),
                None,
            )
            if prepared is not None:  # a watch stream already started: end it with an ERROR
                event = {"type": "ERROR", "object": self._error_body(exc)[1]}
                try:
                    await prepared.write(json.dumps(event).encode() + b"\n")
                    await prepared.write_eof()
                except (ConnectionError, RuntimeError):
                    pass
                return prepared
            code, payload = self._error_body(exc)
            return aiohttp.web.json_response(payload, status=code)

    @staticmethod
    def _error_body(exc: BaseException) -> tuple[int, JSON]:
        cause = exc.__cause__ if not isinstance(exc, kmock.KubernetesError) else None
        if isinstance(cause, kmock.KubernetesError):
            exc = cause
        if isinstance(exc, kmock.KubernetesNotFoundError):  # KMock's own "no such endpoint"
            message = "the server could not find the requested resource"
            return 404, _status_body(404, "NotFound", message, None)
        if isinstance(exc, kmock.KubernetesError):
            code = exc.status
            return code, _status_body(code, exc.reason or "", exc.message or "", exc.details)
        return 500, _status_body(500, "InternalError", f"{type(exc).__name__}: {exc}", None)

    def _make_request(self, raw: aiohttp.web.BaseRequest, body: bytes) -> kmock.Request:
        parsed = parse_api_path(raw.path)
        group, version, plural, namespace, name, sub = parsed or (None,) * 6
        method = raw.method.upper()
        watch = raw.query.get("watch", "").lower() in ("true", "1")
        action: kmock.action | None = None
        if parsed is not None and plural is not None:
            listing = kmock.action.FETCH if name else kmock.action.LIST
            action = {
                "GET": kmock.action.WATCH if watch else listing,
                "POST": kmock.action.CREATE,
                "PUT": kmock.action.UPDATE,
                "PATCH": kmock.action.UPDATE,
                "DELETE": kmock.action.DELETE,
            }.get(method)
        data: Any = None
        if body:
            try:
                data = json.loads(body)
            except ValueError:
                data = None
        self._request_count += 1
        return kmock.Request(
            id=self._request_count,
            raw_request=raw,
            url=raw.url,
            method=method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            cookies=dict(raw.cookies),
            body=body,
            text=body.decode("utf-8", errors="replace"),
            data=data,
            action=action,
            resource=None  # set for object requests only (not for discovery)
            if parsed is None or plural is None
            else kmock.resource(group=group, version=version, plural=plural),
            namespace=namespace,
            name=name,
            subresource=sub,
        )

    def __iter__(self) -> Iterator[kmock.Request]:
        # KMock routes a request by testing ``request in reaction_view``, which walks the request
        # history through the view's filters until it meets that request. The request being
        # routed is always the newest, so the history runs newest first: a matching reaction is
        # found in O(1); a non-matching one still walks it all (hence the short history and the
        # route priorities). Views like ``emulator["get"]`` list the newest request first.
        yield from reversed(self._requests)

    def _remember(self, request: kmock.Request) -> None:
        """Keep KMock's request history (the handler's and each reaction's) bounded."""
        self._requests.append(request)
        if len(self._requests) > REQUEST_LOG_LIMIT * 2:
            del self._requests[:-REQUEST_LOG_LIMIT]
        for reaction in self._payloads:
            seen = getattr(reaction, "_requests", None)
            if isinstance(seen, list) and len(seen) > REQUEST_LOG_LIMIT * 2:
                del seen[:-REQUEST_LOG_LIMIT]

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Route through KMock's DSL (kmock.RawHandler) but skip KubernetesEmulator's own
        # state-tracking interceptor: this class keeps the state.
        return await kmock.RawHandler._handle(self, request)

    @staticmethod
    def _json(payload: Any, status: int = 200, warnings: Iterable[str] = ()) -> kmock.Response:
        # KMock merges each answer's headers into its reaction's, which outlive the request: a
        # header that is not set to None here would be sent again with every later answer.
        warning = ", ".join(f"299 - {json.dumps(w)}" for w in warnings) or None
        headers = {"Content-Type": "application/json", "Warning": warning}
        return kmock.Response(status=status, payload=payload, headers=headers)

    def _written(self, payload: Any, status: int = 200) -> kmock.Response:
        """The answer to a write, with its warnings (``Warning: 299 - "..."``, as kubectl and
        client-go read them)."""
        return self._json(payload, status, self._warnings)

    # --- discovery ---------------------------------------------------------------------------

    def _register(self, res: Resource) -> None:
        old = self._registry.get(res.key)
        if old is not None:
            for version in old.versions:
                key = kmock.resource(group=old.group, version=version, plural=old.plural)
                if key in self.resources:
                    del self.resources[key]
        self._registry[res.key] = res
        self._store.setdefault(res.key, {})
        for version in res.versions:
            key = kmock.resource(group=res.group, version=version, plural=res.plural)
            self.resources[key] = kmock.ResourceInfo(
                namespaced=res.namespaced,
                kind=res.kind,
                singular=res.singular,
                verbs=VERBS,
                shortnames=res.short_names,
                categories=res.categories,
                subresources=[s for s, on in (("status", res.status), ("scale", res.scale)) if on],
            )

    def _unregister(self, key: tuple[str, str]) -> None:
        res = self._registry.pop(key, None)
        if res is None:
            return
        for version in res.versions:
            rkey = kmock.resource(group=res.group, version=version, plural=res.plural)
            if rkey in self.resources:
                del self.resources[rkey]
        self._store.pop(key, None)
        for watch in list(self._watches):
            if watch.key == key:
                watch.close()

    def _groups(self) -> dict[str, list[str]]:
        """Group -> served versions (preferred first), from KMock's resource registry."""
        versions: dict[str, set[str]] = {}
        for ref in self.resources:
            if ref.group is not None and ref.version is not None:
                versions.setdefault(ref.group, set()).add(ref.version)
        order = {g: i for i, g in enumerate(BUILTIN_GROUP_ORDER)}
        groups = sorted(versions, key=lambda g: (order.get(g, len(order)), g))
        return {g: sorted(versions[g], key=_version_priority) for g in groups}

    def _serve_server_version(self) -> kmock.Response:
        return self._json(SERVER_VERSION)

    def _serve_core_versions(self) -> kmock.Response:
        return self._json(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": self.server_address}
                ],
            }
        )

    @staticmethod
    def _group_info(group: str, versions: list[str]) -> JSON:
        return {
            "name": group,
            "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
            "preferredVersion": {"groupVersion": f"{group}/{versions[0]}", "version": versions[0]},
        }

    def _serve_groups(self) -> kmock.Response:
        groups = [self._group_info(g, vs) for g, vs in self._groups().items() if g]
        return self._json({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    def _serve_group_info(self, request: kmock.Request) -> kmock.Response:
        group = request.url.path.rstrip("/").split("/")[2]
        versions = self._groups().get(group)
        if not group or not versions:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        return self._json(
            {"kind": "APIGroup", "apiVersion": "v1", **self._group_info(group, versions)}
        )

    def _serve_resources(self, request: kmock.Request) -> kmock.Response:
        parsed = parse_api_path(request.url.path)
        assert parsed is not None
        group, version = parsed[0], parsed[1]
        entries: list[JSON] = []
        for ref, info in sorted(self.resources.items(), key=lambda item: str(item[0].plural)):
            if ref.group != group or ref.version != version:
                continue
            entries.append(
                {
                    "name": ref.plural,
                    "singularName": info.singular or "",
                    "namespaced": bool(info.namespaced),
                    "kind": info.kind,
                    "verbs": sorted(info.verbs),
                    "shortNames": sorted(info.shortnames),
                    "categories": sorted(info.categories),
                }
            )
            for sub in sorted(info.subresources):
                entry = {
                    "name": f"{ref.plural}/{sub}",
                    "singularName": "",
                    "namespaced": bool(info.namespaced),
                    "kind": info.kind,
                    "verbs": STATUS_VERBS,
                }
                if sub == "scale":
                    entry.update(group="autoscaling", version="v1", kind="Scale")
                entries.append(entry)
        if not entries:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        group_version = f"{group}/{version}" if group else version
        return self._json(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": group_version,
                "resources": entries,
            }
        )

    def _serve_root_paths(self) -> kmock.Response:
        paths = {"/api", "/api/v1", "/apis", "/version", "/healthz", "/livez", "/readyz"}
        for group, versions in self._groups().items():
            if group:
                paths.add(f"/apis/{group}")
                paths.update(f"/apis/{group}/{v}" for v in versions)
        return self._json({"paths": sorted(paths)})

    def _serve_no_openapi(self) -> kmock.Response:
        raise _error(404, "NotFound", "the server could not find the requested resource")

    def _openapi_document(self, group: str, version: str) -> JSON | None:
        """A skeletal OpenAPI v3 document of one group/version: PATCH operations only.

        kubectl's default ``--validate=strict`` asks OpenAPI v3 whether the PATCH endpoint of a
        kind takes the ``fieldValidation`` query parameter; when it does, kubectl leaves the
        validation to the server (this one validates custom resources and refuses their unknown
        fields under ``fieldValidation=Strict``) instead of downloading the OpenAPI v2 schemas.
        No request bodies are described, so ``kubectl apply`` computes strategic merge
        patches from its built-in Go types and JSON merge patches for custom resources.
        """
        paths: JSON = {}
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        for ref, info in self.resources.items():
            if ref.group != group or ref.version != version:
                continue
            scope = "/namespaces/{namespace}" if info.namespaced else ""
            paths[f"{prefix}{scope}/{ref.plural}/{{name}}"] = {
                "patch": {
                    "operationId": f"patch{info.kind}",
                    "x-kubernetes-group-version-kind": {
                        "group": group,
                        "version": version,
                        "kind": info.kind,
                    },
                    "parameters": [
                        {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
                        {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
                        {"name": "dryRun", "in": "query", "schema": {"type": "string"}},
                    ],
                    "responses": {"200": {"description": "OK"}},
                }
            }
        if not paths:
            return None
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": SERVER_VERSION["gitVersion"]},
            "paths": paths,
            "components": {"schemas": {}},
        }

    def _serve_openapi_v3(self, request: kmock.Request) -> kmock.Response:
        rest = request.url.path.rstrip("/").removeprefix("/openapi/v3").strip("/")
        if rest:
            parts = rest.split("/")
            group, version = ("", parts[1]) if parts[0] == "api" else (parts[1], parts[-1])
            if len(parts) != (2 if parts[0] == "api" else 3):
                raise _error(404, "NotFound", "the server could not find the requested resource")
            doc = self._openapi_document(group, version)
            if doc is None:
                raise _error(404, "NotFound", "the server could not find the requested resource")
            return self._json(doc)
        paths: JSON = {}
        for group, versions in self._groups().items():
            for version in versions:
                doc = self._openapi_document(group, version)
                gv = f"apis/{group}/{version}" if group else f"api/{version}"
                digest = uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(doc, sort_keys=True)).hex
                paths[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest.upper()}"}
        return self._json({"paths": paths})

    # --- resource requests -------------------------------------------------------------------

    def _lookup(self, group: str, version: str, plural: str) -> Resource:
        res = self._registry.get((group, plural))
        if res is None or version not in res.versions:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        return res

    def _body(self, request: kmock.Request, *, yaml_ok: bool = False) -> Any:
        if not request.body:
            return None
        if request.headers.get("Content-Type", "").startswith(
            "application/vnd.kubernetes.protobuf"
        ):
            try:
                return decode_protobuf(request.body)
            except LookupError as e:
                raise _error(
                    415,
                    "UnsupportedMediaType",
                    f"this test server decodes protobuf bodies of Namespace, ConfigMap and Secret "
                    f"only, not {e.args[0]!r}: use JSON (e.g. kubectl apply/create -f)",
                ) from None
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                raise _bad_request(f"invalid protobuf body: {e}") from None
        try:
            return json.loads(request.body)
        except ValueError:
            if yaml_ok:
                try:
                    return yaml.safe_load(request.body)
                except yaml.YAMLError as e:
                    raise _bad_request(f"invalid YAML: {e}") from None
            raise _bad_request("the request body is not valid JSON") from None

    async def _serve_resource_request(self, request: kmock.Request) -> kmock.Response:
        # NB: no awaits here; every mutation below is atomic within the event loop.
        ref = request.resource
        assert ref is not None and ref.group is not None and ref.version is not None
        assert ref.plural is not None
        res = self._lookup(ref.group, ref.version, ref.plural)
        version = ref.version
        ns, name, sub = request.namespace, request.name, request.subresource
        params = request.params
        method = str(request.method.value).upper()
        dry_run = "All" in (params.get("dryRun") or "").split(",")
        self._field_validation = params.get("fieldValidation") or "Warn"  # the server's default
        self._warnings = []
        if ns is not None and not res.namespaced:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        if name is not None and res.namespaced and ns is None:
            raise _error(404, "NotFound", "the server could not find the requested resource")
        if sub is not None and not (sub == "status" and res.status):
            if sub == "scale" and res.scale and name is not None:
                return self._serve_scale(request, res, ns, name, dry_run)
            raise _error(404, "NotFound", "the server could not find the requested resource")
        table = "as=Table" in request.headers.get("Accept", "")
        include = params.get("includeObject", "Metadata")

        if method == "GET" and params.get("watch", "").lower() in ("true", "1"):
            return self._start_watch(res, version, ns, name, params, table, include)
        if method == "GET" and name is None:
            items = self._select(res, ns, params)
            rv = str(self._rv)
            if table:
                objs = [self._versioned(res, version, o) for o in items]
                return self._json(make_table(res, version, objs, rv, include))
            return self._json(
                {
                    "kind": res.list_kind,
                    "apiVersion": res.api_version(version),
                    "metadata": {"resourceVersion": rv},
                    "items": [self._versioned(res, version, o) for o in items],
                }
            )
        if method == "GET":
            assert name is not None
            obj = self._versioned(res, version, self._get(res, ns, name))
            if table:
                return self._json(make_table(res, version, [obj], str(self._rv), include))
            return self._json(obj)
        if method == "POST" and name is None:
            body = self._body(request)
            created = self._create_object(res, version, ns, body, dry_run=dry_run)
            return self._written(self._versioned(res, version, created), 201)
        if method == "PUT" and name is not None:
            body = self._body(request)
            updated = self._replace(res, ns, name, body, sub, dry_run=dry_run)
            return self._written(self._versioned(res, version, updated))
        if method == "PATCH" and name is not None:
            content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
            body = self._body(request, yaml_ok=content_type == "application/apply-patch+yaml")
            status, patched = self._patch(
                res, version, ns, name, sub, content_type, body, dry_run=dry_run
            )
            return self._written(self._versioned(res, version, patched), status)
        if method == "DELETE" and name is not None and sub is None:
            options = self._body(request) or {}
            if not isinstance(options, dict):
                raise _bad_request("DeleteOptions must be an object")
            policy = options.get("propagationPolicy") or params.get("propagationPolicy")
            if options.get("orphanDependents") is True or params.get("orphanDependents") == "true":
                policy = "Orphan"
            dry_run = dry_run or "All" in (options.get("dryRun") or [])
            obj = self._get(res, ns, name)
            self._check_preconditions(res, name, obj, options.get("preconditions") or {})
            if dry_run:
                return self._json(self._versioned(res, version, obj))
            result, gone = self._delete(res, obj, policy or "Background")
            if gone and res.key in STATUS_ON_DELETE:
                meta = _meta(result)
                details = {**_details(res, name), "uid": meta.get("uid")}
                return self._json(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": details,
                    }
                )
            return self._json(self._versioned(res, version, result))
        if method == "DELETE" and name is None:
            options = self._body(request) or {}
            policy = (options.get("propagationPolicy") if isinstance(options, dict) else None) or (
                params.get("propagationPolicy") or "Background"
            )
            items = self._select(res, ns, params)
            deleted = [] if dry_run else [self._delete(res, o, policy)[0] for o in items]
            return self._json(
                {
                    "kind": res.list_kind,
                    "apiVersion": res.api_version(version),
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": [
                        self._versioned(res, version, o) for o in (items if dry_run else deleted)
                    ],
                }
            )
        raise _error(
            405,
            "MethodNotAllowed",
            f"the server does not allow this method on {res.group_resource}",
        )

    def _scale_of(self, res: Resource, obj: JSON) -> JSON:
        assert res.scale is not None
        meta = _meta(obj)
        spec = jsonpath(obj, res.scale["specReplicasPath"])
        status = jsonpath(obj, res.scale.get("statusReplicasPath", ".status.replicas"))
        scale: JSON = {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": int(spec[0]) if spec else 0},
            "status": {"replicas": int(status[0]) if status else 0},
        }
        return scale

    def _serve_scale(
        self, request: kmock.Request, res: Resource, ns: str | None, name: str, dry_run: bool
    ) -> kmock.Response:
        """The ``scale`` subresource: ``autoscaling/v1`` Scale objects over the replica count."""
        assert res.scale is not None
        obj = self._get(res, ns, name)
        current = self._scale_of(res, obj)
        method = str(request.method.value).upper()
        if method == "GET":
            return self._json(current)
        body = self._body(request)
        content_type = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        try:
            if method == "PUT":
                wanted = body
            elif content_type == "application/json-patch+json":
                wanted = json_patch(current, body)
            elif content_type in (
                "application/merge-patch+json",
                "application/strategic-merge-patch+json",
            ):
                wanted = merge_patch(current, body)
            else:
                raise _error(
                    415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
                )
        except TypeError as e:
            raise _bad_request(str(e)) from None
        except PatchError as e:
            raise _error(422, "Invalid", str(e)) from None
        if method not in ("PUT", "PATCH") or not isinstance(wanted, dict):
            raise _error(405, "MethodNotAllowed", "the scale subresource takes GET, PUT and PATCH")
        rv = _meta(wanted).get("resourceVersion")
        if rv and rv != _meta(obj).get("resourceVersion"):
            raise _conflict(res, name, STALE)
        replicas = (wanted.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise _invalid(res, name, "spec.replicas", "must be a non-negative integer")
        new = copy.deepcopy(obj)
        target: Any = new
        keys = [k for k in res.scale["specReplicasPath"].split(".") if k]
        for key in keys[:-1]:
            target = target.setdefault(key, {})
        target[keys[-1]] = replicas
        return self._json(self._scale_of(res, self._update(res, obj, new, None, dry_run=dry_run)))

    # --- store -------------------------------------------------------------------------------

    @staticmethod
    def _versioned(res: Resource, version: str, obj: JSON) -> JSON:
        api_version = res.api_version(version)
        return obj if obj.get("apiVersion") == api_version else {**obj, "apiVersion": api_version}

    def _get(self, res: Resource, ns: str | None, name: str) -> JSON:
        obj = self._store.get(res.key, {}).get((ns or "", name))
        if obj is None:
            raise _not_found(res, name)
        return obj

    @staticmethod
    def _field_selector(res: Resource, text: str | None) -> list[FieldRequirement]:
        fields = parse_field_selector(text)
        if res.selectable is not None:
            allowed = {("metadata", "name"), ("metadata", "namespace")}
            allowed |= {tuple(path.split(".")) for path in res.selectable}
            for f in fields:
                if f.path not in allowed:
                    raise _bad_request(
                        f"field label not supported: {'.'.join(f.path)} for {res.group_resource}"
                    )
        return fields

    def _select(self, res: Resource, ns: str | None, params: Any) -> list[JSON]:
        labels = parse_label_selector(params.get("labelSelector"))
        fields = self._field_selector(res, params.get("fieldSelector"))
        items = []
        for (obj_ns, _), obj in sorted(self._store.get(res.key, {}).items()):
            if ns is not None and obj_ns != ns:
                continue
            obj_labels = _meta(obj).get("labels") or {}
            if all(r(obj_labels) for r in labels) and all(r(obj) for r in fields):
                items.append(obj)
        return items

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, res: Resource, kind: str, obj: JSON, prev: JSON | None) -> None:
        event = StoredEvent(int(_meta(obj)["resourceVersion"]), res.key, kind, obj, prev)
        if len(self._history) == self._history.maxlen:
            self._history_floor = self._history[0].rv
        self._history.append(event)
        for watch in list(self._watches):
            if watch.key == res.key:
                watch.offer(event)

    def _check_namespace(self, res: Resource, ns: str) -> None:
        namespace = self._store[NAMESPACE_KEY].get(("", ns))
        if namespace is None:
            raise _error(
                404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
            )
        if _meta(namespace).get("deletionTimestamp"):
            raise _error(
                403,
                "Forbidden",
                f"{res.group_resource} is forbidden: unable to create new content in namespace "
                f"{ns} because it is being terminated",
                {"name": ns, "kind": "namespaces"},
            )

    def _create_object(
        self, res: Resource, version: str, ns: str | None, body: Any, *, dry_run: bool = False
    ) -> JSON:
        if not isinstance(body, dict):
            raise _bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(body)
        if obj.get("kind") not in (None, "", res.kind):
            raise _bad_request(f"the kind {obj.get('kind')!r} does not match {res.kind!r}")
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if res.namespaced:
            body_ns = meta.get("namespace")
            if ns is not None and body_ns and body_ns != ns:
                raise _bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request"
                )
            ns = ns or body_ns
            if not ns:
                raise _bad_request("a namespace is required to create a namespaced object")
            meta["namespace"] = ns
            self._check_namespace(res, ns)
        else:
            meta.pop("namespace", None)
            ns = None
        store = self._store[res.key]
        name = meta.get("name")
        if not name and meta.get("generateName"):
            for _ in range(100):
                name = str(meta["generateName"]) + "".join(random.choices(_NAME_CHARS, k=5))
                if (ns or "", name) not in store:
                    break
        if not name or not isinstance(name, str):
            raise _invalid(res, "", "metadata.name", "name or generateName is required")
        if "/" in name or len(name) > 253:
            raise _invalid(res, name, "metadata.name", f"invalid name {name!r}")
        meta["name"] = name
        if (ns or "", name) in store:
            message = f'{res.group_resource} "{name}" already exists'
            raise _error(409, "AlreadyExists", message, _details(res, name))
        for key in (
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "selfLink",
        ):
            meta.pop(key, None)
        obj["apiVersion"] = res.api_version(res.versions[0])
        obj["kind"] = res.kind
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if res.status:
            obj.pop("status", None)
        if res.schema is not None:
            obj = self._prune_and_default(res, obj)
            meta = obj["metadata"]
        self._defaults(res, obj)
        _normalize_meta(meta)
        if res.crd is not None:
            self._validate_custom(res, obj, None)
        if dry_run:
            return obj
        meta["resourceVersion"] = self._next_rv()
        store[(ns or "", name)] = obj
        self._uids.add(meta["uid"])
        self._emit(res, "ADDED", obj, None)
        if res.key == CRD_KEY:
            self._register_crd(obj)
        self._collect_if_orphaned(res, obj)
        return obj

    def _prune_and_default(self, res: Resource, obj: JSON) -> JSON:
        """The object pruned and defaulted by its CRD's schema; unknown fields are refused
        (``fieldValidation=Strict``), warned about (``Warn``, the default) or not (``Ignore``)."""
        unknown: list[str] = []
        out = apply_schema(obj, res.schema, root=True, unknown=unknown)
        if unknown and self._field_validation == "Strict":
            raise _unknown_fields(res, res.versions[0], unknown)
        if self._field_validation == "Warn":
            self._warnings += [f'unknown field "{f}"' for f in unknown]
        return out

    @staticmethod
    def _validate_custom(res: Resource, obj: JSON, old: JSON | None) -> None:
        """Refuse (422 Invalid) what kube-apiserver would: a name that is no DNS subdomain, and
        anything the CRD's schema or CEL rules refuse (:func:`crdschema.validate`)."""
        name = _meta(obj).get("name", "")
        errors = name_errors(name) if old is None else []
        if res.schema is not None:
            errors += validate(obj, old, res.schema)
        if errors:
            raise _refused(res, name, errors)

    def _defaults(self, res: Resource, obj: JSON) -> None:
        meta = obj["metadata"]
        if res.key == NAMESPACE_KEY:
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
            obj["status"] = {"phase": "Terminating" if meta.get("deletionTimestamp") else "Active"}
        elif res.key == ("", "pods") and "status" not in obj:
            obj["status"] = {"phase": "Pending"}
        elif res.key == CRD_KEY:
            obj["status"] = self._crd_status(res, obj)
        self._normalize(res, obj)

    @staticmethod
    def _normalize(res: Resource, obj: JSON) -> None:
        """Server-side conversions on every write (Secrets: ``stringData`` into ``data``)."""
        if res.key == ("", "secrets"):
            strings = obj.pop("stringData", None) or {}
            if strings:
                data = obj.setdefault("data", {})
                for key, value in strings.items():
                    data[key] = base64.b64encode(str(value).encode()).decode()
            obj.setdefault("type", "Opaque")

    def _replace(
        self,
        res: Resource,
        ns: str | None,
        name: str,
        body: Any,
        sub: str | None,
        *,
        dry_run: bool = False,
    ) -> JSON:
        if not isinstance(body, dict):
            raise _bad_request("the request body must be a JSON object")
        old = self._get(res, ns, name)
        meta = _meta(body)
        if meta.get("name") not in (None, name):
            raise _bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL "
                f"({name})"
            )
        rv = meta.get("resourceVersion")
        if rv and rv != _meta(old)["resourceVersion"]:
            raise _conflict(res, name, STALE)
        return self._update(res, old, copy.deepcopy(body), sub, dry_run=dry_run)

    def _patch(
        self,
        res: Resource,
        version: str,
        ns: str | None,
        name: str,
        sub: str | None,
        content_type: str,
        body: Any,
        *,
        dry_run: bool = False,
    ) -> tuple[int, JSON]:
        key = (ns or "", name)
        old = self._store[res.key].get(key)
        if content_type == "application/apply-patch+yaml":
            if not isinstance(body, dict):
                raise _bad_request("an apply patch must be an object")
            if old is None:
                if sub is not None:
                    raise _not_found(res, name)
                created = self._create_object(
                    res,
                    version,
                    ns,
                    {**body, "metadata": {**_meta(body), "name": name}},
                    dry_run=dry_run,
                )
                return 201, created
            apply = strategic_merge_patch if res.crd is None else merge_patch
            patched = apply(old, body)
        else:
            if old is None:
                raise _not_found(res, name)
            try:
                if content_type == "application/merge-patch+json":
                    if not isinstance(body, dict):
                        raise TypeError("a merge patch must be a JSON object")
                    patched = merge_patch(old, body)
                elif content_type == "application/json-patch+json":
                    patched = json_patch(old, body)
                elif content_type == "application/strategic-merge-patch+json":
                    if res.crd is not None:
                        raise _error(
                            415,
                            "UnsupportedMediaType",
                            "the body of the request was in an unknown format - accepted media "
                            "types include: application/json-patch+json, "
                            "application/merge-patch+json, application/apply-patch+yaml",
                        )
                    if not isinstance(body, dict):
                        raise TypeError("a strategic merge patch must be a JSON object")
                    patched = strategic_merge_patch(old, body)
                else:
                    raise _error(
                        415,
                        "UnsupportedMediaType",
                        f"the body of the request was in an unknown format: {content_type!r}",
                    )
            except TypeError as e:
                raise _bad_request(str(e)) from None
            except PatchError as e:
                raise _error(422, "Invalid", str(e)) from None
        if not isinstance(patched, dict):
            raise _bad_request("the patched object is not a JSON object")
        patched_meta = _meta(patched)
        if patched_meta.get("name", name) != name:
            raise _bad_request("the name of the patched object does not match the name on the URL")
        rv = patched_meta.get("resourceVersion")
        if rv and rv != _meta(old)["resourceVersion"]:
            raise _conflict(res, name, STALE)
        return 200, self._update(res, old, patched, sub, dry_run=dry_run)

    def _update(
        self, res: Resource, old: JSON, new: JSON, sub: str | None, *, dry_run: bool = False
    ) -> JSON:
        """Store ``new`` in place of ``old`` with the server-side rules; return what is stored."""
        old_meta = old["metadata"]
        if sub == "status":  # only the status changes via the status subresource
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        elif res.status:  # and never via the main resource
            new.pop("status", None)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        for key in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "resourceVersion",
        ):
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        meta.pop("selfLink", None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        _normalize_meta(meta)
        name = meta["name"]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers", [])) - set(old_meta.get("finalizers", []))
            if added:
                raise _invalid(
                    res,
                    name,
                    "metadata.finalizers",
                    "Forbidden: no new finalizers can be added if the object is being deleted",
                )
        if res.schema is not None:
            new = self._prune_and_default(res, new)
            meta = new["metadata"]
        if res.key == NAMESPACE_KEY:
            self._defaults(res, new)
        self._normalize(res, new)
        if res.key == CRD_KEY:
            self._validate_crd(new)
            # Status is the server's: an update (a PUT without it, too) keeps what it recorded.
            new["status"] = self._crd_status(res, {**new, "status": old.get("status")})
        if res.crd is not None:
            self._validate_custom(res, new, old)
        ignored = ("metadata", "status") if res.status else ("metadata",)
        if _without(old, ignored) != _without(new, ignored):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if new == old or dry_run:
            return old if new == old else new
        meta["resourceVersion"] = self._next_rv()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(res, new, old, "Background", bump=False)
            return new
        self._store[res.key][(meta.get("namespace") or "", name)] = new
        self._emit(res, "MODIFIED", new, old)
        if res.key == CRD_KEY:
            self._register_crd(new)
        self._collect_if_orphaned(res, new)
        return new

    @staticmethod
    def _check_preconditions(res: Resource, name: str, obj: JSON, pre: JSON) -> None:
        meta = _meta(obj)
        if pre.get("uid") and pre["uid"] != meta.get("uid"):
            raise _conflict(
                res,
                name,
                f"Precondition failed: UID in precondition: {pre['uid']}, "
                f"UID in object meta: {meta.get('uid')}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta.get("resourceVersion"):
            raise _conflict(res, name, STALE)

    def _delete(self, res: Resource, obj: JSON, policy: str) -> tuple[JSON, bool]:
        """Delete now, or mark for deletion when finalizers (or namespace content) block it.

        Returns the resulting object and whether it is gone.
        """
        meta = obj["metadata"]
        ns, name = meta.get("namespace") or "", meta["name"]
        if self._store.get(res.key, {}).get((ns, name)) is not obj:
            return obj, True  # already gone (e.g. collected in a cascade)
        if meta.get("deletionTimestamp"):
            return obj, False
        if meta.get("finalizers") or res.key == NAMESPACE_KEY:
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            # As kube-apiserver: marking an object for deletion changes what its controllers
            # should do, so its generation moves on (a status "for its generation" is stale).
            if new["metadata"].get("generation"):
                new["metadata"]["generation"] += 1
            if res.key == NAMESPACE_KEY:
                new["status"] = {**(new.get("status") or {}), "phase": "Terminating"}
            new["metadata"]["resourceVersion"] = self._next_rv()
            self._store[res.key][(ns, name)] = new
            self._emit(res, "MODIFIED", new, obj)
            if res.key == NAMESPACE_KEY:
                self._empty_namespace(name)
                self._finish_namespace(name)
                current = self._store[res.key].get((ns, name))
                return (current, False) if current is not None else (new, True)
            return new, False
        return self._remove(res, obj, obj, policy), True

    def _remove(
        self, res: Resource, obj: JSON, prev: JSON, policy: str, *, bump: bool = True
    ) -> JSON:
        """Take the object out of the store, tell the watchers, collect its dependents."""
        meta = obj["metadata"]
        ns, name = meta.get("namespace") or "", meta["name"]
        self._store.get(res.key, {}).pop((ns, name), None)
        self._uids.discard(meta.get("uid", ""))
        if bump:
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = self._next_rv()
        self._emit(res, "DELETED", obj, prev)
        if res.key == CRD_KEY:
            self._unregister_crd(obj)
        self._collect_garbage(res, obj, policy)
        if res.namespaced and ns:
            self._finish_namespace(ns)
        return obj

    def _collect_if_orphaned(self, res: Resource, obj: JSON) -> None:
        """Delete an object all of whose owners are gone, as the garbage collector would.

        An owner can go between a controller's read of it and its write of a dependent (a
        reconcile racing the owner's deletion); the cascade at the owner's deletion cannot see
        that dependent, so a real cluster's garbage collector finds it by its dangling owner
        references. Here that happens at once, so nothing waits on a collector's timing.
        """
        refs = [r for r in _meta(obj).get("ownerReferences") or [] if isinstance(r, dict)]
        if refs and not any(r.get("uid") in self._uids for r in refs):
            self._delete(res, obj, "Background")

    def _collect_garbage(self, owner_res: Resource, owner: JSON, policy: str) -> None:
        uid = _meta(owner).get("uid")
        owner_ns = _meta(owner).get("namespace")
        for res in list(self._registry.values()):
            for dep in list(self._store.get(res.key, {}).values()):
                dep_meta = _meta(dep)
                refs = dep_meta.get("ownerReferences") or []
                if not any(isinstance(r, dict) and r.get("uid") == uid for r in refs):
                    continue
                if owner_res.namespaced and dep_meta.get("namespace") != owner_ns:
                    continue
                current = self._store.get(res.key, {}).get(
                    (dep_meta.get("namespace") or "", dep_meta["name"])
                )
                if current is not dep:
                    continue
                alive = [r for r in refs if r.get("uid") != uid and r.get("uid") in self._uids]
                if policy == "Orphan" or alive:
                    new = copy.deepcopy(dep)
                    new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != uid]
                    self._update(res, dep, new, None)
                else:
                    self._delete(res, dep, "Background")

    def _empty_namespace(self, ns: str) -> None:
        for res in list(self._registry.values()):
            if not res.namespaced:
                continue
            for (obj_ns, _), obj in list(self._store.get(res.key, {}).items()):
                if obj_ns == ns:
                    self._delete(res, obj, "Background")

    def _finish_namespace(self, ns: str) -> None:
        """Remove a terminating namespace once nothing is left in it."""
        namespace = self._store[NAMESPACE_KEY].get(("", ns))
        if namespace is None:
            return
        meta = _meta(namespace)
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return
        for key, objs in self._store.items():
            if self._registry[key].namespaced and any(obj_ns == ns for obj_ns, _ in objs):
                return
        self._remove(self._registry[NAMESPACE_KEY], namespace, namespace, "Background")

    # --- CustomResourceDefinitions -----------------------------------------------------------

    def _validate_crd(self, crd: JSON) -> JSON:
        res = self._registry[CRD_KEY]
        name = _meta(crd).get("name", "")
        spec = crd.get("spec")
        if not isinstance(spec, dict):
            raise _invalid(res, name, "spec", "spec is required")
        names = spec.get("names") or {}
        group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
        if not group or not plural or not kind:
            raise _invalid(res, name, "spec", "spec.group, spec.names.plural and kind are required")
        if name != f"{plural}.{group}":
            raise _invalid(
                res,
                name,
                "metadata.name",
                f'must be spec.names.plural+"."+spec.group: "{plural}.{group}"',
            )
        if spec.get("scope") not in ("Namespaced", "Cluster"):
            raise _invalid(res, name, "spec.scope", "must be Namespaced or Cluster")
        versions = [v for v in spec.get("versions") or [] if isinstance(v, dict) and v.get("name")]
        if not versions:
            raise _invalid(res, name, "spec.versions", "must have at least one version")
        if sum(bool(v.get("storage")) for v in versions) != 1:
            raise _invalid(
                res, name, "spec.versions", "exactly one version must be the storage version"
            )
        problems = [
            problem
            for i, v in enumerate(versions)
            if isinstance((v.get("schema") or {}).get("openAPIV3Schema"), dict)
            for problem in rule_problems(
                v["schema"]["openAPIV3Schema"], f"spec.versions[{i}].schema.openAPIV3Schema"
            )
        ]
        if problems:
            raise _refused(res, name, problems)
        taken = self._registry.get((group, plural))
        if taken is not None and taken.crd != name:
            raise _invalid(res, name, "spec.names.plural", f"{plural}.{group} is already served")
        return spec

    def _crd_status(self, res: Resource, crd: JSON) -> JSON:
        spec = self._validate_crd(crd)
        names = dict(spec["names"])
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", f"{names['kind']}List")
        storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
        old = crd.get("status") or {}
        stored = list(old.get("storedVersions") or [])
        # A version objects may still be stored in cannot go until they are migrated and the
        # status says so (kube-apiserver refuses the update the same way).
        declared = {v["name"] for v in spec["versions"]}
        gone = [
            FieldError(
                "FieldValueInvalid",
                f"status.storedVersions[{i}]",
                v,
                "must appear in spec.versions",
            )
            for i, v in enumerate(stored)
            if v not in declared
        ]
        if gone:
            raise _refused(res, _meta(crd).get("name", ""), gone)
        if storage not in stored:
            stored.append(storage)
        since = {
            c.get("type"): c.get("lastTransitionTime")
            for c in old.get("conditions") or []
            if isinstance(c, dict) and c.get("status") == "True"
        }
        conditions = [
            ("NamesAccepted", "NoConflicts", "no conflicts found"),
            ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        ]
        return {
            "conditions": [
                {
                    "type": kind,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": since.get(kind) or _now(),
                }
                for kind, reason, message in conditions
            ],
            "acceptedNames": names,
            "storedVersions": stored,
        }

    def _register_crd(self, crd: JSON) -> None:
        spec = crd["spec"]
        names = spec["names"]
        served = [v for v in spec["versions"] if v.get("served", True)]
        versions = sorted((v["name"] for v in served), key=_version_priority)
        res = Resource(
            group=spec["group"],
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec["scope"] == "Namespaced",
            versions=versions,
            singular=names.get("singular") or names["kind"].lower(),
            short_names=list(names.get("shortNames") or []),
            categories=list(names.get("categories") or []),
            status=any("status" in (v.get("subresources") or {}) for v in served),
            scale=next(
                (
                    v["subresources"]["scale"]
                    for v in served
                    if isinstance((v.get("subresources") or {}).get("scale"), dict)
                ),
                None,
            ),
            columns={v["name"]: list(v.get("additionalPrinterColumns") or []) for v in served},
            schema=next(
                (
                    v["schema"]["openAPIV3Schema"]
                    for v in sorted(served, key=lambda v: _version_priority(v["name"]))
                    if isinstance((v.get("schema") or {}).get("openAPIV3Schema"), dict)
                ),
                None,
            ),
            list_kind=names.get("listKind") or "",
            crd=_meta(crd)["name"],
            # Of the preferred version (the one a selector is evaluated against here).
            selectable=frozenset(
                str(f.get("jsonPath", "")).lstrip(".")
                for v in served
                if v["name"] == (versions[0] if versions else None)
                for f in v.get("selectableFields") or []
            ),
        )
        if not versions:
            self._unregister(res.key)
            return
        self._register(res)

    def _unregister_crd(self, crd: JSON) -> None:
        spec = crd.get("spec") or {}
        key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        res = self._registry.get(key)
        if res is None or res.crd != _meta(crd).get("name"):
            return
        for obj in list(self._store.get(key, {}).values()):  # the custom objects go with it
            self._remove(res, obj, obj, "Background")
        self._unregister(key)

    # --- watches -----------------------------------------------------------------------------

    def _start_watch(
        self,
        res: Resource,
        version: str,
        ns: str | None,
        name: str | None,
        params: Any,
        table: bool,
        include: str,
    ) -> kmock.Response:
        watch = Watch(
            key=res.key,
            namespace=ns,
            name=name,
            labels=parse_label_selector(params.get("labelSelector")),
            fields=self._field_selector(res, params.get("fieldSelector")),
        )
        since_text = params.get("resourceVersion") or ""
        initial_events = params.get("sendInitialEvents", "").lower() == "true"
        try:
            since = int(since_text) if since_text else 0
        except ValueError:
            raise _bad_request(f"invalid resourceVersion {since_text!r}") from None
        timeout: float | None = None
        if params.get("timeoutSeconds"):
            try:
                timeout = float(params["timeoutSeconds"])
            except ValueError:
                raise _bad_request("invalid timeoutSeconds") from None

        first: list[tuple[str, JSON]] = []
        expired = False
        if since == 0 or initial_events:
            # No resourceVersion ("0" too): the current state as ADDED events, then live changes.
            first = [
                ("ADDED", o) for o in self._store.get(res.key, {}).values() if watch.matches(o)
            ]
            first.sort(key=lambda e: int(_meta(e[1])["resourceVersion"]))
        elif since < self._history_floor:
            expired = True
        else:
            for event in self._history:
                if event.rv > since and event.key == res.key:
                    seen = watch.translate(event)
                    if seen is not None:
                        first.append(seen)
        if not expired:
            self._watches.add(watch)  # in the same step as the snapshot: nothing is lost
        wants_bookmark = params.get("allowWatchBookmarks", "").lower() == "true"
        bookmark = str(self._rv) if initial_events and wants_bookmark else None
        stream = self._stream_watch(
            watch, res, version, first, expired, bookmark, timeout, table, include, wants_bookmark
        )
        return kmock.Response(
            status=200,
            headers={"Content-Type": "application/json"},
            payload=stream,
        )

    async def _stream_watch(
        self,
        watch: Watch,
        res: Resource,
        version: str,
        first: list[tuple[str, JSON]],
        expired: bool,
        bookmark: str | None,  # the snapshot's resourceVersion, for the initial-events bookmark
        timeout: float | None,
        table: bool,
        include: str,
        bookmarks: bool = False,  # periodic BOOKMARK events (allowWatchBookmarks=true)
    ) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def next_bookmark(now: float) -> float | None:
            """When the next periodic bookmark is due: a minute on, or just before the timeout
            if that comes first; None when that moment has passed already."""
            if not bookmarks:
                return None
            at = now + BOOKMARK_INTERVAL
            if deadline is not None:
                at = min(at, deadline - BOOKMARK_BEFORE_TIMEOUT)
            return at if at >= now else None

        def bookmark_event(rv: str, initial: bool = False) -> JSON:
            meta: JSON = {"resourceVersion": rv}
            if initial:
                meta["annotations"] = {"k8s.io/initial-events-end": "true"}
            return {
                "type": "BOOKMARK",
                "object": {
                    "kind": res.kind,
                    "apiVersion": res.api_version(version),
                    "metadata": meta,
                },
            }

        def render(kind: str, obj: JSON) -> JSON:
            obj = self._versioned(res, version, obj)
            if table:
                obj = make_table(
                    res, version, [obj], _meta(obj).get("resourceVersion", ""), include
                )
            return {"type": kind, "object": obj}

        try:
            yield b""  # send the headers now, even if no event comes for a long time
            if expired:
                message = "too old resource version"
                yield {"type": "ERROR", "object": _status_body(410, "Expired", message, None)}
                return
            for kind, obj in first:
                yield render(kind, obj)
            if bookmark is not None:
                yield bookmark_event(bookmark, initial=True)
            due = next_bookmark(loop.time())
            while True:
                now = loop.time()
                if deadline is not None and deadline - now <= 0:
                    return
                if due is not None and due <= now and watch.queue.empty():
                    # Only once every event queued so far is out: its resourceVersion is the
                    # newest the server has, so nothing the watch should show is skipped. Until
                    # then the bookmark stays due (the queued events go first).
                    yield bookmark_event(str(self._rv))
                    due = next_bookmark(now)
                    continue
                until = [t for t in (deadline, due) if t is not None and t > now]
                remaining = min(until) - now if until else None
                try:
                    item = await asyncio.wait_for(watch.queue.get(), remaining)
                except TimeoutError:
                    continue
                if item is None:
                    return
                yield render(*item)
        finally:
            watch.closed = True
            self._watches.discard(watch)

    def close_watches(self) -> None:
        for watch in list(self._watches):
            watch.close()


# --------------------------------------------------------------------------------------------
# The server process and its controller
# --------------------------------------------------------------------------------------------

TESTKIT_DIR = pathlib.Path(__file__).resolve().parents[1]


async def serve(
    port: int,
    kubeconfig: str | None = None,
    ready: asyncio.Event | None = None,
    audit_log: str | None = None,
) -> None:
    """Serve on 127.0.0.1:``port`` until SIGTERM/SIGINT (or cancellation)."""
    emulator = KubeEmulator()
    if audit_log:
        emulator.audit_to(audit_log)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stopping.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    async with emulator, kmock.Server(emulator, host="127.0.0.1", port=port) as server:
        emulator.server_address = f"127.0.0.1:{server.port}"
        url = f"http://127.0.0.1:{server.port}"
        if kubeconfig:
            write_kubeconfig(url, kubeconfig)
        print(f"zarrlake kubeapi serving on {url}", flush=True)
        if ready is not None:
            ready.set()
        try:
            await stopping.wait()
        finally:
            emulator.close_watches()
            await asyncio.sleep(0.05)  # let the watch streams end before the server closes


def kubeconfig_text(
    url: str, namespace: str = "default", token: str = "zarrlake-test-token"
) -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubeapi", "cluster": {"server": url}}],
        "users": [{"name": "kubeapi", "user": {"token": token}}],
        "contexts": [
            {
                "name": "kubeapi",
                "context": {"cluster": "kubeapi", "user": "kubeapi", "namespace": namespace},
            }
        ],
        "current-context": "kubeapi",
        "preferences": {},
    }
    return yaml.safe_dump(config, sort_keys=False)


def write_kubeconfig(
    url: str, path: str | os.PathLike[str], token: str = "zarrlake-test-token"
) -> pathlib.Path:
    """A kubeconfig for ``url``; the ``token`` is the user an audit log records."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(kubeconfig_text(url, token=token))
    return target


class KubeAPI:
    """Run the emulator in a child process on 127.0.0.1; stop it by pid."""

    def __init__(
        self, port: int | None = None, audit_log: str | os.PathLike[str] | None = None
    ) -> None:
        self.port = port or 0  # 0: a free one, chosen at start
        self.proc: subprocess.Popen[bytes] | None = None
        #: Where the server appends one JSON line per request (see ``KubeEmulator.audit_to``).
        self.audit_log = pathlib.Path(audit_log) if audit_log else None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> KubeAPI:
        if self.proc is not None and self.proc.poll() is None:
            return self
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(TESTKIT_DIR), env.get("PYTHONPATH", "")) if p
        )

        def command(port: int) -> list[str]:
            cmd = [sys.executable, "-m", "zarrlake_testkit.kubeapi", "--port", str(port)]
            if self.audit_log is not None:
                cmd += ["--audit-log", str(self.audit_log)]
            return cmd

        if self.port:
            self.proc = subprocess.Popen(command(self.port), env=env, stdout=subprocess.DEVNULL)
        else:
            self.proc, self.port = spawn_on_free_port(
                command, 60, env=env, stdout=subprocess.DEVNULL
            )
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no *_proxy
        try:
            deadline = time.monotonic() + 60
            wait_for_port(self.port, 60, self.proc)
            while True:
                try:
                    with direct.open(f"{self.url}/version", timeout=5) as rsp:
                        if rsp.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the kube API on {self.url} did not start") from None
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def write_kubeconfig(
        self, path: str | os.PathLike[str], token: str = "zarrlake-test-token"
    ) -> pathlib.Path:
        return write_kubeconfig(self.url, path, token)

    def audit(self) -> list[dict[str, Any]]:
        """The requests received so far (needs ``audit_log``), oldest first."""
        if self.audit_log is None or not self.audit_log.exists():
            return []
        lines = self.audit_log.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def __enter__(self) -> KubeAPI:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zarrlake_testkit.kubeapi",
        description="A small Kubernetes API server for tests (KMock-based), on 127.0.0.1.",
    )
    parser.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    parser.add_argument("--kubeconfig", default=None, help="also write a kubeconfig to this path")
    parser.add_argument(
        "--audit-log", default=None, help="append one JSON line per request received to this file"
    )
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port or free_port(), args.kubeconfig, audit_log=args.audit_log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
