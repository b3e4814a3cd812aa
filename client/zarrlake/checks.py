"""Checks: validators a protected branch requires before a commit or merge lands on it.

A check is named (``required_checks`` of a :class:`~zarrlake.rules.BranchRule`) and found as an
entry point of the group ``zarrlake.checks``: a factory called with the rule's options for it
(``check_options``), returning a callable that takes the :class:`Change` about to land and
returns the problems it finds (an empty list: the change passes). Three ship with zarrlake:

``required-attributes``
    every array written (or, with ``groups=True``, every group too) carries the attributes
    named (default ``["units"]``, as CF asks of every variable), non-empty.
``array-rules``
    ``rules``: glob of array paths -> what its arrays must be: ``dtype``, ``shape``, ``ndim``,
    ``chunks`` (the chunk shape), ``codecs`` (names that must appear), ``dimension_names``.
``no-nan``
    no NaN in the new chunks of the arrays matched by ``arrays`` (globs; default every
    floating-point array). Reads only the chunks the change writes.

A check runs with the change's snapshot written but not published: it reads the new data
through :meth:`Change.open_array` (read-only, lazy). A check that raises, or runs past its
``timeout_s`` (a reserved option; default :data:`DEFAULT_TIMEOUT_S`), refuses the change.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from zarrlake.errors import CheckFailed, InvalidArgument
from zarrlake.format.model import Snapshot
from zarrlake.nodes import array_paths, is_meta_key, meta_key_node, split_chunk_key
from zarrlake.rules import BranchRule

ENTRY_POINTS = "zarrlake.checks"
DEFAULT_TIMEOUT_S = 120.0
#: How long a worker process of :class:`IsolatedChecks` may take to start.
WORKER_START_S = 120.0
#: Problems a check may report before the rest are counted, not listed.
MAX_PROBLEMS = 100

Check = Callable[["Change"], Iterable[str]]


@dataclass(frozen=True)
class ArrayChange:
    """One array the change touches. ``path``: its node path (``/group/temp``); ``metadata``:
    its ``zarr.json`` after the change (None: the change deletes it); ``previous``: before (None:
    new); ``chunks``: the coordinates of the chunks (or shards) it writes."""

    path: str
    metadata: dict[str, Any] | None
    previous: dict[str, Any] | None
    chunks: tuple[tuple[int, ...], ...]

    @property
    def attributes(self) -> dict[str, Any]:
        meta = self.metadata or {}
        attrs = meta.get("attributes", {})
        return attrs if isinstance(attrs, dict) else {}


class Change:
    """What is about to land on ``branch``: a commit (``kind`` "commit") or a merge ("merge")
    of ``snapshot`` onto ``parent``, with its message and author; ``written()`` gives the keys
    of the chunks it writes (from the session's changes, or a commit service's manifest diff).
    ``arrays`` and ``groups`` are computed when first asked (a change of a million chunks costs
    nothing until a check looks)."""

    def __init__(
        self,
        branch: str,
        kind: str,
        parent: Snapshot,
        built: Snapshot,
        written: Callable[[], Iterable[str]],
        open_store: Callable[[str], Any],
        digest: str | None = None,
        parent_digest: str | None = None,
    ) -> None:
        self.branch = branch
        self.kind = kind
        self.parent = parent.id
        self.snapshot = built.id
        self.message = built.message
        self.author = built.author
        #: SHA-256 of the snapshot's bytes as they will be published (a commit service's
        #: checks that run elsewhere read it again, and compare), or None.
        self.snapshot_sha256 = digest
        #: The same of the parent's bytes, as its journal entry carries them (or None).
        self.parent_sha256 = parent_digest
        self._before = parent
        self._after = built
        self._written = written
        self._open_store = open_store

    @functools.cached_property
    def _changed_meta(self) -> dict[str, tuple[bytes | None, bytes | None]]:
        before, after = self._before.nodes, self._after.nodes
        out = {}
        for key in before.keys() | after.keys():
            old, new = before.get(key), after.get(key)
            if old != new:
                out[key] = (old, new)
        return out

    @functools.cached_property
    def written_keys(self) -> tuple[str, ...]:
        """The keys of the chunks the change writes (computed when first asked, once)."""
        return tuple(self._written())

    @functools.cached_property
    def arrays(self) -> Mapping[str, ArrayChange]:
        """Node path -> :class:`ArrayChange`, for every array whose metadata or chunks change."""
        after = array_paths(self._after.nodes)
        before = array_paths(self._before.nodes)
        chunks: dict[str, list[tuple[int, ...]]] = {}
        for key in self.written_keys:
            if is_meta_key(key):
                continue
            path, coords = split_chunk_key(key, after)
            if path in after and all(isinstance(c, int) for c in coords):
                chunks.setdefault(path, []).append(coords)
        touched = set(chunks)
        for key in self._changed_meta:
            node = meta_key_node(key)
            if node in after or node in before:
                touched.add(node)
        out = {}
        for path in sorted(touched):
            out[path] = ArrayChange(
                path,
                _node_doc(self._after.nodes, path) if path in after else None,
                _node_doc(self._before.nodes, path) if path in before else None,
                tuple(sorted(chunks.get(path, ()))),
            )
        return out

    @functools.cached_property
    def groups(self) -> Mapping[str, dict[str, Any] | None]:
        """Node path -> the group's metadata after the change (None: deleted), for every group
        whose metadata changes."""
        arrays = array_paths(self._after.nodes) | array_paths(self._before.nodes)
        out: dict[str, dict[str, Any] | None] = {}
        for key, (_, new) in sorted(self._changed_meta.items()):
            node = meta_key_node(key)
            if node not in arrays:
                out[node] = None if new is None else _doc(new)
        return out

    @functools.cached_property
    def store(self) -> Any:
        """A read-only Zarr store of the repository as it would be after the change."""
        return self._open_store(self.snapshot)

    def open_array(self, path: str) -> Any:
        """The array at node path ``path`` as it would be after the change (read-only, lazy)."""
        import zarr

        return zarr.open_array(self.store, path=path.strip("/"), mode="r")

    def new_chunks(self, path: str) -> Iterator[tuple[tuple[int, ...], Any]]:
        """(coordinates, values) of each chunk (or shard) of array ``path`` the change writes,
        read one at a time."""
        change = self.arrays.get(path)
        if change is None or change.metadata is None or not change.chunks:
            return
        array = self.open_array(path)
        shape = getattr(array, "shards", None) or array.chunks
        for coords in change.chunks:
            region = tuple(
                slice(c * s, min((c + 1) * s, n))
                for c, s, n in zip(coords, shape, array.shape, strict=False)
            )
            yield coords, array[region]


def _doc(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _node_doc(nodes: Mapping[str, bytes], path: str) -> dict[str, Any]:
    prefix = path.strip("/")
    for name in ("zarr.json", ".zarray"):
        data = nodes.get(f"{prefix}/{name}" if prefix else name)
        if data is not None:
            return _doc(data)
    return {}


def _matches(path: str, globs: Iterable[str]) -> bool:
    plain = path.strip("/")
    return any(fnmatch.fnmatchcase(plain, g.strip("/")) for g in globs)


def _globs(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidArgument(f"{name} must be a list of path globs, not {value!r}")
    if not all(isinstance(g, str) and g for g in value):
        raise InvalidArgument(f"{name} must be a list of path globs, not {value!r}")
    return tuple(value)


# -- the checks that ship ------------------------------------------------------------------------


class RequiredAttributes:
    """``required-attributes``: the arrays written (matched by ``arrays``, default all; with
    ``groups``, the groups too) carry every attribute of ``attributes``, not empty."""

    def __init__(
        self,
        attributes: list[str] | tuple[str, ...] = ("units",),
        arrays: list[str] | tuple[str, ...] = ("*",),
        groups: bool = False,
    ) -> None:
        if isinstance(attributes, str) or not isinstance(attributes, list | tuple):
            raise InvalidArgument(f"attributes must be a list of names, not {attributes!r}")
        if not attributes or not all(isinstance(a, str) and a for a in attributes):
            raise InvalidArgument(f"attributes must be a list of names, not {attributes!r}")
        if not isinstance(groups, bool):
            raise InvalidArgument(f"groups must be true or false, not {groups!r}")
        self.attributes = tuple(attributes)
        self.arrays = _globs(arrays, "arrays")
        self.groups = groups

    def __call__(self, change: Change) -> list[str]:
        problems = []
        for path, array in change.arrays.items():
            if array.metadata is None or not _matches(path, self.arrays):
                continue
            missing = [a for a in self.attributes if _empty(array.attributes.get(a))]
            if missing:
                problems.append(f"array {path} has no {', '.join(missing)} attribute")
        if self.groups:
            for path, doc in change.groups.items():
                if doc is None:
                    continue
                attrs = doc.get("attributes") or {}
                missing = [a for a in self.attributes if _empty(attrs.get(a))]
                if missing:
                    problems.append(f"group {path} has no {', '.join(missing)} attribute")
        return problems


def _empty(value: Any) -> bool:
    return value is None or value == "" or value == [] or value == {}


_ARRAY_RULES = ("dtype", "shape", "ndim", "chunks", "codecs", "dimension_names")


class ArrayRules:
    """``array-rules``: ``rules`` maps a glob of array paths to what its arrays must be
    (``dtype``, ``shape``, ``ndim``, ``chunks``, ``codecs``, ``dimension_names``); an array
    matched by several globs obeys all of them."""

    def __init__(self, rules: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        if not isinstance(rules, Mapping) or not rules:
            raise InvalidArgument(
                'array-rules needs rules: {"<path glob>": {"dtype": "float32", ...}}'
            )
        for glob, rule in rules.items():
            if not isinstance(glob, str) or not isinstance(rule, Mapping):
                raise InvalidArgument(f"array-rules: {glob!r} must map to a dict of settings")
            unknown = sorted(set(rule) - set(_ARRAY_RULES))
            if unknown:
                raise InvalidArgument(
                    f"array-rules: {glob!r} has no setting(s) {', '.join(unknown)} "
                    f"(known: {', '.join(_ARRAY_RULES)})"
                )
        self.rules = {g: dict(r) for g, r in rules.items()}

    def __call__(self, change: Change) -> list[str]:
        problems: list[str] = []
        for path, array in change.arrays.items():
            meta = array.metadata
            if meta is None:
                continue
            for glob, rule in self.rules.items():
                if _matches(path, (glob,)):
                    problems.extend(f"array {path}: {p}" for p in _rule_problems(meta, rule))
        return problems


def _rule_problems(meta: Mapping[str, Any], rule: Mapping[str, Any]) -> list[str]:
    out = []
    shape = list(meta.get("shape") or [])
    if "dtype" in rule:
        dtype = _dtype_name(meta)
        want = rule["dtype"]
        allowed = [want] if isinstance(want, str) else list(want)
        if dtype not in allowed:
            out.append(f"dtype is {dtype}, not {' or '.join(map(str, allowed))}")
    if "ndim" in rule and len(shape) != rule["ndim"]:
        out.append(f"has {len(shape)} dimension(s), not {rule['ndim']}")
    if "shape" in rule:
        want = list(rule["shape"])
        if len(want) != len(shape) or any(
            w is not None and w != s for w, s in zip(want, shape, strict=True)
        ):
            out.append(f"shape is {shape}, not {want}")
    if "chunks" in rule:
        chunks = _chunk_shape(meta)
        want = list(rule["chunks"])
        if (
            chunks is None
            or len(want) != len(chunks)
            or any(w is not None and w != c for w, c in zip(want, chunks, strict=True))
        ):
            out.append(f"chunks are {chunks}, not {want}")
    if "codecs" in rule:
        names = _codec_names(meta)
        missing = [c for c in rule["codecs"] if c not in names]
        if missing:
            out.append(f"does not use codec(s) {', '.join(missing)} (uses {', '.join(names)})")
    if "dimension_names" in rule:
        dims = meta.get("dimension_names")
        if list(dims or []) != list(rule["dimension_names"]):
            out.append(f"dimension_names are {dims}, not {list(rule['dimension_names'])}")
    return out


def _dtype_name(meta: Mapping[str, Any]) -> str:
    dtype = meta.get("data_type", meta.get("dtype"))
    if isinstance(dtype, dict):
        return str(dtype.get("name"))
    if isinstance(dtype, str) and meta.get("zarr_format") == 2:
        import numpy as np

        try:
            return np.dtype(dtype).name
        except TypeError:
            return dtype
    return str(dtype)


def _chunk_shape(meta: Mapping[str, Any]) -> list[int] | None:
    if "chunks" in meta and meta.get("zarr_format") == 2:
        return list(meta["chunks"])
    grid = meta.get("chunk_grid") or {}
    config = grid.get("configuration") or {}
    shape = config.get("chunk_shape")
    for codec in meta.get("codecs") or []:
        if isinstance(codec, dict) and codec.get("name") == "sharding_indexed":
            inner = (codec.get("configuration") or {}).get("chunk_shape")
            return list(inner) if inner is not None else None
    return None if shape is None else list(shape)


def _codec_names(meta: Mapping[str, Any]) -> list[str]:
    names = []

    def walk(codecs: Any) -> None:
        for codec in codecs or []:
            if isinstance(codec, dict):
                names.append(str(codec.get("name")))
                walk((codec.get("configuration") or {}).get("codecs"))

    walk(meta.get("codecs"))
    if meta.get("zarr_format") == 2 and isinstance(meta.get("compressor"), dict):
        names.append(str(meta["compressor"].get("id")))
    return names


class NoNaN:
    """``no-nan``: no NaN in the chunks the change writes, in the arrays matched by ``arrays``
    (default: every floating-point array)."""

    def __init__(self, arrays: list[str] | tuple[str, ...] = ("*",)) -> None:
        self.arrays = _globs(arrays, "arrays")

    def __call__(self, change: Change) -> list[str]:
        import numpy as np

        problems = []
        for path, array in change.arrays.items():
            if array.metadata is None or not array.chunks or not _matches(path, self.arrays):
                continue
            if not _dtype_name(array.metadata).startswith(("float", "complex")):
                continue
            for coords, values in change.new_chunks(path):
                count = int(np.isnan(values).sum())
                if count:
                    problems.append(f"array {path} chunk {list(coords)} has {count} NaN value(s)")
                    if len(problems) >= MAX_PROBLEMS:
                        return problems
        return problems


#: The checks that ship, by name: found even where the package's entry points are not
#: installed (a source checkout); an entry point of the same name wins.
BUILTIN: dict[str, Callable[..., Check]] = {
    "required-attributes": RequiredAttributes,
    "array-rules": ArrayRules,
    "no-nan": NoNaN,
}


def available() -> dict[str, Callable[..., Check]]:
    """Every check this process can run, by name: the shipped ones and the ``zarrlake.checks``
    entry points of installed packages."""
    found: dict[str, Callable[..., Check]] = dict(BUILTIN)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name in BUILTIN and ep.value.startswith("zarrlake.checks:"):
            continue  # our own, already here
        found[ep.name] = _lazy(ep)
    return found


def _lazy(ep: importlib.metadata.EntryPoint) -> Callable[..., Check]:
    def factory(**options: Any) -> Check:
        made: Check = ep.load()(**options)
        return made

    return factory


def build(name: str, options: Mapping[str, Any]) -> tuple[Check, float]:
    """The check ``name`` made with ``options``, and its timeout. Raises
    :class:`InvalidArgument` for a check not installed here or options it refuses."""
    opts = dict(options)
    timeout = opts.pop("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise InvalidArgument(f"check {name!r}: timeout_s must be a positive number of seconds")
    factories = available()
    factory = factories.get(name)
    if factory is None:
        raise InvalidArgument(
            f"no check named {name!r} is installed here (installed: {', '.join(sorted(factories))})"
        )
    try:
        return factory(**opts), float(timeout)
    except InvalidArgument:
        raise
    except Exception as e:  # a third-party factory's own refusal
        raise InvalidArgument(f"check {name!r} refuses its options: {e}") from None


class Runner(Protocol):
    """Where checks run: :func:`run` asks it for each check's problems."""

    def run_one(
        self, name: str, options: Mapping[str, Any], change: Change, timeout: float
    ) -> list[str]: ...


