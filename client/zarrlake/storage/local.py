"""A directory on the local file system.

Create-only writes are atomic: data goes to a temporary file first, and ``os.link`` publishes it
under the final name, which fails if the name exists (``O_EXCL`` semantics without exposing a
half-written file). Plain writes use ``os.replace``, also atomic. Readers never see torn objects.

Compare-and-set (:meth:`LocalStorage.put_if_version`) reads, compares and renames while holding
an exclusive ``flock`` on a lock file of that key, ``.tmp/locks/<sha256 of the key>``: hidden
from listings as temporary files are, made on first use and never deleted (deleting a lock file
another process has open would let a third lock a new file of the same name). ``flock`` is
released when its process dies, so a killed writer leaves no lock behind. Each call opens the
file anew, so threads of one process exclude each other too. On NFS, ``flock`` is only as good
as the server's lock manager (Linux maps it onto NFS byte-range locks; a mount with
``local_lock`` keeps it to one machine): a repository there that several machines write should
not rely on it.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import operator
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import SplitResult, unquote

from zarrlake.storage.base import (
    Buffer,
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    Storage,
    StorageError,
    Versioned,
    micros,
    register_backend,
)

_TMP = ".tmp"
#: Below :data:`_TMP`: the lock files of compare-and-set, one per key ever swapped.
_LOCKS = "locks"


_sort_key = operator.itemgetter(0)


def _holds_file(path: Path) -> bool:
    return any(files for _, _, files in os.walk(path))


def _publish(op: Callable[[str, str], None], tmp: str, path: str) -> None:
    """``op(tmp, path)`` (link or rename), creating ``path``'s directory only when it is missing:
    most writes land in an existing directory, and a mkdir per object is a syscall each time."""
    try:
        op(tmp, path)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        op(tmp, path)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    data = os.read(fd, size + 1)  # one read for a small file; the extra byte finds the end
    return data if len(data) == size else data + _read_rest(fd)


def _read_rest(fd: int) -> bytes:
    parts: list[bytes] = []
    while chunk := os.read(fd, 1 << 20):
        parts.append(chunk)
    return b"".join(parts)


def _version(data: Buffer, st: os.stat_result) -> str:
    digest = hashlib.blake2b(data, digest_size=16).hexdigest()
    return f"{digest}-{st.st_ino:x}-{st.st_mtime_ns:x}"


def _read_versioned(path: str) -> Versioned | None:
    """The file's bytes and their version, from one open file (a rename of a newer one onto
    the name meanwhile changes neither); None if there is no file (or a folder) there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return None
        data = _read_all(fd)
    finally:
        os.close(fd)
    return Versioned(data, _version(data, st))


