"""Pure tests of the on-storage format: ids, envelope, every object type, ref keys, names.

No storage is involved. The decoders are fed random bytes, random truncations of valid objects and
well-formed envelopes around random payloads: a decoder may only ever answer with a value of the
right shape, :class:`CorruptObject` or :class:`UnsupportedFormat`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zarrlake.errors import CorruptObject, InvalidName, UnsupportedFormat
from zarrlake.format.codec import (
    FORMAT_VERSION,
    HEADER_LEN,
    MAGIC,
    ObjectType,
    decode,
    encode,
    gc_paused,
    newest_version,
)
from zarrlake.format.ids import (
    CONTENT_HASHES,
    SNAPSHOT_ID_LEN,
    content_hash,
    content_hasher,
    is_snapshot_id,
    new_snapshot_id,
    snapshot_id_millis,
)
from zarrlake.format.model import (
    INLINE,
    OBJECT,
    PACKED,
    SEQ_MAX,
    AncestorRecord,
    HistoryPage,
    JournalEntry,
    ManifestShard,
    RepoRecord,
    ShardInfo,
    Snapshot,
    TagRecord,
    TxLog,
    branch_entry_key,
    branch_prefix,
    from_micros,
    ref_name_from_key,
    seq_from_entry_key,
    tag_key,
    tag_tombstone_key,
    to_micros,
)
from zarrlake.refs import validate_name

CROCKFORD = set("0123456789ABCDEFGHJKMNPQRSTVWXYZ")
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- snapshot ids ---------------------------------------------------------------------------------


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def test_snapshot_id_shape() -> None:
    for _ in range(200):
        sid = new_snapshot_id()
        assert len(sid) == SNAPSHOT_ID_LEN == 26
        assert set(sid) <= CROCKFORD
        assert sid[0] in "01234567"  # 128 bits in 130: the two top bits are zero
        assert is_snapshot_id(sid)


def test_snapshot_ids_strictly_increase_when_generated_rapidly() -> None:
    ids = [new_snapshot_id() for _ in range(20_000)]
    assert all(a < b for a, b in pairwise(ids))
    assert len(set(ids)) == len(ids)


def test_snapshot_ids_increase_within_one_millisecond() -> None:
    ms = now_ms()
    ids = [new_snapshot_id(now_ms=ms) for _ in range(1000)]
    assert all(a < b for a, b in pairwise(ids))
    millis = {snapshot_id_millis(i) for i in ids}
    assert len(millis) == 1  # same millisecond: the random part counts up instead
    assert millis.pop() >= ms


def test_snapshot_ids_unique_across_threads() -> None:
    out: list[list[str]] = [[] for _ in range(8)]
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        out[i].extend(new_snapshot_id() for _ in range(2000))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [sid for part in out for sid in part]
    assert len(set(every)) == len(every) == 16_000
    for part in out:  # each thread sees its own ids increase
        assert part == sorted(part)


def test_snapshot_id_time_extraction() -> None:
    before = now_ms()
    sid = new_snapshot_id()
    after = now_ms()
    assert before <= snapshot_id_millis(sid) <= after

    t = now_ms() + 5  # a few milliseconds ahead: later ids carry a later time and sort after
    a = new_snapshot_id(now_ms=t)
    b = new_snapshot_id(now_ms=t + 1)
    assert snapshot_id_millis(a) == t
    assert snapshot_id_millis(b) == t + 1
    assert a < b


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0" * 25,
        "0" * 27,
        "8" + "0" * 25,  # would need more than 128 bits
        "Z" * 26,
        "0" * 25 + "I",  # I, L, O and U are not Crockford digits
        "0" * 25 + "L",
        "0" * 25 + "O",
        "0" * 25 + "U",
        "0" * 25 + "-",
        "0" * 25 + " ",
    ],
)
def test_is_snapshot_id_rejects(text: str) -> None:
    assert not is_snapshot_id(text)


def test_is_snapshot_id_rejects_other_ids() -> None:
    assert not is_snapshot_id("main")
    assert not is_snapshot_id(content_hash(b"x"))
    assert is_snapshot_id("0" * 26)
    assert is_snapshot_id("7" + "Z" * 25)


def test_content_hash_is_sha256_hex() -> None:
    assert content_hash(b"") == hashlib.sha256(b"").hexdigest()
    assert content_hash(b"abc") == hashlib.sha256(b"abc").hexdigest()
    assert len(content_hash(b"abc")) == 64


def test_content_hashers_match_their_published_vectors() -> None:
    # BLAKE3's test vector for empty input (its specification), and SHA-256's.
    assert content_hasher("blake3")(b"") == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    assert content_hasher("sha256")(b"abc") == hashlib.sha256(b"abc").hexdigest()
    for name, hasher in CONTENT_HASHES.items():  # the shape object keys need: 64 hex digits
        assert len(hasher(memoryview(b"xyz"))) == 64, name
    with pytest.raises(UnsupportedFormat, match="'md5'"):
        content_hasher("md5")


# -- values for round trips ------------------------------------------------------------------------

texts = st.text(max_size=20)
aware_times = st.datetimes(
    min_value=dt.datetime(1970, 1, 1),
    max_value=dt.datetime(2300, 1, 1),
    timezones=st.sampled_from(
        [
            dt.UTC,
            dt.timezone(dt.timedelta(hours=5, minutes=30)),
            dt.timezone(-dt.timedelta(hours=8)),
        ]
    ),
)
snapshot_ids = st.integers(0, 2**128 - 1).map(
    lambda v: "".join(
        "0123456789ABCDEFGHJKMNPQRSTVWXYZ"[(v >> (5 * i)) & 31] for i in range(25, -1, -1)
    )
)
digests = st.binary(min_size=32, max_size=32).map(lambda b: b.hex())
chunk_refs = st.one_of(
    st.tuples(st.just(INLINE), st.binary(max_size=40)),
    st.tuples(st.just(OBJECT), st.binary(min_size=32, max_size=32), st.integers(0, 2**40)),
    st.tuples(st.just(PACKED), snapshot_ids, st.integers(0, 2**40), st.integers(0, 2**32)),
)
json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def manifest_shards(draw: st.DrawFn) -> ManifestShard:
    keys = sorted(draw(st.sets(st.text(min_size=1, max_size=12), max_size=20)))
    refs = [draw(chunk_refs) for _ in keys]
    return ManifestShard(keys, refs)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    return Snapshot(
        id=draw(snapshot_ids),
        parents=tuple(draw(st.lists(snapshot_ids, max_size=2))),
        time=draw(aware_times),
        author=draw(st.none() | texts),
        message=draw(texts),
        metadata=draw(st.dictionaries(texts, json_like, max_size=4)),
        nodes=draw(st.dictionaries(texts, st.binary(max_size=30), max_size=4)),
        shards=[
            ShardInfo(a, b, d, n)
            for a, b, d, n in draw(
                st.lists(st.tuples(texts, texts, digests, st.integers(0, 10**6)), max_size=5)
            )
        ],
        ancestry=draw(st.lists(snapshot_ids, max_size=5)),
    )


txlogs = st.builds(
    TxLog,
    st.lists(texts, max_size=5),
    st.lists(texts, max_size=5),
    st.lists(texts, max_size=3),
    st.lists(texts, max_size=3),
)
journal_entries = st.builds(
    JournalEntry,
    seq=st.integers(0, SEQ_MAX),
    snapshot=st.none() | snapshot_ids,
    previous=st.none() | snapshot_ids,
    time=aware_times,
    writer=texts,
    token=st.none() | st.integers(0, 2**63 - 1),
)
tag_records = st.builds(TagRecord, snapshot=snapshot_ids, time=aware_times)
repo_records = st.builds(
    RepoRecord,
    id=texts,
    created=aware_times,
    config=st.dictionaries(texts, json_like, max_size=4),
    initialized=st.booleans(),
    content_hash=st.sampled_from(["sha256", "blake3", "a-future-hash"]),
    features=st.lists(texts, max_size=3).map(tuple),
)


def test_time_round_trip_is_exact_to_the_microsecond() -> None:
    # Times from 1970 to 2300 at every microsecond offset: no float rounding may creep in.
    rng = random.Random(1234)
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    span = (dt.datetime(2300, 1, 1, tzinfo=dt.UTC) - epoch) // dt.timedelta(microseconds=1)
    for _ in range(100_000):
        when = epoch + dt.timedelta(microseconds=rng.randrange(span))
        back = from_micros(to_micros(when))
        assert back == when, f"{when.isoformat()} came back as {back.isoformat()}"
    assert to_micros(dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) == 0
    assert to_micros(dt.datetime(1970, 1, 1, 0, 0, 1, 7, tzinfo=dt.UTC)) == 1_000_007
    assert from_micros(1_000_007) == dt.datetime(1970, 1, 1, 0, 0, 1, 7, tzinfo=dt.UTC)
    assert from_micros(0).tzinfo is not None


_FLOAT_EDGE = 2**33 * 10**6  # where from_micros leaves its float path (the year 2242)


@FAST
@given(
    st.one_of(
        st.integers(min_value=0, max_value=_FLOAT_EDGE + 10**7),
        st.integers(min_value=_FLOAT_EDGE - 10**7, max_value=_FLOAT_EDGE + 10**7),
        st.integers(min_value=-(10**16), max_value=10**17),
        st.sampled_from([0, 1, 499_999, 500_000, 999_999, _FLOAT_EDGE - 1, _FLOAT_EDGE, -1]),
    )
)
def test_from_micros_equals_exact_arithmetic_on_both_of_its_paths(us: int) -> None:
    # Below 2**33 s it goes through a float timestamp, which must round back to the exact
    # microsecond; elsewhere (before 1970, after 2242) through integer arithmetic.
    exact = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=us)
    got = from_micros(us)
    assert got == exact and got.tzinfo is dt.UTC
    assert to_micros(got) == us


def test_history_records_keep_times_before_1970_and_after_2242() -> None:
    # Records whose times are outside the decoder's fast path take the careful one, intact.
    times = [
        dt.datetime(1969, 7, 20, 20, 17, 40, 1, tzinfo=dt.UTC),
        dt.datetime(2242, 3, 16, 12, 56, 32, 999_999, tzinfo=dt.UTC),
        dt.datetime(2026, 11, 26, 14, 0, 0, 123_456, tzinfo=dt.UTC),
    ]
    records = tuple(
        AncestorRecord(("01ARZ3NDEKTSV4RRFFQ69G5FAV",), when, None, f"m{i}", {"i": i})
        for i, when in enumerate(times)
    )
    ids = tuple(new_snapshot_id() for _ in records)
    back = HistoryPage.decode(HistoryPage(ids, records, ()).encode())
    assert back.records == records
    assert [r.time for r in back.records] == times


@pytest.mark.parametrize("us", [2**62, -(2**62)])
def test_a_history_record_with_a_time_no_datetime_holds_is_corrupt(us: int) -> None:
    body = {"ids": [new_snapshot_id()], "records": [[[], us, None, "m", {}]], "older": []}
    with pytest.raises(CorruptObject, match="invalid time"):
        HistoryPage.decode(encode(ObjectType.HISTORY_PAGE, body))


def test_gc_paused_turns_the_collector_back_on_only_if_it_turned_it_off() -> None:
    import gc

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested, or another thread's decoder meanwhile
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(CorruptObject), gc_paused():
        raise CorruptObject("k", "an error inside")
    assert gc.isenabled()
    gc.disable()  # the application's choice is kept
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_decoders_in_threads_share_one_pause_of_the_collector() -> None:
    import gc

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with gc_paused():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with gc_paused():
            second_in.set()
            first_out.wait(10)
            seen.append(gc.isenabled())  # the first is done, this one still decodes

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [False]
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_during_a_pause_gets_its_collector_back() -> None:
    # A decoding thread holds the collector off while another thread forks: the child has no
    # such thread, so nothing in it would ever turn the collector back on.
    import gc

    inside, done = threading.Event(), threading.Event()

    def decoder() -> None:
        with gc_paused():
            inside.set()
            done.wait(10)

    thread = threading.Thread(target=decoder)
    thread.start()
    try:
        assert inside.wait(10) and not gc.isenabled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
            pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not gc.isenabled()  # the parent's pause goes on
    finally:
        done.set()
        thread.join(10)
    assert gc.isenabled()


@FAST
@given(snapshots())
def test_snapshot_round_trip(snap: Snapshot) -> None:
    back = Snapshot.decode(snap.encode())
    assert back == snap
    assert back.time.utcoffset() is not None
    assert isinstance(back.parents, tuple)
    assert back.chunk_count == sum(s.count for s in snap.shards)


@FAST
@given(manifest_shards())
def test_manifest_shard_round_trip(shard: ManifestShard) -> None:
    back = ManifestShard.decode(shard.encode())
    assert back.keys == shard.keys
    assert back.refs == shard.refs
    assert all(isinstance(r, tuple) for r in back.refs)


@FAST
@given(txlogs)
def test_txlog_round_trip(log: TxLog) -> None:
    assert TxLog.decode(log.encode()) == log


class _KeysView(Sequence[str]):
    """A sequence that is not a list, as a large commit's chunk keys are; ``lie`` skews its
    length."""

    def __init__(self, keys: list[str], lie: int = 0) -> None:
        self.keys, self.lie = keys, lie

    def __len__(self) -> int:
        return len(self.keys) + self.lie

    def __getitem__(self, i: Any) -> Any:
        return self.keys[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys)


@FAST
@given(txlogs)
def test_a_txlog_of_a_key_view_is_encoded_a_block_at_a_time_to_the_same_payload(log: TxLog) -> None:
    """A view's keys are packed a block at a time and compressed part by part; the payload (and
    the frame's content size, which readers need) is that of the list's encoding."""
    keys = list(log.chunks) * 700  # past a block of 8,192 keys for most examples
    streamed = TxLog(log.nodes, _KeysView(keys), log.deleted_prefixes, log.resized, log.relocated)
    whole = TxLog(log.nodes, keys, log.deleted_prefixes, log.resized, log.relocated)
    data = streamed.encode()
    assert TxLog.decode(data) == whole
    assert data[:6] == whole.encode()[:6]
    params = zstandard.get_frame_parameters(data[6:])
    assert params.content_size == len(zstandard.ZstdDecompressor().decompress(whole.encode()[6:]))


def test_a_key_view_whose_length_lies_is_never_encoded() -> None:
    for lie in (1, -1):
        log = TxLog([], _KeysView(["a/c/0", "a/c/1"], lie), [], [])
        with pytest.raises(RuntimeError, match="changed while the txlog was encoded"):
            log.encode()


@FAST
@given(journal_entries)
def test_journal_entry_round_trip(entry: JournalEntry) -> None:
    back = JournalEntry.decode(entry.encode())
    assert back == entry
    assert back.time.utcoffset() is not None


@FAST
@given(tag_records)
def test_tag_record_round_trip(rec: TagRecord) -> None:
    assert TagRecord.decode(rec.encode()) == rec


@FAST
@given(repo_records)
def test_repo_record_round_trip(rec: RepoRecord) -> None:
    assert RepoRecord.decode(rec.encode()) == rec


def old_marker(rec: RepoRecord) -> bytes:
    """The marker exactly as zarrlake wrote it before content hashes were a setting."""
    body: dict[str, Any] = {"id": rec.id, "created": to_micros(rec.created), "config": rec.config}
    if rec.initialized:
        body["initialized"] = True
    return (
        MAGIC
        + bytes([1, ObjectType.REPO])
        + zstandard.ZstdCompressor().compress(msgpack.packb(body, use_bin_type=True))
    )


def test_sha256_marker_stays_version_1_and_byte_identical_to_old_ones() -> None:
    now = dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC)
    rec = RepoRecord("r", now, {"shard_max_refs": 16}, initialized=True)
    data = rec.encode()
    assert data[4] == FORMAT_VERSION == 1
    assert data == old_marker(rec)
    back = RepoRecord.decode(old_marker(rec))
    assert back == rec and back.content_hash == "sha256" and back.features == ()
    assert back.write_blocker() is None


def test_marker_with_a_setting_is_version_2_which_version_1_readers_refuse() -> None:
    now = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    rec = RepoRecord("r", now, {}, True, content_hash="blake3", features=("content-hash",))
    data = rec.encode()
    assert data[4] == 2 == newest_version(ObjectType.REPO)
    assert decode(data, ObjectType.REPO)["content_hash"] == "blake3"
    assert RepoRecord.decode(data).write_blocker() is None
    # Only the marker has a version 2: every other object type still refuses it.
    for kind in ObjectType:
        if kind != ObjectType.REPO:
            with pytest.raises(UnsupportedFormat, match="version 2"):
                decode(MAGIC + bytes([2, kind]) + data[HEADER_LEN:], kind)


@pytest.mark.parametrize(
    ("content_hash_name", "features", "blocked"),
    [
        ("blake3", ("content-hash",), None),
        ("sha256", ("content-hash", "a-future-feature"), "a-future-feature"),
        ("a-future-hash", ("content-hash",), "a-future-hash"),
    ],
)
def test_marker_write_blocker_names_what_this_version_lacks(
    content_hash_name: str, features: tuple[str, ...], blocked: str | None
) -> None:
    rec = RepoRecord(
        "r", dt.datetime(2026, 1, 2, tzinfo=dt.UTC), {}, True, content_hash_name, features
    )
    reason = RepoRecord.decode(rec.encode()).write_blocker()
    if blocked is None:
        assert reason is None
    else:
        assert reason is not None and blocked in reason


def test_envelope_header() -> None:
    data = TagRecord("0" * 26, dt.datetime.now(dt.UTC)).encode()
    assert data[:4] == MAGIC
    assert data[4] == FORMAT_VERSION
    assert data[5] == ObjectType.TAG
    assert decode(encode(ObjectType.TXLOG, {"x": [1, b"2"]}), ObjectType.TXLOG) == {"x": [1, b"2"]}


# -- refusing bad objects ------------------------------------------------------------------------


def sample_objects() -> dict[str, tuple[bytes, Callable[[bytes], Any]]]:
    now = dt.datetime(2026, 1, 2, 3, 4, 5, 678_901, tzinfo=dt.UTC)
    sid = "01" + "A" * 24
    return {
        "snapshot": (
            Snapshot(
                sid,
                (sid,),
                now,
                "me",
                "msg",
                {"a": 1},
                {"zarr.json": b"{}"},
                [ShardInfo("a", "b", "d" * 64, 2)],
                [sid],
            ).encode(),
            Snapshot.decode,
        ),
        "manifest": (
            ManifestShard(["a/c/0", "a/c/1"], [(INLINE, b"x"), (OBJECT, b"\0" * 32, 9)]).encode(),
            ManifestShard.decode,
        ),
        "txlog": (TxLog(["a/zarr.json"], ["a/c/0"], ["b"], ["a"]).encode(), TxLog.decode),
        "journal": (JournalEntry(3, sid, None, now, "w", 7).encode(), JournalEntry.decode),
        "tag": (TagRecord(sid, now).encode(), TagRecord.decode),
        "repo": (RepoRecord("id", now, {"shard_max_refs": 16}).encode(), RepoRecord.decode),
    }


SAMPLES = sample_objects()
DECODERS = {name: dec for name, (_, dec) in SAMPLES.items()}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_bad_magic_is_unsupported_format(name: str) -> None:
    data, dec = SAMPLES[name]
    with pytest.raises(UnsupportedFormat):
        dec(b"ZARR" + data[4:])
    with pytest.raises(UnsupportedFormat):
        dec(b'{"zarr_format": 3, "node_type": "group"}')


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_newer_format_version_is_unsupported_format(name: str) -> None:
    data, dec = SAMPLES[name]
    for version in (newest_version(ObjectType(data[5])) + 1, 255):
        with pytest.raises(UnsupportedFormat, match=str(version)):
            dec(data[:4] + bytes([version]) + data[5:])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_wrong_object_type_is_corrupt(name: str) -> None:
    data, dec = SAMPLES[name]
    for other_name, (_, other_dec) in SAMPLES.items():
        if other_name != name:
            with pytest.raises(CorruptObject):
                other_dec(data)
    with pytest.raises(CorruptObject):
        dec(data[:5] + bytes([99]) + data[6:])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_truncated_and_garbage_are_corrupt(name: str) -> None:
    data, dec = SAMPLES[name]
    for cut in range(len(data)):
        with pytest.raises(CorruptObject):
            dec(data[:cut])
    with pytest.raises(CorruptObject):
        dec(data[:HEADER_LEN] + b"\x00" * 40)
    with pytest.raises(CorruptObject):
        dec(data + b"trailing garbage")
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF
    with pytest.raises(CorruptObject):
        dec(bytes(flipped))


def test_corrupt_object_names_the_key() -> None:
    with pytest.raises(CorruptObject) as info:
        TxLog.decode(b"ZLAK", "txlogs/XYZ")
    assert info.value.key == "txlogs/XYZ"
    assert "txlogs/XYZ" in str(info.value)


def decode_only_cleanly(dec: Callable[[bytes], Any], data: bytes) -> Any:
    try:
        return dec(data)
    except (CorruptObject, UnsupportedFormat):
        return None


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(DECODERS)), st.binary(max_size=200))
def test_random_bytes_only_raise_format_errors(name: str, data: bytes) -> None:
    decode_only_cleanly(DECODERS[name], data)
    # The same bytes behind a valid header, and behind a valid header plus a zstd frame magic.
    kind = SAMPLES[name][0][5]
    decode_only_cleanly(DECODERS[name], MAGIC + bytes([FORMAT_VERSION, kind]) + data)
    decode_only_cleanly(
        DECODERS[name], MAGIC + bytes([FORMAT_VERSION, kind]) + b"\x28\xb5\x2f\xfd" + data
    )


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_random_truncations_and_mutations_only_raise_format_errors(
    name: str, data: st.DataObject
) -> None:
    blob, dec = SAMPLES[name]
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptObject):
        dec(blob[:cut])
    mutated = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        mutated[pos] = data.draw(st.integers(0, 255))
    result = decode_only_cleanly(dec, bytes(mutated))
    assert result is None or isinstance(result, type(dec(blob)))


def raw_envelope(kind: int, body: bytes) -> bytes:
    return MAGIC + bytes([FORMAT_VERSION, kind]) + zstandard.ZstdCompressor().compress(body)


FIELDS: dict[str, tuple[ObjectType, list[str]]] = {
    "snapshot": (
        ObjectType.SNAPSHOT,
        ["id", "parents", "time", "author", "message", "metadata", "nodes", "shards", "ancestry"],
    ),
    "manifest": (ObjectType.MANIFEST, ["k", "r"]),
    "txlog": (ObjectType.TXLOG, ["n", "c", "d", "r"]),
    "journal": (
        ObjectType.BRANCH_ENTRY,
        ["seq", "snapshot", "previous", "time", "writer", "token"],
    ),
    "tag": (ObjectType.TAG, ["snapshot", "time"]),
    "repo": (ObjectType.REPO, ["id", "created", "config"]),
}

wire_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


def is_time(v: Any) -> bool:
    return isinstance(v, dt.datetime) and v.utcoffset() is not None


def is_str_list(v: Any) -> bool:
    return all(isinstance(x, str) for x in v)


def well_formed(obj: Any) -> bool:
    """The shape a successfully decoded object must have, whatever bytes it came from."""
    if isinstance(obj, Snapshot):
        return (
            isinstance(obj.id, str)
            and isinstance(obj.parents, tuple)
            and is_str_list(obj.parents)
            and is_time(obj.time)
            and (obj.author is None or isinstance(obj.author, str))
            and isinstance(obj.message, str)
            and isinstance(obj.metadata, dict)
            and isinstance(obj.nodes, dict)
            and all(isinstance(k, str) and isinstance(v, bytes) for k, v in obj.nodes.items())
            and all(
                isinstance(s.first, str)
                and isinstance(s.last, str)
                and isinstance(s.digest, str)
                and isinstance(s.count, int)
                for s in obj.shards
            )
            and is_str_list(obj.ancestry)
        )
    if isinstance(obj, ManifestShard):
        return (
            len(obj.keys) == len(obj.refs)
            and is_str_list(obj.keys)
            and all(isinstance(r, tuple) for r in obj.refs)
        )
    if isinstance(obj, TxLog):
        return all(
            isinstance(v, list) and is_str_list(v)
            for v in (obj.nodes, obj.chunks, obj.deleted_prefixes, obj.resized)
        )
    if isinstance(obj, JournalEntry):
        return (
            isinstance(obj.seq, int)
            and 0 <= obj.seq <= SEQ_MAX
            and (obj.snapshot is None or isinstance(obj.snapshot, str))
            and (obj.previous is None or isinstance(obj.previous, str))
            and is_time(obj.time)
            and isinstance(obj.writer, str)
            and (obj.token is None or isinstance(obj.token, int))
        )
    if isinstance(obj, TagRecord):
        return isinstance(obj.snapshot, str) and is_time(obj.time)
    if isinstance(obj, RepoRecord):
        return isinstance(obj.id, str) and is_time(obj.created) and isinstance(obj.config, dict)
    return False


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(FIELDS)), st.data())
def test_valid_envelope_with_random_payload_is_corrupt_or_well_formed(
    name: str, data: st.DataObject
) -> None:
    kind, names = FIELDS[name]
    if data.draw(st.booleans()):
        payload: Any = {
            n: data.draw(wire_values) for n in names if data.draw(st.integers(0, 9)) > 0
        }
    else:
        payload = data.draw(wire_values)
    body = msgpack.packb(payload, use_bin_type=True)
    result = decode_only_cleanly(DECODERS[name], raw_envelope(int(kind), body))
    assert result is None or well_formed(result), result


@pytest.mark.parametrize(
    ("name", "payload"),
    [
        ("txlog", {"n": 5, "c": [], "d": []}),
        ("txlog", {"n": ["a"], "c": None, "d": []}),
        ("txlog", [1, 2, 3]),
        ("journal", {"seq": 1, "time": 2**63 - 1, "writer": "w"}),
        ("journal", {"seq": "x", "time": 0, "writer": "w"}),
        ("journal", {"seq": -1, "time": 0, "writer": "w"}),
        ("journal", {"seq": [], "time": 0, "writer": "w"}),
        ("tag", {"snapshot": "S", "time": "yesterday"}),
        ("tag", {"snapshot": "S", "time": -(2**62)}),
        ("repo", {"id": "i", "created": 0, "config": 7}),
        ("snapshot", {"id": "S", "parents": [], "time": 2**63, "nodes": {}, "shards": []}),
        ("snapshot", {"id": "S", "parents": 3, "time": 0, "nodes": {}, "shards": []}),
        ("snapshot", {"id": "S", "parents": [], "time": 0, "nodes": [], "shards": [[1]]}),
        ("snapshot", {"id": "S", "parents": [], "time": 0, "nodes": {}, "shards": [5]}),
        ("manifest", {"k": ["a"], "r": [5]}),
        ("manifest", {"k": "ab", "r": "cd"}),
        ("manifest", {"k": [1], "r": [[0, b""]]}),
    ],
)
def test_well_enveloped_nonsense_is_corrupt(name: str, payload: Any) -> None:
    kind, _ = FIELDS[name]
    with pytest.raises(CorruptObject):
        DECODERS[name](raw_envelope(int(kind), msgpack.packb(payload, use_bin_type=True)))


# -- ref keys --------------------------------------------------------------------------------------


def test_branch_entry_keys_sort_newest_first() -> None:
    seqs = [0, 1, 2, 9, 10, 15, 16, 255, 256, 10**6, 2**32, SEQ_MAX - 1, SEQ_MAX]
    keys = [branch_entry_key("main", s) for s in seqs]
    assert sorted(keys) == keys[::-1]
    for s, k in zip(seqs, keys, strict=True):
        assert k.startswith(branch_prefix("main"))
        assert seq_from_entry_key(k) == s
        assert len(k) == len(keys[0])  # fixed width


@FAST
@given(st.lists(st.integers(0, SEQ_MAX), min_size=2, max_size=20, unique=True), st.text(min_size=1))
def test_branch_entry_key_order_and_inverse(seqs: list[int], name: str) -> None:
    keys = {s: branch_entry_key(name, s) for s in seqs}
    by_key = sorted(seqs, key=lambda s: keys[s])
    assert by_key == sorted(seqs, reverse=True)
    for s, k in keys.items():
        assert seq_from_entry_key(k) == s
        assert k.startswith(branch_prefix(name))


NAMES = [
    "main",
    "feature/x",
    "a/b/c",
    "100%",
    "%2F",
    "a%2Fb",
    "ünïcødé/ветка",
    "数据",
    "x.y-z_w",
    "😀",
]


@pytest.mark.parametrize("name", NAMES)
def test_ref_name_quoting_round_trip(name: str) -> None:
    part = branch_prefix(name)[len("refs/branch.") : -1]
    assert "/" not in part
    assert ref_name_from_key(part) == name
    tag_part = tag_key(name)[len("refs/tag.") :]
    assert "/" not in tag_part
    assert ref_name_from_key(tag_part) == name
    assert ref_name_from_key(tag_tombstone_key(name)[len("refs/tagdel.") :]) == name
    assert branch_entry_key(name, 0).count("/") == 2


@FAST
@given(st.text(min_size=1, max_size=30), st.text(min_size=1, max_size=30))
def test_ref_name_keys_are_injective_and_never_nest(a: str, b: str) -> None:
    assume(a != b)
    assert ref_name_from_key(branch_prefix(a)[len("refs/branch.") : -1]) == a
    assert ref_name_from_key(tag_key(a)[len("refs/tag.") :]) == a
    assert branch_prefix(a) != branch_prefix(b)
    assert not branch_prefix(b).startswith(branch_prefix(a))
    assert tag_key(a) != tag_key(b)
    # listing "refs/tag." must never pick up tombstones, and no tag key is a branch key
    assert not tag_tombstone_key(a).startswith("refs/tag.")
    assert not tag_key(a).startswith("refs/branch.")


# -- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "main",
        "feature/x",
        "release/2024.10",
        "ünïcødé",
        "数据/分支",
        "a" * 255,
        "é" * 127,
        "v1.0",
        "x_y",
        "a-b",
    ],
)
def test_validate_name_accepts(name: str) -> None:
    assert validate_name(name) == name
    assert validate_name(name, "tag") == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        " ",
        "a b",
        "tab\there",
        "new\nline",
        "nbsp\u00a0x",
        "ideographic\u3000space",
        "..",
        "a..b",
        "../escape",
        "-rf",
        "-",
        "nul\x00",
        "bell\x07",
        "del\x7f",
        "esc\x1b[0m",
        "a" * 256,
        "é" * 128,  # 256 bytes in UTF-8
        "/leading",
        "trailing/",
        "double//slash",
    ],
)
def test_validate_name_rejects(name: str) -> None:
    with pytest.raises(InvalidName):
        validate_name(name)
    with pytest.raises(ValueError):  # InvalidName is also a ValueError
        validate_name(name, "tag")


@pytest.mark.parametrize("value", [None, 3, b"main", ["main"]])
def test_validate_name_rejects_non_strings(value: object) -> None:
    with pytest.raises(InvalidName):
        validate_name(value)