class JobRunner(Protocol):
    """Checks that are not installed here but run elsewhere, as programs of their own (a
    commit service's checks run as Kubernetes Jobs: :mod:`zarrlake.checkjobs`)."""

    def runs(self, name: str) -> bool:
        """Whether check ``name`` is one of these (then no entry point of that name is looked
        for)."""
        ...

    def run_job(self, name: str, options: Mapping[str, Any], change: Change) -> list[str]:
        """The problems check ``name`` finds in ``change`` (its failure, its timeout are
        problems too)."""
        ...


class RunElsewhere:
    """Checks known by name only: they run in a commit service, as Jobs, not in this process.
    A rule may require them (an operator setting rules it does not run); asked to run one,
    this refuses the change, saying where it runs."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def runs(self, name: str) -> bool:
        return name in self.names

    def run_job(self, name: str, options: Mapping[str, Any], change: Change) -> list[str]:
        return [f"cannot run here: {name!r} runs as a Job of the commit service; commit through it"]


def run(
    rule: BranchRule,
    change: Change,
    runner: Runner | None = None,
    jobs: JobRunner | None = None,
) -> None:
    """Run every check ``rule`` requires on ``change``, in order; raise :class:`CheckFailed` for
    the first that finds problems, fails or runs out of time. ``runner``: where they run (by
    default a thread of this process each; :class:`IsolatedChecks`: worker processes);
    ``jobs``: the checks that run as programs of their own, by name, before entry points."""
    for name in rule.required_checks:
        if jobs is not None and jobs.runs(name):
            problems = jobs.run_job(name, rule.options(name), change)
            if problems:
                raise CheckFailed(name, change.branch, problems)
            continue
        try:
            check, timeout = build(name, rule.options(name))
        except InvalidArgument as e:
            raise CheckFailed(name, change.branch, [f"cannot run here: {e}"]) from None
        if runner is None:
            problems = _run_in_thread(check, change, timeout)
        else:
            problems = runner.run_one(name, rule.options(name), change, timeout)
        if problems:
            raise CheckFailed(name, change.branch, problems)


def problems_of(check: Check, change: Change) -> list[str]:
    """What ``check`` finds in ``change``: its problems, or the one that it failed."""
    try:
        found = check(change)
        if isinstance(found, str):  # one problem, said as a string
            found = [found]
        out: list[str] = []
        for p in found or ():
            if len(out) == MAX_PROBLEMS:
                out.append("(and more)")
                break
            out.append(str(p))
        return out
    except BaseException as e:
        return [f"crashed: {type(e).__name__}: {e}"]


def _run_in_thread(check: Check, change: Change, timeout: float) -> list[str]:
    """The check's problems (its failure or its timeout are problems too)."""
    result: list[list[str]] = []
    # A thread, so that a check that hangs does not hang the commit: it is left behind (Python
    # cannot stop a thread), marked daemon so that it does not keep the process alive. A
    # process that runs for long (a commit service) runs them in processes instead.
    thread = threading.Thread(
        target=lambda: result.append(problems_of(check, change)), name="zarrlake-check", daemon=True
    )
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return [f"did not finish within {_seconds(timeout)}"]
    return result[0] if result else ["crashed: returned nothing"]


