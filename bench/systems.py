"""The systems under test, behind one small interface.

A :class:`System` is a picklable, JSON-able description (kind, backend, where its data goes), so
the run can hand it to the worker process that runs that system's workloads, and the
concurrent-writer benchmark to its writer processes. zarrlake gets every storage wrapped in a
request counter (``zarrlake_testkit.counting``). Everything a benchmark does goes through
the same five verbs for every system: ``create``/``open`` a repository, ``begin`` a write
transaction, ``read_store`` a version, ``log`` the history. Raw Zarr has no versions: its
transaction writes straight to a ``LocalStore`` (or, on S3, to Zarr's ``ObjectStore`` over
obstore's ``S3Store``) and its commit does nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import REGION, S3Server

ZARR, ZARRLAKE, ICECHUNK = "zarr", "zarrlake", "icechunk"
LOCAL, S3 = "local", "s3"

_COUNTS: Any = None


def zarrlake_counts() -> Any:
    """The storage-request counters of this process's zarrlake repositories (a ``Counts``)."""
    global _COUNTS
    if _COUNTS is None:
        from zarrlake_testkit.counting import Counts

        _COUNTS = Counts()
    return _COUNTS


class Txn:
    """A write transaction: ``store`` for Zarr, ``commit`` to publish it."""

    def __init__(self, store: Any, commit: Any) -> None:
        self.store = store
        self._commit = commit

    def commit(self, message: str, *, concurrent: bool = False) -> str | None:
        return self._commit(message, concurrent)


