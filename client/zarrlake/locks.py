"""Branch locks: liveness and fairness for many writers; never what safety rests on.

A commit takes the per-(repository, branch) lock before it reads the branch head and releases it
after the journal write. Without a lock, writers racing for one branch retry optimistically, and
under heavy contention most of their work is thrown away (a retry storm). With a lock they queue.

Safety never depends on the lock: the create-only journal write still decides. A holder whose lease
ran out (a paused process) simply loses the create-only race and rebases; it cannot move a branch
backwards or overwrite a commit. Every journal entry records the holder's fencing token, which
increases monotonically per repository, so a log shows who held the lock when.

- :class:`RedisLock` — a lease in Redis, renewed while held, released by compare-and-delete,
  waiters served in arrival order (a ticket queue). Waiters block (``BLPOP``) on a wake-up list
  of their own; a release pushes to the first live waiter's list, so the lock changes hands in one
  round trip, without polling. Waiters still look again at least once a second (and the next in
  line when the lease would run out), which keeps their place alive and notices dead holders.
- :class:`LocalLock` — ``flock(2)`` on files in a directory, for processes on one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlparse

from zarrlake.errors import InvalidArgument, LockTimeout, LockUnavailable
from zarrlake.extras import require

log = logging.getLogger("zarrlake.locks")

_MAX_BLOCK_S = 1.0  # a waiter looks again at least this often (must stay below socket_timeout)

# KEYS: lock, queue, beats, fence, own wake list   ARGV: holder, ticket, lease_ms, beat_ms
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local beat = tonumber(ARGV[4])
if redis.call('ZSCORE', KEYS[2], ARGV[1]) == false then
  redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), ARGV[1])
end
redis.call('HSET', KEYS[3], ARGV[1], now + beat)
redis.call('PEXPIRE', KEYS[2], beat * 4)
redis.call('PEXPIRE', KEYS[3], beat * 4)
local rank = 0
local waiters = redis.call('ZRANGE', KEYS[2], 0, -1)
for _, w in ipairs(waiters) do
  if w == ARGV[1] then break end
  local exp = tonumber(redis.call('HGET', KEYS[3], w) or '0')
  if exp < now then
    redis.call('ZREM', KEYS[2], w)
    redis.call('HDEL', KEYS[3], w)
  else
    rank = rank + 1
  end
end
if rank > 0 or redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, rank, redis.call('PTTL', KEYS[1])}
end
local token = redis.call('INCR', KEYS[4])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', tonumber(ARGV[3]))
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[5])
return {1, token, 0}
"""

# KEYS: lock, queue, beats   ARGV: expected value, wake-list prefix
# Compare-and-delete, then hand over: push to the wake-up list of the first waiter whose heartbeat
# is alive. (That list's name is built here; it shares the repository's {hash tag}, so the script
# stays on one cluster slot.) A wake-up nobody consumes expires; a missed one costs a waiter at
# most its next look.
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, w in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if tonumber(redis.call('HGET', KEYS[3], w) or '0') >= now then
    local wake = ARGV[2] .. w
    redis.call('RPUSH', wake, '1')
    redis.call('PEXPIRE', wake, 10000)
    break
  end
end
return 1
"""

# KEYS: lock   ARGV: expected value, lease_ms
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return 0
"""

