"""``moto_server`` whose writes of an object are atomic: ``python -m zarrlake_testkit.moto_atomic``
takes moto_server's arguments.

S3 decides a conditional PUT (``If-Match``, ``If-None-Match: *``) atomically: of two writers
that read one version, exactly one can replace it. moto's threaded server checks the condition,
then builds and stores the object in separate steps, so two requests on two of its threads can
both pass the check (seen: 60 compare-and-set swaps that wrote 59 values,
``tests/test_compare_and_set.py::test_racing_swaps_threads``). The engine's tests are about
zarrlake keeping its promises on a server that keeps S3's, not about moto's races: here every
PutObject of one server runs under one lock, so a check and its write are one step, as on S3.
Unconditional writes take the lock too, so a conditional write never straddles one. The rest of
moto (listings, reads, deletes, multipart parts) runs as before.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


def _atomic_puts() -> None:
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    put_object = S3Response.put_object

    def locked(self: Any) -> Any:
        with lock:
            return put_object(self)

    S3Response.put_object = locked  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    _atomic_puts()
    from moto.server import main as moto_main

    moto_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
