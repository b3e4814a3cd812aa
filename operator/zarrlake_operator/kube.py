"""Kubernetes I/O at the edge: get, list, apply, delete and status patches, as plain dicts.

Every object kind the operator touches is one row of :data:`KINDS`; the generic REST calls go
through the ``kubernetes`` client's ``ApiClient`` (authentication, TLS, retries), and bodies stay
dicts so the pure functions in :mod:`zarrlake_operator.desired` can build and compare them.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from zarrlake.k8s import SecretReader, secret_reader
from zarrlake_operator.desired import SPARK_API_VERSION, drifted
from zarrlake_operator.models import GROUP, VERSION

KINDS: dict[str, str] = {
    "Namespace": "/api/v1/namespaces",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "Service": "/api/v1/namespaces/{ns}/services",
    "Pod": "/api/v1/namespaces/{ns}/pods",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "PersistentVolumeClaim": "/api/v1/namespaces/{ns}/persistentvolumeclaims",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "CronJob": "/apis/batch/v1/namespaces/{ns}/cronjobs",
    "Job": "/apis/batch/v1/namespaces/{ns}/jobs",
    "Repository": f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/repositories",
    "Branch": f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/branches",
    "Tag": f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/tags",
    "RetentionPolicy": f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/retentionpolicies",
    "Mirror": f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/mirrors",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "Lease": "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases",
    # The Kubeflow Spark operator's, when it is installed (see served()).
    "ScheduledSparkApplication": f"/apis/{SPARK_API_VERSION}/namespaces/{{ns}}/"
    "scheduledsparkapplications",
}

_lock = threading.Lock()
_client: Any = None

#: Called with (verb, resource) for every request, e.g. ``("PATCH", "repositories/status")``.
observers: list[Callable[[str, str], None]] = []


def _resource(path: str) -> str:
    """The resource a request path names: its plural, and its subresource if any."""
    parts = path.strip("/").split("/")
    rest = parts[2:] if parts[0] == "api" else parts[3:]  # after /api/v1 or /apis/<g>/<v>
    if len(rest) > 2 and rest[0] == "namespaces":
        rest = rest[2:]
    if not rest:
        return "discovery"
    return rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")


class KubeError(Exception):
    """An API call failed; ``status`` is the HTTP status (0 when the server was unreachable)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def api_client() -> Any:
    """One ``ApiClient``: in-cluster credentials, else the kubeconfig."""
    global _client
    with _lock:
        if _client is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            _client = client.ApiClient()
        return _client


def use_kubeconfig(path: str) -> None:
    """Talk to the cluster of this kubeconfig from now on (tests, the e2e scenario)."""
    global _client
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=configuration)
    with _lock:
        _client = client.ApiClient(configuration)


def _call(
    method: str,
    path: str,
    *,
    body: Any = None,
    query: list[tuple[str, str]] | None = None,
    content_type: str = "application/json",
    timeout: float = 30,
) -> Any:
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    client = api_client()
    for observe in observers:
        observe(method, _resource(path))
    try:
        resp = client.call_api(
            path,
            method,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
            _request_timeout=timeout,
        )
    except (ApiException, HTTPError, OSError) as e:
        raise _failure(f"{method} {path}", e) from None
    data = resp.data
    return json.loads(data) if data else None


def request(method: str, path: str, *, body: Any = None, timeout: float = 30) -> Any:
    """One request by path, its answer parsed; :class:`KubeError` on failure (leader election's
    reads and writes of its Lease, which need a short timeout)."""
    return _call(method, path, body=body, timeout=timeout)


