"""What should exist: pure functions from a spec and observed state to objects and status.

Nothing here talks to Kubernetes or S3, so unit tests call these directly. The handlers feed them
what they observed and apply what comes back.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ValidationError

from zarrlake.config import MAX_SESSION_TTL, RepositoryConfig
from zarrlake.durations import parse_duration
from zarrlake.errors import InvalidDuration, InvalidName, InvalidRetentionRules
from zarrlake.jobreport import JobReport
from zarrlake.maintenance.retention import RetentionRules
from zarrlake.refs import branch_glob_problem, validate_name
from zarrlake.resources import (
    API_VERSION,
    BranchSpec,
    Condition,
    ConditionStatus,
    CredentialsSecretRef,
    JobRun,
    JobSchedule,
    LockServiceSpec,
    MirrorDestinationSpec,
    MirrorRefStatus,
    MirrorSpec,
    Repository,
    RepositorySpec,
    RetentionPolicySpec,
    StorageSpec,
    TagSpec,
    problems,
)

MANAGED_BY = "zarrlake-operator"
REDIS_PORT = 6379
JOB_IMAGE = "ghcr.io/zarrlake/zarrlake:0.4.0"
DNS_NAME_MAX = 63
CRONJOB_NAME_MAX = 52  # the CronJob controller appends 11 characters for its Jobs
POLICY_LABEL = "zarrlake.io/retention-policy"
JOB_KIND_LABEL = "zarrlake.io/job"
REPOSITORY_LABEL = "zarrlake.io/repository"


def now_iso(now: dt.datetime | None = None) -> str:
    return (now or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def child_name(owner: str, suffix: str, limit: int = DNS_NAME_MAX) -> str:
    """``zl-<owner>-<suffix>``, shortened with a stable hash when it would exceed ``limit``.

    Always a DNS label (a Service name may not contain dots, a resource name may): dots become
    hyphens, and the hash is added then too, so ``a.b`` and ``a-b`` stay distinct."""
    safe = owner.replace(".", "-")
    name = f"zl-{safe}-{suffix}"
    if safe == owner and len(name) <= limit:
        return name
    digest = hashlib.sha256(owner.encode()).hexdigest()[:8]
    keep = limit - len(suffix) - len(digest) - 5
    return f"zl-{safe[:keep].rstrip('-')}-{digest}-{suffix}"


def locked_down_container() -> dict[str, Any]:
    """The security context of every container the operator runs: no privilege escalation, a
    read-only root file system, no capabilities (a fresh dict: callers may extend it)."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def owned_metadata(owner: Mapping[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    """The metadata of an object ``owner`` owns: its name, the owner's namespace, labels, and
    the owner reference that deletes it with the owner."""
    return {
        "name": name,
        "namespace": owner["metadata"]["namespace"],
        "labels": labels,
        "ownerReferences": [owner_reference(owner)],
    }


def marked_for_deletion(body: Mapping[str, Any]) -> bool:
    """Whether the API server has marked the object for deletion (``deletionTimestamp``): its
    finalizers are running, and no controller may act on it but to finish deleting it."""
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """An owner reference to a resource: its children are deleted with it (Kubernetes GC)."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(instance: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "zarrlake",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


# -- conditions --


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: bool | ConditionStatus,
    reason: str,
    message: str = "",
    *,
    generation: int | None = None,
    now: dt.datetime | None = None,
) -> list[Condition]:
    """Conditions with ``type_`` set, the others kept in place; the input is not modified.

    ``lastTransitionTime`` moves only when the status changes (the Kubernetes convention: it says
    since when the condition has been what it is, not when it was last written).
    """
    text: ConditionStatus = status if isinstance(status, str) else ("True" if status else "False")
    previous = condition(conditions, type_)
    if previous is not None and previous.status == text:
        since = previous.last_transition_time
    else:
        since = now_iso(now)
    new = Condition(
        type=type_,
        status=text,
        reason=reason,
        message=message,
        lastTransitionTime=since,
        observedGeneration=generation,
    )
    if previous is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


