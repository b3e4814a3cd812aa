"""Opening a repository described by a ``Repository`` resource (``zarrlake.io/v1alpha1``).

One implementation serves both sides: the operator (which has the resource body and reads Secrets
through its own API client) and :meth:`zarrlake.Repository.from_kubernetes` (which runs inside a
job or notebook pod and fetches both with the ``kubernetes`` client). Credentials come from the
Secrets the resource names and go straight into the storage and lock objects — never into URLs
that get logged.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from zarrlake.errors import KubernetesError
from zarrlake.extras import require
from zarrlake.storage import Storage

if TYPE_CHECKING:
    from zarrlake.locks import RedisLock
    from zarrlake.resources import MirrorDestinationSpec, StorageSpec, VirtualContainerSpec

GROUP, VERSION, PLURAL = "zarrlake.io", "v1alpha1", "repositories"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

SecretReader = Callable[[str], Mapping[str, str] | None]
"""Secret name -> decoded data, or None when the Secret does not exist."""


@dataclass(frozen=True)
class Connection:
    """Everything needed to open one repository, with the secrets resolved.

    ``storage_url`` and ``lock_url`` carry no secrets and are safe to log.
    ``provider`` is ``s3``, ``gcs``, ``azure`` or ``http``; ``bucket`` is the bucket (azure: the
    container; http: empty, ``url`` says where).
    """

    bucket: str
    prefix: str
    endpoint_url: str | None
    region: str | None
    access_key_id: str | None
    secret_access_key: str | None
    session_token: str | None
    lock_url: str | None
    lock_password: str | None
    on_unavailable: str = "optimistic"
    provider: str = "s3"
    account_name: str | None = None
    url: str | None = None
    account_key: str | None = None
    sas_token: str | None = None
    service_account_info: str | None = field(default=None, repr=False)
    #: The commit service's address (status.commitService.url), when spec.commitService runs one.
    commit_service: str | None = None
    authorization: str | None = field(default=None, repr=False)
    #: Credentials of the repository's virtual chunk containers, from the Secrets
    #: ``spec.virtualContainers`` names: ((prefix, ((field, value), ...)), ...).
    virtual: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = field(default=(), repr=False)

    @property
    def virtual_credentials(self) -> dict[str, dict[str, str]] | None:
        """:attr:`virtual` as ``Repository.open(virtual_credentials=...)`` takes them."""
        return {prefix: dict(given) for prefix, given in self.virtual} or None

    @property
    def storage_url(self) -> str:
        """The location as :meth:`Storage.from_url` reads it (credentials never in it)."""
        if self.provider == "http":
            return str(self.url)
        scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[self.provider]
        pairs = (
            ("account_name", self.account_name),
            ("endpoint_url", self.endpoint_url),
            ("region", self.region),
        )
        query = {k: v for k, v in pairs if v}
        base = f"{scheme}://{self.bucket}/{self.prefix}".rstrip("/")
        return base + ("?" + urlencode(query) if query else "")

    @property
    def credentials(self) -> tuple[str | None, ...]:
        """Every secret the connection carries (for telling two connections' clients apart)."""
        return (
            self.access_key_id,
            self.secret_access_key,
            self.session_token,
            self.account_key,
            self.sas_token,
            self.service_account_info,
            self.authorization,
        )

    @property
    def read_only(self) -> bool:
        return self.provider == "http"

    def with_credentials(self, values: Mapping[str, str | None]) -> Connection:
        fields: dict[str, Any] = dict(values)
        return replace(self, **fields)

    def storage(self) -> Storage:
        plain_http = bool(self.endpoint_url and self.endpoint_url.startswith("http://"))
        if self.provider == "gcs":
            info = None
            if self.service_account_info is not None:
                info = json.loads(self.service_account_info)  # checked when read from the Secret
            return Storage.gcs(
                self.bucket,
                self.prefix,
                endpoint_url=self.endpoint_url,
                service_account_info=info,
                allow_http=plain_http,
            )
        if self.provider == "azure":
            return Storage.azure(
                self.bucket,
                self.prefix,
                account_name=self.account_name,
                account_key=self.account_key,
                sas_token=self.sas_token,
                endpoint_url=self.endpoint_url,
                allow_http=plain_http,
            )
        if self.provider == "http":
            headers = {"Authorization": self.authorization} if self.authorization else None
            return Storage.http(str(self.url), headers=headers)
        return Storage.s3(
            self.bucket,
            self.prefix,
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            session_token=self.session_token,
            allow_http=plain_http,
        )

    def lock(self, lock_url: str | None = None) -> RedisLock | None:
        """The RedisLock, or None for ``lockService.mode: none`` (and read-only storage).

        ``lock_url`` replaces the host part (for example a ``kubectl port-forward`` address when
        running outside the cluster); the password still comes from the Secret.
        """
        url = lock_url or self.lock_url
        if url is None or self.read_only:
            return None
        from zarrlake.locks import RedisLock

        return RedisLock(with_password(url, self.lock_password), on_unavailable=self.on_unavailable)


def with_password(url: str, password: str | None) -> str:
    """``redis://host:port/0`` + password -> ``redis://:password@host:port/0`` (quoted)."""
    if not password:
        return url
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f":{quote(password, safe='')}@{host}"))


