"""The ``zarrlake.io`` custom resources, as Pydantic models: the single source of truth.

Both sides read resources through these models: :mod:`zarrlake.k8s` (``Repository.from_kubernetes``
in a job or notebook pod) and the operator, which also writes every status through them and
generates the CRDs from them (``make crds``, :mod:`zarrlake_operator.crds`). A spec the API server
let through but that we cannot act on becomes a readable error instead of a traceback. Field names
follow the Kubernetes API conventions (camelCase, acronyms upper-case: ``endpointURL``); the Python
attributes are snake_case, and keyword arguments take the Kubernetes names.

Only the Kubernetes side imports this module (it needs pydantic, from the ``kubernetes`` extra);
``import zarrlake`` does not.

Schema details that Kubernetes needs but Pydantic does not know — CEL immutability rules, int-or-
string quantities — travel as ``json_schema_extra`` and are kept by the CRD generator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

SchemaExtra = dict[str, Any]
"""Schema keywords Kubernetes needs and Pydantic does not know, for ``json_schema_extra``."""

GROUP = "zarrlake.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "zarrlake"


def immutable(what: str) -> SchemaExtra:
    """A CEL transition rule: the API server refuses any change to the field after creation."""
    rule = {"rule": "self == oldSelf", "message": f"{what} is immutable"}
    return {"x-kubernetes-validations": [rule]}


class ResourceModel(BaseModel):
    # No docstring: a model's docstring becomes its description in the CRD schema.
    # Unknown fields are ignored, not refused: the API server prunes them anyway, and an operator
    # one version behind its CRDs must not fail on fields it does not know yet.
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    def dump(self) -> dict[str, Any]:
        """The Kubernetes (camelCase) form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def problems(error: ValidationError, prefix: str = "", limit: int = 3) -> str:
    """A validation error as ``spec.storage.bucket: Field required; ...``: where and what, never
    the value (a wrong field could hold anything, a credential included)."""

    def one(err: Any) -> str:
        message = str(err["msg"]).removeprefix("Value error, ")
        if message.startswith("spec."):  # a cross-field rule names its fields itself
            return message
        return (prefix + ".".join(str(p) for p in err["loc"])).rstrip(".") + ": " + message

    return "; ".join(one(err) for err in error.errors()[:limit])


class CustomResource(ResourceModel):
    # No docstring (see ResourceModel); each kind has its own.

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        """The resource from its body as the API server returns it: ``spec`` and ``status`` are
        read (an absent one as empty), the rest (``metadata``, ...) is not. Raises pydantic's
        ``ValidationError``."""
        return cls.model_validate(
            {"spec": body.get("spec") or {}, "status": body.get("status") or {}}
        )


# -- shared pieces --

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# S3 bucket names: 3-63 lower-case letters, digits, dots and hyphens, alphanumeric at both ends.
BUCKET = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
# Branch and tag names, as zarrlake.refs.validate_name accepts them (the engine re-checks).
REF_NAME = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$"
#: A check's name, as zarrlake.rules.CHECK_NAME has it (a test holds the two the same).
CHECK_NAME = r"^[a-z0-9][a-z0-9._-]{0,63}$"
DURATION = r"^([0-9]+(\.[0-9]+)?[wdhms])+$|^[0-9]+$"
CRON = r"^(@(yearly|annually|monthly|weekly|daily|midnight|hourly)|(\S+\s+){4}\S+)$"