def condition(conditions: Iterable[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: Iterable[Condition], type_: str) -> bool:
    c = condition(conditions, type_)
    return c is not None and c.status == "True"


# -- readiness: Ready, and what GitOps tools read beside it (Reconciling, Stalled) --

#: Ready=False reasons that mean the operator is still on its way and needs nobody's help: a
#: Repository's bucket or lock service being set up, a dependent waiting for its Repository, a
#: Mirror waiting for its replicator's first pass. The resource is ``Reconciling``. Any other
#: reason of a Ready=False is something a person must fix (a spec, a Secret, a bucket, a
#: conflict): the resource is ``Stalled``, so that Flux (kstatus) sees Failed, not InProgress.
WAITING_REASONS = frozenset(
    {
        "Pending",
        "WaitingForBucket",
        "Unavailable",  # a managed lock service whose pod is starting
        "RepositoryNotFound",
        "RepositoryNotReady",
        "RepositoryDeleting",
        "WaitingForReplicator",
    }
)


#: How long a dependent may wait for a Repository that does not exist before it is ``Stalled``:
#: long enough for any apply order (GitOps tools apply a tree in their own order), short enough
#: that a misspelt ``spec.repository`` shows as Failed, not as in progress until a timeout.
MISSING_REPOSITORY_STALL = dt.timedelta(minutes=5)


def waited_too_long(
    conditions: Sequence[Condition],
    reason: str,
    bound: dt.timedelta,
    now: dt.datetime | None = None,
) -> bool:
    """Whether the resource has been waiting (``Reconciling`` True) for longer than ``bound``
    and still for ``reason`` (the Ready condition's), or was already found to (``Stalled``
    for it: it stays so while the reason holds)."""
    ready, waiting = condition(conditions, "Ready"), condition(conditions, "Reconciling")
    stalled = condition(conditions, "Stalled")
    if (
        ready is not None
        and (ready.reason, ready.status) == (reason, "False")
        and stalled is not None
        and (stalled.reason, stalled.status) == (reason, "True")
    ):
        return True
    if ready is None or ready.reason != reason or waiting is None or waiting.status != "True":
        return False
    if not waiting.last_transition_time:
        return False
    since = dt.datetime.fromisoformat(waiting.last_transition_time.replace("Z", "+00:00"))
    return (now or dt.datetime.now(dt.UTC)) - since > bound


def set_ready(
    conditions: Sequence[Condition],
    ready: bool,
    reason: str,
    message: str,
    *,
    generation: int | None = None,
    reconciling: bool | None = None,
    keep_stalled: bool = False,
    now: dt.datetime | None = None,
) -> list[Condition]:
    """Ready, with ``Reconciling`` and ``Stalled`` beside it, the kstatus conventions Flux and
    other GitOps tools read (an Argo CD health check reads them too).

    ``Reconciling`` is True while the operator works towards the spec without anyone's help
    (by default: Ready=False for one of :data:`WAITING_REASONS`; a Ready resource may say so
    too, as a Repository whose lock service is starting does); ``Stalled`` is True when it
    cannot get there alone (any other Ready=False). Both are always written, so every resource
    shows the same three; a False one has the reason ``Ready``, or Ready's own reason.
    ``keep_stalled``: leave ``Stalled`` as the caller set it (a Mirror's own measure of
    progress) while Ready is True. Conditions keep their ``lastTransitionTime`` unless their
    status changes (:func:`set_condition`), so an unchanged readiness rewrites nothing.
    """
    waiting = (not ready and reason in WAITING_REASONS) if reconciling is None else reconciling
    stalled = not ready and not waiting
    quiet = "Ready" if ready else reason  # the reason of a False Reconciling or Stalled

    def put(out: Sequence[Condition], type_: str, on: bool, why: str, text: str) -> list[Condition]:
        return set_condition(out, type_, on, why, text, generation=generation, now=now)

    if waiting:
        out = put(conditions, "Reconciling", True, reason, message)
    else:
        out = put(conditions, "Reconciling", False, quiet, "")
    if stalled:
        out = put(out, "Stalled", True, reason, message)
    elif not (keep_stalled and ready and condition(out, "Stalled") is not None):
        out = put(out, "Stalled", False, quiet, "")
    return put(out, "Ready", ready, reason, message)


# -- spec checks: what the CRD schema cannot say --


class SpecProblem(NamedTuple):
    """Why a spec cannot be acted on: the Ready condition's reason and message (the message
    names the field, never its value: a wrong field could hold anything, a credential too)."""

    reason: str
    message: str


def engine_config(spec: RepositorySpec) -> RepositoryConfig:
    """The engine settings a Repository's ``spec.config`` (and ``spec.virtualContainers``)
    asks for. Raises the engine's
    ``InvalidConfig`` (a ``ValueError``) for a value it refuses."""
    c = spec.config
    values: dict[str, Any] = {}
    if c.inline_threshold_bytes is not None:
        values["inline_threshold_bytes"] = c.inline_threshold_bytes
    if c.shard_max_refs is not None:
        values["shard_max_refs"] = c.shard_max_refs
    if c.session_ttl is not None:
        values["session_ttl"] = parse_duration(c.session_ttl)
    if c.pack_chunks_below_bytes is not None:
        values["pack_chunks_below_bytes"] = c.pack_chunks_below_bytes
    if spec.virtual_containers:  # kept to at each resync too, unlike the rest
        values["virtual_containers"] = tuple(v.to_engine() for v in spec.virtual_containers)
    return RepositoryConfig(**values)


MIN_GRACE = MAX_SESSION_TTL  # one floor, the engine's: GC may not outrun a session

_SPEC_MODELS: dict[str, type[BaseModel]] = {
    "Repository": RepositorySpec,
    "Branch": BranchSpec,
    "Tag": TagSpec,
    "RetentionPolicy": RetentionPolicySpec,
    "Mirror": MirrorSpec,
}


def spec_problem(body: Mapping[str, Any]) -> SpecProblem | None:
    """What stops the operator from acting on a resource's spec, or None when nothing does.

    The CRD's schema and rules refuse most bad specs, but not all of them reach an API server
    that checks: a server before Kubernetes 1.25 ignores the CEL rules, and some checks only the
    engine can make (retention rules, a duration's range, a branch glob, a ref name). Whatever
    this returns, the resource gets Ready=False with it (``InvalidSpec`` unless a more precise
    reason says more), never silence. Raises nothing for any body of a known kind."""
    kind = str(body.get("kind"))
    try:
        spec = _SPEC_MODELS[kind].model_validate(body.get("spec") or {})
    except ValidationError as e:
        return SpecProblem("InvalidSpec", problems(e, prefix="spec."))
    if isinstance(spec, RepositorySpec):
        return _repository_spec_problem(spec)
    if isinstance(spec, BranchSpec | TagSpec):
        ref = ref_name(body)
        field = "spec.name" if (body.get("spec") or {}).get("name") else "metadata.name"
        try:
            validate_name(ref)
        except InvalidName as e:
            return SpecProblem("InvalidName", f"{field}: {e}")
        return None
    if isinstance(spec, RetentionPolicySpec):
        return _retention_spec_problem(spec)
    if isinstance(spec, MirrorSpec):
        keys = _secret_keys_problem(
            spec.destination.credentials_secret, "spec.destination.credentialsSecret"
        )
        return keys or mirror_spec_problem(spec)
    return None


#: What a key of a Secret's data may be (Kubernetes refuses any other): a name that does not
#: fit can never be found, so it is a spec to fix, not a Secret to wait for.
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_KEY_FIELDS = (
    ("access_key_id_key", "accessKeyIDKey"),
    ("secret_access_key_key", "secretAccessKeyKey"),
    ("session_token_key", "sessionTokenKey"),
    ("account_key_key", "accountKeyKey"),
    ("sas_token_key", "sasTokenKey"),
    ("service_account_json_key", "serviceAccountJSONKey"),
    ("authorization_key", "authorizationKey"),
)


def _secret_keys_problem(creds: CredentialsSecretRef | None, where: str) -> SpecProblem | None:
    """A key name of the credentials Secret reference at ``where`` that no Secret can have."""
    if creds is None:
        return None
    for attribute, field in _KEY_FIELDS:
        key = getattr(creds, attribute)
        if key is not None and not SECRET_KEY.match(key):
            return _bad_secret_key(f"{where}.{field}")
    return None


def _bad_secret_key(field: str) -> SpecProblem:
    return SpecProblem(
        "InvalidSpec",
        f"{field}: not a possible key of a Secret (letters, digits, '-', '_' and '.')",
    )


def _repository_spec_problem(spec: RepositorySpec) -> SpecProblem | None:
    serve = spec.serve
    keys = _secret_keys_problem(
        spec.storage.credentials_secret, "spec.storage.credentialsSecret"
    ) or _secret_keys_problem(serve.credentials_secret_ref, "spec.serve.credentialsSecretRef")
    if keys is not None:
        return keys
    if serve.token_secret_ref is not None and not SECRET_KEY.match(serve.token_secret_ref.key):
        return _bad_secret_key("spec.serve.tokenSecretRef.key")
    try:
        engine_config(spec)
    except ValueError as e:
        return SpecProblem("InvalidSpec", f"spec.config: {e}")
    lock = spec.lock_service
    if lock.mode == "external" and not lock.url and not spec.storage.read_only:
        return SpecProblem(
            "InvalidSpec",
            "spec.lockService.url is required in external mode (a redis:// or rediss:// URL; "
            "or set spec.lockService.mode to managed or none)",
        )
    return None


def _retention_spec_problem(spec: RetentionPolicySpec) -> SpecProblem | None:
    try:
        RetentionRules.from_dict(spec.rules.to_engine())
        grace = parse_duration(spec.gc.grace)
    except (InvalidRetentionRules, InvalidDuration) as e:
        return SpecProblem("InvalidSpec", str(e))
    if grace < MIN_GRACE and not spec.gc.force:
        return SpecProblem(
            "InvalidSpec",
            f"spec.gc.grace {spec.gc.grace} is below 7d: a writer session could still need "
            "objects that young (set spec.gc.force: true if none can)",
        )
    return None


REPOSITORY_CONDITIONS = ("BucketReady", "LockServiceReady", "Initialized")


class Phase(NamedTuple):
    """A Repository's phase and its Ready condition, derived from the component conditions."""

    phase: str
    ready: bool
    reason: str
    message: str


#: LockServiceReady reasons that say the service is down, not misconfigured: clients can still
#: connect (and commit optimistically). A missing password Secret, an invalid spec: they cannot.
LOCK_OUTAGES = ("Unavailable", "Unreachable")


#: ServeReady reasons that say spec.serve's server is down or cannot start, and will not come
#: up by waiting: its pods fail their readiness probe, its rollout ran out of time, a Secret it
#: mounts is missing. (``Starting`` is a wait; ``ScaledToZero`` was asked for.)
SERVE_FAULTS = ("Unavailable", "RolloutFailed", "SecretNotFound")


def repository_phase(conditions: Sequence[Condition], *, lock_required: bool = True) -> Phase:
    """The phase and Ready condition from the three component conditions.

    A lock service is an optimization, not a requirement, unless its clients were told to fail
    without it (``onUnavailable: fail``): with ``lock_required`` False, a lock service that is
    down (unreachable or unavailable, not misconfigured: clients can still connect) leaves the
    repository Ready, in phase Degraded — writers commit optimistically meanwhile, and nobody
    waits for it. The HTTP server of ``spec.serve`` is an add-on in the same way: one that is
    down (a ``ServeReady`` condition with a reason of :data:`SERVE_FAULTS`) leaves an otherwise
    ready repository Ready, in phase Degraded, so that a person looking (or Argo CD) sees it;
    without ``spec.serve`` there is no ``ServeReady`` and nothing changes.
    """
    missing = [t for t in REPOSITORY_CONDITIONS if not is_true(conditions, t)]
    lock = condition(conditions, "LockServiceReady")
    if (
        missing == ["LockServiceReady"]
        and not lock_required
        and lock is not None
        and lock.reason in (*LOCK_OUTAGES, "Lost")
    ):
        return Phase(
            "Degraded",
            True,
            "LockServiceUnavailable",
            f"{lock.message or 'the lock service is not available'}; writers commit "
            "optimistically until it is back",
        )
    if not missing:
        serve = condition(conditions, "ServeReady")
        if serve is not None and serve.status != "True" and serve.reason in SERVE_FAULTS:
            return Phase(
                "Degraded",
                True,
                "ServeUnavailable",
                f"{serve.message}; the repository itself is ready",
            )
        return Phase("Ready", True, "Ready", "bucket, lock service and repository are ready")
    first = condition(conditions, missing[0])
    failed = any(
        (c := condition(conditions, t)) is not None and c.reason.startswith("Invalid")
        for t in missing
    )
    reason = (first.reason or "Pending") if first else "Pending"
    message = first.message if first else f"waiting for {missing[0]}"
    return Phase("Failed" if failed else "Provisioning", False, reason, message)


# -- drift --


_QUANTITY = re.compile(
    r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
)
_SUFFIX = {
    None: Decimal(1), "m": Decimal("0.001"), "k": Decimal(10) ** 3, "M": Decimal(10) ** 6,
    "G": Decimal(10) ** 9, "T": Decimal(10) ** 12, "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}  # fmt: skip


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity (``500m``, ``1Gi``, ``2``) as a number, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    m = _QUANTITY.match(str(value).strip())
    return Decimal(m[1]) * _SUFFIX[m[2]] if m else None


def drifted(desired: Any, actual: Any) -> bool:
    """True when ``actual`` differs from ``desired`` in any field ``desired`` sets.

    Fields only the server sets (defaults, status, uids) do not count: desired must be a subset.
    """
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return True
        return any(drifted(v, actual.get(k)) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return True
        return any(drifted(d, a) for d, a in zip(desired, actual, strict=True))
    if isinstance(desired, bool) and isinstance(actual, str):
        return str(desired).lower() != actual.lower()
    if desired != actual and (q := quantity(desired)) is not None:
        # The API server rewrites quantities canonically ("0.5" -> "500m", 1073741824 -> "1Gi").
        return q != quantity(actual)
    return bool(desired != actual)


# -- the managed lock service --


def lock_service_names(repository: str) -> str:
    """One name for the managed Redis Deployment, Service and password Secret."""
    return child_name(repository, "lock")


def lock_endpoint(repository: str, namespace: str) -> str:
    return f"redis://{lock_service_names(repository)}.{namespace}.svc:{REDIS_PORT}/0"


DEFAULT_REDIS_RESOURCES = {
    "requests": {"cpu": "50m", "memory": "64Mi"},
    "limits": {"memory": "256Mi"},
}


def _lock_metadata(body: Mapping[str, Any]) -> dict[str, Any]:
    """Name, labels and owner of each lock-service object (Secret, Deployment, Service)."""
    name = body["metadata"]["name"]
    return owned_metadata(
        body, lock_service_names(name), labels(name, "lock-service") | {REPOSITORY_LABEL: name}
    )


def lock_secret(body: Mapping[str, Any], password: str) -> dict[str, Any]:
    """The password Secret; created once, never rewritten (rotating it would lock clients out)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _lock_metadata(body),
        "type": "Opaque",
        "stringData": {"password": password},
    }


SECRET_HASH_ANNOTATION = "zarrlake.io/password-hash"


def password_hash(secret: Mapping[str, Any]) -> str:
    """A short digest of the lock Secret's password (as stored, base64 or plain)."""
    value = (secret.get("data") or {}).get("password") or (secret.get("stringData") or {}).get(
        "password", ""
    )
    return hashlib.sha256(str(value).encode()).hexdigest()[:16]


def lock_scheduling(lock: LockServiceSpec) -> dict[str, Any]:
    """Where the managed Redis pod goes: the pod-spec fields ``affinity`` and
    ``topologySpreadConstraints``.

    Each Repository has one Redis, so the defaults spread the lock services of a namespace, not
    the replicas of one: a preferred anti-affinity to nodes already running one (by the labels
    every managed Redis pod carries) and a zone spread that only scores (ScheduleAnyway), so
    that one node or zone going down takes few lock services with it and a small or zone-less
    cluster still schedules them all. ``lockService.affinity`` and
    ``lockService.topologySpreadConstraints`` replace a default as given; an empty one turns it
    off. The operator corrects drift with merge patches, which merge maps and keep keys a patch
    leaves out: so each field is given whole, null where nothing is wanted (a patch's null
    removes the key; the API server stores no null, and none reads as drift)."""
    every_lock_service = {
        "app.kubernetes.io/component": "lock-service",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    defaults = preferred_spread(every_lock_service)
    affinity = lock.affinity if lock.affinity is not None else defaults["affinity"]
    spread = lock.topology_spread_constraints
    if spread is None:
        spread = defaults["topologySpreadConstraints"]
    return {
        "affinity": _whole_affinity(affinity) if affinity else None,
        "topologySpreadConstraints": spread or None,
    }


def preferred_spread(match_labels: Mapping[str, str]) -> dict[str, Any]:
    """The pod-spec fields ``affinity`` and ``topologySpreadConstraints`` that keep the pods
    ``match_labels`` selects apart: a preferred anti-affinity to nodes already running one, and
    a zone spread that only scores (ScheduleAnyway). Preferences only, so that one node or zone
    going down takes few of them with it while a small or zone-less cluster still schedules
    them all."""
    selector = {"matchLabels": dict(match_labels)}
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": selector}
    return {
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 100, "podAffinityTerm": term}
                ]
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": selector,
            }
        ],
    }


