"""How long creating one small object takes on a local file system, by method (issue 11).

    python bench/file_create.py [--files 3000] [--dir DIR] [--passes 2]

Small-chunk writes to a local repository cost about one file creation each. This times the ways
an object can be put in place, to show whether the method or the file system decides. The
methods are: a temporary file linked into place and unlinked (zarrlake's create-only write); an
unnamed ``O_TMPFILE`` linked into place (Linux); a temporary file renamed into place; a file
created in place (not atomic: a reader can see it half-written); a temporary file in the object's
own folder.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400
_DATA = os.urandom(1024)


_LIBC: list[ctypes.CDLL] = []


def _libc() -> ctypes.CDLL:
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _create(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _write(fd: int) -> None:
    os.write(fd, _DATA)
    os.close(fd)


def _dest(root: str, i: int) -> str:
    return f"{root}/chunks/{i % 256:02x}/{uuid.uuid4().hex}"


def link_unlink(root: str, i: int) -> None:
    tmp = f"{root}/.tmp/{uuid.uuid4().hex}"
    _write(_create(tmp))
    os.link(tmp, _dest(root, i))
    os.unlink(tmp)


def tmpfile_linkat(root: str, i: int) -> None:
    libc = _libc()
    fd = os.open(f"{root}/chunks/{i % 256:02x}", os.O_WRONLY | os.O_TMPFILE, 0o644)
    os.write(fd, _DATA)
    # os.link would link the /proc symlink itself: linkat must follow it.
    src, dst = f"/proc/self/fd/{fd}".encode(), _dest(root, i).encode()
    if libc.linkat(_AT_FDCWD, src, _AT_FDCWD, dst, _AT_SYMLINK_FOLLOW) != 0:
        raise OSError(ctypes.get_errno(), "linkat")
    os.close(fd)


def rename(root: str, i: int) -> None:
    tmp = f"{root}/.tmp/{uuid.uuid4().hex}"
    _write(_create(tmp))
    os.rename(tmp, _dest(root, i))


def in_place(root: str, i: int) -> None:
    _write(_create(_dest(root, i)))


def same_folder(root: str, i: int) -> None:
    dest = _dest(root, i)
    tmp = f"{os.path.dirname(dest)}/.t{uuid.uuid4().hex}"
    _write(_create(tmp))
    os.link(tmp, dest)
    os.unlink(tmp)


METHODS: list[Callable[[str, int], None]] = [
    link_unlink,
    tmpfile_linkat,
    rename,
    in_place,
    same_folder,
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--dir", type=Path, help="where to create them (default: a temp dir)")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="zarrlake-files-", dir=args.dir))
    try:
        print("| method | µs per file |\n| --- | ---: |")
        for _ in range(args.passes):
            for method in METHODS:
                root = str(base / method.__name__)
                shutil.rmtree(root, ignore_errors=True)
                os.makedirs(f"{root}/.tmp")
                for j in range(256):
                    os.makedirs(f"{root}/chunks/{j:02x}")
                t0 = time.perf_counter()
                for i in range(args.files):
                    method(root, i)
                us = (time.perf_counter() - t0) * 1e6 / args.files
                print(f"| {method.__name__} | {us:.1f} |", flush=True)
                shutil.rmtree(root)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