class WatchStream:
    """The events of one watch request (``?watch=true``), as the API server streams them: one
    JSON object per line, ``{"type": ..., "object": ...}``. One thread iterates; any other may
    :meth:`close` it, which ends a read that is waiting for the next event.

    An ``ERROR`` event (a ``Status``; 410 Gone when the resourceVersion is too old) is raised as
    :class:`KubeError` with its code; a broken or timed-out connection as a :class:`KubeError`
    with status 0. The iteration simply ends when the server ends the watch (its
    ``timeoutSeconds``) or after :meth:`close`."""

    def __init__(self, response: Any, what: str) -> None:
        self._response = response
        self._what = what
        self.closed = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from urllib3.exceptions import HTTPError

        response = self._response
        pending = b""
        try:
            if response.chunked:  # what API servers send: one chunk per event, as it happens
                chunks: Iterator[bytes] = response.read_chunked(None, decode_content=True)
            else:
                chunks = iter(lambda: bytes(response.read1(65536)), b"")
            for chunk in chunks:
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    if line.strip():
                        yield self._event(line)
            if pending.strip():
                yield self._event(pending)
        except (HTTPError, OSError, ValueError) as e:
            if not self.closed:
                raise KubeError(f"{self._what}: the watch broke: {e}") from None
        finally:
            self.close()

    def _event(self, line: bytes) -> dict[str, Any]:
        try:
            event = json.loads(line)
        except ValueError:
            raise KubeError(f"{self._what}: the API server sent a line that is not JSON") from None
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            raise KubeError(f"{self._what}: the API server sent a malformed watch event")
        if event.get("type") == "ERROR":
            status = event["object"]
            code = status.get("code")
            raise KubeError(
                f"{self._what}: {code} {status.get('message') or status.get('reason')}",
                code if isinstance(code, int) else 0,
            )
        return event

    def close(self) -> None:
        """End the stream (from any thread): a read waiting for the next event returns."""
        if self.closed:
            return
        self.closed = True
        if not self._response.closed:
            try:
                self._response.shutdown()  # unblocks a read in progress on another thread
            # AttributeError: urllib3 < 2.3; RuntimeError: the stream had ended; ValueError: the
            # connection broke and urllib3 released its socket already.
            except (AttributeError, OSError, RuntimeError, ValueError):
                pass
        self._response.close()


def watch(
    path: str,
    query: Mapping[str, str],
    *,
    timeout_seconds: float,
    read_timeout: float | None = None,
    connect_timeout: float = 10,
) -> WatchStream:
    """Open a watch on the collection at ``path`` (``query``: its ``fieldSelector``,
    ``resourceVersion``, ...). The server ends it after ``timeout_seconds``; a read waits at most
    ``read_timeout`` (default: that plus 30 s) for the next bytes."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    client = api_client()
    for observe in observers:
        observe("WATCH", _resource(path))
    params = [("watch", "true"), *query.items(), ("timeoutSeconds", str(int(timeout_seconds)))]
    limit = read_timeout if read_timeout is not None else timeout_seconds + 30
    try:
        response = client.call_api(
            path,
            "GET",
            query_params=params,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
            _request_timeout=(connect_timeout, limit),
        )
    except (ApiException, HTTPError, OSError) as e:
        raise _failure(f"WATCH {path}", e) from None
    return WatchStream(response, f"WATCH {path}")


def _failure(what: str, e: Exception) -> KubeError:
    """The :class:`KubeError` of a failed request: the API server's answer (its status and the
    message of its Status object), or that it could not be reached."""
    from kubernetes.client.exceptions import ApiException

    if not isinstance(e, ApiException):
        return KubeError(f"{what}: API server unreachable: {e}")
    reason = e.reason
    try:
        reason = json.loads(e.body).get("message") or reason
    except (TypeError, ValueError, AttributeError):
        pass
    return KubeError(f"{what}: {e.status} {reason}", e.status)


def _object(data: Any, what: str) -> dict[str, Any]:
    """An API answer that must be one object (JSON parsed, so anything is possible)."""
    if not isinstance(data, dict):
        raise KubeError(f"{what}: expected an object, the API server sent {type(data).__name__}")
    return data


def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    path = KINDS[kind].format(ns=namespace)  # cluster-scoped kinds have no {ns}
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def get(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object, or None when it does not exist."""
    path = _path(kind, namespace, name)
    try:
        return _object(_call("GET", path), f"GET {path}")
    except KubeError as e:
        if e.status == 404:
            return None
        raise


# -- a watch-fed cache --------------------------------------------------------------------------
# Every Branch, Tag, RetentionPolicy and Mirror reconcile looks its Repository up. The operator
# watches Repositories anyway (Kopf does), so their bodies are kept here as the watch delivers
# them, and those lookups cost no request; a miss (not seen yet) reads through. A watch can miss
# a deletion (a reconnect re-lists what exists, it never reports what went meanwhile), so an
# entry is trusted for CACHE_TTL_S after the watch or a read last confirmed it, then read again;
# a deletion leaves a tombstone, so a read that raced it cannot bring the object back.

CACHE_TTL_S = float(os.environ.get("ZARRLAKE_WATCH_CACHE_SECONDS", "300"))
_cache: dict[tuple[str, str, str], tuple[dict[str, Any], float]] = {}
_tombstones: dict[tuple[str, str, str], int] = {}
# (kind, namespace) -> names, and (kind, namespace, spec.repository) -> names: the objects of
# one kind in a namespace, or a Repository's dependents, without a scan of everything kept.
_in_namespace: dict[tuple[str, str], set[str]] = {}
_dependents: dict[tuple[str, str, str], set[str]] = {}
_cache_lock = threading.Lock()


def _named_repository(body: Mapping[str, Any]) -> str | None:
    spec = body.get("spec")
    repository = spec.get("repository") if isinstance(spec, Mapping) else None
    return repository if isinstance(repository, str) else None