def _whole_affinity(affinity: Mapping[str, Any]) -> dict[str, Any]:
    """An Affinity with each of its kinds and rule lists named, null where absent."""
    rules = (
        "requiredDuringSchedulingIgnoredDuringExecution",
        "preferredDuringSchedulingIgnoredDuringExecution",
    )
    out: dict[str, Any] = dict(affinity)
    for kind in ("nodeAffinity", "podAffinity", "podAntiAffinity"):
        given = affinity.get(kind)
        out[kind] = {rule: None for rule in rules} | dict(given) if given else None
    return out


def lock_deployment(
    body: Mapping[str, Any], spec: RepositorySpec, password_digest: str = ""
) -> dict[str, Any]:
    """A single-replica Redis, non-root, read-only root, password from the Secret, probed.

    ``password_digest`` goes into the pod template: when the Secret is replaced (deleted by
    hand and recreated), the template changes and Redis restarts with the new password.
    """
    name = body["metadata"]["name"]
    obj_name = lock_service_names(name)
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "lock-service"}
    lock = spec.lock_service
    resources = lock.resources.to_k8s() if lock.resources else DEFAULT_REDIS_RESOURCES
    password_env = {
        "name": "REDIS_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": obj_name, "key": "password"}},
    }
    # redis-cli reads REDISCLI_AUTH, so the probes need no password on their command line.
    cli_env = {
        "name": "REDISCLI_AUTH",
        "valueFrom": {"secretKeyRef": {"name": obj_name, "key": "password"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _lock_metadata(body),
        "spec": {
            "replicas": 1,
            # Never two Redis at once: a second one would hand out a second set of leases.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {
                    "labels": labels(name, "lock-service") | selector,
                    "annotations": {SECRET_HASH_ANNOTATION: password_digest},
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    **lock_scheduling(lock),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 999,
                        "runAsGroup": 999,
                        "fsGroup": 999,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "redis",
                            "image": lock.image,
                            # The password reaches redis-server as a configuration file on a
                            # memory volume only this user reads (printf is a shell builtin):
                            # never in any process's arguments. Then redis-server replaces the
                            # shell: PID 1, so it gets the kubelet's SIGTERM and shuts down
                            # cleanly (an AOF rewrite is not cut off).
                            "command": ["sh", "-c"],
                            "args": [
                                # Quoted for Redis' config syntax (backslash, double quote).
                                "umask 077 && printf 'requirepass \"%s\"\\n' "
                                '"$(printf %s "$REDIS_PASSWORD"'
                                " | sed 's/[\\\\\"]/\\\\&/g')\" > /run/redis/redis.conf"
                                " && exec redis-server /run/redis/redis.conf"
                                f" --port {REDIS_PORT} --appendonly yes --dir /data"
                            ],
                            "env": [password_env, cli_env],
                            "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
                            "resources": resources,
                            "readinessProbe": {
                                "exec": {"command": ["redis-cli", "ping"]},
                                "periodSeconds": 5,
                                "timeoutSeconds": 2,
                            },
                            "livenessProbe": {
                                "tcpSocket": {"port": "redis"},
                                "initialDelaySeconds": 5,
                                "periodSeconds": 10,
                            },
                            "securityContext": locked_down_container(),
                            "volumeMounts": [
                                {"name": "data", "mountPath": "/data"},
                                {"name": "conf", "mountPath": "/run/redis"},
                            ],
                        }
                    ],
                    "volumes": [
                        # Its append-only file: on the claim when the spec asks to persist it.
                        {"name": "data", "persistentVolumeClaim": {"claimName": obj_name}}
                        if lock.persistence is not None
                        else {"name": "data", "emptyDir": {}},
                        {"name": "conf", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                    ],
                },
            },
        },
    }


def lock_service(body: Mapping[str, Any]) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _lock_metadata(body),
        "spec": {
            "selector": {
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/component": "lock-service",
            },
            "ports": [
                {"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}
            ],
        },
    }


def _lock_selector(repository: str) -> dict[str, str]:
    """The labels that select the managed Redis pod of a repository."""
    return {"app.kubernetes.io/instance": repository, "app.kubernetes.io/component": "lock-service"}


def lock_disruption_budget(body: Mapping[str, Any]) -> dict[str, Any]:
    """Voluntary disruptions (a drain, a cluster autoscaler's scale-down) may not evict a
    healthy Redis: there is one, and its loss drops every lease at once. A drain of its node
    waits until the pod is deleted by hand (the Repository stays usable meanwhile: the lock is
    optional). One that is not Ready serves nothing and may always be evicted."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _lock_metadata(body),
        "spec": {
            "minAvailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": _lock_selector(body["metadata"]["name"])},
        },
    }


def lock_network_policy(body: Mapping[str, Any], spec: RepositorySpec) -> dict[str, Any]:
    """Who may reach the managed Redis: pods of the Repository's namespace only, those that
    ``lockService.clientSelector`` picks (by default the ones labelled
    ``zarrlake.io/repository: <name>``) and those the operator runs for the repository
    (maintenance jobs, Spark drivers and executors, Mirror replicators: labelled so already).
    The operator itself never connects to it (it watches the Deployment's status). Redis makes
    no connections of its own: no egress at all."""
    name = body["metadata"]["name"]
    chosen = spec.lock_service.client_selector
    clients = {REPOSITORY_LABEL: name} if chosen is None else dict(chosen)
    ours = {"app.kubernetes.io/managed-by": MANAGED_BY, REPOSITORY_LABEL: name}
    peers = [{"podSelector": {"matchLabels": clients}}]
    if not ours.items() >= clients.items():  # else the clients' selector takes them in already
        peers.append({"podSelector": {"matchLabels": ours}})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _lock_metadata(body),
        "spec": {
            "podSelector": {"matchLabels": _lock_selector(name)},
            "policyTypes": ["Ingress", "Egress"],
            # Egress listed with no rule: none allowed.
            "ingress": [{"from": peers, "ports": [{"port": REDIS_PORT, "protocol": "TCP"}]}],
        },
    }


def lock_volume_claim(body: Mapping[str, Any], spec: RepositorySpec) -> dict[str, Any] | None:
    """The claim for Redis' data when ``lockService.persistence`` asks for one (None: no claim).
    One replica (Recreate) mounts it at a time: ReadWriteOnce."""
    persistence = spec.lock_service.persistence
    if persistence is None:
        return None
    claim: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": persistence.size}},
    }
    if persistence.storage_class_name:
        claim["storageClassName"] = persistence.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _lock_metadata(body),
        "spec": claim,
    }


def deployment_available(deployment: Mapping[str, Any] | None) -> tuple[bool, str]:
    """Whether a Deployment serves, and why not, from its status."""
    if deployment is None:
        return False, "the lock service Deployment does not exist yet"
    status = deployment.get("status") or {}
    if (status.get("availableReplicas") or 0) >= 1:
        return True, "the lock service is available"
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Available" and cond.get("status") == "False":
            return False, cond.get("message") or "the lock service is not available"
    return False, "waiting for the lock service pod to become ready"


# -- maintenance CronJobs --


def credential_env(creds: CredentialsSecretRef | None, prefix: str = "") -> list[dict[str, Any]]:
    """The AWS credential variables (``prefix`` + ``AWS_ACCESS_KEY_ID``, ...) of a credentials
    Secret, by reference only, never by value; none without a Secret."""
    if creds is None:
        return []
    keys = [
        ("AWS_ACCESS_KEY_ID", creds.access_key_id_key, False),
        ("AWS_SECRET_ACCESS_KEY", creds.secret_access_key_key, False),
    ]
    if creds.session_token_key:
        keys.append(("AWS_SESSION_TOKEN", creds.session_token_key, True))
    env: list[dict[str, Any]] = []
    for var, key, optional in keys:
        ref: dict[str, Any] = {"name": creds.name, "key": key}
        if optional:
            ref["optional"] = True
        env.append({"name": prefix + var, "valueFrom": {"secretKeyRef": ref}})
    return env


#: Where a GCS service-account key from a credentials Secret is mounted (the whole Secret, so the
#: file is named as its key, as Spark's own secret mounts name it too).
GCS_KEY_DIR = "/var/run/secrets/zarrlake/gcs"
GCS_VOLUME = "gcs-credentials"
#: A Mirror destination's credentials reach the replicator in its provider's variables with this
#: in front (the unprefixed ones are the source's: both sides may need different keys, and one
#: process reads both) ...
DESTINATION_ENV_PREFIX = "ZARRLAKE_DEST_"
#: ... and its GCS key file is mounted here.
DEST_GCS_KEY_DIR = "/var/run/secrets/zarrlake/gcs-destination"
DEST_GCS_VOLUME = "gcs-destination-credentials"


def _secret_env(var: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": var, "valueFrom": {"secretKeyRef": ref}}


def storage_env(
    storage: StorageSpec | MirrorDestinationSpec, *, destination: bool = False
) -> list[dict[str, Any]]:
    """The variables through which a pod's zarrlake finds the storage's credentials, in each
    provider's standard names (AWS_*, AZURE_STORAGE_*, GOOGLE_APPLICATION_CREDENTIALS; for a
    Mirror's ``destination``, the same with :data:`DESTINATION_ENV_PREFIX` in front); Secrets by
    reference only, never by value. Without a credentials Secret, the pod's identity."""
    creds = storage.credentials_secret
    prefix = DESTINATION_ENV_PREFIX if destination else ""
    if storage.provider == "s3":
        env = credential_env(creds, prefix)
        if storage.region and not destination:  # a destination's region is in its URL
            env.append({"name": "AWS_DEFAULT_REGION", "value": storage.region})
        return env
    if creds is None:
        return []
    if storage.provider == "azure":
        account_key, sas_token = creds.azure_keys
        # Either may be absent (the operator checked that one is there).
        return [
            _secret_env(f"{prefix}AZURE_STORAGE_ACCOUNT_KEY", creds.name, account_key, True),
            _secret_env(f"{prefix}AZURE_STORAGE_SAS_TOKEN", creds.name, sas_token, True),
        ]
    if storage.provider == "gcs":
        path = f"{DEST_GCS_KEY_DIR if destination else GCS_KEY_DIR}/{creds.gcs_key}"
        return [{"name": f"{prefix}GOOGLE_APPLICATION_CREDENTIALS", "value": path}]
    return []  # http: read-only, no job ever runs against it


#: Where a pod finds each virtual chunk container's credentials Secret (``<index>/<field>``).
VIRTUAL_CREDENTIALS_DIR = "/var/run/secrets/zarrlake/virtual"


def virtual_credentials(
    spec: RepositorySpec,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, pod volumes, container mounts) that give a pod the credentials of the
    repository's virtual chunk containers: each container's Secret mounted whole under
    :data:`VIRTUAL_CREDENTIALS_DIR`, and ``ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS`` saying which
    directory is whose (prefixes and paths only: the values stay in the Secrets, and kubelet
    keeps the files up to date when they rotate)."""
    dirs: dict[str, str] = {}
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for i, container in enumerate(spec.virtual_containers or ()):
        ref = container.credentials_secret_ref
        if ref is None:
            continue
        name, path = f"virtual-{i}", f"{VIRTUAL_CREDENTIALS_DIR}/{i}"
        volumes.append({"name": name, "secret": {"secretName": ref.name, "defaultMode": 0o440}})
        mounts.append({"name": name, "mountPath": path, "readOnly": True})
        dirs[container.url_prefix] = path
    if not dirs:
        return [], [], []
    env = [{"name": "ZARRLAKE_VIRTUAL_CREDENTIALS_DIRS", "value": json.dumps(dirs)}]
    return env, volumes, mounts


def storage_volumes(
    storage: StorageSpec | MirrorDestinationSpec, *, destination: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts) that put the storage's credentials file in place: the
    GCS service-account key Secret at :data:`GCS_KEY_DIR` (a Mirror destination's at
    :data:`DEST_GCS_KEY_DIR`); none for the other providers."""
    creds = storage.credentials_secret
    if storage.provider != "gcs" or creds is None:
        return [], []
    name, path = (DEST_GCS_VOLUME, DEST_GCS_KEY_DIR) if destination else (GCS_VOLUME, GCS_KEY_DIR)
    volume = {"name": name, "secret": {"secretName": creds.name}}
    return [volume], [{"name": name, "mountPath": path, "readOnly": True}]


def lock_env(repository: Repository) -> list[dict[str, Any]]:
    """``ZARRLAKE_LOCK`` and ``ZARRLAKE_LOCK_PASSWORD`` (by Secret reference) for the
    repository's lock service; none without one."""
    lock, status = repository.spec.lock_service, repository.status
    if lock.mode == "managed" and status.lock_endpoint:
        return [
            {"name": "ZARRLAKE_LOCK", "value": status.lock_endpoint},
            {
                "name": "ZARRLAKE_LOCK_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": status.lock_secret, "key": "password"}},
            },
        ]
    if lock.mode == "external" and lock.url:
        env: list[dict[str, Any]] = [{"name": "ZARRLAKE_LOCK", "value": lock.url}]
        if lock.password_secret:
            env.append(
                {
                    "name": "ZARRLAKE_LOCK_PASSWORD",
                    "valueFrom": {"secretKeyRef": lock.password_secret.dump()},
                }
            )
        return env
    return []