# KEYS: queue, beats, own wake list   ARGV: holder
_LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
return 1
"""


# KEYS: fence   ARGV: floor
_RAISE_FLOOR = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class LockHolder:
    """What ``zarrlake lock status`` shows for one held branch lock."""

    branch: str
    holder: str
    token: int
    ttl_ms: int
    waiters: int


class Lease:
    """A held Redis lock: renewed in the background until released."""

    def __init__(
        self, lock: RedisLock, key: str, value: str, token: int, handoff: tuple[str, str, str]
    ) -> None:
        self._lock = lock
        self.key = key
        self._handoff = handoff  # (queue key, beats key, wake-list prefix)
        self.value = value
        self.token = token
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="zarrlake-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        interval = max(0.05, self._lock.lease_s / 3)
        lease_ms = int(self._lock.lease_s * 1000)
        while not self._stop.wait(interval):
            try:
                ok = self._lock._script(_RENEW)(keys=[self.key], args=[self.value, lease_ms])
            except Exception as e:  # Redis down: the lease will lapse; the journal keeps us safe
                log.warning("could not renew lock %s: %s", self.key, e)
                continue
            if not ok:
                self.lost = True
                log.warning(
                    "lost lock %s (lease expired); commit stays safe via the journal", self.key
                )
                return

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            queue, beats, wake_prefix = self._handoff
            self._lock._script(_RELEASE)(
                keys=[self.key, queue, beats], args=[self.value, wake_prefix]
            )
        except Exception as e:
            log.warning("could not release lock %s (it will expire): %s", self.key, e)


def _require_redis() -> ModuleType:
    return require("redis", extra="redis", feature="RedisLock")


class RedisLock:
    """A per-(repository, branch) lease in Redis with a per-repository fencing token.

    ``url``: ``redis://[[user]:password@]host:port/db`` or ``rediss://`` for TLS.
    ``lease_s``: lease length; renewed every ``lease_s/3`` while held. ``wait_s``: how long to wait
    before :class:`LockTimeout`. ``on_unavailable``: if Redis cannot be reached, ``"optimistic"``
    commits without the lock (safe, only less orderly), ``"fail"`` raises :class:`LockUnavailable`.
    Keys live under ``zarrlake:{<repository id>}:`` so many repositories can share one Redis.
    Needs Redis 6 or newer (waiters block with sub-second ``BLPOP`` timeouts). The fencing counter
    lives in Redis: run it with persistence if tokens must keep rising across a Redis restart.
    Needs the ``redis`` client (``pip install 'zarrlake[redis]'``): without it, constructing one
    raises :class:`~zarrlake.MissingDependency`.
    """

    def __init__(
        self,
        url: str,
        *,
        lease_s: float = 30,
        wait_s: float = 120,
        on_unavailable: str = "optimistic",
        namespace: str = "zarrlake",
    ) -> None:
        if on_unavailable not in ("optimistic", "fail"):
            raise InvalidArgument("on_unavailable must be 'optimistic' or 'fail'")
        if lease_s <= 0 or wait_s < 0:
            raise InvalidArgument("lease_s must be positive and wait_s non-negative")
        scheme = urlparse(url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise InvalidArgument(f"not a Redis URL: {url!r}")
        _require_redis()  # missing, it is an error now, not at the first commit
        self.url = url
        self.lease_s = float(lease_s)
        self.wait_s = float(wait_s)
        self.on_unavailable = on_unavailable
        self.namespace = namespace
        self._client: Any = None
        self._scripts: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["_scripts"] = {}
        return state

    def __repr__(self) -> str:
        u = urlparse(self.url)
        host = u.hostname or ""
        safe = u._replace(netloc=f"{host}:{u.port}" if u.port else host).geturl()  # no credentials
        return f"RedisLock({safe!r}, lease_s={self.lease_s}, wait_s={self.wait_s})"

    @property
    def client(self) -> Any:
        if self._client is None:
            redis = _require_redis()  # this lock may have been unpickled where redis is not
            self._client = redis.Redis.from_url(
                self.url, socket_timeout=5, socket_connect_timeout=2, decode_responses=True
            )
        return self._client

    def _script(self, source: str) -> Any:
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.client.register_script(source)
        return script

    def _keys(self, repo_id: str, branch: str) -> tuple[str, str, str, str, str, str]:
        base = f"{self.namespace}:{{{repo_id}}}"
        b = quote(branch, safe="")
        return (
            f"{base}:lock:{b}",
            f"{base}:queue:{b}",
            f"{base}:beats:{b}",
            f"{base}:fence",
            f"{base}:tickets",
            f"{base}:wake:{b}:",  # + holder: each waiter's wake-up list
        )

    def acquire(self, repo_id: str, branch: str) -> Lease | None:
        """Wait for the lock; a :class:`Lease`, or None when Redis is down and we go optimistic."""
        import redis

        lock_key, queue_key, beats_key, fence_key, tickets_key, wake_prefix = self._keys(
            repo_id, branch
        )
        holder = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        wake_key = wake_prefix + holder
        handoff = (queue_key, beats_key, wake_prefix)
        lease_ms = int(self.lease_s * 1000)
        beat_ms = 5000
        deadline = time.monotonic() + self.wait_s
        try:
            ticket = self.client.incr(tickets_key)
            acquire = self._script(_ACQUIRE)
            while True:
                got, value, ttl = acquire(
                    keys=[lock_key, queue_key, beats_key, fence_key, wake_key],
                    args=[holder, ticket, lease_ms, beat_ms],
                )
                if got:
                    return Lease(self, lock_key, f"{holder}:{value}", int(value), handoff)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    with contextlib.suppress(redis.RedisError):
                        self._script(_LEAVE)(keys=[queue_key, beats_key, wake_key], args=[holder])
                    raise LockTimeout(
                        f"could not lock branch {branch!r} of repository {repo_id} within "
                        f"{self.wait_s:g}s ({value} waiter(s) ahead)"
                    )
                # Block until a release hands the lock to us. Look again after at most a second
                # (a heartbeat keeps our place; beat_ms is far longer) and, next in line, when
                # the holder's lease would run out (it may have died).
                block = min(remaining, _MAX_BLOCK_S)
                if int(value) == 0:
                    block = min(block, max(int(ttl), 0) / 1000 + 0.005)
                self.client.blpop([wake_key], timeout=max(block, 0.01))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            if self.on_unavailable == "fail":
                raise LockUnavailable(f"lock service {self!r} unreachable: {e}") from None
            log.warning("lock service unreachable (%s); committing optimistically", e)
            return None

    @contextlib.contextmanager
    def hold(self, repo_id: str, branch: str) -> Iterator[int | None]:
        """Hold the branch lock for the block; yields the fencing token (None if optimistic)."""
        lease = self.acquire(repo_id, branch)
        try:
            yield None if lease is None else lease.token
        finally:
            if lease is not None:
                lease.release()

    def raise_floor(self, repo_id: str, floor: int) -> bool:
        """Make every later token exceed ``floor`` (a token the journal already recorded).

        Redis without persistence forgets its counter on restart; the journal does not, so a
        commit that finds a higher token on the branch head calls this. True if it moved."""
        import redis

        try:
            fence_key = self._keys(repo_id, "")[3]
            return bool(self._script(_RAISE_FLOOR)(keys=[fence_key], args=[int(floor)]))
        except redis.RedisError as e:
            log.warning("could not raise the fencing-token floor: %s", e)
            return False

    def _head_key(self, repo_id: str, branch: str) -> str:
        return f"{self.namespace}:{{{repo_id}}}:head:{quote(branch, safe='')}"

    def last_head(self, repo_id: str, branch: str) -> int | None:
        """The journal entry the branch's last holder appended, as it told this service: a
        hint, so that the next holder reads that entry (and finds the one after it absent) in
        one round instead of listing the journal. The journal decides: a wrong hint costs the
        listing, nothing else. None if no holder said, or the service cannot be asked."""
        import redis

        try:
            said = self.client.get(self._head_key(repo_id, branch))
            return None if said is None else int(said)
        except (redis.RedisError, ValueError):
            return None

    def record_head(self, repo_id: str, branch: str, seq: int) -> None:
        """Tell the next holder of the branch that entry ``seq`` is the head (see
        :meth:`last_head`); called holding the lease, after the append landed. Kept a day."""
        import redis

        try:
            self.client.set(self._head_key(repo_id, branch), int(seq), ex=86_400)
        except redis.RedisError as e:
            log.debug("could not record the head of %s: %s", branch, e)

    def status(self, repo_id: str) -> list[LockHolder]:
        """Current holders of this repository's branch locks. Raises :class:`LockUnavailable`
        when the service cannot be asked (unreachable, refused credentials)."""
        from urllib.parse import unquote

        import redis

        base = f"{self.namespace}:{{{repo_id}}}:lock:"
        out = []
        try:
            for key in sorted(self.client.scan_iter(match=base.replace("[", "\\[") + "*")):
                value = self.client.get(key)
                if value is None:
                    continue
                branch = unquote(key[len(base) :])
                holder, _, token = value.rpartition(":")
                waiters = self.client.zcard(self._keys(repo_id, branch)[1])
                ttl = int(self.client.pttl(key))
                out.append(LockHolder(branch, holder, int(token), ttl, waiters))
        except redis.RedisError as e:
            raise LockUnavailable(f"cannot ask lock service {self!r}: {e}") from None
        return out


class LocalLock:
    """Branch locks for processes on one machine: ``flock(2)`` on files under ``path``."""

    def __init__(self, path: str | os.PathLike[str], *, wait_s: float = 120) -> None:
        self.path = Path(path).expanduser().absolute()
        self.wait_s = float(wait_s)

    def __repr__(self) -> str:
        return f"LocalLock({str(self.path)!r})"

    def _next_token(self, repo_dir: Path, floor: int = 0) -> int:
        fd = os.open(repo_dir / "fence", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            raw = os.pread(fd, 32, 0).strip()
            token = max(int(raw or b"0"), floor) + 1
            os.pwrite(fd, str(token).encode().ljust(20), 0)
            return token
        finally:
            os.close(fd)

    def raise_floor(self, repo_id: str, floor: int) -> bool:
        """Make every later token exceed ``floor`` (e.g. after the lock directory was wiped)."""
        repo_dir = self.path / quote(repo_id, safe="")
        repo_dir.mkdir(parents=True, exist_ok=True)
        before = self._next_token(repo_dir, int(floor))
        return before == int(floor) + 1

    @contextlib.contextmanager
    def hold(self, repo_id: str, branch: str) -> Iterator[int]:
        repo_dir = self.path / quote(repo_id, safe="")
        repo_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(repo_dir / (quote(branch, safe="") + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + self.wait_s
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise LockTimeout(
                            f"could not lock branch {branch!r} of repository {repo_id} "
                            f"within {self.wait_s:g}s"
                        ) from None
                    time.sleep(delay * random.uniform(0.5, 1.5))
                    delay = min(delay * 2, 0.05)
            try:
                yield self._next_token(repo_dir)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def lock_from_url(url: str, **options: Any) -> RedisLock | LocalLock:
    """``redis://…``/``rediss://…`` -> :class:`RedisLock`; ``file:///dir`` or a path ->
    :class:`LocalLock`."""
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        return RedisLock(url, **options)
    if scheme == "file":
        return LocalLock(urlparse(url).path, **options)
    if "://" not in url:
        return LocalLock(url, **options)
    raise InvalidArgument(f"unsupported lock URL {url!r} (use redis://, rediss:// or a directory)")
