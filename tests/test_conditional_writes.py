"""Atomic create-only writes (S3 ``If-None-Match: *``) are what the branch journal is built on: of
two commits racing for a branch's next entry exactly one may win. A server that ignores the header
would let both "win" and lose one. Such a server is found out before the first write and refused
with :class:`zarrlake.ConditionalWritesUnsupported`; reads never ask.

The careless server is real HTTP: moto behind a loopback proxy that drops ``If-None-Match`` and
``If-Match`` (``zarrlake_testkit.s3proxy``). The check itself runs on moto and on SeaweedFS.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zarr

import zarrlake
from cli_helpers import Result, assert_one_line_error
from zarrlake import ConditionalWritesUnsupported
from zarrlake.format.model import MIRROR_PREFIX, WRITE_PROBE_KEY
from zarrlake.mirror import Mirror
from zarrlake.storage import PreconditionFailed, Storage, StorageError
from zarrlake.storage.memory import MemoryStorage
from zarrlake_testkit.counting import CountingStorage, Counts
from zarrlake_testkit.s3proxy import HeaderStrippingProxy


@pytest.fixture
def careless(moto_s3: Any) -> Iterator[HeaderStrippingProxy]:
    """moto behind a proxy that drops conditional headers: a server that ignores them."""
    with HeaderStrippingProxy(moto_s3.endpoint) as proxy:
        yield proxy


def through(proxy: HeaderStrippingProxy, storage: Any) -> Storage:
    """``storage``'s bucket and prefix, reached through ``proxy``."""
    return Storage.s3(
        storage.bucket,
        storage.prefix,
        endpoint_url=proxy.endpoint,
        region="us-east-1",
        access_key_id="testing",
        secret_access_key="testing",
        allow_http=True,
    )


def commit_array(repo: zarrlake.Repository, value: float) -> str:
    session = repo.writable_session("main")
    arr = zarr.create_array(
        session.store, name="a", shape=(4,), chunks=(2,), dtype="f8", overwrite=True
    )
    arr[:] = value
    return session.commit(f"a = {value}")


def test_the_proxy_makes_a_server_that_ignores_conditional_writes(
    moto_s3: Any, careless: HeaderStrippingProxy
) -> None:
    storage = through(careless, moto_s3.storage())
    storage.put("k", b"first", create_only=True)
    storage.put("k", b"second", create_only=True)  # no PreconditionFailed: a lost update
    assert storage.get("k") == b"second"
    assert careless.stripped == 2
    direct = moto_s3.storage(storage.prefix)  # moto itself keeps them
    with pytest.raises(PreconditionFailed):
        direct.put("k", b"third", create_only=True)


def test_create_is_refused_before_anything_but_the_check_is_written(
    moto_s3: Any, careless: HeaderStrippingProxy
) -> None:
    direct = moto_s3.storage()
    with pytest.raises(ConditionalWritesUnsupported) as info:
        zarrlake.Repository.create(through(careless, direct))
    error = info.value
    assert isinstance(error, StorageError) and isinstance(error, zarrlake.ZarrlakeError)
    assert "\n" not in str(error)
    assert str(error).startswith(f"s3://{direct.bucket}/{direct.prefix.rstrip('/')}?")
    assert "does not keep create-only writes" in str(error)
    assert error.key == WRITE_PROBE_KEY
    assert error.found == f"a second create-only write of {WRITE_PROBE_KEY} succeeded"
    assert direct.list_keys() == [WRITE_PROBE_KEY]
    assert not zarrlake.Repository.exists(direct)