def job_env(repository: Repository) -> list[dict[str, Any]]:
    """Environment of a maintenance job: credentials by Secret reference only, never by value."""
    return [
        {"name": "ZARRLAKE_REPORT_FILE", "value": "/dev/termination-log"},
        *storage_env(repository.spec.storage),
        *lock_env(repository),
    ]


def _job_labels(policy: Mapping[str, Any], kind: str, spec: RetentionPolicySpec) -> dict[str, str]:
    name = policy["metadata"]["name"]
    return labels(name, f"retention-{kind}") | {
        POLICY_LABEL: name,
        JOB_KIND_LABEL: kind,
        REPOSITORY_LABEL: spec.repository,
    }


def _cron_job(
    policy: Mapping[str, Any],
    kind: str,
    schedule: JobSchedule,
    command: list[str],
    repository: Repository,
    spec: RetentionPolicySpec,
    image: str,
    *,
    identity: dict[str, Any] | None = None,
    extra_env: Sequence[Mapping[str, Any]] = (),
    run_as_user: int = 10001,
    name_suffix: str = "",
    default_resources: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    name = policy["metadata"]["name"]
    job_labels = _job_labels(policy, kind, spec)
    volumes, mounts = storage_volumes(repository.spec.storage)
    container: dict[str, Any] = {
        "name": kind,
        "image": image,
        "command": command,
        "env": [*job_env(repository), *extra_env],
        # The JSON report goes to the termination log; on a crash the log tail is shown instead.
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": locked_down_container(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    if schedule.resources:
        container["resources"] = schedule.resources.to_k8s()
    elif default_resources is not None:
        container["resources"] = dict(default_resources)
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": owned_metadata(
            policy, child_name(name, kind + name_suffix, CRONJOB_NAME_MAX), job_labels
        ),
        "spec": {
            "schedule": schedule.schedule,
            "suspend": schedule.suspend,
            "concurrencyPolicy": "Forbid",
            "startingDeadlineSeconds": 3600,
            "successfulJobsHistoryLimit": spec.successful_jobs_history_limit,
            "failedJobsHistoryLimit": spec.failed_jobs_history_limit,
            "jobTemplate": {
                "metadata": {"labels": job_labels},
                "spec": {
                    "backoffLimit": 1,
                    "activeDeadlineSeconds": schedule.active_deadline_seconds,
                    "ttlSecondsAfterFinished": 7 * 86400,
                    "template": {
                        "metadata": {"labels": job_labels},
                        "spec": {
                            "restartPolicy": "Never",
                            **(_job_identity(spec) if identity is None else identity),
                            "securityContext": {
                                "runAsNonRoot": True,
                                "runAsUser": run_as_user,
                                "seccompProfile": {"type": "RuntimeDefault"},
                            },
                            "containers": [container],
                            "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
                        },
                    },
                },
            },
        },
    }


def _job_identity(spec: RetentionPolicySpec) -> dict[str, Any]:
    return pod_identity(spec.service_account_name, spec.image_pull_secrets)


def pod_identity(
    service_account_name: str | None, image_pull_secrets: Sequence[str]
) -> dict[str, Any]:
    """Who the pods of a job, replicator or server run as: a named ServiceAccount (for ambient
    cloud identity such as IRSA or workload identity) gets its token; without one, no token is
    mounted at all. Pull Secrets, if any, for the image's registry."""
    out: dict[str, Any] = {}
    if service_account_name:
        out["serviceAccountName"] = service_account_name
    else:
        out["automountServiceAccountToken"] = False
    if image_pull_secrets:
        out["imagePullSecrets"] = [{"name": n} for n in image_pull_secrets]
    return out


def retention_cron_jobs(
    policy: Mapping[str, Any],
    spec: RetentionPolicySpec,
    repository: Mapping[str, Any],
    default_image: str = JOB_IMAGE,
) -> dict[str, dict[str, Any]]:
    """The CronJobs a RetentionPolicy asks for, by kind (``gc``, ``compact``).

    The storage URL carries no secrets, so it may appear in the arguments; everything secret
    reaches the job as Secret-referenced environment variables.
    """
    resource = _repository_with_url(repository, spec)
    image = spec.image or default_image
    jobs = {}
    for kind, args in maintenance_arguments(spec, str(resource.status.url)).items():
        schedule = _schedule(spec, kind)
        jobs[kind] = _cron_job(
            policy,
            kind,
            schedule,
            ["zarrlake", *args],
            resource,
            spec,
            image,
            default_resources=DEFAULT_JOB_RESOURCES,
        )
    return jobs


def _repository_with_url(repository: Mapping[str, Any], spec: RetentionPolicySpec) -> Repository:
    resource = Repository.from_body(repository)
    if not resource.status.url:
        raise ValueError(f"Repository {spec.repository!r} has no URL in its status yet")
    return resource


def _schedule(spec: RetentionPolicySpec, kind: str) -> JobSchedule:
    if kind == "gc":
        return spec.gc
    assert spec.compaction is not None
    return spec.compaction


def maintenance_arguments(
    spec: RetentionPolicySpec, url: str, *, engine: str = "local"
) -> dict[str, list[str]]:
    """The ``zarrlake`` arguments of each job the policy schedules, by kind (``gc``,
    ``compact``); ``engine="spark"`` adds ``--engine spark`` (the SparkSession is the one
    ``spark-submit`` or the Spark operator configured)."""
    rules = json.dumps(spec.rules.to_engine(), separators=(",", ":"), sort_keys=True)
    gc = ["gc", url, "--rules", rules, "--grace", spec.gc.grace, "--json"]
    if spec.gc.force:
        gc.append("--force")
    out = {"gc": gc}
    if spec.compaction is not None:
        out["compact"] = ["compact", url, "--branch", spec.compaction.branch, "--json"]
    if engine == "spark":
        for args in out.values():
            args += ["--engine", "spark"]
    return out


# -- engine: spark --

SPARK_IMAGE = "ghcr.io/zarrlake/zarrlake-spark:0.4.0"
SPARK_GROUP = "sparkoperator.k8s.io"
SPARK_VERSION = "v1beta2"
SPARK_API_VERSION = f"{SPARK_GROUP}/{SPARK_VERSION}"
#: The zarrlake command line as a Python file spark-submit can run (a console script is not one:
#: spark-submit takes a primary resource without ``.py`` for a JAR). examples/spark/Dockerfile
#: copies examples/spark/ to /opt/zarrlake/examples/spark/.
SPARK_ENTRY = "/opt/zarrlake/examples/spark/zarrlake_main.py"
SPARK_SUBMIT = "/opt/spark/bin/spark-submit"
SPARK_RELEASE = "4.0.1"  # the Spark of examples/spark/Dockerfile's image
SPARK_USER = 185  # the image's ``spark`` user: the JVM wants a user name for its uid
SPARK_NAME_MAX = 40  # the Spark operator appends a timestamp to each run, and "-driver" to pods
ROLE_LABEL = "spark-role"
SparkMode = Literal["spark-operator", "spark-submit"]