def _seconds(s: float) -> str:
    return f"{s:g} s" if not math.isinf(s) else "ever"


# -- checks in a process of their own ---------------------------------------------------------


class IsolatedChecks:
    """Runs checks in worker processes of their own, so that one that hangs is stopped at its
    timeout (the worker is killed, and the next check starts a new one) and one that crashes
    the interpreter (``os._exit``, a segfault in an extension) takes only its worker down. What
    a commit service uses: a thread left behind by each hung check would pile up in a process
    that runs for months.

    ``open_store(snapshot_id)``, picklable (a repository's bound method): what a worker reads
    the change through, in its own process. Workers are spawned (not forked: the service has
    threads) and kept for the next check; each costs an interpreter and zarrlake's imports
    (about a second) once."""

    def __init__(self, open_store: Callable[[str], Any], *, idle_workers: int = 2) -> None:
        self._open_store = open_store
        self._idle: list[_Worker] = []
        self._idle_max = idle_workers
        self._lock = threading.Lock()
        self._closed = False

    def run_one(
        self, name: str, options: Mapping[str, Any], change: Change, timeout: float
    ) -> list[str]:
        """The problems check ``name`` (made with ``options``) finds in ``change`` (its failure,
        its timeout and its worker's death are problems too)."""
        request = _Request(
            name,
            dict(options),
            change.branch,
            change.kind,
            change._before,
            change._after,
            change.written_keys,  # computed once for all the checks of this change
        )
        worker = self._take()
        try:
            problems = worker.ask(request, timeout)
        except _WorkerLost as e:
            worker.stop()
            return [str(e)]
        except BaseException:
            worker.stop()  # in whatever state it was left: never reused, never left running
            raise
        self._give_back(worker)
        return problems

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("these isolated checks were closed")
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
        return _Worker(self._open_store)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._idle_max:
                self._idle.append(worker)
                return
        worker.stop()

    def pids(self) -> list[int]:
        """The process ids of the idle workers."""
        with self._lock:
            return [w.pid for w in self._idle]

    def close(self) -> None:
        """Stop every idle worker (a busy one stops when its check ends)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.stop()


@dataclass(frozen=True)
class _Request:
    name: str
    options: dict[str, Any]
    branch: str
    kind: str
    parent: Snapshot
    built: Snapshot
    written: tuple[str, ...]


class _WorkerLost(Exception):
    """A worker that ran out of time or died: its check's one problem."""