def connection_from_resource(
    resource: Mapping[str, Any],
    read_secret: SecretReader,
    *,
    require_ready: bool = True,
    with_lock: bool = True,
    with_virtual: bool = True,
) -> Connection:
    """Resolve a Repository resource (its body as a dict) into a :class:`Connection`.

    The body is read through :class:`zarrlake.resources.Repository`, the model the CRD is
    generated from. Raises :class:`KubernetesError` when the resource does not match it, is not
    Ready (unless ``require_ready`` is False, as for the operator itself), or a Secret or key it
    names is missing. ``with_lock`` False skips the lock service (and its Secret) entirely,
    ``with_virtual`` False the virtual chunk containers' Secrets (for who reads no chunks).
    """
    from pydantic import ValidationError

    from zarrlake.resources import Repository, problems

    name = (resource.get("metadata") or {}).get("name", "?")
    try:
        repository = Repository.from_body(resource)
    except ValidationError as e:
        raise KubernetesError(
            f"Repository {name!r} does not match its CRD: {problems(e)}"
        ) from None
    spec, status = repository.spec, repository.status
    if require_ready:
        ready = status.condition("Ready")
        if ready is None or ready.status != "True":
            why = ready.message if ready else "no status yet"
            raise KubernetesError(f"Repository {name!r} is not ready: {why}")

    def secret_value(secret: str, key: str) -> str | None:
        return _secret_value(read_secret, secret, key, f"Repository {name!r}")

    lock_spec = spec.lock_service
    mode = lock_spec.mode if with_lock and not spec.storage.read_only else "none"
    lock_url = lock_password = None
    if mode == "external":
        lock_url = lock_spec.url
        ref = lock_spec.password_secret
        if ref:
            lock_password = secret_value(ref.name, ref.key)
    elif mode == "managed":
        lock_url = status.lock_endpoint
        if status.lock_secret:
            lock_password = secret_value(status.lock_secret, "password")
        if lock_url is None and require_ready:
            raise KubernetesError(f"Repository {name!r} has no lock endpoint in its status")
    return replace(
        storage_connection(spec.storage, read_secret, f"Repository {name!r}"),
        virtual=(
            _virtual_credentials(spec.virtual_containers or (), read_secret, name)
            if with_virtual
            else ()
        ),
        lock_url=lock_url,
        lock_password=lock_password,
        on_unavailable=lock_spec.on_unavailable,
        commit_service=(
            status.commit_service.url
            if spec.commit_service.enabled and status.commit_service is not None
            else None
        ),
    )


def _virtual_credentials(
    containers: Sequence[VirtualContainerSpec], read_secret: SecretReader, name: str
) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """The credentials of each container with a ``credentialsSecretRef``: the Secret's keys
    that name the container's credential fields (others are left alone)."""
    from zarrlake.sources import CREDENTIALS

    found = []
    for container in containers:
        ref = container.credentials_secret_ref
        if ref is None:
            continue
        data = read_secret(ref.name)
        if data is None:
            raise KubernetesError(
                f"Secret {ref.name!r} (named by Repository {name!r} for virtual container "
                f"{container.url_prefix}) not found"
            )
        scheme = container.url_prefix.partition("://")[0]
        takes = CREDENTIALS.get(scheme, ())
        given = tuple((k, data[k].strip()) for k in takes if k in data)
        if not given:
            raise KubernetesError(
                f"Secret {ref.name!r} (for virtual container {container.url_prefix}) has none "
                f"of the keys a {scheme}:// container takes: {', '.join(takes)}"
            )
        found.append((container.url_prefix, given))
    return tuple(found)


def _secret_value(
    read_secret: SecretReader, secret: str, key: str, owner: str, *, required: bool = True
) -> str | None:
    data = read_secret(secret)
    if data is None:
        raise KubernetesError(f"Secret {secret!r} (named by {owner}) not found")
    if key not in data:
        if not required:
            return None
        raise KubernetesError(f"Secret {secret!r} has no key {key!r}")
    return data[key]


def _credentials(
    storage: StorageSpec | MirrorDestinationSpec, read_secret: SecretReader, owner: str
) -> dict[str, str | None]:
    """The :class:`Connection` fields the storage's credentials Secret fills, by provider."""
    creds = storage.credentials_secret
    if creds is None:
        return {}
    provider = storage.provider

    def value(key: str, *, required: bool = True) -> str | None:
        return _secret_value(read_secret, creds.name, key, owner, required=required)

    if provider == "azure":
        key_key, sas_key = creds.azure_keys
        found = {"account_key": value(key_key, required=False)}
        found["sas_token"] = value(sas_key, required=False)
        if not any(found.values()):
            raise KubernetesError(
                f"Secret {creds.name!r} has neither {key_key!r} (an account key) nor "
                f"{sas_key!r} (a SAS token)"
            )
        return found
    if provider == "gcs":
        key_file = value(creds.gcs_key)
        try:
            json.loads(key_file or "")
        except ValueError:
            raise KubernetesError(
                f"Secret {creds.name!r} key {creds.gcs_key!r} is not a service-account key file "
                "(JSON)"
            ) from None
        return {"service_account_info": key_file}
    if provider == "http":
        return {"authorization": value(creds.http_key)}
    found = {
        "access_key_id": value(creds.access_key_id_key),
        "secret_access_key": value(creds.secret_access_key_key),
    }
    if creds.session_token_key:
        found["session_token"] = value(creds.session_token_key, required=False)
    return found