class SparkDefaults(NamedTuple):
    """The operator's defaults for engine: spark (Helm values ``spark.image`` and
    ``spark.serviceAccountName``)."""

    image: str = SPARK_IMAGE
    service_account_name: str | None = None


SPARK_DEFAULTS = SparkDefaults()


def spark_names(policy: str) -> str:
    """One name for the ServiceAccount, Role and RoleBinding of a policy's Spark driver."""
    return child_name(policy, "spark")


def spark_service_account(
    policy: Mapping[str, Any], spec: RetentionPolicySpec, defaults: SparkDefaults
) -> tuple[str, bool]:
    """The driver's ServiceAccount and whether the operator manages it (and its Role)."""
    if spec.spark.service_account_name:
        return spec.spark.service_account_name, False
    if defaults.service_account_name:
        return defaults.service_account_name, False
    return spark_names(policy["metadata"]["name"]), True


def spark_rbac(policy: Mapping[str, Any], spec: RetentionPolicySpec) -> list[dict[str, Any]]:
    """A ServiceAccount for the policy's Spark driver, and a Role (with its RoleBinding) that
    lets the driver run its executors in the namespace: pods, their services and configmaps."""
    name = policy["metadata"]["name"]
    obj_name = spark_names(name)
    meta = owned_metadata(policy, obj_name, labels(name, "spark-driver") | {POLICY_LABEL: name})
    everything = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods", "services", "configmaps", "persistentvolumeclaims"],
                    "verbs": everything,
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": obj_name,
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": obj_name,
                    "namespace": policy["metadata"]["namespace"],
                }
            ],
        },
    ]


def _spark_env(repository: Repository) -> list[dict[str, Any]]:
    """What the driver and executors get: the maintenance job's environment (report file,
    credentials and lock password by Secret reference)."""
    return job_env(repository)


def spark_submit_command(
    policy: Mapping[str, Any],
    kind: str,
    spec: RetentionPolicySpec,
    arguments: Sequence[str],
    repository: Repository,
    image: str,
    service_account: str,
) -> list[str]:
    """``spark-submit`` in client mode against the cluster's own API server: the Job's pod is
    the driver (so its termination message carries the report, as for a local job) and the
    executors are pods in the namespace, created by the driver as ``service_account``.

    Executors get the credentials by Secret reference (``secretKeyRef`` settings name the
    Secret and key, never the value)."""
    s = spec.spark
    ns = policy["metadata"]["namespace"]
    name = policy["metadata"]["name"]
    conf: dict[str, str] = {
        "spark.kubernetes.namespace": ns,
        "spark.kubernetes.container.image": image,
        "spark.kubernetes.authenticate.driver.serviceAccountName": service_account,
        "spark.kubernetes.driver.pod.name": "$(POD_NAME)",
        "spark.driver.host": "$(POD_IP)",
        "spark.driver.bindAddress": "0.0.0.0",
        "spark.executor.instances": str(s.executor_instances),
        "spark.executor.cores": str(s.executor_cores),
        "spark.executor.memory": s.executor_memory,
        "spark.driver.cores": str(s.driver_cores),
        "spark.driver.memory": s.driver_memory,
        f"spark.kubernetes.executor.label.{POLICY_LABEL}": name,
        f"spark.kubernetes.executor.label.{JOB_KIND_LABEL}": kind,
    }
    for var in _spark_env(repository):
        if var["name"] == "ZARRLAKE_REPORT_FILE":
            continue  # the driver's alone
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            conf[f"spark.kubernetes.executor.secretKeyRef.{var['name']}"] = (
                f"{ref['name']}:{ref['key']}"
            )
        else:
            conf[f"spark.executorEnv.{var['name']}"] = str(var["value"])
    for volume, mount in zip(*storage_volumes(repository.spec.storage), strict=True):
        conf[f"spark.kubernetes.executor.secrets.{volume['secret']['secretName']}"] = mount[
            "mountPath"
        ]
    if spec.image_pull_secrets:
        conf["spark.kubernetes.container.image.pullSecrets"] = ",".join(spec.image_pull_secrets)
    conf |= dict(sorted(s.spark_conf.items()))
    cmd = [
        SPARK_SUBMIT,
        "--master",
        "k8s://https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)",
        "--deploy-mode",
        "client",
        "--name",
        child_name(name, kind, SPARK_NAME_MAX),
    ]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    return [*cmd, SPARK_ENTRY, *arguments]


def zarrlake_arguments(command: Sequence[str]) -> list[str]:
    """The ``zarrlake`` arguments of a spark-submit command (what follows the entry file)."""
    return list(command[list(command).index(SPARK_ENTRY) + 1 :])


def spark_submit_cron_jobs(
    policy: Mapping[str, Any],
    spec: RetentionPolicySpec,
    repository: Mapping[str, Any],
    defaults: SparkDefaults = SPARK_DEFAULTS,
) -> dict[str, dict[str, Any]]:
    """engine: spark without the Spark operator: CronJobs whose Jobs run ``spark-submit``
    (:func:`spark_submit_command`) as the driver's ServiceAccount, with the local jobs'
    labels, environment and termination-log report."""
    resource = _repository_with_url(repository, spec)
    image = spec.spark.image or defaults.image
    account, _ = spark_service_account(policy, spec, defaults)
    identity: dict[str, Any] = {"serviceAccountName": account, "automountServiceAccountToken": True}
    if spec.image_pull_secrets:
        identity["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    pod_env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SPARK_USER", "value": "spark"},
    ]
    jobs = {}
    url = str(resource.status.url)
    for kind, args in maintenance_arguments(spec, url, engine="spark").items():
        cmd = spark_submit_command(policy, kind, spec, args, resource, image, account)
        jobs[kind] = _cron_job(
            policy,
            kind,
            _schedule(spec, kind),
            cmd,
            resource,
            spec,
            image,
            identity=identity,
            extra_env=pod_env,
            run_as_user=SPARK_USER,
            # Named apart from the local CronJobs: switching engines replaces one by the other
            # instead of patching one pod template into the other.
            name_suffix="-spark",
        )
    return jobs


def scheduled_spark_applications(
    policy: Mapping[str, Any],
    spec: RetentionPolicySpec,
    repository: Mapping[str, Any],
    defaults: SparkDefaults = SPARK_DEFAULTS,
) -> dict[str, dict[str, Any]]:
    """engine: spark with the Spark operator installed: one ScheduledSparkApplication per job
    (``sparkoperator.k8s.io/v1beta2``); the operator starts a SparkApplication on schedule.

    The driver runs the zarrlake command line with ``--engine spark`` (cluster mode: the
    SparkSession is the application's); its pod carries the policy's job labels, and the report
    goes to its termination log, where the operator reads it when the driver finishes."""
    resource = _repository_with_url(repository, spec)
    s = spec.spark
    image = s.image or defaults.image
    account, _ = spark_service_account(policy, spec, defaults)
    name = policy["metadata"]["name"]
    env = _spark_env(resource)
    executor_env = [v for v in env if v["name"] != "ZARRLAKE_REPORT_FILE"]
    out = {}
    for kind, args in maintenance_arguments(spec, str(resource.status.url), engine="spark").items():
        schedule = _schedule(spec, kind)
        job_labels = _job_labels(policy, kind, spec)
        template: dict[str, Any] = {
            "type": "Python",
            "pythonVersion": "3",
            "mode": "cluster",
            "image": image,
            "mainApplicationFile": f"local://{SPARK_ENTRY}",
            "arguments": args,
            "sparkVersion": SPARK_RELEASE,
            "restartPolicy": {"type": "Never"},
            "timeToLiveSeconds": 7 * 86400,
            "driver": {
                "cores": s.driver_cores,
                "memory": s.driver_memory,
                "serviceAccount": account,
                "labels": job_labels,
                "env": env,
            },
            "executor": {
                "instances": s.executor_instances,
                "cores": s.executor_cores,
                "memory": s.executor_memory,
                "labels": job_labels,
                "env": executor_env,
            },
        }
        secrets = [
            {"name": v["secret"]["secretName"], "path": m["mountPath"], "secretType": "Generic"}
            for v, m in zip(*storage_volumes(resource.spec.storage), strict=True)
        ]
        if secrets:
            template["driver"]["secrets"] = secrets
            template["executor"]["secrets"] = secrets
        if s.spark_conf:
            template["sparkConf"] = dict(sorted(s.spark_conf.items()))
        if spec.image_pull_secrets:
            template["imagePullSecrets"] = list(spec.image_pull_secrets)
        out[kind] = {
            "apiVersion": SPARK_API_VERSION,
            "kind": "ScheduledSparkApplication",
            "metadata": owned_metadata(policy, child_name(name, kind, SPARK_NAME_MAX), job_labels),
            "spec": {
                "schedule": schedule.schedule,
                "suspend": schedule.suspend,
                "concurrencyPolicy": "Forbid",
                "successfulRunHistoryLimit": max(1, spec.successful_jobs_history_limit),
                "failedRunHistoryLimit": max(1, spec.failed_jobs_history_limit),
                "template": template,
            },
        }
    return out


def seconds_between(start: str | None, end: str | None) -> int | None:
    """Whole seconds from one Kubernetes time (``2025-01-02T03:04:05Z``) to another; None when
    either is missing or unreadable (or the end comes first)."""
    if not start or not end:
        return None
    try:
        begun = dt.datetime.fromisoformat(start.replace("Z", "+00:00"))
        ended = dt.datetime.fromisoformat(end.replace("Z", "+00:00"))
    except ValueError:
        return None
    if (begun.tzinfo is None) != (ended.tzinfo is None):
        return None
    seconds = (ended - begun).total_seconds()
    return int(seconds) if seconds >= 0 else None


