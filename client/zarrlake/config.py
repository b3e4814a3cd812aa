"""Repository configuration, stored in the ``repo`` object at creation (the virtual chunk
containers may change later: :func:`with_virtual_containers`)."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from zarrlake.errors import InvalidConfig

MAX_SESSION_TTL = dt.timedelta(days=7)
MAX_PACKED_CHUNK = 16 * 1024 * 1024
#: The default of :attr:`RepositoryConfig.pack_chunks_below_bytes`, for repositories created
#: without one (read when a config is made: a test of the chunk-object path may set it to 0).
PACK_CHUNKS_BELOW_BYTES = 256 * 1024


#: URL schemes a virtual chunk container may name: those whose sources zarrlake reads today.
VIRTUAL_SCHEMES = ("s3", "gs", "az", "http", "https", "file")
#: What zarrlake 0.3 and 0.4 knew of containers. The stored config keeps containers of these
#: schemes and fields under ``virtual_containers`` and the others under
#: ``virtual_containers_ext`` (which those versions leave out as a setting they do not know), so
#: that an older client still opens the repository, and refuses only refs into the containers
#: it cannot read (:class:`VirtualContainerNotAllowed`).
_FIRST_SCHEMES = ("s3", "file")
_EXT_KEY = "virtual_containers_ext"
#: Where each container field applies; elsewhere it must be left unset.
_FIELD_SCHEMES = {
    "endpoint_url": ("s3", "gs", "az"),
    "region": ("s3",),
    "account_name": ("az",),
    "anonymous": ("s3", "gs", "az"),
}


@dataclass(frozen=True)
class VirtualContainer:
    """A place outside the repository that its virtual chunk refs may point into.

    A repository lists them in its config as an allow-list: a ref whose URL starts with no
    container's ``url_prefix`` is refused when written and when read, so that a repository can
    never make a reader fetch an arbitrary URL with the reader's credentials.

    ``url_prefix`` is ``s3://bucket/…/``, ``gs://bucket/…/``, ``az://container/…/``,
    ``http(s)://host/…/`` or ``file:///…/``. How to reach it: ``endpoint_url`` (an S3-compatible
    server, a GCS or Azure emulator or another cloud), ``region`` (S3), ``account_name`` (the
    Azure storage account; else ``$AZURE_STORAGE_ACCOUNT_NAME`` or the reader's credentials),
    ``anonymous`` (unsigned requests: a public bucket). Credentials are never stored here:
    readers give them at open.
    """

    url_prefix: str
    endpoint_url: str | None = None
    region: str | None = None
    anonymous: bool = False
    account_name: str | None = None

    @property
    def scheme(self) -> str:
        """The URL scheme of the container (``s3``, ``gs``, ``az``, ``http``, ``https``,
        ``file``)."""
        return self.url_prefix.partition("://")[0]

    def to_dict(self) -> dict[str, Any]:
        """The stored form: the fields set (``url_prefix`` always)."""
        d = asdict(self)
        return {k: v for k, v in d.items() if k == "url_prefix" or v not in (None, False)}

    def __post_init__(self) -> None:
        """Raises :class:`InvalidConfig` for a prefix that is not one of the forms above
        (ending in ``/``, so that ``s3://b/data`` cannot admit ``s3://b/data2``), a setting of
        the wrong type, or one the container's scheme does not take (``region`` of a ``gs://``
        container, say)."""
        prefix = self.url_prefix
        if not isinstance(prefix, str):
            raise InvalidConfig(f"url_prefix must be a string, not {prefix!r}")
        scheme, sep, rest = prefix.partition("://")
        if not sep or scheme not in VIRTUAL_SCHEMES:
            raise InvalidConfig(
                f"virtual container {prefix!r}: the URL must start with "
                f"{' or '.join(s + '://' for s in VIRTUAL_SCHEMES)}"
            )
        if not prefix.endswith("/"):
            raise InvalidConfig(f"virtual container {prefix!r}: url_prefix must end with '/'")
        segments = rest.split("/")[1:-1]
        if any(seg in (".", "..") for seg in segments):
            raise InvalidConfig(f"virtual container {prefix!r}: no '.' or '..' segments")
        if scheme in ("s3", "gs", "az") and not rest.split("/", 1)[0]:
            what = "a container" if scheme == "az" else "a bucket"
            raise InvalidConfig(f"virtual container {prefix!r}: an {scheme}:// URL needs {what}")
        no_host = not rest.split("/", 1)[0]
        if scheme in ("http", "https") and (no_host or "?" in rest or "#" in rest):
            raise InvalidConfig(
                f"virtual container {prefix!r}: an {scheme}:// URL needs a host, and no query"
            )
        if scheme == "file" and not rest.startswith("/"):
            raise InvalidConfig(
                f"virtual container {prefix!r}: a file:// URL needs an absolute path"
            )
        for name in ("endpoint_url", "region", "account_name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidConfig(f"virtual container {prefix!r}: {name} must be a string")
        if not isinstance(self.anonymous, bool):
            raise InvalidConfig(f"virtual container {prefix!r}: anonymous must be true or false")
        for name, schemes in _FIELD_SCHEMES.items():
            if getattr(self, name) not in (None, False) and scheme not in schemes:
                raise InvalidConfig(
                    f"virtual container {prefix!r}: {name} is for "
                    f"{', '.join(s + '://' for s in schemes)} containers only"
                )
        endpoint = self.endpoint_url
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise InvalidConfig(
                f"virtual container {prefix!r}: endpoint_url must be an http(s):// URL"
            )

    @classmethod
    def from_value(cls, value: object) -> VirtualContainer:
        """A container from its config form (a dict of the fields) or itself."""
        if isinstance(value, VirtualContainer):
            return value
        if not isinstance(value, dict):
            raise InvalidConfig(f"a virtual container is a dict with url_prefix, not {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown or "url_prefix" not in value:
            raise InvalidConfig(
                f"virtual container {value!r}: needs url_prefix, takes {', '.join(sorted(known))}"
            )
        return cls(**value)


@dataclass(frozen=True)
class RepositoryConfig:
    """Engine settings.

    - ``inline_threshold_bytes``: chunks at most this size live inside the manifest, not as objects.
    - ``shard_max_refs``: the bound on chunk refs per manifest shard (what makes commits O(change)).
    - ``session_ttl``: default lifetime of a writable session (at most 7 days).
    - ``pack_chunks_below_bytes``: chunks a session writes that are above the inline threshold
      and below this size go into pack objects of a few MiB (:mod:`zarrlake.packs`): one request
      per pack instead of one per chunk. 0 writes every such chunk as an object of its own.
    - ``virtual_containers``: where virtual chunk refs may point (:class:`VirtualContainer`;
      dicts are taken). A repository with any has the ``virtual-chunks`` format feature.
    """

    inline_threshold_bytes: int = 512
    shard_max_refs: int = 2048
    session_ttl: dt.timedelta = dt.timedelta(hours=24)
    pack_chunks_below_bytes: int = field(default_factory=lambda: PACK_CHUNKS_BELOW_BYTES)
    virtual_containers: tuple[VirtualContainer, ...] = ()

    def __post_init__(self) -> None:
        """Raises :class:`InvalidConfig` (a ``ValueError``) for a value of the wrong type or out
        of range. A whole number given as a float (``1e5``, as earlier versions stored what they
        were given) is taken as the integer."""
        for name in ("inline_threshold_bytes", "shard_max_refs", "pack_chunks_below_bytes"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, value := int(value))
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidConfig(f"{name} must be an integer, not {value!r}")
        check_session_ttl(self.session_ttl, InvalidConfig)
        if not 0 <= self.inline_threshold_bytes <= 1 << 20:
            raise InvalidConfig("inline_threshold_bytes must be between 0 and 1 MiB")
        if not 4 <= self.shard_max_refs <= 1_000_000:
            raise InvalidConfig("shard_max_refs must be between 4 and 1,000,000")
        if not 0 <= self.pack_chunks_below_bytes <= MAX_PACKED_CHUNK:
            raise InvalidConfig("pack_chunks_below_bytes must be between 0 and 16 MiB")
        containers = self.virtual_containers
        if not isinstance(containers, list | tuple):
            raise InvalidConfig(f"virtual_containers must be a list, not {containers!r}")
        parsed = tuple(VirtualContainer.from_value(c) for c in containers)
        prefixes = [c.url_prefix for c in parsed]
        if len(set(prefixes)) != len(prefixes):
            raise InvalidConfig("virtual_containers lists a url_prefix twice")
        object.__setattr__(self, "virtual_containers", parsed)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["session_ttl"] = self.session_ttl.total_seconds()
        # Left out when empty: the settings of a repository without virtual chunks are what
        # they were before containers existed.
        del d["virtual_containers"]
        first = [c for c in self.virtual_containers if _first_form(c)]
        ext = [c for c in self.virtual_containers if not _first_form(c)]
        if first:
            d["virtual_containers"] = [
                {"endpoint_url": None, "region": None, "anonymous": False, **c.to_dict()}
                for c in first
            ]
        if ext:
            d[_EXT_KEY] = [c.to_dict() for c in ext]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, strict: bool = False) -> RepositoryConfig:
        """The settings in ``d`` (``session_ttl`` as a ``timedelta`` or seconds). With
        ``strict`` (a user's settings), a name zarrlake does not know raises
        :class:`InvalidConfig`, so that a misspelt one is not silently the default; without
        (a stored record's), it is left out: a newer zarrlake may have written it."""
        known = {f.name for f in fields(cls)}
        if _EXT_KEY in d and not strict:  # stored: containers older versions did not know
            d = dict(d)
            d["virtual_containers"] = [*d.get("virtual_containers", ()), *d.pop(_EXT_KEY)]
        unknown = sorted(str(k) for k in d if k not in known)
        if strict and unknown:
            raise InvalidConfig(
                f"unknown repository setting(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(sorted(known))})"
            )
        kw = {k: v for k, v in d.items() if k in known}
        ttl = kw.get("session_ttl")
        if isinstance(ttl, int | float) and not isinstance(ttl, bool):
            kw["session_ttl"] = dt.timedelta(seconds=float(ttl))
        return cls(**kw)


def with_virtual_containers(
    stored: Mapping[str, Any], containers: Sequence[VirtualContainer | dict[str, Any]]
) -> dict[str, Any]:
    """The stored settings ``stored`` with exactly ``containers`` as virtual containers, every
    other setting as it is (those a newer zarrlake wrote too). Raises :class:`InvalidConfig`
    for a container that is not valid, or a prefix listed twice."""
    if isinstance(containers, str | bytes) or not isinstance(containers, Sequence):
        raise InvalidConfig(f"virtual containers are a list, not {containers!r}")
    kept = {k: v for k, v in stored.items() if k not in ("virtual_containers", _EXT_KEY)}
    parsed = tuple(VirtualContainer.from_value(c) for c in containers)
    wanted = RepositoryConfig(virtual_containers=parsed).to_dict()
    return kept | {k: wanted[k] for k in ("virtual_containers", _EXT_KEY) if k in wanted}


def _first_form(container: VirtualContainer) -> bool:
    """Whether zarrlake 0.3 reads ``container`` as stored (its scheme and fields)."""
    return container.scheme in _FIRST_SCHEMES and container.account_name is None


def check_session_ttl(
    ttl: object, error: type[Exception], name: str = "session_ttl"
) -> dt.timedelta:
    """``ttl`` if it is a session lifetime zarrlake takes (a ``timedelta``, positive, at most
    7 days); else raise ``error`` saying so of ``name``."""
    if not isinstance(ttl, dt.timedelta):
        raise error(f"{name} must be a datetime.timedelta, not {ttl!r}")
    if not dt.timedelta(0) < ttl <= MAX_SESSION_TTL:
        raise error(f"{name} must be positive and at most 7 days")
    return ttl


#: Turns verified chunk reads off for every repository a process opens without saying
#: (``Repository.open(storage, verify_reads=None)``): the CLI's, a job's.
VERIFY_READS_ENV = "ZARRLAKE_VERIFY_READS"


def verify_reads_default() -> bool:
    """Whether chunk reads are verified when the caller does not say: on, unless
    ``$ZARRLAKE_VERIFY_READS`` is ``0``, ``false``, ``no`` or ``off``. Another value raises
    :class:`InvalidConfig`, so that a typo does not silently keep it on (or off)."""
    return _switch(VERIFY_READS_ENV, True)


#: Turns off (``0``) the age queue of optimistic writers (``zarrlake.commit.WaitQueue``) for a
#: process: with it, p99 stays within a few times p50 with dozens of writers on one branch.
FAIR_COMMITS_ENV = "ZARRLAKE_FAIR_COMMITS"


def fair_commits_default() -> bool:
    """Whether optimistic writers of a contended branch queue by age: on, unless
    ``$ZARRLAKE_FAIR_COMMITS`` is ``0``, ``false``, ``no`` or ``off`` (a typo raises). On by
    default since a rebase no longer reads a txlog per commit behind: on S3 the queue is then
    faster as well as fairer than racing (bench/RESULTS.md, issue 45)."""
    return _switch(FAIR_COMMITS_ENV, True)


#: Turns off (``0``) the narrow rebase (``docs/design/narrow-rebase.md``): every rebase then
#: reads the txlogs of the commits in between, as ``DESIGN.md`` words the rule.
NARROW_REBASE_ENV = "ZARRLAKE_NARROW_REBASE"


def narrow_rebase_default() -> bool:
    """Whether a rebase over several commits first asks the manifests whether any of them
    touched what it changes: on, unless ``$ZARRLAKE_NARROW_REBASE`` is ``0``, ``false``,
    ``no`` or ``off`` (a typo raises)."""
    return _switch(NARROW_REBASE_ENV, True)


def _switch(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise InvalidConfig(f"${name} must be 1/true/on or 0/false/off, not {value!r}")