@dataclass(frozen=True)
class System:
    kind: str  # zarr | zarrlake | icechunk
    backend: str  # local | s3
    workdir: str  # local data goes below <workdir>/<kind>/<label>
    run_id: str  # S3 data goes below <run_id>/<kind>/<label>
    endpoint: str | None = None
    bucket: str | None = None

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.backend}"

    @property
    def versioned(self) -> bool:
        return self.kind != ZARR

    # -- where a repository lives ------------------------------------------------------------

    def _path(self, label: str) -> Path:
        return Path(self.workdir) / self.kind / label

    def _prefix(self, label: str) -> str:
        return f"{self.run_id}/{self.kind}/{label}"

    def _zarrlake_storage(self, label: str) -> Any:
        import zarrlake
        from zarrlake_testkit.counting import CountingStorage

        if self.backend == LOCAL:
            inner = zarrlake.Storage.local(self._path(label))
        else:
            inner = zarrlake.Storage.s3(
                self.bucket or "",
                self._prefix(label),
                endpoint_url=self.endpoint,
                region=REGION,
                allow_http=True,
            )
        # Every storage this process hands to zarrlake counts its requests in one place.
        return CountingStorage(inner, zarrlake_counts())

    def _icechunk_storage(self, label: str) -> Any:
        import icechunk

        if self.backend == LOCAL:
            return icechunk.local_filesystem_storage(str(self._path(label)))
        return icechunk.s3_storage(
            bucket=self.bucket or "",
            prefix=self._prefix(label),
            region=REGION,
            endpoint_url=self.endpoint,
            allow_http=True,
            force_path_style=True,
            from_env=True,
        )

    def _zarr_store(self, where: Any, read_only: bool = False) -> Any:
        """Raw Zarr's store: a ``LocalStore`` directory, or an obstore ``S3Store`` prefix."""
        if self.backend == LOCAL:
            from zarr.storage import LocalStore

            return LocalStore(where, read_only=read_only)
        from obstore.store import S3Store
        from zarr.storage import ObjectStore

        from harness import CREDENTIALS

        s3 = S3Store(
            self.bucket or "",
            prefix=self._prefix(where),
            endpoint=self.endpoint,
            region=REGION,
            access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            client_options={"allow_http": True},
            virtual_hosted_style_request=False,
        )
        return ObjectStore(s3, read_only=read_only)

    # -- the five verbs ----------------------------------------------------------------------

    def create(self, label: str) -> Any:
        """A new, empty repository (for raw Zarr: a new directory)."""
        if self.kind == ZARRLAKE:
            import zarrlake

            return zarrlake.Repository.create(self._zarrlake_storage(label))
        if self.kind == ICECHUNK:
            import icechunk

            return icechunk.Repository.create(self._icechunk_storage(label))
        if self.backend == S3:
            return label  # a prefix: nothing to create
        path = self._path(label)
        path.mkdir(parents=True, exist_ok=False)
        return path

    def open(self, label: str) -> Any:
        """The repository as a fresh client sees it: no caches carried over."""
        if self.kind == ZARRLAKE:
            import zarrlake

            return zarrlake.Repository.open(self._zarrlake_storage(label))
        if self.kind == ICECHUNK:
            import icechunk

            return icechunk.Repository.open(self._icechunk_storage(label))
        return label if self.backend == S3 else self._path(label)

    def begin(self, repo: Any) -> Txn:
        """A writable session on ``main``."""
        if self.kind == ZARRLAKE:
            session = repo.writable_session("main")
            return Txn(session.store, lambda msg, _concurrent: session.commit(msg))
        if self.kind == ICECHUNK:
            import icechunk

            session = repo.writable_session("main")

            def commit(msg: str, concurrent: bool) -> str:
                if concurrent:
                    # Icechunk's documented way for writers of disjoint chunks: rebase on the
                    # commits that landed meanwhile, failing only on real conflicts.
                    return session.commit(
                        msg, rebase_with=icechunk.ConflictDetector(), rebase_tries=1000
                    )
                return session.commit(msg)

            return Txn(session.store, commit)
        return Txn(self._zarr_store(repo), lambda _msg, _concurrent: None)

    def read_store(self, repo: Any, snapshot: str | None = None) -> Any:
        """A read-only store of ``main`` or of one snapshot."""
        if self.kind == ZARRLAKE:
            return repo.readonly_session(snapshot or "main").store
        if self.kind == ICECHUNK:
            if snapshot is None:
                return repo.readonly_session(branch="main").store
            return repo.readonly_session(snapshot_id=snapshot).store
        return self._zarr_store(repo, read_only=True)

    def log(self, repo: Any) -> list[str]:
        """Ids of every commit reachable from ``main``, newest first."""
        if self.kind == ZARRLAKE:
            return [c.id for c in repo.log("main")]
        if self.kind == ICECHUNK:
            return [s.id for s in repo.ancestry(branch="main")]
        raise TypeError("raw Zarr has no history")

    def make_refs(self, repo: Any, branches: dict[str, str], tags: dict[str, str]) -> None:
        """Create branches and tags: name -> snapshot id."""
        if not self.versioned:
            raise TypeError("raw Zarr has no refs")
        for name, snapshot in branches.items():
            if self.kind == ZARRLAKE:
                repo.create_branch(name, snapshot)
            else:
                repo.create_branch(name, snapshot_id=snapshot)
        for name, snapshot in tags.items():
            if self.kind == ZARRLAKE:
                repo.create_tag(name, snapshot)
            else:
                repo.create_tag(name, snapshot_id=snapshot)

    def refs(self, repo: Any) -> tuple[list[str], list[str]]:
        """The names of every branch and every tag, as each system lists them: zarrlake's
        ``refs()`` (one listing for both; it gives each one's snapshot too), Icechunk's
        ``list_branches()`` and ``list_tags()`` (names)."""
        if self.kind == ZARRLAKE:
            refs = repo.refs()
            return list(refs.branches), list(refs.tags)
        if self.kind == ICECHUNK:
            return sorted(repo.list_branches()), sorted(repo.list_tags())
        raise TypeError("raw Zarr has no refs")

    def destroy(self, label: str, s3: S3Server | None) -> None:
        """Delete a repository's data."""
        if self.backend == LOCAL:
            shutil.rmtree(self._path(label), ignore_errors=True)
        elif s3 is not None:
            s3.delete_prefix(self._prefix(label), self.bucket)


def make_systems(workdir: str, run_id: str, s3: S3Server | None) -> list[System]:
    """Every system/backend pair, raw Zarr first (it is the baseline)."""
    out = [
        System(ZARR, LOCAL, workdir, run_id),
        System(ZARRLAKE, LOCAL, workdir, run_id),
        System(ICECHUNK, LOCAL, workdir, run_id),
    ]
    if s3 is not None:
        out += [
            System(kind, S3, workdir, run_id, s3.endpoint, s3.bucket_for(kind))
            for kind in (ZARR, ZARRLAKE, ICECHUNK)
        ]
    return out