def driver_run(pod: Mapping[str, Any]) -> JobRun | None:
    """A finished Spark driver pod (of a ScheduledSparkApplication's run) as a ``JobRun``; None
    while it runs. The report is the termination message of the driver container."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase not in ("Succeeded", "Failed"):
        return None
    result: Literal["Succeeded", "Failed"] = "Succeeded" if phase == "Succeeded" else "Failed"
    report: JobReport | None = None
    message = None
    finished = None
    started = None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        finished = finished or term.get("finishedAt")
        started = started or term.get("startedAt")
        text = (term.get("message") or "").strip()
        if text:
            report = JobReport.parse(text)
            message = None if report is not None else text.splitlines()[-1][:500]
            break
    if message is None and result == "Failed":
        message = status.get("message") or status.get("reason") or "the Spark driver failed"
    meta = pod["metadata"]
    job = (meta.get("labels") or {}).get("sparkoperator.k8s.io/app-name") or meta["name"]
    return JobRun(
        job=job,
        time=finished or now_iso(),
        result=result,
        message=message or None,
        durationSeconds=seconds_between(started or status.get("startTime"), finished),
        snapshotsExpired=report.snapshots_expired if report else None,
        objectsDeleted=report.objects_deleted if report else None,
        bytesFreed=report.bytes_freed if report else None,
        chunksPacked=report.chunks_packed if report else None,
    )


def job_run(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> JobRun | None:
    """A finished Job (and its pods) as a ``JobRun`` status entry; None while it still runs."""
    status = job.get("status") or {}
    finished = {
        c.get("type"): c
        for c in status.get("conditions") or []
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
    }
    if not finished:
        return None
    result: Literal["Succeeded", "Failed"] = "Succeeded" if "Complete" in finished else "Failed"
    cond = finished.get("Complete") or finished["Failed"]
    report: JobReport | None = None
    message = None
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            text = (term.get("message") or "").strip()
            if not text:
                continue
            report = JobReport.parse(text)
            # Not a report: a crash, whose log tail's last line says why (and no older pod's
            # report counts).
            message = None if report is not None else text.splitlines()[-1][:500]
    if message is None and result == "Failed":
        message = cond.get("message") or cond.get("reason") or "the job failed"
    ended = status.get("completionTime") or cond.get("lastTransitionTime")
    return JobRun(
        job=job["metadata"]["name"],
        time=ended or now_iso(),
        result=result,
        message=message or None,
        durationSeconds=seconds_between(status.get("startTime"), ended),
        snapshotsExpired=report.snapshots_expired if report else None,
        objectsDeleted=report.objects_deleted if report else None,
        bytesFreed=report.bytes_freed if report else None,
        chunksPacked=report.chunks_packed if report else None,
    )


# -- branch and tag claims --


def claim_winner(
    claims: Iterable[Mapping[str, Any]], *, include_deleting: bool = False
) -> str | None:
    """Of several resources claiming one branch or tag, the oldest wins (then the name).

    Resources being deleted do not win, except when asking who owned the ref until now
    (``include_deleting``): the owner's deletion deletes the ref, a loser's leaves it.
    """
    live = [c for c in claims if include_deleting or not marked_for_deletion(c)]
    if not live:
        return None
    oldest = min(
        live,
        key=lambda c: (c["metadata"].get("creationTimestamp") or "", c["metadata"]["name"]),
    )
    return str(oldest["metadata"]["name"])


def ref_name(body: Mapping[str, Any]) -> str:
    """The branch or tag a Branch/Tag resource manages: ``spec.name`` or the resource's name."""
    return str((body.get("spec") or {}).get("name") or body["metadata"]["name"])


def ref_reported(body: Mapping[str, Any], target: str | None, winner: str | None) -> bool:
    """Whether a Branch or Tag resource's status already says what was observed: Ready for its
    current generation, the owner of its ref (``winner`` of the claims on it), and that ref at
    ``target`` (the snapshot the branch head or the tag was seen at; None, the ref is gone,
    is never confirmed). False means: reconcile it."""
    meta = body["metadata"]
    status = body.get("status") or {}
    if target is None or winner != meta["name"]:
        return False
    if status.get("observedGeneration") != meta.get("generation"):
        return False
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return False
    ref = ref_name(body)
    if body.get("kind") == "Tag":
        return bool(status.get("tag") == ref and status.get("snapshot") == target)
    return bool(status.get("branch") == ref and status.get("head") == target)


# -- Mirror: the replicator Deployment and the status --

MIRROR_LABEL = "zarrlake.io/mirror"
REPLICATOR = "mirror-replicator"
MIN_MIRROR_INTERVAL = 1.0  # seconds: the floor of both the replicator's and the status' pace
#: A local maintenance Job's pod when the policy names no resources: what GC over a million chunk
#: objects and compaction of a large branch were measured to need, with room (bench/RESULTS.md).
DEFAULT_JOB_RESOURCES = {
    "requests": {"cpu": "250m", "memory": "512Mi"},
    "limits": {"memory": "4Gi"},
}

DEFAULT_REPLICATOR_RESOURCES = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


def mirror_spec_problem(spec: MirrorSpec) -> SpecProblem | None:
    """What the schema cannot say about a Mirror spec: globs that match nothing as written
    (an unclosed ``[``), durations the engine refuses. None when it is fine."""
    for glob in spec.branches:
        problem = branch_glob_problem(glob)
        if problem is not None:
            return SpecProblem("InvalidBranchGlob", f"spec.branches: {problem}")
    durations = [("interval", spec.interval), ("stalledAfter", spec.stalled_after)]
    if spec.gc is not None:
        durations += [("gc.every", spec.gc.every), ("gc.grace", spec.gc.grace)]
    for field, text in durations:
        try:
            seconds = parse_duration(text).total_seconds()
        except ValueError as e:
            return SpecProblem("InvalidDuration", f"spec.{field}: {e}")
        if seconds <= 0:
            return SpecProblem("InvalidDuration", f"spec.{field}: {text!r} is not positive")
    return None


def mirror_interval(spec: MirrorSpec) -> float:
    """The replicator's (and the status') pace in seconds, bounded below."""
    try:
        seconds = parse_duration(spec.interval).total_seconds()
    except ValueError:
        seconds = 10.0
    return max(MIN_MIRROR_INTERVAL, seconds)


def replicator_name(mirror: str) -> str:
    return child_name(mirror, "mirror")


def _seconds(value: float) -> str:
    return f"{value:g}"


def replicator_command(spec: MirrorSpec, source_url: str, destination_url: str) -> list[str]:
    """``zarrlake mirror run SOURCE DEST ...`` for the spec. The URLs carry no secrets."""
    cmd = ["zarrlake", "mirror", "run", source_url, destination_url]
    for glob in spec.branches:
        cmd += ["--branch", glob]
    cmd.append("--tags" if spec.tags else "--no-tags")
    cmd.append("--copy" if spec.mode == "copy" else "--external")
    cmd += ["--interval", _seconds(mirror_interval(spec)), "--json"]
    cmd += ["--metrics-port", str(spec.metrics_port)]
    if spec.gc is not None:
        cmd += ["--gc-every", spec.gc.every, "--gc-grace", spec.gc.grace]
    return cmd


def replicator_env(spec: MirrorSpec, repository: Repository) -> list[dict[str, Any]]:
    """The source's credentials in its provider's variables, the destination's in its
    provider's with ``ZARRLAKE_DEST_`` in front, and the source repository's lock service: all
    by Secret reference, never by value."""
    return [
        *storage_env(repository.spec.storage),
        *storage_env(spec.destination, destination=True),
        *lock_env(repository),
    ]


def replicator_deployment(
    mirror: Mapping[str, Any],
    spec: MirrorSpec,
    repository: Mapping[str, Any],
    destination_url: str,
    default_image: str = JOB_IMAGE,
) -> dict[str, Any]:
    """One replicator per Mirror: a single replica, replaced with ``Recreate`` (never two
    promoters at once; the lock service, when the source has one, makes sure of it as well).

    Raises ``ValueError`` when the source Repository has no URL in its status yet.
    """
    resource = Repository.from_body(repository)
    source_url = resource.status.url
    if not source_url:
        raise ValueError(f"Repository {spec.repository!r} has no URL in its status yet")
    name = mirror["metadata"]["name"]
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": REPLICATOR}
    pod_labels = labels(name, REPLICATOR) | {MIRROR_LABEL: name, REPOSITORY_LABEL: spec.repository}
    volumes, mounts = storage_volumes(resource.spec.storage)
    dest_volumes, dest_mounts = storage_volumes(spec.destination, destination=True)
    volumes, mounts = volumes + dest_volumes, mounts + dest_mounts
    container: dict[str, Any] = {
        "name": "replicator",
        "image": spec.image or default_image,
        "command": replicator_command(spec, source_url, destination_url),
        "env": replicator_env(spec, resource),
        "ports": [{"name": "metrics", "containerPort": spec.metrics_port}],
        "resources": spec.resources.to_k8s() if spec.resources else DEFAULT_REPLICATOR_RESOURCES,
        # Alive while its metrics server answers; being stuck is the Stalled condition's job.
        "livenessProbe": {
            "httpGet": {"path": "/metrics", "port": "metrics"},
            "initialDelaySeconds": 30,
            "periodSeconds": 20,
            "failureThreshold": 3,
        },
        "securityContext": locked_down_container(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owned_metadata(mirror, replicator_name(name), pod_labels),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": pod_labels | selector},
                "spec": {
                    **pod_identity(spec.service_account_name, spec.image_pull_secrets),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
                },
            },
        },
    }


def mirror_ref_status(ref: Mapping[str, Any]) -> MirrorRefStatus:
    """One ref of ``zarrlake.mirror.MirrorStatus.to_json()`` as the resource's status entry."""
    return MirrorRefStatus(
        kind=ref["kind"],
        name=ref["name"],
        sourceHead=ref.get("source_head"),
        mirroredHead=ref.get("mirrored_head"),
        commitsBehind=int(ref.get("commits_behind") or 0),
        secondsBehind=int(ref.get("seconds_behind") or 0),
        missingObjects=int(ref.get("missing_objects") or 0),
        lastPromotion=ref.get("last_promotion"),
        error=ref.get("error"),
    )


class MirrorHealth(NamedTuple):
    """What the refs of one status pass say, against the status before it."""

    last_progress_time: str
    commits_behind: int
    missing_objects: int
    behind: list[str]  # "branch main", ... : refs whose mirror does not show the source's head
    stalled: bool
    stalled_for: float  # seconds without progress