def _drop(key: tuple[str, str, str]) -> None:
    """Forget a cached object and its places in the indexes (``_cache_lock`` held)."""
    found = _cache.pop(key, None)
    if found is None:
        return
    names = _in_namespace.get(key[:2])
    if names is not None:
        names.discard(key[2])
        if not names:
            del _in_namespace[key[:2]]
    repository = _named_repository(found[0])
    if repository is not None:
        names = _dependents.get((key[0], key[1], repository))
        if names is not None:
            names.discard(key[2])
            if not names:
                del _dependents[key[0], key[1], repository]


def _put(key: tuple[str, str, str], body: dict[str, Any]) -> None:
    """Keep ``body`` under ``key``, indexed by kind and namespace and by the Repository it names
    (``_cache_lock`` held)."""
    _drop(key)
    _cache[key] = (body, time.monotonic())
    _in_namespace.setdefault(key[:2], set()).add(key[2])
    repository = _named_repository(body)
    if repository is not None:
        _dependents.setdefault((key[0], key[1], repository), set()).add(key[2])


def remember(body: Mapping[str, Any], kind: str, *, deleted: bool = False) -> None:
    """Keep (or with ``deleted``, drop) the body of a watched object of ``kind``, as the watch
    sees it (a listed item may not say its kind)."""
    meta = body.get("metadata") or {}
    key = (kind, str(meta.get("namespace")), str(meta.get("name")))
    version = _version(body)
    with _cache_lock:
        if deleted:
            _drop(key)
            _tombstones[key] = max(version, _tombstones.get(key, -1))
            return
        if version <= _tombstones.get(key, -1):
            return  # the object as it was before its deletion
        _tombstones.pop(key, None)
        known = _cache.get(key)
        if known is not None and _version(known[0]) > version:
            return  # an older event than what is kept (a read-through can be newer)
        # A copy as plain data: the caller's body (Kopf's view) may change.
        _put(key, _plain(body))


def _plain(value: Any) -> Any:
    """A deep copy as plain dicts and lists (Kopf hands bodies over as mapping views)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _version(body: Mapping[str, Any]) -> int:
    rv = (body.get("metadata") or {}).get("resourceVersion")
    return int(rv) if isinstance(rv, str) and rv.isdigit() else -1


def _fresh(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    with _cache_lock:
        found = _cache.get((kind, namespace, name))
    if found is None or time.monotonic() - found[1] > CACHE_TTL_S:
        return None
    return found[0]


def watched(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object as the watch last delivered it, however long ago, or None; never a request
    (for code on the event loop)."""
    with _cache_lock:
        found = _cache.get((kind, namespace, name))
    return None if found is None else found[0]