def test_an_existing_repository_is_read_but_never_written(
    moto_s3: Any, careless: HeaderStrippingProxy
) -> None:
    direct = moto_s3.storage()
    made = zarrlake.Repository.create(direct)
    head = commit_array(made, 1.0)
    made.create_tag("v1", head)
    before = sorted(direct.list_keys())
    assert WRITE_PROBE_KEY in before  # its creator checked moto, which keeps create-only writes
    counts = Counts(record_keys=True)
    storage = CountingStorage(through(careless, direct), counts)

    # Reads: open, refs, history, data, fsck. Not one write, so no check.
    repo = zarrlake.Repository.open(storage)
    assert repo.list_branches() == {"main": head} and repo.list_tags() == {"v1": head}
    assert next(iter(repo.log("main"))).id == head
    session = repo.readonly_session("main")
    assert np.array_equal(zarr.open_array(session.store, path="a", mode="r")[:], [1.0] * 4)
    assert repo.fsck().ok
    assert not {op for op, _ in counts.calls()} & {"put", "put_create_only", "delete_many"}

    # Every way to write is refused, each before it writes anything of its own.
    writes: dict[str, Callable[[], object]] = {
        "writable_session": lambda: repo.writable_session("main"),
        "create_branch": lambda: repo.create_branch("dev"),
        "reset_branch": lambda: repo.reset_branch("main", head),
        "create_tag": lambda: repo.create_tag("v2", head),
        "delete_tag": lambda: repo.delete_tag("v1"),
        "gc": lambda: repo.gc(),
        "compact": lambda: repo.compact(),
        "expire": lambda: repo.expire(zarrlake.RetentionRules()),
    }
    for name, write in writes.items():
        counts.reset()
        with pytest.raises(ConditionalWritesUnsupported):
            write()
        written = {k for op, k in counts.calls() if op.startswith("put") or op == "delete_many"}
        assert written == {WRITE_PROBE_KEY}, name
    assert sorted(direct.list_keys()) == before  # the check overwrote its own object alone
    assert zarrlake.Repository.open(direct).list_branches() == {"main": head}


def test_the_cli_refuses_in_one_line(
    moto_s3: Any, careless: HeaderStrippingProxy, cli: Callable[..., Result]
) -> None:
    prefix = moto_s3.storage().prefix.rstrip("/")
    url = f"s3://{moto_s3.bucket}/{prefix}?endpoint_url={careless.endpoint}&region=us-east-1"
    message = assert_one_line_error(cli("init", url), 1)
    assert "does not keep create-only writes" in message and "testing" not in message
    assert not zarrlake.Repository.exists(moto_s3.storage(prefix))


def test_a_mirror_destination_that_ignores_them_is_refused(
    moto_s3: Any, careless: HeaderStrippingProxy
) -> None:
    source = zarrlake.Repository.create(zarrlake.Storage.memory())
    commit_array(source, 2.0)
    direct = moto_s3.storage()
    with pytest.raises(ConditionalWritesUnsupported):
        Mirror(source, through(careless, direct))
    assert direct.list_keys() == [MIRROR_PREFIX + WRITE_PROBE_KEY]


def test_the_check_is_two_requests_once_per_storage(s3_server: Any) -> None:
    # On both real servers, which keep create-only writes: the check passes, and costs little.
    counts = Counts(record_keys=True)
    prefix = s3_server.storage().prefix

    def client() -> CountingStorage:
        return CountingStorage(s3_server.storage(prefix), counts)

    creator = client()
    repo = zarrlake.Repository.create(creator)
    calls = counts.calls()
    assert ("put_create_only", WRITE_PROBE_KEY) == calls[2] == calls[3]  # after the two exists
    assert [key for _, key in calls].count(WRITE_PROBE_KEY) == 2
    counts.reset()
    commit_array(repo, 3.0)  # the same storage object: asked already
    assert WRITE_PROBE_KEY not in {key for _, key in counts.calls()}

    other = zarrlake.Repository.open(client())  # another client: asks once, when it writes
    counts.reset()
    other.list_branches()
    other.readonly_session("main")
    assert WRITE_PROBE_KEY not in {key for _, key in counts.calls()}
    counts.reset()
    other.create_branch("dev")
    other.create_branch("dev2")
    probe = [(op, key) for op, key in counts.calls() if key == WRITE_PROBE_KEY]
    assert probe == [("put_create_only", WRITE_PROBE_KEY), ("head", WRITE_PROBE_KEY)]

    counts.reset()  # a pickled copy (a Spark task's, a worker's) keeps the answer
    copy = pickle.loads(pickle.dumps(other))
    copy.create_branch("dev3")
    assert WRITE_PROBE_KEY not in {key for _, key in counts.calls()}


class RefusesEveryCreate(MemoryStorage):
    """A server that answers every create-only write with 412, even for an absent key."""

    conditional_writes_by_server = True

    def put(self, key: str, data: Any, *, create_only: bool = False) -> None:
        if create_only:
            raise PreconditionFailed(key)
        super().put(key, data)


def test_a_server_refusing_to_create_an_absent_key_is_refused_too() -> None:
    # It would not lose commits, but no commit could ever land: said at once, not by a hang.
    with pytest.raises(ConditionalWritesUnsupported, match="of absent refs/probe was refused"):
        zarrlake.Repository.create(RefusesEveryCreate())