def _iso_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def mirror_health(
    previous: Sequence[MirrorRefStatus] | None,
    last_progress_time: str | None,
    refs: Sequence[MirrorRefStatus],
    stalled_after: dt.timedelta,
    now: dt.datetime | None = None,
) -> MirrorHealth:
    """Progress and stall from two consecutive observations of a mirror.

    Progress is a mirrored head that moved, a missing-object count that fell, or catching up.
    A mirror behind its source with no progress for longer than ``stalled_after`` is stalled;
    the first observation, and falling behind after being up to date, start the clock.
    """
    now = now or dt.datetime.now(dt.UTC)
    before = {(r.kind, r.name): r for r in previous or ()}
    behind = [f"{r.kind} {r.name}" for r in refs if r.source_head != r.mirrored_head]
    moved = any(
        (old := before.get((r.kind, r.name))) is not None
        and (r.mirrored_head != old.mirrored_head or r.missing_objects < old.missing_objects)
        for r in refs
    )
    was_up_to_date = previous is not None and all(
        r.source_head == r.mirrored_head for r in previous
    )
    since = last_progress_time
    # The clock restarts on progress, on catching up, and when a mirror that was up to date
    # falls behind (a quiet spell before is no stall); it stays put while nothing changes, so
    # an idle mirror's status stays the same and is not rewritten.
    if previous is None or since is None or moved or (bool(behind) == was_up_to_date):
        since = now_iso(now)
    waited = max(0.0, (now - _iso_time(since)).total_seconds())
    return MirrorHealth(
        since,
        sum(r.commits_behind for r in refs),
        sum(r.missing_objects for r in refs),
        behind,
        bool(behind) and waited > stalled_after.total_seconds(),
        waited,
    )


def _listing(names: Sequence[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def mirror_conditions(
    conditions: Sequence[Condition],
    health: MirrorHealth,
    stalled_after: str,
    *,
    generation: int | None = None,
    now: dt.datetime | None = None,
) -> list[Condition]:
    """Progressing and Stalled from a :class:`MirrorHealth` (Ready is the caller's)."""
    refs = _listing(health.behind)
    missing = f"{health.missing_objects} object(s) still missing at the destination"
    behind = f"{health.commits_behind} commit(s) behind ({refs})"
    if not health.behind:
        progressing = (False, "UpToDate", "every mirrored ref shows its source's head")
        stalled = (False, "UpToDate", "every mirrored ref shows its source's head")
    elif health.stalled:
        message = (
            f"no progress for {int(health.stalled_for)}s (stalledAfter {stalled_after}): "
            f"{missing}; {behind}"
        )
        progressing = (False, "Stalled", message)
        stalled = (True, "NoProgress", message)
    else:
        message = f"{behind}; {missing}"
        progressing = (True, "CatchingUp", message)
        stalled = (False, "Progressing", message)
    out = set_condition(conditions, "Progressing", *progressing, generation=generation, now=now)
    return set_condition(out, "Stalled", *stalled, generation=generation, now=now)


# -- spec.serve: zarrlake serve as a Deployment and a Service --

SERVE_COMPONENT = "serve"
#: Where the bearer token of ``spec.serve.tokenSecretRef`` is mounted (its key as ``token``).
SERVE_TOKEN_DIR = "/var/run/zarrlake-serve"
SERVE_TOKEN_FILE = f"{SERVE_TOKEN_DIR}/token"
SERVE_USER = 10001  # the image's zarrlake user (Dockerfile)
#: A server pod when the spec names no resources: the JSON API and chunk reads are light; a
#: preview of a 4096 x 4096 float32 slice holds the slice (64 MiB) and its image at once.
DEFAULT_SERVE_RESOURCES = {
    "requests": {"cpu": "100m", "memory": "256Mi"},
    "limits": {"memory": "1Gi"},
}


class ServeDefaults(NamedTuple):
    """The operator's defaults for spec.serve (Helm values ``serve.image`` and
    ``serve.resources``)."""

    image: str = JOB_IMAGE
    resources: Mapping[str, Any] = DEFAULT_SERVE_RESOURCES


SERVE_DEFAULTS = ServeDefaults()


def serve_names(repository: str) -> str:
    """One name for the server's Deployment and Service."""
    return child_name(repository, SERVE_COMPONENT)


def serve_url(repository: str, namespace: str, port: int) -> str:
    """The server's address inside the cluster (its Service's DNS name)."""
    return f"http://{serve_names(repository)}.{namespace}.svc:{port}"


def serve_storage(spec: RepositorySpec) -> StorageSpec:
    """The storage as the server reaches it: the Repository's, with ``serve.credentialsSecretRef``
    (read-only credentials) in place of its own credentials when given."""
    creds = spec.serve.credentials_secret_ref
    if creds is None:
        return spec.storage
    return spec.storage.model_copy(update={"credentials_secret": creds})


#: The pod-spec fields :func:`pod_identity` may set.
_IDENTITY_FIELDS = ("serviceAccountName", "automountServiceAccountToken", "imagePullSecrets")


def serve_deployment(
    body: Mapping[str, Any],
    spec: RepositorySpec,
    url: str,
    defaults: ServeDefaults = SERVE_DEFAULTS,
) -> dict[str, Any]:
    """``zarrlake serve URL --host 0.0.0.0 --port PORT [--token-file F]`` as a Deployment.

    The container is locked down as every other the operator runs (non-root, read-only root,
    no capabilities, a scratch ``/tmp``); storage credentials reach it by Secret reference,
    the token as a file from its Secret (never in an argument or variable). Kubernetes asks the
    server itself whether it serves: readiness is ``/readyz`` (one read of the refs: a pod that
    cannot reach the storage leaves the Service), liveness ``/healthz`` (no I/O: a slow bucket
    restarts nothing). The pods carry no ``zarrlake.io/repository`` label, so the lock
    service's NetworkPolicy keeps them out: the server never writes. ``url`` is the Repository's
    storage URL (its status); it carries no secrets.
    """
    serve = spec.serve
    storage = serve_storage(spec)
    volumes, mounts = storage_volumes(storage)
    virtual_env, virtual_volumes, virtual_mounts = virtual_credentials(spec)
    volumes += virtual_volumes
    mounts += virtual_mounts
    args = ["serve", url, "--host", "0.0.0.0", "--port", str(serve.port)]
    token = serve.token_secret_ref
    if token is not None:
        args += ["--token-file", SERVE_TOKEN_FILE]
        volumes.append(
            {
                "name": "serve-token",
                "secret": {
                    "secretName": token.name,
                    "items": [{"key": token.key, "path": "token"}],
                    "defaultMode": 0o440,  # the pod's group (fsGroup) reads it, nobody else
                },
            }
        )
        mounts.append({"name": "serve-token", "mountPath": SERVE_TOKEN_DIR, "readOnly": True})
    container: dict[str, Any] = {
        "name": SERVE_COMPONENT,
        "image": serve.image or defaults.image,
        "command": ["zarrlake"],
        "args": args,
        # null, not [], when there is none: the API server stores no empty list, and a merge
        # patch's null removes what a previous spec set.
        "env": [*storage_env(storage), *virtual_env] or None,
        "ports": [{"name": "http", "containerPort": serve.port, "protocol": "TCP"}],
        "resources": serve.resources.to_k8s() if serve.resources else dict(defaults.resources),
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 10,
            "periodSeconds": 20,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": locked_down_container(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    return _server_deployment(
        body,
        SERVE_COMPONENT,
        serve.replicas,
        container,
        volumes,
        pod_identity(serve.service_account_name, serve.image_pull_secrets),
    )


def _server_deployment(
    body: Mapping[str, Any],
    component: str,
    replicas: int,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
    identity: Mapping[str, Any],
) -> dict[str, Any]:
    """The Deployment of one of a Repository's servers (``serve``, the commit service) around
    its container: non-root pods of the image's zarrlake user, replicas spread."""
    name = body["metadata"]["name"]
    selector = {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": component}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _server_metadata(body, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels(name, component) | selector},
                "spec": {
                    # Given whole, null where unset: drift is corrected by merge patches, which
                    # keep what they leave out (a ServiceAccount dropped from the spec must go).
                    **dict.fromkeys(_IDENTITY_FIELDS),
                    **identity,
                    # The replicas of one server prefer different nodes and zones.
                    **preferred_spread(selector),
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": SERVE_USER,
                        "runAsGroup": SERVE_USER,
                        "fsGroup": SERVE_USER,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
                },
            },
        },
    }


def _server_metadata(body: Mapping[str, Any], component: str) -> dict[str, Any]:
    name = body["metadata"]["name"]
    return owned_metadata(
        body, child_name(name, component), labels(name, component) | {REPOSITORY_LABEL: name}
    )