def cached(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    """The object as the watch last delivered it (if recently), else read (and kept); None if it
    does not exist."""
    body = _fresh(kind, namespace, name)
    if body is not None:
        return body
    body = get(kind, namespace, name)
    if body is None:
        with _cache_lock:
            _drop((kind, namespace, name))
    else:
        remember(body, kind)
    return body


def cached_list(kind: str, namespace: str) -> list[dict[str, Any]]:
    """Every object of ``kind`` in ``namespace`` the watch has delivered (no request). Callers
    use it only where an object it misses or one gone meanwhile cannot lead to harm, and confirm
    with :func:`list_` before acting on what it shows."""
    with _cache_lock:
        return [_cache[kind, namespace, n][0] for n in _in_namespace.get((kind, namespace), ())]


def cached_dependents(kind: str, namespace: str, repository: str) -> list[dict[str, Any]]:
    """The objects of ``kind`` in ``namespace`` whose ``spec.repository`` is ``repository``, as
    the watch delivered them (no request; what :func:`cached_list` says of those)."""
    with _cache_lock:
        names = sorted(_dependents.get((kind, namespace, repository), ()))
        return [_cache[kind, namespace, n][0] for n in names]


# (kind, field) pairs the API server would not select on: listed whole and filtered here.
_unselectable: set[tuple[str, str]] = set()


def list_(
    kind: str,
    namespace: str,
    label_selector: str | None = None,
    *,
    field: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The objects of ``kind`` in ``namespace``, those with the labels of ``label_selector``,
    and with ``field`` = (dotted path, value), those whose field has that value.

    The field is selected by the API server where the CRD declares it selectable (Kubernetes
    1.31 and later), so the answer does not grow with the namespace; a server that refuses the
    selector (400) is asked for everything, filtered here, from then on."""
    query = [("labelSelector", label_selector)] if label_selector else []
    if field is not None and (kind, field[0]) not in _unselectable:
        try:
            selected = [*query, ("fieldSelector", f"{field[0]}={field[1]}")]
            return _items(_call("GET", _path(kind, namespace), query=selected))
        except KubeError as e:
            if e.status != 400:
                raise
            _unselectable.add((kind, field[0]))
    items = _items(_call("GET", _path(kind, namespace), query=query or None))
    if field is None:
        return items
    return [o for o in items if _field_text(o, field[0]) == field[1]]


def _items(answer: Any) -> list[dict[str, Any]]:
    return list((answer or {}).get("items") or [])


def _field_text(obj: Mapping[str, Any], path: str) -> str:
    """A field as a field selector compares it: its text, "" when absent."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def served(api_version: str, plural: str) -> bool:
    """Whether the API server serves this resource (a CRD installed, e.g. the Spark operator's),
    from discovery, which every authenticated client may read."""
    try:
        found = _call("GET", f"/apis/{api_version}") or {}
    except KubeError as e:
        if e.status == 404:
            return False
        raise
    return any(r.get("name") == plural for r in found.get("resources") or [])


def create(obj: Mapping[str, Any]) -> dict[str, Any]:
    path = _path(obj["kind"], obj["metadata"].get("namespace", ""))
    return _object(_call("POST", path, body=dict(obj)), f"POST {path}")


def merge_patch(kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
    path = _path(kind, namespace, name)
    answer = _call("PATCH", path, body=dict(patch), content_type="application/merge-patch+json")
    return _object(answer, f"PATCH {path}")


def patch_status(kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
    """Merge-patch the status subresource (a missing object is not an error: it is going away)."""
    try:
        _call(
            "PATCH",
            _path(kind, namespace, name, "status"),
            body={"status": dict(status)},
            content_type="application/merge-patch+json",
        )
    except KubeError as e:
        if e.status != 404:
            raise


def delete(kind: str, namespace: str, name: str) -> bool:
    """Delete (background propagation); False when it was already gone."""
    try:
        _call(
            "DELETE",
            _path(kind, namespace, name),
            body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
        )
        return True
    except KubeError as e:
        if e.status == 404:
            return False
        raise


def apply(
    desired: Mapping[str, Any], *, create_only: bool = False, watched: bool = False
) -> tuple[dict[str, Any], str]:
    """Make ``desired`` exist: create it, or merge-patch the fields that drifted.

    Returns the object and what happened: ``created``, ``updated`` or ``unchanged``.
    ``create_only`` objects (password Secrets) are never rewritten once they exist. ``watched``:
    compare with the watch's view of the object (see :func:`remember`), if it has one.
    """
    kind, meta = desired["kind"], desired["metadata"]
    if watched:
        actual = cached(kind, meta["namespace"], meta["name"])
    else:
        actual = get(kind, meta["namespace"], meta["name"])
    if actual is None:
        try:
            return create(desired), "created"
        except KubeError as e:
            if e.status != 409:  # created concurrently: fall through and compare
                raise
            actual = get(kind, meta["namespace"], meta["name"]) or {}
    if create_only:
        return actual, "unchanged"
    compared = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}
    if not drifted(compared, actual):
        return actual, "unchanged"
    return merge_patch(kind, meta["namespace"], meta["name"], compared), "updated"


#: How long a Secret read stays good for reconciles (a rotated credential is seen within it).
SECRET_TTL_S = float(os.environ.get("ZARRLAKE_SECRET_CACHE_SECONDS", "120"))
_secret_cache: dict[tuple[str, str], tuple[Mapping[str, str], float]] = {}


def secrets(namespace: str, *, kept: bool = False) -> SecretReader:
    """A Secret reader for one namespace (decoded values; never logged), one request per Secret.

    With ``kept`` (a resync: nothing changed), a Secret read within :data:`SECRET_TTL_S` is
    reused: every resync of every object opens its repository with its credentials Secret, and
    re-reading it each time was most of an idle fleet's API traffic. A change (create, update,
    resume) always reads afresh, and a missing Secret is never kept."""
    from kubernetes import client

    read = secret_reader(client.CoreV1Api(api_client()), namespace)
    asked: set[str] = set()

    def get_secret(name: str) -> Mapping[str, str] | None:
        key = (namespace, name)
        if kept:
            with _cache_lock:
                found = _secret_cache.get(key)
            if found is not None and time.monotonic() - found[1] <= SECRET_TTL_S:
                return found[0]
        if name not in asked:  # the reader keeps what it read: one request per Secret
            asked.add(name)
            for observe in observers:
                observe("GET", "secrets")
        value = read(name)
        with _cache_lock:
            if value is None:
                _secret_cache.pop(key, None)
            else:
                _secret_cache[key] = (value, time.monotonic())
        return value

    return get_secret