class _Worker:
    """One spawned process that runs checks one at a time (:func:`_serve`)."""

    def __init__(self, open_store: Callable[[str], Any]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(child, open_store), name="zarrlake-check", daemon=True
        )
        self._process.start()
        child.close()
        self.pid = self._process.pid or 0
        self._ready = False

    def alive(self) -> bool:
        return self._process.is_alive()

    def ask(self, request: _Request, timeout: float) -> list[str]:
        try:
            if not self._ready:
                # Its start (an interpreter, zarrlake's imports) is not the check's time.
                if not self._conn.poll(WORKER_START_S):
                    raise _WorkerLost(
                        f"its process did not start within {_seconds(WORKER_START_S)}"
                    )
                self._ready = self._conn.recv() == "ready"
            self._conn.send(request)
            # Finding and importing the check is not its time either (the thread runner's
            # check was made before its clock started): the worker says when it has it.
            if not _poll(self._conn, max(timeout, WORKER_START_S)):
                raise _WorkerLost(
                    f"could not be loaded within {_seconds(max(timeout, WORKER_START_S))} "
                    "(its process was stopped)"
                )
            answer: list[str] | str = self._conn.recv()
            if answer == "built":
                if not _poll(self._conn, timeout):
                    raise _WorkerLost(
                        f"did not finish within {_seconds(timeout)} (its process was stopped)"
                    )
                answer = self._conn.recv()
            assert isinstance(answer, list)
        except (EOFError, OSError, BrokenPipeError):
            self._process.join(5)
            code = self._process.exitcode
            raise _WorkerLost(f"crashed: its process exited (exit code {code})") from None
        return answer

    def stop(self) -> None:
        if self._process.is_alive():
            self._process.kill()
        self._process.join(10)
        self._conn.close()


def _poll(conn: Any, timeout: float) -> bool:
    """``conn.poll(timeout)`` for any timeout (one poll takes at most ~24 days, as its
    milliseconds must fit an int)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if conn.poll(max(0.0, min(left, 86_400.0))):
            return True
        if left <= 86_400.0:
            return False


def _serve(conn: Any, open_store: Callable[[str], Any]) -> None:
    """A worker's loop: run each check asked for, answer its problems."""
    conn.send("ready")
    while True:
        try:
            request: _Request = conn.recv()
        except EOFError:
            return  # the service went away
        change = Change(
            request.branch,
            request.kind,
            request.parent,
            request.built,
            functools.partial(iter, request.written),
            open_store,
        )
        try:
            check, _ = build(request.name, request.options)
        except InvalidArgument as e:
            conn.send([f"cannot run here: {e}"])
            continue
        conn.send("built")
        conn.send(problems_of(check, change))
