"""Helpers shared by the mirror tests (test_mirror, test_mirror_adversarial, test_mirror_s3).

Writing: :func:`write` commits array ``a`` whole; :func:`write_chunks` rewrites some of its
chunks. Reading: :func:`read` reads ``a``, :func:`read_all` every array of a snapshot (so every
chunk). Replication: :func:`replicate` copies objects from a source storage to a destination as
bucket replication does (every key, journal and marker included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import zarr

import zarrlake as zl

CHUNK = 1024  # elements of int32 per chunk: 4 KiB, so every chunk is an object, never inlined


def data(seed: int, n: int = 64) -> np.ndarray:
    """What ``write(..., seed, ..., n)`` wrote."""
    return np.random.default_rng(seed).integers(0, 2**31, n * CHUNK, dtype="i4")


def write(
    repo: zl.Repository, branch: str, value: int, message: str, n: int = 64, path: str = "a"
) -> str:
    """Commit array ``path``: ``n`` chunks of 4 KiB of random numbers (so every chunk is an
    object, not inlined) drawn from seed ``value``; returns the new head."""
    with repo.transaction(branch, message=message) as store:
        try:
            arr = zarr.open_array(store, path=path, mode="r+")
        except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError):
            arr = zarr.create_array(
                store, name=path, shape=(n * CHUNK,), chunks=(CHUNK,), dtype="i4"
            )
        assert arr.shape == (n * CHUNK,), f"{path} has {arr.shape[0] // CHUNK} chunks, not {n}"
        arr[:] = data(value, n)
    return repo.lookup_branch(branch)


def write_chunks(
    repo: zl.Repository, branch: str, seed: int, chunks: Iterable[int], message: str
) -> str:
    """Commit new random contents (from ``seed``) for the given chunk indexes of array ``a``
    (which must exist); returns the new head."""
    rng = np.random.default_rng(seed)
    with repo.transaction(branch, message=message) as store:
        arr = zarr.open_array(store, path="a", mode="r+")
        for i in sorted(set(chunks)):
            arr[i * CHUNK : (i + 1) * CHUNK] = rng.integers(0, 2**31, CHUNK, dtype="i4")
    return repo.lookup_branch(branch)


def read(repo: zl.Repository, ref: str) -> np.ndarray:
    return np.asarray(zarr.open_array(repo.readonly_session(ref).store, path="a", mode="r")[:])


def read_all(repo: zl.Repository, ref: str) -> dict[str, np.ndarray]:
    """Every array of snapshot (or ref) ``ref``, read whole: every chunk is read."""
    group = zarr.open_group(repo.readonly_session(ref).store, mode="r")
    return {name: np.asarray(arr[:]) for name, arr in sorted(group.arrays())}


def chunk_keys(storage: zl.Storage) -> set[str]:
    return set(storage.list_keys("chunks/"))


def replicate(
    source: zl.Storage, dest: zl.Storage, keep: Callable[[str], bool] = lambda key: True
) -> list[str]:
    """What bucket replication does: copy every object under the prefix (journal and marker
    included), here all at once (concurrently); returns the keys withheld by ``keep``."""
    keys = source.list_keys("")
    dest.map(lambda key: dest.put(key, source.get(key)), [k for k in keys if keep(k)])
    return [k for k in keys if not keep(k)]