def storage_connection(
    storage: StorageSpec | MirrorDestinationSpec,
    read_secret: SecretReader | None,
    owner: str,
) -> Connection:
    """A :class:`Connection` to a storage location without a lock service (a mirror's
    destination). Without ``read_secret`` no credentials are resolved: for its URL only.
    Raises :class:`KubernetesError` when a Secret or key it names is missing (``owner`` names
    the resource in that message)."""
    creds = {} if read_secret is None else _credentials(storage, read_secret, owner)
    return Connection(
        bucket=storage.bucket or "",
        prefix=storage.prefix,
        endpoint_url=storage.endpoint_url,
        region=storage.region,
        access_key_id=None,
        secret_access_key=None,
        session_token=None,
        lock_url=None,
        lock_password=None,
        provider=storage.provider,
        account_name=storage.account_name,
        url=getattr(storage, "url", None),  # a destination is never published (http)
    ).with_credentials(creds)


def current_namespace() -> str:
    """The pod's namespace inside a cluster, else the kubeconfig context's, else ``default``."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError:
        pass
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()
        return (context or {}).get("context", {}).get("namespace") or "default"
    except Exception:
        return "default"


def _require_client() -> None:
    """What reading resources from the cluster needs: the client, and pydantic for the specs."""
    for module in ("kubernetes", "pydantic"):
        require(module, extra="kubernetes", feature="Repository.from_kubernetes")


def api_client() -> Any:
    """An ``ApiClient`` with its own configuration (the process-wide default is left alone):
    the service account inside a pod, else ``$KUBECONFIG`` / ``~/.kube/config``."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            # $KUBECONFIG as it is now (the client reads it once, at import).
            path = os.environ.get("KUBECONFIG") or None
            config.load_kube_config(config_file=path, client_configuration=configuration)
        except Exception as e:
            raise KubernetesError(f"no in-cluster config and no usable kubeconfig: {e}") from None
    return client.ApiClient(configuration)


def api_error_reason(e: BaseException) -> str:
    """One line for a failed API call: the HTTP status and reason, else the exception."""
    status, reason = getattr(e, "status", None), getattr(e, "reason", None)
    if status is not None:
        return f"{status} {reason or ''}".strip()
    return f"{type(e).__name__}: {e}"


def secret_reader(core_api: Any, namespace: str) -> SecretReader:
    """A :data:`SecretReader` over ``CoreV1Api`` for one namespace, caching each Secret."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    cache: dict[str, Mapping[str, str] | None] = {}

    def read(name: str) -> Mapping[str, str] | None:
        if name not in cache:
            try:
                # Unparsed: with a parsed response the client logs the body (the Secret's
                # values) at DEBUG, in whatever process calls us.
                resp = core_api.read_namespaced_secret(name, namespace, _preload_content=False)
                doc = json.loads(resp.data)
            except ApiException as e:
                if e.status == 404:
                    cache[name] = None
                    return None
                raise KubernetesError(f"cannot read Secret {name!r}: {e.reason}") from None
            except (HTTPError, OSError, ValueError) as e:
                raise KubernetesError(f"cannot read Secret {name!r}: {type(e).__name__}") from None
            try:
                data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            except (ValueError, UnicodeDecodeError):
                raise KubernetesError(f"Secret {name!r} holds a value that is not text") from None
            cache[name] = data | dict(doc.get("stringData") or {})
        return cache[name]

    return read


def locate(name: str, namespace: str | None = None) -> Connection:
    """Where the Repository resource ``name`` keeps its repository, with credentials resolved.

    :meth:`zarrlake.Repository.from_kubernetes` opens what this returns; this module knows the
    cluster, not the repository, so the dependency points one way (repository -> k8s). Raises
    :class:`~zarrlake.MissingDependency` without the ``zarrlake[kubernetes]`` extra.
    """
    _require_client()
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    api = api_client()
    namespace = namespace or current_namespace()
    try:
        obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )
    except ApiException as e:
        if e.status == 404:
            raise KubernetesError(f"Repository {namespace}/{name} not found") from None
        raise KubernetesError(f"cannot read Repository {namespace}/{name}: {e.reason}") from None
    except (HTTPError, OSError) as e:
        raise KubernetesError(f"Kubernetes API unreachable: {type(e).__name__}: {e}") from None
    return connection_from_resource(obj, secret_reader(client.CoreV1Api(api), namespace))
