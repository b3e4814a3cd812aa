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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from zarrlake.errors import KubernetesError
from zarrlake.storage import Storage

if TYPE_CHECKING:
    from zarrlake.locks import RedisLock
    from zarrlake.resources import CredentialsSecretRef, MirrorDestinationSpec, StorageSpec

GROUP, VERSION, PLURAL = "zarrlake.io", "v1alpha1", "repositories"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

SecretReader = Callable[[str], Mapping[str, str] | None]
"""Secret name -> decoded data, or None when the Secret does not exist."""


@dataclass(frozen=True)
class Connection:
    """Everything needed to open one repository, with the secrets resolved.

    ``storage_url`` and ``lock_url`` carry no secrets and are safe to log.
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

    @property
    def storage_url(self) -> str:
        pairs = (("endpoint_url", self.endpoint_url), ("region", self.region))
        query = {k: v for k, v in pairs if v}
        base = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return base + ("?" + urlencode(query) if query else "")

    def storage(self) -> Storage:
        return Storage.s3(
            self.bucket,
            self.prefix,
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            session_token=self.session_token,
            allow_http=bool(self.endpoint_url and self.endpoint_url.startswith("http://")),
        )

    def lock(self, lock_url: str | None = None) -> RedisLock | None:
        """The RedisLock, or None for ``lockService.mode: none``.

        ``lock_url`` replaces the host part (for example a ``kubectl port-forward`` address when
        running outside the cluster); the password still comes from the Secret.
        """
        url = lock_url or self.lock_url
        if url is None:
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
) -> Connection:
    """Resolve a Repository resource (its body as a dict) into a :class:`Connection`.

    The body is read through :class:`zarrlake.resources.Repository`, the model the CRD is
    generated from. Raises :class:`KubernetesError` when the resource does not match it, is not
    Ready (unless ``require_ready`` is False, as for the operator itself), or a Secret or key it
    names is missing. ``with_lock`` False skips the lock service (and its Secret) entirely.
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

    access, secret, token = _credentials(
        spec.storage.credentials_secret, read_secret, f"Repository {name!r}"
    )

    lock_spec = spec.lock_service
    mode = lock_spec.mode if with_lock else "none"
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
    return Connection(
        bucket=spec.storage.bucket,
        prefix=spec.storage.prefix,
        endpoint_url=spec.storage.endpoint_url,
        region=spec.storage.region,
        access_key_id=access,
        secret_access_key=secret,
        session_token=token,
        lock_url=lock_url,
        lock_password=lock_password,
        on_unavailable=lock_spec.on_unavailable,
    )


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
    creds: CredentialsSecretRef | None, read_secret: SecretReader, owner: str
) -> tuple[str | None, str | None, str | None]:
    """(access key id, secret access key, session token) from a credentials Secret."""
    if creds is None:
        return None, None, None
    access = _secret_value(read_secret, creds.name, creds.access_key_id_key, owner)
    secret = _secret_value(read_secret, creds.name, creds.secret_access_key_key, owner)
    token = None
    if creds.session_token_key:
        token = _secret_value(
            read_secret, creds.name, creds.session_token_key, owner, required=False
        )
    return access, secret, token


def storage_connection(
    storage: StorageSpec | MirrorDestinationSpec,
    read_secret: SecretReader | None,
    owner: str,
) -> Connection:
    """A :class:`Connection` to a storage location without a lock service (a mirror's
    destination). Without ``read_secret`` no credentials are resolved: for its URL only.
    Raises :class:`KubernetesError` when a Secret or key it names is missing (``owner`` names
    the resource in that message)."""
    creds: tuple[str | None, str | None, str | None] = (None, None, None)
    if read_secret is not None:
        creds = _credentials(storage.credentials_secret, read_secret, owner)
    return Connection(
        bucket=storage.bucket,
        prefix=storage.prefix,
        endpoint_url=storage.endpoint_url,
        region=storage.region,
        access_key_id=creds[0],
        secret_access_key=creds[1],
        session_token=creds[2],
        lock_url=None,
        lock_password=None,
    )


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


def _api_client() -> Any:
    """An ``ApiClient`` with its own configuration (the process-wide default is left alone):
    the service account inside a pod, else ``$KUBECONFIG`` / ``~/.kube/config``."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise KubernetesError(
            "from_kubernetes needs the kubernetes client: pip install 'zarrlake[kubernetes]'"
        ) from None
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
    cluster, not the repository, so the dependency points one way (repository -> k8s).
    """
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    api = _api_client()
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