@register_backend("file")
class LocalStorage(Storage):
    """Durable; shared with every process that sees the same directory (on one machine, or on a
    file system that all of them mount)."""

    concurrency: ClassVar[int] = 8
    inline_read_bytes: ClassVar[int] = 256 * 1024
    #: A commit's few small objects are written in the committing thread: creating a file in the
    #: page cache and linking it into place cost less than waking a pool thread for each.
    inline_write_bytes: ClassVar[int] = 256 * 1024
    atomic_stale_delete: ClassVar[bool] = True
    supports_compare_and_set: ClassVar[bool] = True
    #: fsync every object before publishing it (durability across power loss, at a cost). A
    #: subclass that turns it on sets :attr:`inline_write_bytes` to 0 too: a round of writes
    #: that each wait on the disk is faster overlapped on the I/O pool.
    fsync: ClassVar[bool] = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not os.fspath(path).strip():
            raise StorageError("empty local path (to mean the current directory, say '.')")
        self.root = Path(path).expanduser().absolute()
        # Reads join strings: building a Path per read costs more than the read of a small file.
        self._root_slash = os.path.join(str(self.root), "")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # A copy pickled by an older client carries no read prefix: derive it again.
        self._root_slash = os.path.join(str(self.root), "")

    @classmethod
    def from_parsed_url(cls, url: SplitResult) -> LocalStorage:
        return cls(unquote(url.netloc + url.path))

    @property
    def url(self) -> str:
        return self.root.as_uri()

    @staticmethod
    def _check_key(key: str) -> None:
        """A key names a file below the root, nothing else (no escape, no NUL for the OS)."""
        if not key or key[0] == "/" or "\0" in key or ".." in key.split("/"):
            raise StorageError(f"invalid object key: {key!r}")

    def _path(self, key: str) -> Path:
        self._check_key(key)
        return self.root / key

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        self._check_key(key)  # reads join strings (cheaper than a Path), checked alike
        try:
            fd = os.open(self._root_slash + key, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        try:
            if byte_range is None:
                return _read_all(fd)
            start, end = byte_range
            return os.pread(fd, max(0, end - start), start) if end > start else b""
        except IsADirectoryError:
            raise ObjectNotFound(key) from None
        finally:
            os.close(fd)

    def get_if_unchanged(
        self,
        key: str,
        byte_range: tuple[int, int],
        *,
        etag: str | None = None,
        modified: dt.datetime | None = None,
    ) -> bytes:
        """As :meth:`Storage.get_if_unchanged`; the time is the file's mtime (to the
        microsecond, as :meth:`head` says it), read from the very descriptor the bytes are read
        from. A file has no
        ETag: one asked for never matches."""
        self._check_key(key)
        try:
            fd = os.open(self._root_slash + key, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ObjectNotFound(key)
            if etag is not None:
                raise PreconditionFailed(key)
            # The time as head() reports it (from the same float), so that a time read there
            # matches here.
            mtime = dt.datetime.fromtimestamp(st.st_mtime, dt.UTC)
            if modified is not None and micros(mtime) != micros(modified):
                raise PreconditionFailed(key)
            start, end = byte_range
            return os.pread(fd, max(0, end - start), start) if end > start else b""
        finally:
            os.close(fd)

    def _write_temp(self, data: Buffer) -> str:
        # Paths as strings, joined (as reads do): a Path per write costs more than the syscalls.
        tmp = f"{self._root_slash}{_TMP}/{uuid.uuid4().hex}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            os.makedirs(self._root_slash + _TMP, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        self._check_key(key)
        path = self._root_slash + key
        try:
            self._put(key, path, data, create_only)
        except (FileExistsError, IsADirectoryError) as e:
            # Decided by what the failed call was about, not by looking again: the object a
            # create-only write lost to may be gone already (GC's sweep), and that write still
            # lost. A name taken on the way (a file where a folder goes) is no such answer.
            if path in (e.filename, e.filename2):
                if os.path.isdir(path):
                    raise StorageError(f"cannot write {key!r}: {path} is a directory") from None
                if create_only and isinstance(e, FileExistsError):
                    raise PreconditionFailed(key) from None
            raise StorageError(f"cannot write {key!r} under {self.root}: {e.strerror or e}") from e
        except OSError as e:
            # Not an object store's answer but the file system's (a file where a folder should
            # be, permissions, a full disk): say where.
            raise self._write_failed(key, e) from e

    def _write_failed(self, key: str, e: OSError) -> StorageError:
        """The error for a write the file system refused, naming what a person can act on: the
        directory itself when it could not be created or takes no files (the first write of
        ``Repository.create`` into ``/proc/x`` or a read-only folder), else the object."""
        reason = e.strerror or str(e)
        if not self.root.is_dir():
            return StorageError(f"cannot create directory {self.root}: {reason}")
        if isinstance(e.filename, str) and e.filename.startswith(self._root_slash + _TMP):
            # Every write starts as a temporary file here: the directory takes no writes.
            return StorageError(f"cannot write to directory {self.root}: {reason}")
        return StorageError(f"cannot write {key!r} under {self.root}: {reason}")

    def _put(self, key: str, path: str, data: Buffer, create_only: bool) -> None:
        tmp = self._write_temp(data)
        published = False
        try:
            if create_only:
                try:
                    _publish(os.link, tmp, path)  # FileExistsError: see put
                except OSError as e:  # file systems without hard links
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                        raise
                    self._create_exclusive(path, data)
            else:
                _publish(os.replace, tmp, path)
                published = True  # the temporary file is now the object
        finally:
            if not published:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def _create_exclusive(self, path: str, data: Buffer) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # FileExistsError: put
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    # -- compare-and-set --------------------------------------------------------------------------
    # A version is "<BLAKE2b-128 of the bytes>-<inode>-<mtime_ns>", all read from one open file.
    # What holds: equal versions mean equal bytes (the digest); every swap publishes a new file,
    # whose inode and modification time make its version new even when its bytes are the same
    # (the file it replaces still holds its inode number when the new one is made). A version
    # can come back only as an A-B-A: a later file that gets the inode number an earlier one
    # freed, within one tick of a coarse file-system clock, holding that file's very bytes. A
    # swap from that old version then succeeds against an object that is exactly what its
    # caller read (the ETag of an S3 PUT, the MD5 of the bytes, behaves so every time). Swaps
    # are ordered against swaps, not against a plain put or a delete of the key (no lock).

    def get_versioned(self, key: str) -> Versioned:
        self._check_key(key)
        found = _read_versioned(self._root_slash + key)
        if found is None:
            raise ObjectNotFound(key)
        return found

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        self._check_key(key)
        path = self._root_slash + key
        try:
            with self._swap_lock(key):
                found = _read_versioned(path)
                if (None if found is None else found.version) != version:
                    raise PreconditionFailed(key)
                return self._swap(path, data, create=version is None)
        except (FileExistsError, IsADirectoryError) as e:
            # As in put: decided by what the failed call was about (a create that lost to a
            # create-only put that took no lock), not by looking again.
            if path in (e.filename, e.filename2):
                if os.path.isdir(path):
                    raise StorageError(f"cannot write {key!r}: {path} is a directory") from None
                if version is None and isinstance(e, FileExistsError):
                    raise PreconditionFailed(key) from None
            raise StorageError(f"cannot write {key!r} under {self.root}: {e.strerror or e}") from e
        except OSError as e:
            raise self._write_failed(key, e) from e

    def _swap(self, path: str, data: Buffer, *, create: bool) -> str:
        """Publish ``data`` at ``path`` (under the key's lock); returns its version."""
        view = memoryview(data)
        tmp = self._write_temp(view)
        try:
            st = os.stat(tmp)  # the object's inode and time: a rename or link keeps both
            if not create:
                _publish(os.replace, tmp, path)
                return _version(view, st)
            # A create links, so that it also loses to a create-only put (which takes no lock).
            try:
                _publish(os.link, tmp, path)  # FileExistsError: see put_if_version
            except OSError as e:  # file systems without hard links, as in _put
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                    raise
                self._create_exclusive(path, view)
                st = os.stat(path)
            return _version(view, st)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # a link's other name; gone already after a rename

    @contextlib.contextmanager
    def _swap_lock(self, key: str) -> Iterator[None]:
        """Hold the key's lock file exclusively (see the module docstring)."""
        folder = f"{self._root_slash}{_TMP}/{_LOCKS}"
        path = f"{folder}/{hashlib.sha256(key.encode()).hexdigest()}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not os.path.isfile(self._path(key)):
            return None
        return ObjectInfo(key, st.st_size, dt.datetime.fromtimestamp(st.st_mtime, dt.UTC))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the directory that can hold the prefix, one directory's names in memory at a
        # time: a listing of a million chunk objects must not hold a million entries.
        base_dir, _, _ = prefix.rpartition("/")
        start = self._root_slash + base_dir if base_dir else self._root_slash
        return self._walk(start, base_dir + "/" if base_dir else "", prefix)

    def _walk(self, path: str, rel: str, prefix: str) -> Iterator[ObjectInfo]:
        # Paths as strings, from the directory entries: a pathlib join and its conversion back
        # per name cost more than the stat itself (a fresh client's refs(), 1,001 journal
        # entries, 100 branches and 100 tags: 11.3 -> 6.9 ms).
        try:
            with os.scandir(path) as it:
                entries = [
                    (e.name + "/", e.name, e.path, True, e.is_symlink())
                    if e.is_dir()
                    else (e.name, e.name, e.path, False, False)
                    for e in it
                ]
        except (FileNotFoundError, NotADirectoryError):
            return
        # Every key below directory d starts with "d/": ordering a directory's names with "/"
        # appended to directories yields keys in ascending order, level by level. The sort key
        # is made once per name, as the entry is read (a key function per name cost more than the
        # sort: finding a branch head in a journal of 1,002 entries 789 -> 488 us).
        entries.sort(key=_sort_key)
        stat, fromtimestamp, utc = os.stat, dt.datetime.fromtimestamp, dt.UTC
        for _, name, full, is_dir, is_link in entries:
            key = rel + name
            if is_dir:
                sub = key + "/"
                if is_link or (not rel and name == _TMP):
                    continue
                if sub.startswith(prefix) or prefix.startswith(sub):
                    yield from self._walk(full, sub, prefix)
            elif key.startswith(prefix):
                try:
                    st = stat(full)
                except FileNotFoundError:
                    continue  # deleted since the directory was read
                yield ObjectInfo(key, st.st_size, fromtimestamp(st.st_mtime, utc))

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        path = self.root / prefix if prefix else self.root
        try:
            names = sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        # Folders left empty by deletes are not listed: a folder exists only through its objects.
        return [n for n in names if n != _TMP and (path / n).is_dir() and _holds_file(path / n)]

    def delete_many(self, keys: Iterable[str]) -> int:
        n = 0
        for key in keys:
            n += 1
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
        return n

    def delete_stale(
        self, keys: Iterable[str], cutoff: dt.datetime
    ) -> tuple[builtins.list[ObjectInfo], builtins.list[ObjectInfo]]:
        """Atomic per object: the file is first renamed out of its key's place, then judged.

        A writer rewrites a key by renaming a new file onto it. After our rename, a rewrite
        creates a new file at the key (it survives; we delete the old one). A rewrite that came
        before our rename left a fresh modification time on the file we moved: it goes back,
        unless the key has been written again meanwhile. While a file is away its key reads as
        absent, which a commit checking its deduplicated chunks treats as retryable, never as
        lost data.
        """
        deleted: builtins.list[ObjectInfo] = []
        kept: builtins.list[ObjectInfo] = []
        tmpdir = self.root / _TMP
        tmpdir.mkdir(parents=True, exist_ok=True)
        for key in keys:
            path = self._path(key)
            away = tmpdir / f"stale-{uuid.uuid4().hex}"
            try:
                os.rename(path, away)
            except (FileNotFoundError, NotADirectoryError):
                continue
            st = os.stat(away)
            info = ObjectInfo(key, st.st_size, dt.datetime.fromtimestamp(st.st_mtime, dt.UTC))
            if info.modified <= cutoff:
                os.unlink(away)
                deleted.append(info)
                continue
            try:
                os.link(away, path)  # back in place, unless a newer write already is
            except FileExistsError:
                pass
            os.unlink(away)
            kept.append(info)
        return deleted, kept

    def set_modified(self, key: str, when: dt.datetime) -> None:
        """Backdate an object (tests of grace periods use this)."""
        ts = when.timestamp()
        os.utime(self._path(key), (ts, ts))