def _server_service(body: Mapping[str, Any], component: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _server_metadata(body, component),
        "spec": {
            "type": "ClusterIP",
            "selector": {
                "app.kubernetes.io/instance": body["metadata"]["name"],
                "app.kubernetes.io/component": component,
            },
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def serve_service(body: Mapping[str, Any], spec: RepositorySpec) -> dict[str, Any]:
    """The server's ClusterIP Service: ``status.serve.url`` names it."""
    return _server_service(body, SERVE_COMPONENT, spec.serve.port)


COMMIT_COMPONENT = "commit"
#: Where the tokens file of ``spec.commitService.tokensSecretRef`` is mounted.
COMMIT_TOKENS_DIR = "/var/run/zarrlake-service"
COMMIT_TOKENS_FILE = f"{COMMIT_TOKENS_DIR}/tokens.json"


def commit_service_names(repository: str) -> str:
    """One name for the commit service's Deployment and Service."""
    return child_name(repository, COMMIT_COMPONENT)


def commit_service_url(repository: str, namespace: str, port: int) -> str:
    return f"http://{commit_service_names(repository)}.{namespace}.svc:{port}"


def commit_service_deployment(
    body: Mapping[str, Any],
    spec: RepositorySpec,
    url: str,
    defaults: ServeDefaults = SERVE_DEFAULTS,
) -> dict[str, Any]:
    """``zarrlake service URL --host 0.0.0.0 --port PORT --tokens-file F`` as a Deployment of
    one pod, with the Repository's own credentials (it alone writes the refs) and the tokens
    file from its Secret. Readiness and liveness are ``/healthz``. Its pods carry no
    ``zarrlake.io/repository`` label: the lock service's NetworkPolicy keeps them out (the
    service's appends are create-only writes, decided without the lock)."""
    service = spec.commit_service
    assert service.tokens_secret_ref is not None  # the spec's rules ask for it
    volumes, mounts = storage_volumes(spec.storage)
    # Its checks read the new data, virtual chunks too.
    virtual_env, virtual_volumes, virtual_mounts = virtual_credentials(spec)
    volumes += virtual_volumes
    mounts += virtual_mounts
    tokens = service.tokens_secret_ref
    volumes.append(
        {
            "name": "service-tokens",
            "secret": {
                "secretName": tokens.name,
                "items": [{"key": tokens.key, "path": "tokens.json"}],
                "defaultMode": 0o440,
            },
        }
    )
    mounts.append({"name": "service-tokens", "mountPath": COMMIT_TOKENS_DIR, "readOnly": True})
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "timeoutSeconds": 5}
    templates = check_job_templates(body, spec, url)
    check_jobs_env = (
        [{"name": "ZARRLAKE_CHECK_JOBS", "value": json.dumps(templates, sort_keys=True)}]
        if templates
        else []
    )
    if service.events:
        meta = body["metadata"]
        about = {
            "apiVersion": body.get("apiVersion", ""),
            "kind": body.get("kind", "Repository"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        }
        check_jobs_env.append(
            {"name": "ZARRLAKE_EVENTS_FOR", "value": json.dumps(about, sort_keys=True)}
        )
    container: dict[str, Any] = {
        "name": COMMIT_COMPONENT,
        "image": service.image or defaults.image,
        "command": ["zarrlake"],
        "args": [
            "service",
            url,
            "--host",
            "0.0.0.0",
            "--port",
            str(service.port),
            "--tokens-file",
            COMMIT_TOKENS_FILE,
        ],
        "env": [*storage_env(spec.storage), *virtual_env, *check_jobs_env] or None,
        "ports": [{"name": "http", "containerPort": service.port, "protocol": "TCP"}],
        "resources": service.resources.to_k8s() if service.resources else dict(defaults.resources),
        "readinessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {
            **probe,
            "initialDelaySeconds": 10,
            "periodSeconds": 20,
            "failureThreshold": 3,
        },
        "securityContext": locked_down_container(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    return _server_deployment(
        body,
        COMMIT_COMPONENT,
        1,
        container,
        volumes,
        pod_identity(commit_service_account(body, spec)[0], service.image_pull_secrets),
    )


CREDENTIALS_COMPONENT = "credentials"


def role_credentials_secret_name(repository: str, role: str) -> str:
    """The Secret holding the key the operator made for ``role`` (provisionCredentials)."""
    return child_name(repository, f"{role}-credentials")


def role_credentials_secret(
    body: Mapping[str, Any], role: str, access_key_id: str, secret_access_key: str, user: str
) -> dict[str, Any]:
    """A ``role``'s key as a credentials Secret (the keys ``storage.credentialsSecret``
    reads by default, so a pod can take it with ``envFrom``), owned by the Repository."""
    name = body["metadata"]["name"]
    meta = owned_metadata(
        body,
        role_credentials_secret_name(name, role),
        labels(name, CREDENTIALS_COMPONENT) | {REPOSITORY_LABEL: name},
    )
    meta["annotations"] = {"zarrlake.io/iam-user": user, "zarrlake.io/role": role}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": {
            "AWS_ACCESS_KEY_ID": access_key_id,
            "AWS_SECRET_ACCESS_KEY": secret_access_key,
        },
    }


#: A check Job's name: its generateName (this long at most) and 8 characters of its own.
CHECK_JOB_PREFIX_MAX = DNS_NAME_MAX - 8
CHECK_COMPONENT = "check"


def commit_service_account(
    body: Mapping[str, Any], spec: RepositorySpec
) -> tuple[str | None, bool]:
    """Whom the commit service's pod runs as, and whether the operator makes that
    ServiceAccount: the one the spec names; else, when it uses the API (checks as Jobs, Events
    of refusals), one of the operator's; else none (no API token mounted)."""
    service = spec.commit_service
    if service.service_account_name:
        return service.service_account_name, False
    if service.checks or service.events:
        return commit_service_names(body["metadata"]["name"]), True
    return None, False


def commit_service_rbac(body: Mapping[str, Any], spec: RepositorySpec) -> list[dict[str, Any]]:
    """When the service uses the API, a Role in its namespace bound to its ServiceAccount (made
    too, unless the spec names one): to run checks as Jobs, create them, follow them and read
    their pods' termination messages; to tell of refusals, post Events (and count repeats).
    Nothing else is granted; but creating Jobs is creating pods, which may run as any
    ServiceAccount and mount any Secret of the namespace (docs/design/governance.md)."""
    service = spec.commit_service
    rules: list[dict[str, Any]] = []
    if service.checks:
        rules += [
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "delete"]},
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        ]
    if service.events:
        rules.append({"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]})
    if not rules:
        return []
    name = body["metadata"]["name"]
    obj_name = commit_service_names(name)
    account, managed = commit_service_account(body, spec)
    meta = owned_metadata(body, obj_name, labels(name, COMMIT_COMPONENT))
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": meta,
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": obj_name},
        "subjects": [
            {"kind": "ServiceAccount", "name": account, "namespace": body["metadata"]["namespace"]}
        ],
    }
    made = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}] if managed else []
    return [*made, role, binding]


def check_job_templates(
    body: Mapping[str, Any], spec: RepositorySpec, url: str
) -> dict[str, dict[str, Any]]:
    """``spec.commitService.checks`` as the Jobs the service creates (it adds a name's last
    characters and the change, :mod:`zarrlake.checkjobs`): the check's image and command
    (default ``zarrlake check URL``), the repository's credentials by Secret reference (a check
    reads the change), its report to the termination log, its deadline. Owned by the
    Repository, so that a Job left behind goes with it."""
    name = body["metadata"]["name"]
    service = spec.commit_service
    out = {}
    for check in service.checks:
        volumes, mounts = storage_volumes(spec.storage)
        virtual_env, virtual_volumes, virtual_mounts = virtual_credentials(spec)
        job_labels = labels(name, CHECK_COMPONENT) | {REPOSITORY_LABEL: name}
        container: dict[str, Any] = {
            "name": CHECK_COMPONENT,
            "image": check.image,
            "env": [
                {"name": "ZARRLAKE_REPORT_FILE", "value": "/dev/termination-log"},
                *storage_env(spec.storage),
                *virtual_env,
            ],
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": locked_down_container(),
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts, *virtual_mounts],
        }
        if check.command is None and check.args is None:
            container["command"] = ["zarrlake", "check", url]
        if check.command is not None:
            container["command"] = list(check.command)
        if check.args is not None:
            container["args"] = list(check.args)
        if check.resources is not None:
            container["resources"] = check.resources.to_k8s()
        meta = owned_metadata(body, "", job_labels)
        del meta["name"]
        # Without blockOwnerDeletion: setting it needs update on repositories/finalizers (the
        # OwnerReferencesPermissionEnforcement admission plugin), which the service lacks.
        meta["ownerReferences"] = [
            {**ref, "blockOwnerDeletion": False} for ref in meta["ownerReferences"]
        ]
        prefix = child_name(
            name, f"{CHECK_COMPONENT}-{_short(check.name)}", CHECK_JOB_PREFIX_MAX - 1
        )
        meta["generateName"] = prefix + "-"
        identity = pod_identity(check.service_account_name, service.image_pull_secrets)
        out[check.name] = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta,
            "spec": {
                "backoffLimit": 0,
                "activeDeadlineSeconds": check.timeout_seconds,
                "template": {
                    "metadata": {"labels": job_labels},
                    "spec": {
                        "restartPolicy": "Never",
                        **identity,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": 10001,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [container],
                        "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes, *virtual_volumes],
                    },
                },
            },
        }
    return out


def _short(check: str) -> str:
    """A check's name as part of a Job's: a DNS label of at most 20 characters (a stable hash
    where it is longer or has characters a label may not: dots, underscores, capitals)."""
    label = re.sub(r"[^a-z0-9-]", "-", check).strip("-")
    if label == check and len(label) <= 20:
        return label
    digest = hashlib.sha256(check.encode()).hexdigest()[:8]
    head = label[:11].strip("-")
    return f"{head}-{digest}" if head else digest


def commit_service_service(body: Mapping[str, Any], spec: RepositorySpec) -> dict[str, Any]:
    """The commit service's ClusterIP Service: ``status.commitService.url`` names it."""
    return _server_service(body, COMMIT_COMPONENT, spec.commit_service.port)


class ServeState(NamedTuple):
    """The ServeReady condition's facts, and how many server pods are ready.

    ``starting``: a rollout is on its way (the Deployment controller and the kubelets are still
    at work, and nobody needs to act): the Repository is ``Reconciling`` meanwhile."""

    ready: bool
    reason: str
    message: str
    ready_replicas: int = 0
    starting: bool = False


def serve_rollout(deployment: Mapping[str, Any] | None, replicas: int) -> ServeState:
    """How the server's Deployment stands, from its status, read as ``kubectl rollout status``
    reads it: the current template rolled out and every replica ready is ``Available``; a
    rollout on its way ``Starting``; one past its progress deadline ``RolloutFailed``; one that
    completed and then lost ready pods (a failing ``/readyz``: the storage unreachable, say)
    ``Unavailable``. ``replicas`` 0 is ``ScaledToZero``: asked for, nothing serves."""
    if replicas == 0:
        return ServeState(False, "ScaledToZero", "spec.serve.replicas is 0: no server runs")
    if deployment is None:
        return ServeState(False, "Starting", "the server Deployment is being made", starting=True)
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    generation = (deployment.get("metadata") or {}).get("generation")
    progressing: Mapping[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {}
    )
    if progressing.get("status") == "False" and progressing.get("reason") == (
        "ProgressDeadlineExceeded"
    ):
        message = progressing.get("message") or "the rollout exceeded its progress deadline"
        return ServeState(False, "RolloutFailed", f"{ready} of {replicas} ready: {message}", ready)
    current = (generation is None or status.get("observedGeneration") == generation) and int(
        status.get("updatedReplicas") or 0
    ) >= replicas
    counted = f"{ready} of {replicas} server pod(s) ready"
    if current and ready >= replicas:
        return ServeState(True, "Available", counted, ready)
    if current and progressing.get("reason") == "NewReplicaSetAvailable":
        return ServeState(False, "Unavailable", f"{counted} (the others fail GET /readyz)", ready)
    return ServeState(False, "Starting", f"rolling out: {counted}", ready, starting=True)