_MONTHS = ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC")
_DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
#: The five fields of a CronJob schedule: name, lowest and highest value, names for values.
_CRON_FIELDS: tuple[tuple[str, int, int, tuple[str, ...]], ...] = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` cannot be a storage endpoint (None if it can): an http(s) URL with a host
    and, if any, a port in range. The schema's pattern only checks the scheme."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError as e:
        return f"{url!r} is not a URL: {e}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http:// or https:// URL with a host"
    if any(c.isspace() for c in url):
        return f"{url!r} contains whitespace"
    return None


def _valid_endpoint(url: str) -> str:
    problem = endpoint_problem(url)
    if problem:
        raise ValueError(problem)
    return url


#: A storage endpoint's URL, checked by :func:`endpoint_problem` beyond the schema's pattern.
EndpointURL = Annotated[
    str, StringConstraints(pattern=r"^https?://"), AfterValidator(_valid_endpoint)
]


def cron_problem(schedule: str) -> str | None:
    """Why Kubernetes would refuse ``schedule`` for a CronJob (None if it would not): five
    fields of values, ranges, lists and steps within each field's bounds, or a macro."""
    if schedule.startswith("@"):
        return None if re.fullmatch(CRON, schedule) else f"unknown cron macro {schedule!r}"
    parts = schedule.split()
    if len(parts) != 5:
        return f"a cron schedule has 5 fields, {schedule!r} has {len(parts)}"

    def value(text: str, lo: int, hi: int, names: tuple[str, ...], field: str) -> int:
        upper = text.upper()
        if names and upper in names:
            return names.index(upper) + lo
        if not text.isdigit():
            raise ValueError(f"{field} {text!r} is not a number")
        n = int(text)
        if not lo <= n <= hi:
            raise ValueError(f"{field} {n} is out of range {lo}-{hi}")
        return n

    for part, (field, lo, hi, names) in zip(parts, _CRON_FIELDS, strict=True):
        try:
            for item in part.split(","):
                base, slash, step = item.partition("/")
                if slash and (not step.isdigit() or int(step) == 0):
                    raise ValueError(f"{field} step {step!r} must be a positive number")
                if base in ("*", "?"):
                    if base == "?" and field not in ("day of month", "day of week"):
                        raise ValueError("'?' is only for day of month or day of week")
                    continue
                first, dash, last = base.partition("-")
                start = value(first, lo, hi, names, field)
                if dash and value(last, lo, hi, names, field) < start:
                    raise ValueError(f"{field} range {base!r} runs backwards")
        except ValueError as e:
            return f"bad cron schedule {schedule!r}: {e}"
    return None


class SecretKeyRef(ResourceModel):
    """One key of a Secret in the resource's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Secret name.")
    key: str = Field(min_length=1, description="Key within the Secret.")


class CredentialsSecretRef(ResourceModel):
    """A Secret holding the storage's credentials. Which keys are read depends on the provider:
    s3 the AWS keys, azure an account key or a SAS token, gcs a service-account key file, http
    an Authorization header value."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Secret name.")
    access_key_id_key: str = Field(
        default="AWS_ACCESS_KEY_ID",
        alias="accessKeyIDKey",
        description="Key holding the access key id.",
    )
    secret_access_key_key: str = Field(
        default="AWS_SECRET_ACCESS_KEY",
        alias="secretAccessKeyKey",
        description="Key holding the secret access key.",
    )
    session_token_key: str | None = Field(
        default=None, alias="sessionTokenKey", description="Key holding a session token, if any."
    )
    account_key_key: str | None = Field(
        default=None,
        alias="accountKeyKey",
        description="azure: key holding the storage account key "
        "(default AZURE_STORAGE_ACCOUNT_KEY; the Secret needs it or a SAS token).",
    )
    sas_token_key: str | None = Field(
        default=None,
        alias="sasTokenKey",
        description="azure: key holding a SAS token (default AZURE_STORAGE_SAS_TOKEN).",
    )
    service_account_json_key: str | None = Field(
        default=None,
        alias="serviceAccountJSONKey",
        description="gcs: key holding a service-account key file, JSON "
        "(default service-account.json).",
    )
    authorization_key: str | None = Field(
        default=None,
        alias="authorizationKey",
        description="http: key holding the Authorization header's value, e.g. 'Bearer ...' "
        "(default Authorization).",
    )

    @property
    def azure_keys(self) -> tuple[str, str]:
        """(account key, SAS token) key names, defaults applied."""
        return (
            self.account_key_key or "AZURE_STORAGE_ACCOUNT_KEY",
            self.sas_token_key or "AZURE_STORAGE_SAS_TOKEN",
        )

    @property
    def gcs_key(self) -> str:
        return self.service_account_json_key or "service-account.json"

    @property
    def http_key(self) -> str:
        return self.authorization_key or "Authorization"


Quantity = int | str
QUANTITY_SCHEMA: SchemaExtra = {"x-kubernetes-int-or-string": True}


class Resources(ResourceModel):
    """Container resource requests and limits (``cpu``, ``memory``, ...)."""

    requests: dict[str, Quantity] | None = Field(
        default=None, json_schema_extra={"additionalProperties": QUANTITY_SCHEMA}
    )
    limits: dict[str, Quantity] | None = Field(
        default=None, json_schema_extra={"additionalProperties": QUANTITY_SCHEMA}
    )

    def to_k8s(self) -> dict[str, Any]:
        return self.dump()


class Condition(ResourceModel):
    """The Kubernetes condition shape (``metav1.Condition``)."""

    type: str
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = Field(default=None, alias="lastTransitionTime")
    observed_generation: int | None = Field(default=None, alias="observedGeneration")


ConditionStatus = Literal["True", "False", "Unknown"]


class ResourceStatus(ResourceModel):
    phase: str | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    observed_generation: int | None = Field(default=None, alias="observedGeneration")

    def condition(self, type_: str) -> Condition | None:
        """The condition of this type, if the status has one."""
        return next((c for c in self.conditions if c.type == type_), None)

    def patch(self) -> dict[str, Any]:
        """This status as a JSON merge patch: exactly the fields that were set, where None (null)
        removes a field. Conditions are written whole, without unset (None) entries: a null
        inside a list is a value, not a removal, and the schema refuses it."""
        out = self.model_dump(by_alias=True, exclude_unset=True, mode="json")
        if "conditions" in out:
            out["conditions"] = [c.dump() for c in self.conditions]
        return out


# -- Repository --


#: Storage providers a Repository may live on.
StorageProvider = Literal["s3", "gcs", "azure", "http"]


def _account_name(where: str) -> Any:
    """The ``accountName`` field of the storage spec at ``spec.<where>``."""
    return Field(
        default=None,
        alias="accountName",
        pattern=r"^[a-z0-9]{3,24}$",
        description="azure: the storage account.",
        json_schema_extra=immutable(f"{where}.accountName"),
    )


def _provider_rules(where: str) -> tuple[tuple[str, Any, str], ...]:
    """(CEL rule, the same check in Python, message) of the fields only some providers take,
    for the storage spec at ``where`` (a Repository's or a Mirror destination's)."""
    return (
        (
            "self.provider == 's3' || !has(self.region)",
            lambda s: s.provider == "s3" or s.region is None,
            f"{where}.region is for provider s3 only",
        ),
        (
            "(self.provider == 'azure') == has(self.accountName)",
            lambda s: (s.provider == "azure") == (s.account_name is not None),
            f"{where}.accountName is required for provider azure, and only for it",
        ),
        (
            "self.provider == 's3' || !self.provision",
            lambda s: s.provider == "s3" or not s.provision,
            f"{where}.provision is supported for provider s3 only: create the bucket or "
            "container beforehand",
        ),
    )


#: Cross-field rules of ``spec.storage``: (CEL rule for the CRD, the same in Python, message).
#: The API server enforces the CEL; the operator checks the Python (older servers, no CEL).
_STORAGE_RULES: tuple[tuple[str, Any, str], ...] = (
    (
        "self.provider == 'http' || has(self.bucket)",
        lambda s: s.provider == "http" or s.bucket is not None,
        "spec.storage.bucket is required (for azure: the container)",
    ),
    (
        "self.provider != 'http' || (has(self.url) && !has(self.bucket) && self.prefix == '')",
        lambda s: s.provider != "http" or (s.url is not None and s.bucket is None and not s.prefix),
        "provider http takes spec.storage.url only (no bucket or prefix: the URL says where)",
    ),
    (
        "self.provider == 'http' || !has(self.url)",
        lambda s: s.provider == "http" or s.url is None,
        "spec.storage.url is for provider http only",
    ),
    (
        "self.provider != 'http' || !has(self.endpointURL)",
        lambda s: s.provider != "http" or s.endpoint_url is None,
        "provider http takes its address in spec.storage.url, not endpointURL",
    ),
    *_provider_rules("spec.storage"),
)


class StorageSpec(ResourceModel):
    """Where the repository lives. The location cannot change: data is not moved."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": rule, "message": message} for rule, _, message in _STORAGE_RULES
            ]
        }
    )

    provider: StorageProvider = Field(
        default="s3",
        description="s3 (AWS or S3-compatible), gcs (Google Cloud Storage), azure (Azure Blob "
        "Storage) or http (read-only: a repository published on a web server or CDN).",
        json_schema_extra=immutable("storage.provider"),
    )
    bucket: str | None = Field(
        default=None,
        pattern=BUCKET,
        description="Bucket name (azure: the container). Not for http.",
        json_schema_extra=immutable("storage.bucket"),
    )
    prefix: str = Field(
        default="",
        max_length=512,
        pattern=r"^([^/].*[^/]|[^/]?)$",
        description="Key prefix inside the bucket (no leading or trailing slash).",
        json_schema_extra=immutable("storage.prefix"),
    )
    region: str | None = Field(default=None, description="s3: bucket region, e.g. eu-west-1.")
    endpoint_url: EndpointURL | None = Field(
        default=None,
        alias="endpointURL",
        description="s3, gcs, azure: endpoint of a non-default service (MinIO, Ceph, an "
        "emulator, another cloud).",
    )
    account_name: str | None = _account_name("storage")
    url: str | None = Field(
        default=None,
        pattern=r"^https?://[^@/?#]+(/[^?#]*)?$",
        max_length=2048,
        description="http: where the repository is published (no credentials in it: use "
        "credentialsSecret).",
        json_schema_extra=immutable("storage.url"),
    )
    credentials_secret: CredentialsSecretRef | None = Field(
        default=None,
        alias="credentialsSecret",
        description="Secret with the credentials; without it the provider's standard chain "
        "(the pod's identity) is used.",
    )
    provision: bool = Field(
        default=False,
        description="s3: create the bucket (public access blocked, encryption on, "
        "incomplete multipart uploads aborted) if it does not exist.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for _, holds, message in _STORAGE_RULES:
            if not holds(self):
                raise ValueError(message)
        return self

    @property
    def read_only(self) -> bool:
        """Storage nothing can be written to (http): no commits, no maintenance, no lock."""
        return self.provider == "http"


class LockPersistence(ResourceModel):
    """A PersistentVolumeClaim for the managed Redis' data (its append-only file), so that a
    restarted Redis keeps its leases and fencing counter. Made once: a later change of size or
    class is not applied to the claim (expand it by editing the claim, if its class allows)."""

    size: str = Field(
        default="1Gi",
        pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$",
        description="Requested storage, e.g. 1Gi.",
    )
    storage_class_name: str | None = Field(
        default=None,
        alias="storageClassName",
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="StorageClass of the claim; absent: the cluster's default class.",
    )


class LockServiceSpec(ResourceModel):
    """The Redis lock service that serializes branch-pointer updates."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.mode != 'external' || has(self.url)",
                    "message": "lockService.url is required in external mode",
                }
            ]
        }
    )

    mode: Literal["managed", "external", "none"] = Field(
        default="managed",
        description="managed: the operator runs Redis for this repository; external: use url; "
        "none: optimistic commits only.",
    )
    url: str | None = Field(
        default=None,
        pattern=r"^rediss?://[^@]*$",
        description="external mode: redis:// or rediss:// URL without a password.",
    )
    password_secret: SecretKeyRef | None = Field(
        default=None,
        alias="passwordSecret",
        description="external mode: Secret key with the password.",
    )
    image: str = Field(default="redis:7.2-alpine", description="managed mode: Redis image.")
    resources: Resources | None = Field(default=None, description="managed mode: Redis resources.")
    on_unavailable: Literal["fail", "optimistic"] = Field(
        default="optimistic",
        alias="onUnavailable",
        description="What clients do when the lock service cannot be reached.",
    )
    persistence: LockPersistence | None = Field(
        default=None,
        description="managed mode: keep Redis' data on a PersistentVolumeClaim (absent: a "
        "temporary emptyDir, lost when the pod goes).",
    )
    client_selector: dict[str, str] | None = Field(
        default=None,
        alias="clientSelector",
        description="managed mode: labels of the pods of the Repository's namespace that may "
        "connect to Redis (its NetworkPolicy). Absent: zarrlake.io/repository=<the Repository's "
        "name>; {}: every pod of the namespace. The pods the operator runs for the repository "
        "(maintenance jobs, Spark, replicators) are always let in.",
    )
    # Scheduling of the managed Redis pod: Kubernetes objects passed through as they are.
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="managed mode: the Redis pod's affinity (a Kubernetes Affinity). Absent: "
        "prefer a node without another lock service of the namespace; {}: none.",
    )
    topology_spread_constraints: list[dict[str, Any]] | None = Field(
        default=None,
        alias="topologySpreadConstraints",
        description="managed mode: the Redis pod's topologySpreadConstraints. Absent: spread "
        "the namespace's lock services over zones (ScheduleAnyway); []: none.",
    )


class EngineConfigSpec(ResourceModel):
    """Engine settings written when the repository is created (later changes are not applied)."""

    inline_threshold_bytes: int | None = Field(default=None, alias="inlineThresholdBytes", ge=0)
    shard_max_refs: int | None = Field(default=None, alias="shardMaxRefs", ge=16)
    session_ttl: str | None = Field(default=None, alias="sessionTTL", pattern=DURATION)
    pack_chunks_below_bytes: int | None = Field(
        default=None,
        alias="packChunksBelowBytes",
        ge=0,
        le=16 * 1024 * 1024,
        description="chunks above the inline threshold and below this size go into packs of a "
        "few MiB as sessions write them (default 262144); 0: every chunk an object of its own",
    )


#: The port ``zarrlake serve`` listens on when ``spec.serve.port`` says nothing (the CLI's own).
SERVE_PORT = 8700


class ServeSpec(ResourceModel):
    """zarrlake serve for this repository, run by the operator: a Deployment and a ClusterIP
    Service in the Repository's namespace that serve every version as plain Zarr over HTTP, a
    JSON API and web pages, read-only."""

    enabled: bool = Field(
        default=False,
        description="Run the server (false: none; a Deployment and Service made before go).",
    )
    replicas: int = Field(
        default=1, ge=0, le=100, description="Server pods (0: none run; the Service stays)."
    )
    port: int = Field(
        default=SERVE_PORT,
        ge=1024,
        le=65535,
        description="Port of the server and its Service (1024 or above: the server runs as a "
        "non-root user without capabilities).",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        alias="tokenSecretRef",
        description="Secret key holding a bearer token: every route but the probes then asks "
        "for 'Authorization: Bearer <token>'. Absent: no token (anyone who reaches the Service "
        "reads the repository).",
    )
    credentials_secret_ref: CredentialsSecretRef | None = Field(
        default=None,
        alias="credentialsSecretRef",
        description="Secret with read-only storage credentials for the server (keys as for "
        "spec.storage.credentialsSecret), e.g. an S3 or MinIO key allowed only to get and list. "
        "Absent: the Repository's own credentials.",
    )
    resources: Resources | None = Field(
        default=None, description="Server resources (default: the operator's serve defaults)."
    )
    image: str | None = Field(
        default=None, description="Server image (default: the operator's serve image)."
    )
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the server pods (e.g. for IRSA or workload identity with "
        "a read-only role); without one no API token is mounted.",
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list,
        alias="imagePullSecrets",
        description="Secrets for pulling the server image from a private registry.",
    )


#: The port ``zarrlake service`` listens on when ``spec.commitService.port`` says nothing.
COMMIT_SERVICE_PORT = 8701


class CheckJobSpec(ResourceModel):
    """A check the commit service runs as a Kubernetes Job, one per change a branch's rule
    requires it on: the container exits 0 to pass, else it refuses, its termination message
    (one problem per line) saying why (docs/design/governance.md, "Checks as Jobs")."""

    name: str = Field(
        pattern=CHECK_NAME, description="The check, as requiredChecks of a protection names it."
    )
    image: str = Field(min_length=1, description="The check's image.")
    command: list[str] | None = Field(
        default=None,
        description="Its command (default, with no args either: zarrlake check <repository "
        "URL>, which runs the entry point of this name installed in the image).",
    )
    args: list[str] | None = Field(default=None, description="Its arguments.")
    timeout_seconds: int = Field(
        default=600,
        ge=1,
        le=86_400,
        alias="timeoutSeconds",
        description="The Job's activeDeadlineSeconds: past it the change is refused.",
    )
    resources: Resources | None = Field(default=None, description="The check's resources.")
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the check's pod; without one no API token is mounted.",
    )


class CommitServiceSpec(ResourceModel):
    """zarrlake service for this repository, run by the operator: the one writer of its refs,
    which applies its branch rules and checks to every writer (docs/design/governance.md). A
    Deployment and a ClusterIP Service in the Repository's namespace, with the Repository's own
    credentials; writers open the repository with commit_service= its URL (status) and a token,
    and credentials that write only immutable objects."""

    enabled: bool = Field(default=False, description="Run the commit service.")
    port: int = Field(
        default=COMMIT_SERVICE_PORT, ge=1024, le=65535, description="Port of it and its Service."
    )
    tokens_secret_ref: SecretKeyRef | None = Field(
        default=None,
        alias="tokensSecretRef",
        description='Secret key holding the tokens file: {"<token>": {"identity": "alice", '
        '"role": "writer" | "admin"}} (needed when enabled).',
    )
    resources: Resources | None = Field(default=None, description="Service resources.")
    image: str | None = Field(
        default=None, description="Service image (default: the operator's serve image)."
    )
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the service pod; without one, and with neither checks "
        "as Jobs nor events, no API token is mounted (else the operator makes one, "
        "zl-<name>-commit, and binds the Role they need to whichever it runs as).",
    )
    provision_credentials: bool = Field(
        default=False,
        alias="provisionCredentials",
        description="s3: make an IAM user per role through the provider's IAM API, with the "
        "Repository's own credentials (which must manage IAM users): writer (reads the "
        "repository, writes only chunks/, packs/, manifests/, snapshots/, txlogs/, history/; "
        "create-only on AWS) and reader (reads only), their keys in the Secrets "
        "zl-<name>-writer-credentials and zl-<name>-reader-credentials; removed when turned "
        "off or the Repository goes. status.commitService.writerCredentials says how it went.",
    )
    iam_endpoint_url: EndpointURL | None = Field(
        default=None,
        alias="iamEndpointUrl",
        description="IAM API for provisionCredentials (default: storage.endpointUrl, where an "
        "S3-compatible server such as SeaweedFS serves it, else AWS's).",
    )
    events: bool = Field(
        default=True,
        description="Post a Warning Event about this Repository for each change the service "
        "refuses (who, what, the rule or check and its message; repeats counted). Needs an "
        "API token in the service pod; false mounts none when no checks run as Jobs.",
    )
    image_pull_secrets: list[str] = Field(default_factory=list, alias="imagePullSecrets")
    checks: list[CheckJobSpec] = Field(
        default_factory=list,
        max_length=32,
        description="Checks run as Jobs (in this namespace, by the service, which the "
        "operator gives a ServiceAccount and a Role to create them); a check a protection "
        "requires that is not listed here runs in the service, as an installed entry point.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )


class CommitServiceStatus(ResourceModel):
    """Where spec.commitService answers, and whether it does."""

    url: str | None = Field(default=None, description="The service's address in the cluster.")
    ready_replicas: int | None = Field(default=None, alias="readyReplicas")
    writer_credentials: str | None = Field(
        default=None,
        alias="writerCredentials",
        description=(
            "Whether the operator made the writers' credentials (ones that write only the "
            "immutable objects, so that the service alone moves refs), and if not, what to do."
        ),
    )


class BranchProtectionSpec(ResourceModel):
    """How one branch is protected: merges only, no delete or reset, the checks it requires."""

    branch: str = Field(pattern=REF_NAME, description="The branch (main, or any other).")
    require_merge: bool = Field(
        default=True, alias="requireMerge", description="No direct commits: merges only."
    )
    allow_delete: bool = Field(default=False, alias="allowDelete")
    allow_reset: bool = Field(default=False, alias="allowReset", description="Force moves.")
    required_checks: list[Annotated[str, StringConstraints(pattern=CHECK_NAME)]] = Field(
        default_factory=list,
        alias="requiredChecks",
        max_length=32,
        description="Checks (entry points of zarrlake.checks): required-attributes, "
        "array-rules, no-nan, or any the writers' image installs.",
    )
    check_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        alias="checkOptions",
        description="Options by check name, e.g. {required-attributes: {attributes: [units]}}.",
        json_schema_extra={
            "additionalProperties": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
            }
        },
    )


class SecretRef(ResourceModel):
    """A Secret in the resource's namespace, all of its keys."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Secret name.")


#: What a virtual chunk container's URL prefix looks like (the engine's own check,
#: :class:`zarrlake.config.VirtualContainer`, says the same in more words).
VIRTUAL_PREFIX = r"^((s3|gs|az)://[^/]+/|https?://[^/?#]+/|file:///)([^?#]*/)?$"

#: Cross-field rules of one ``spec.virtualContainers`` item: (CEL, Python, message).
_VIRTUAL_RULES: tuple[tuple[str, Any, str], ...] = (
    (
        "!self.urlPrefix.contains('/../') && !self.urlPrefix.contains('/./')",
        lambda c: "/../" not in c.url_prefix and "/./" not in c.url_prefix,
        "urlPrefix: no '.' or '..' segments",
    ),
    (
        "!has(self.region) || self.urlPrefix.startsWith('s3://')",
        lambda c: c.region is None or c.url_prefix.startswith("s3://"),
        "region is for s3:// containers only",
    ),
    (
        "!has(self.accountName) || self.urlPrefix.startsWith('az://')",
        lambda c: c.account_name is None or c.url_prefix.startswith("az://"),
        "accountName is for az:// containers only",
    ),
    (
        "!has(self.endpointURL) || self.urlPrefix.matches('^(s3|gs|az)://')",
        lambda c: c.endpoint_url is None or c.url_prefix.startswith(("s3://", "gs://", "az://")),
        "endpointURL is for s3://, gs:// and az:// containers only",
    ),
    (
        "!self.anonymous || self.urlPrefix.matches('^(s3|gs|az)://')",
        lambda c: not c.anonymous or c.url_prefix.startswith(("s3://", "gs://", "az://")),
        "anonymous is for s3://, gs:// and az:// containers only",
    ),
    (
        "!has(self.credentialsSecretRef) || !(self.anonymous"
        " || self.urlPrefix.startsWith('file://'))",
        lambda c: (
            c.credentials_secret_ref is None
            or not (c.anonymous or c.url_prefix.startswith("file://"))
        ),
        "credentialsSecretRef: anonymous and file:// containers take no credentials",
    ),
)


class VirtualContainerSpec(ResourceModel):
    """A URL prefix the repository's virtual chunk refs may point into, and how to reach it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": rule, "message": message} for rule, _, message in _VIRTUAL_RULES
            ]
        }
    )

    url_prefix: str = Field(
        alias="urlPrefix",
        pattern=VIRTUAL_PREFIX,
        max_length=1024,
        description="s3://bucket/path/, gs://bucket/path/, az://container/path/, "
        "https://host/path/ or file:///path/, ending with /.",
    )
    endpoint_url: str | None = Field(
        default=None,
        alias="endpointURL",
        pattern=r"^https?://",
        max_length=1024,
        description="s3, gs, az: an S3-compatible server, an emulator, another cloud.",
    )
    region: str | None = Field(default=None, max_length=64, description="s3: the region.")
    account_name: str | None = Field(
        default=None,
        alias="accountName",
        pattern=r"^[a-z0-9]{3,24}$",
        description="az: the storage account (else the credentials Secret's account_name).",
    )
    anonymous: bool = Field(default=False, description="s3, gs, az: unsigned requests.")
    credentials_secret_ref: SecretRef | None = Field(
        default=None,
        alias="credentialsSecretRef",
        description="A Secret whose keys are the container's credentials, named as "
        "virtual_credentials names them: s3 access_key_id, secret_access_key, session_token; "
        "gs token, service_account_json; az account_name, account_key, sas_token; http(s) "
        "authorization. Given to the pods that read chunks (spec.serve, the commit service); "
        "never stored in the repository.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for _, holds, message in _VIRTUAL_RULES:
            if not holds(self):
                raise ValueError(message)
        return self

    def to_engine(self) -> dict[str, Any]:
        """The container as :class:`zarrlake.config.VirtualContainer` takes it."""
        out: dict[str, Any] = {"url_prefix": self.url_prefix}
        for name in ("endpoint_url", "region", "account_name"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.anonymous:
            out["anonymous"] = True
        return out


#: Cross-field rules of a Repository's spec: (CEL rule for the CRD, the same in Python, message).
_REPOSITORY_RULES: tuple[tuple[str, Any, str], ...] = (
    (
        "self.storage.provider != 'http' || self.reclaimPolicy == 'Retain'",
        lambda s: not (s.storage.read_only and s.reclaim_policy == "Delete"),
        "spec.reclaimPolicy Delete needs writable storage (http is read-only)",
    ),
    (
        "self.storage.provider != 'http' || !has(self.serve) || !self.serve.enabled"
        " || (!has(self.storage.credentialsSecret) && !has(self.serve.credentialsSecretRef))",
        lambda s: (
            not (
                s.storage.read_only
                and s.serve.enabled
                and (s.storage.credentials_secret or s.serve.credentials_secret_ref)
            )
        ),
        "spec.serve cannot send an Authorization header to provider http: serve a published "
        "repository that needs no credentials",
    ),
    (
        "!has(self.commitService) || !self.commitService.enabled"
        " || has(self.commitService.tokensSecretRef)",
        lambda s: not s.commit_service.enabled or s.commit_service.tokens_secret_ref is not None,
        "spec.commitService needs tokensSecretRef: the Secret of its writers' tokens",
    ),
    (
        "!has(self.commitService) || !self.commitService.enabled"
        " || self.storage.provider != 'http'",
        lambda s: not (s.commit_service.enabled and s.storage.read_only),
        "spec.commitService needs writable storage (http is read-only)",
    ),
)


class RepositorySpec(ResourceModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": rule, "message": message} for rule, _, message in _REPOSITORY_RULES
            ]
        }
    )

    storage: StorageSpec
    lock_service: LockServiceSpec = Field(default_factory=LockServiceSpec, alias="lockService")
    config: EngineConfigSpec = Field(default_factory=EngineConfigSpec)
    reclaim_policy: Literal["Retain", "Delete"] = Field(
        default="Retain",
        alias="reclaimPolicy",
        description="On deletion: Retain keeps the data; Delete removes the repository's objects.",
    )
    protection: list[BranchProtectionSpec] | None = Field(
        default=None,
        max_length=256,
        description="Branch protection the operator keeps the repository to: exactly these "
        "rules (a branch not listed is unprotected). Absent: the rules are left as they are "
        "(set with zarrlake branch protect).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["branch"],
        },
    )
    virtual_containers: list[VirtualContainerSpec] | None = Field(
        default=None,
        alias="virtualContainers",
        max_length=64,
        description="The virtual chunk containers the operator keeps the repository to: "
        "exactly these URL prefixes (refs into others are refused). Absent: left as they "
        "are (set with zarrlake virtual allow).",
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["urlPrefix"],
        },
    )
    commit_service: CommitServiceSpec = Field(
        default_factory=CommitServiceSpec,
        alias="commitService",
        description="Run the commit service (zarrlake service), the one writer of the refs.",
    )
    serve: ServeSpec = Field(
        default_factory=ServeSpec,
        description="Serve the repository over HTTP inside the cluster (zarrlake serve): plain "
        "Zarr of any version, a JSON API and web pages, read-only.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for _, holds, message in _REPOSITORY_RULES:
            if not holds(self):
                raise ValueError(message)
        return self


class ServeStatus(ResourceModel):
    """Where spec.serve's server answers, and how many of its pods do."""

    url: str | None = Field(
        default=None,
        description="The server's address inside the cluster: "
        "http://<service>.<namespace>.svc:<port>.",
    )
    ready_replicas: int | None = Field(
        default=None, alias="readyReplicas", ge=0, description="Server pods passing /readyz."
    )


class RepositoryStatus(ResourceStatus):
    repository_id: str | None = Field(default=None, alias="repositoryID")
    url: str | None = None
    lock_endpoint: str | None = Field(default=None, alias="lockEndpoint")
    lock_secret: str | None = Field(
        default=None,
        alias="lockSecret",
        description="Secret with the lock service password, if any.",
    )
    branches: int | None = None
    tags: int | None = None
    protected_branches: int | None = Field(
        default=None, alias="protectedBranches", description="Branches with a protection rule."
    )
    virtual_containers: int | None = Field(
        default=None,
        alias="virtualContainers",
        description="Virtual chunk containers the repository lists (spec.virtualContainers).",
    )
    commit_service: CommitServiceStatus | None = Field(
        default=None,
        alias="commitService",
        description="The commit service of spec.commitService, while it is enabled.",
    )
    serve: ServeStatus | None = Field(
        default=None, description="The HTTP server of spec.serve, while it is enabled."
    )


class Repository(CustomResource):
    """A zarrlake repository on object storage (S3, GCS, Azure; or read-only over HTTP), with an
    optional managed lock service."""

    spec: RepositorySpec
    status: RepositoryStatus = Field(default_factory=RepositoryStatus)


# -- Branch and Tag --


class RepositoryRef(ResourceModel):
    repository: str = Field(
        pattern=DNS_SUBDOMAIN,
        description="Name of the Repository resource in this namespace.",
        json_schema_extra=immutable("repository"),
    )


NAME_FIXED: SchemaExtra = {
    "x-kubernetes-validations": [
        {
            "rule": "has(self.name) == has(oldSelf.name)",
            "message": "name is immutable (it cannot be added or removed either)",
        }
    ]
}


class BranchSpec(RepositoryRef):
    model_config = ConfigDict(json_schema_extra=NAME_FIXED)

    name: str | None = Field(
        default=None,
        pattern=REF_NAME,
        description="Branch name (default: the resource's name).",
        json_schema_extra=immutable("name"),
    )
    from_: str = Field(
        default="main",
        alias="from",
        min_length=1,
        description="Branch, tag or snapshot id the branch starts at.",
        json_schema_extra=immutable("from"),
    )


class BranchStatus(ResourceStatus):
    branch: str | None = None
    head: str | None = None
    last_commit_time: str | None = Field(default=None, alias="lastCommitTime")
    last_commit_message: str | None = Field(default=None, alias="lastCommitMessage")
    last_commit_author: str | None = Field(default=None, alias="lastCommitAuthor")
    recreated: int | None = Field(
        default=None, description="How often the branch was recreated after vanishing from storage."
    )


class Branch(CustomResource):
    """A branch of a Repository; deleting the resource deletes the branch."""

    spec: BranchSpec
    status: BranchStatus = Field(default_factory=BranchStatus)


class TagSpec(RepositoryRef):
    model_config = ConfigDict(json_schema_extra=NAME_FIXED)

    name: str | None = Field(
        default=None,
        pattern=REF_NAME,
        description="Tag name (default: the resource's name).",
        json_schema_extra=immutable("name"),
    )
    ref: str = Field(
        min_length=1,
        description="Branch, tag or snapshot id; resolved once, at creation.",
        json_schema_extra=immutable("ref"),
    )


class TagStatus(ResourceStatus):
    tag: str | None = None
    snapshot: str | None = None


class Tag(CustomResource):
    """An immutable name for one snapshot."""

    spec: TagSpec
    status: TagStatus = Field(default_factory=TagStatus)


# -- RetentionPolicy --


class Keep(ResourceModel):
    last: int | None = Field(
        default=None, ge=1, description="Keep the last N snapshots of a branch."
    )
    days: float | None = Field(
        default=None, ge=0, description="Keep snapshots younger than D days."
    )


class RetentionRulesSpec(ResourceModel):
    """zarrlake.RetentionRules: a default rule and rules by exact branch name or glob."""

    default: Keep = Field(default_factory=Keep)
    branches: dict[str, Keep] = Field(default_factory=dict)

    def to_engine(self) -> dict[str, Any]:
        return {
            "default": self.default.dump(),
            "branches": {k: v.dump() for k, v in self.branches.items()},
        }


class JobSchedule(ResourceModel):
    schedule: str = Field(pattern=CRON, description="Cron schedule (5 fields or @daily etc.).")
    suspend: bool = False
    resources: Resources | None = None
    active_deadline_seconds: int = Field(
        default=6 * 3600, alias="activeDeadlineSeconds", ge=60, description="Job deadline."
    )

    @field_validator("schedule")
    @classmethod
    def _cron_fields(cls, v: str) -> str:
        problem = cron_problem(v)
        if problem:
            raise ValueError(problem)
        return v


class GCSchedule(JobSchedule):
    grace: str = Field(
        default="7d",
        pattern=DURATION,
        description="Only delete objects older than this (at least 7d).",
    )
    force: bool = Field(
        default=False,
        description="Allow a grace below 7 days (only if no writer session can outlive it).",
    )


class CompactionSchedule(JobSchedule):
    branch: str = Field(default="main", pattern=REF_NAME)


# Spark sizes as Spark reads them (512m, 2g, 4096, 1gb, ...): a number and an optional unit.
SPARK_SIZE = r"^[0-9]+([kKmMgGtTpP][bB]?)?$"
#: Spark settings the operator writes itself: a sparkConf entry may not replace them.
SPARK_RESERVED = (
    "spark.master",
    "spark.submit.deployMode",
    "spark.kubernetes.container.image",
    "spark.kubernetes.authenticate.",
    "spark.kubernetes.namespace",
    "spark.kubernetes.driver.pod.name",
    "spark.kubernetes.driverEnv.",
    "spark.kubernetes.executor.secretKeyRef.",
    "spark.kubernetes.driver.secretKeyRef.",
    "spark.executorEnv.",
    "spark.executor.instances",
    "spark.executor.cores",
    "spark.executor.memory",
    "spark.driver.cores",
    "spark.driver.memory",
    "spark.driver.host",
    "spark.driver.bindAddress",
)
# Keys whose values are credentials: they would travel in the job's arguments, in clear.
SPARK_CREDENTIAL_KEY = re.compile(
    r"(secret(?!s\.)|password|access\.key|session\.token|credential)", re.I
)


class SparkSpec(ResourceModel):
    """How engine: spark runs: the Spark image, identity and sizes of driver and executors."""

    image: str | None = Field(
        default=None,
        description="Spark image with zarrlake installed (examples/spark/Dockerfile); default: "
        "the operator's Spark image.",
    )
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the Spark driver; it must be allowed to create and delete "
        "pods, services and configmaps in the namespace. Default: the operator's, else one the "
        "operator creates for the policy (with that Role).",
    )
    executor_instances: int = Field(
        default=2, alias="executorInstances", ge=1, le=1000, description="Number of executors."
    )
    executor_cores: int = Field(
        default=1, alias="executorCores", ge=1, le=64, description="Cores per executor."
    )
    executor_memory: str = Field(
        default="2g",
        alias="executorMemory",
        pattern=SPARK_SIZE,
        description="Memory per executor, as Spark reads it (2g, 512m).",
    )
    driver_cores: int = Field(default=1, alias="driverCores", ge=1, le=64)
    driver_memory: str = Field(
        default="1g",
        alias="driverMemory",
        pattern=SPARK_SIZE,
        description="Driver memory, as Spark reads it (1g, 512m).",
    )
    spark_conf: dict[str, str] = Field(
        default_factory=dict,
        alias="sparkConf",
        description="Extra Spark settings (spark.* keys); never credentials, they would be "
        "visible in the job's arguments.",
    )

    @field_validator("spark_conf")
    @classmethod
    def _conf_keys(cls, conf: dict[str, str]) -> dict[str, str]:
        for key in conf:
            if not key.startswith("spark."):
                raise ValueError(f"{key!r}: Spark settings start with 'spark.'")
            reserved = next(
                (r for r in SPARK_RESERVED if key == r or (r.endswith(".") and key.startswith(r))),
                None,
            )
            if reserved is not None:
                raise ValueError(
                    f"{key!r} is set by the operator (use image, serviceAccountName, "
                    "executorInstances, executorCores, executorMemory, driverCores, driverMemory)"
                )
            if SPARK_CREDENTIAL_KEY.search(key):
                raise ValueError(
                    f"{key!r} looks like a credential: it would be visible in the job's arguments "
                    "(the Repository's credentialsSecret reaches the job by reference)"
                )
        return conf


class RetentionPolicySpec(RepositoryRef):
    rules: RetentionRulesSpec = Field(default_factory=RetentionRulesSpec)
    gc: GCSchedule = Field(
        default_factory=lambda: GCSchedule(schedule="0 3 * * *"),
        description="Expiry by the rules, then garbage collection.",
    )
    compaction: CompactionSchedule | None = None
    image: str | None = Field(
        default=None, description="Job image (default: the operator's job image)."
    )
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the job pods (e.g. for IRSA when the Repository has no "
        "credentialsSecret); without one no API token is mounted.",
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list,
        alias="imagePullSecrets",
        description="Secrets for pulling the job image from a private registry.",
    )
    engine: Literal["local", "spark"] = Field(
        default="local",
        description="local: the jobs run in one pod; spark: as Spark applications (a "
        "ScheduledSparkApplication when the Spark operator is installed, else a CronJob running "
        "spark-submit against the cluster).",
    )
    spark: SparkSpec = Field(
        default_factory=SparkSpec, description="Spark settings for engine: spark."
    )
    successful_jobs_history_limit: int = Field(default=3, alias="successfulJobsHistoryLimit", ge=0)
    failed_jobs_history_limit: int = Field(default=3, alias="failedJobsHistoryLimit", ge=0)


class JobRun(ResourceModel):
    job: str | None = None
    time: str | None = None
    result: Literal["Succeeded", "Failed"] | None = None
    message: str | None = None
    snapshots_expired: int | None = Field(default=None, alias="snapshotsExpired")
    objects_deleted: int | None = Field(default=None, alias="objectsDeleted")
    bytes_freed: int | None = Field(default=None, alias="bytesFreed")
    chunks_packed: int | None = Field(default=None, alias="chunksPacked")
    duration_seconds: int | None = Field(
        default=None,
        alias="durationSeconds",
        ge=0,
        description="From the run's start to its end, in seconds (its Job's or Spark driver's).",
    )


class RetentionPolicyStatus(ResourceStatus):
    gc_cron_job: str | None = Field(default=None, alias="gcCronJob")
    compaction_cron_job: str | None = Field(default=None, alias="compactionCronJob")
    engine: str | None = Field(
        default=None,
        description="How the jobs run: local, spark-operator (ScheduledSparkApplications) or "
        "spark-submit (CronJobs running spark-submit).",
    )
    gc_spark_application: str | None = Field(
        default=None,
        alias="gcSparkApplication",
        description="The ScheduledSparkApplication of the GC (spark-operator engine).",
    )
    compaction_spark_application: str | None = Field(
        default=None,
        alias="compactionSparkApplication",
        description="The ScheduledSparkApplication of the compaction (spark-operator engine).",
    )
    last_gc: JobRun | None = Field(default=None, alias="lastGC")
    last_compaction: JobRun | None = Field(default=None, alias="lastCompaction")


class RetentionPolicy(CustomResource):
    """Retention rules and the schedules of the jobs that apply them."""

    spec: RetentionPolicySpec
    status: RetentionPolicyStatus = Field(default_factory=RetentionPolicyStatus)


# -- Mirror --

# A branch name or a glob of them (``*``, ``?``, ``[...]``), as zarrlake.mirror matches them.
REF_GLOB = r"^[A-Za-z0-9*?\[][A-Za-z0-9._/*?\[\]!-]{0,254}$"


_DESTINATION_RULES = _provider_rules("spec.destination")


class MirrorDestinationSpec(ResourceModel):
    """Where the mirror lives: another bucket, prefix, endpoint, region or provider. It cannot
    move."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": rule, "message": message} for rule, _, message in _DESTINATION_RULES
            ]
        }
    )

    provider: Literal["s3", "gcs", "azure"] = Field(
        default="s3",
        description="s3 (AWS or S3-compatible), gcs (Google Cloud Storage) or azure (Azure Blob "
        "Storage); any source provider mirrors to any of them.",
        json_schema_extra=immutable("destination.provider"),
    )
    bucket: str = Field(
        pattern=BUCKET,
        description="Bucket name (azure: the container).",
        json_schema_extra=immutable("destination.bucket"),
    )
    prefix: str = Field(
        default="",
        max_length=512,
        pattern=r"^([^/].*[^/]|[^/]?)$",
        description="Key prefix inside the bucket (no leading or trailing slash).",
        json_schema_extra=immutable("destination.prefix"),
    )
    region: str | None = Field(default=None, description="s3: bucket region, e.g. us-west-2.")
    endpoint_url: EndpointURL | None = Field(
        default=None,
        alias="endpointURL",
        description="Endpoint of a non-default service (MinIO, Ceph, an emulator, another "
        "cloud's S3 API).",
    )
    account_name: str | None = _account_name("destination")
    credentials_secret: CredentialsSecretRef | None = Field(
        default=None,
        alias="credentialsSecret",
        description="Secret with the destination's credentials (keys as for a Repository of "
        "that provider); without it the replicator uses the provider's standard chain (for s3, "
        "the source's keys when the source is on s3 too, or the pod's identity).",
    )
    provision: bool = Field(
        default=False,
        description="s3: create the bucket (locked down as for a Repository) if it does not exist.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        for _, holds, message in _DESTINATION_RULES:
            if not holds(self):
                raise ValueError(message)
        return self


class MirrorGCSpec(ResourceModel):
    """Garbage collection on the mirror, run by the replicator between passes."""

    every: str = Field(default="1d", pattern=DURATION, description="How often.")
    grace: str = Field(
        default="7d", pattern=DURATION, description="Only delete objects older than this."
    )


class MirrorSpec(RepositoryRef):
    destination: MirrorDestinationSpec
    branches: list[Annotated[str, StringConstraints(pattern=REF_GLOB)]] = Field(
        default_factory=lambda: ["*"],
        min_length=1,
        description="Branch names or globs (*, ?, [...]) to mirror.",
    )
    tags: bool = Field(default=True, description="Mirror every tag too.")
    mode: Literal["copy", "external"] = Field(
        default="copy",
        description="copy: the replicator copies missing objects itself; external: objects "
        "arrive by bucket replication and the replicator only waits for them and promotes.",
    )
    interval: str = Field(
        default="10s", pattern=DURATION, description="Time between the replicator's passes."
    )
    stalled_after: str = Field(
        default="10m",
        alias="stalledAfter",
        pattern=DURATION,
        description="Stalled=True when the mirror is behind and has made no progress this long.",
    )
    reclaim_policy: Literal["Retain", "Delete"] = Field(
        default="Retain",
        alias="reclaimPolicy",
        description="On deletion: Retain keeps the mirror's data; Delete removes its objects.",
    )
    gc: MirrorGCSpec | None = Field(
        default=None, description="Garbage-collect the mirror (objects no mirrored ref reaches)."
    )
    resources: Resources | None = Field(default=None, description="Replicator resources.")
    metrics_port: int = Field(
        default=9102, alias="metricsPort", ge=1024, le=65535, description="Prometheus port."
    )
    image: str | None = Field(
        default=None, description="Replicator image (default: the operator's job image)."
    )
    service_account_name: str | None = Field(
        default=None,
        alias="serviceAccountName",
        pattern=DNS_SUBDOMAIN,
        description="ServiceAccount of the replicator pod (e.g. for IRSA); without one no API "
        "token is mounted.",
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list,
        alias="imagePullSecrets",
        description="Secrets for pulling the replicator image from a private registry.",
    )


class MirrorRefStatus(ResourceModel):
    """Where one mirrored branch or tag stands."""

    kind: Literal["branch", "tag"]
    name: str
    source_head: str | None = Field(default=None, alias="sourceHead")
    mirrored_head: str | None = Field(default=None, alias="mirroredHead")
    commits_behind: int = Field(default=0, alias="commitsBehind")
    seconds_behind: int = Field(default=0, alias="secondsBehind")
    missing_objects: int = Field(default=0, alias="missingObjects")
    last_promotion: str | None = Field(default=None, alias="lastPromotion")
    error: str | None = None


class MirrorStatus(ResourceStatus):
    repository_id: str | None = Field(
        default=None, alias="repositoryID", description="The id of the mirrored repository."
    )
    destination: str | None = Field(default=None, description="The mirror's storage URL.")
    replicator: str | None = Field(default=None, description="The replicator Deployment.")
    refs: list[MirrorRefStatus] | None = None
    commits_behind: int | None = Field(default=None, alias="commitsBehind")
    missing_objects: int | None = Field(default=None, alias="missingObjects")
    last_progress_time: str | None = Field(
        default=None,
        alias="lastProgressTime",
        description="When a mirrored head last moved or the missing count last fell (or the "
        "mirror was last up to date).",
    )

    def patch(self) -> dict[str, Any]:
        """As :meth:`ResourceStatus.patch`, with each ref written without its unset fields."""
        out = super().patch()
        if self.refs is not None and "refs" in out:
            out["refs"] = [r.dump() for r in self.refs]
        return out


class Mirror(CustomResource):
    """A read-only replica of a Repository in another bucket, region or cloud."""

    spec: MirrorSpec
    status: MirrorStatus = Field(default_factory=MirrorStatus)
