"""A storage that lists exactly as loosely as the listing contract allows, for the engine's tests.

The contract (``zarrlake.storage.base``): a listing holds every object under a plain prefix once;
it is ascending only among keys of one length directly in one folder; ``list_dirs`` may name
folders whose objects are all gone. :class:`ContractOnlyStorage` is the memory backend with every
other order taken away: each listing interleaves those ascending runs at random (folders in any
order, names of different lengths mixed), and ``list_dirs`` also names every folder that ever
held an object. Engine code that leans on more than the contract fails on it, as it would on a
real server that keeps no more (SeaweedFS lists folder by folder and keeps emptied folders).
"""

from __future__ import annotations

import builtins
import random
from collections.abc import Iterator
from typing import Any, ClassVar

from zarrlake.storage.base import Buffer, ObjectInfo
from zarrlake.storage.memory import MemoryStorage

__all__ = ["ContractOnlyStorage"]


class ContractOnlyStorage(MemoryStorage):
    """:class:`MemoryStorage` whose listings keep the listing contract and nothing more.

    ``seed`` makes the orders reproducible: each listing draws from one random sequence.
    """

    # As on S3: the server keeps create-only writes, and the engine asks it (a memory store
    # keeps them, so the check passes, through the same code as on S3).
    conditional_writes_by_server: ClassVar[bool] = True
    # Likewise compare-and-set: the engine's check runs through the same code as on S3.
    compare_and_set_by_server: ClassVar[bool] = True

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self._rng = random.Random(seed)
        self._folders: set[str] = set()  # every folder that ever held an object ("a/", "a/b/")

    @property
    def url(self) -> str:
        # Each one is a place of its own (a mirror refuses to copy a place onto itself).
        return f"memory://contract-only-{id(self):x}"

    def put(self, key: str, data: Buffer, *, create_only: bool = False) -> None:
        super().put(key, data, create_only=create_only)
        self._remember_folders(key)

    def put_if_version(self, key: str, data: Buffer, version: str | None) -> str:
        written = super().put_if_version(key, data, version)
        self._remember_folders(key)
        return written

    def _remember_folders(self, key: str) -> None:
        parts = key.split("/")[:-1]
        with self._lock:
            self._folders.update("/".join(parts[: i + 1]) + "/" for i in range(len(parts)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        runs: dict[tuple[str, int], builtins.list[ObjectInfo]] = {}
        for info in super().list(prefix):  # ascending: each run comes out ascending too
            folder, _, name = info.key.rpartition("/")
            runs.setdefault((folder, len(name)), []).append(info)
        pending = [run[::-1] for run in runs.values()]  # popped from the end: smallest first
        while pending:
            run = self._rng.choice(pending)
            yield run.pop()
            if not run:
                pending.remove(run)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        with self._lock:
            named = {
                f[len(prefix) :].split("/", 1)[0] for f in self._folders if f.startswith(prefix)
            }
        named.discard("")
        out = sorted(named)
        self._rng.shuffle(out)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        with self._lock:
            state["_folders"] = set(self._folders)
        state["_rng"] = random.Random(self._rng.random())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._folders = state["_folders"]
        self._rng = state["_rng"]
