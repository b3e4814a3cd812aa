"""The commit service: the one writer of a repository's refs, which applies its rules to every
client (``docs/design/governance.md``, "Enforcement against a client that skips the rules").

Run with credentials that write ``refs/``, ``root`` and ``repo``; writers get credentials that
write only immutable objects, and send their ref changes here (:class:`zarrlake.remote.
ServiceClient`). A writer that skips its client's rules can then still write objects, which no
reader reaches until the service publishes a ref to them, and cannot move a ref.

For each journal entry a writer asks it to append, the service reads what the entry names
itself (never the writer's description of it): the branch's head now, and the snapshot the
entry points at, whose bytes must be the ones the entry carries. From them it knows what the
entry is — a commit on the head (one parent line continues), a creation, a reset, a deletion —
and applies the branch's rule: a protected branch with ``require_merge`` takes no commits from
writers at all (``POST /v1/merge`` merges in the service, from the two sides as stored), a
reset needs ``allow_reset``, a deletion ``allow_delete``; the required checks run on the
snapshot, with the chunks it writes found by diffing its manifest against its parent's (not
from the writer's txlog). Only then does it append, as any client would, and publish the root.

Tokens: a JSON file ``{"<token>": {"identity": "alice", "role": "writer" | "admin"}}``; every
request carries one (``Authorization: Bearer``), compared in constant time. Writers append,
merge and tag; deleting a tag and changing rules need ``admin``. Each change is logged with the
identity that asked for it; each refusal (a protection rule, a failed check, a tag deletion
without ``admin``) is logged too, and handed to ``refused`` (the ``zarrlake service`` command
posts it as a Kubernetes Event about the ``Repository``, :mod:`zarrlake.kevents`).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zarrlake import __version__
from zarrlake.errors import (
    BranchProtected,
    CheckFailed,
    ConflictError,
    CorruptObject,
    InvalidArgument,
    ObjectNotFound,
    ReadOnlyError,
    RefNotFound,
    UnsupportedFormat,
    ZarrlakeError,
)
from zarrlake.format.ids import is_snapshot_id
from zarrlake.format.model import JournalEntry, Snapshot, snapshot_key
from zarrlake.governance import written_between
from zarrlake.refs import validate_name
from zarrlake.repository import Repository

log = logging.getLogger(__name__)

ROLES = ("writer", "admin")
SERVICE = f"zarrlake-service/{__version__}"


@dataclass(frozen=True)
class Caller:
    identity: str
    role: str


def load_tokens(path: str | Path) -> dict[str, Caller]:
    """The tokens file (see the module docstring). Raises :class:`InvalidArgument`."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"cannot read the tokens file {path}: {e}") from None
    if not isinstance(doc, dict) or not doc:
        raise InvalidArgument(f"the tokens file {path} must map tokens to identities")
    out = {}
    for token, who in doc.items():
        if not isinstance(who, dict) or who.get("role") not in ROLES:
            raise InvalidArgument(f"each token names an identity and a role ({', '.join(ROLES)})")
        if not isinstance(token, str) or len(token) < 16:
            raise InvalidArgument("tokens must be strings of at least 16 characters")
        out[token] = Caller(str(who.get("identity") or "unnamed"), who["role"])
    return out


@dataclass(frozen=True)
class Refusal:
    """A change the service refused: who asked (their token's identity), for what, the error's
    class (``BranchProtected``, ``CheckFailed``, ``ReadOnlyError``; ``InvalidArgument`` for an
    entry whose snapshot is not what it says) and its message."""

    identity: str
    action: str
    error: str
    message: str

    def __str__(self) -> str:
        return f"{self.identity}: {self.action} refused: {self.message}"


Refused = Callable[[Refusal], None]


@dataclass(frozen=True)
class _Stored:
    snapshot: Snapshot
    encoded: bytes


class CommitService:
    """The service's decisions, without HTTP (what :func:`app` serves)."""

    def __init__(self, repo: Repository, *, refused: Refused | None = None) -> None:
        self.repo = repo
        self._refused = refused
        core = repo.core
        if core.journal.remote is not None:
            raise InvalidArgument("a commit service writes refs itself: open it without one")
        core.check_writable()
        # The newest rules before every decision, even those set after the service started.
        repo.governance.follow()
        # A check that hangs is stopped at its timeout: in a process that runs for months, a
        # thread left behind by each would pile up.
        self.checks = repo.governance.isolate_checks()
        # Whom the entries the service writes itself (a merge) are by: the caller it acts for.
        self._acting = threading.local()
        core.journal.stamp = lambda: getattr(self._acting, "by", None)

    def _by(self, caller: Caller, client: str) -> dict[str, str]:
        """Who asked, as the token says (not a commit's free-text author), and through what."""
        by = {"identity": caller.identity, "role": caller.role, "service": SERVICE}
        if client:
            by["client"] = client[:100]
        return by

    @contextlib.contextmanager
    def _refusals(
        self, caller: Caller, action: str, also: tuple[type[ZarrlakeError], ...] = ()
    ) -> Iterator[None]:
        """Logs a refusal of ``action`` (a rule's, a check's, a role's, and ``also`` these) and
        hands it to ``refused``, whose failure changes nothing (the refusal stands)."""
        caught: tuple[type[ZarrlakeError], ...] = (BranchProtected, CheckFailed, ReadOnlyError)
        try:
            yield
        except caught + also as e:
            refusal = Refusal(caller.identity, action, type(e).__name__, str(e))
            log.warning("%s", refusal)
            if self._refused is not None:
                try:
                    self._refused(refusal)
                except Exception as told:
                    log.warning("could not report the refusal: %s", told)
            raise

    # -- appends -----------------------------------------------------------------------------------

    def append(self, caller: Caller, branch: str, data: bytes, client: str = "") -> bool:
        validate_name(branch)
        core = self.repo.core
        journal = core.journal
        try:
            entry = JournalEntry.decode(data, f"<entry for {branch}>")
        except CorruptObject as e:
            raise InvalidArgument(f"not a journal entry: {e}") from None
        if entry.snapshot is not None and not is_snapshot_id(entry.snapshot):
            raise InvalidArgument(f"{entry.snapshot[:40]!r} is not a snapshot id")
        if entry.previous is not None and not is_snapshot_id(entry.previous):
            raise InvalidArgument(f"{entry.previous[:40]!r} is not a snapshot id")
        journal.forget(branch)  # the head as it is now, not as this service last saw it
        head = journal.head(branch)
        expected = 0 if head is None else head.seq + 1
        if entry.seq != expected:
            if head is not None and entry.seq <= head.seq:
                # Perhaps its own append, retried after a lost answer: the same writer id.
                try:
                    found = journal.read_entry(journal.entry_key(branch, entry.seq))
                except ObjectNotFound:
                    return False
                return (found.writer, found.snapshot) == (entry.writer, entry.snapshot)
            raise InvalidArgument(f"entry {entry.seq} of {branch!r} skips ahead of {expected}")
        current = None if head is None else head.snapshot
        if entry.previous != current:
            raise InvalidArgument(
                f"entry {entry.seq} of {branch!r} says the head was {entry.previous}, not {current}"
            )
        # An entry whose snapshot is not what it says (other bytes, not stored, unreadable) is
        # what a forger sends: told, as a refusal is.
        with self._refusals(caller, f"move of branch {branch!r}", also=(InvalidArgument,)):
            kind, stored = self._kind(branch, entry, current)
        gov = self.repo.governance
        action = f"{_ACTIONS[kind]} branch {branch!r}" + (
            f" (snapshot {entry.snapshot})" if entry.snapshot is not None else ""
        )
        with self._refusals(caller, action):
            if kind in ("delete", "reset", "create"):
                gov.before_move(branch, kind)
            else:
                gov.admit(branch, merge=False, maintenance=False)  # a writer's merges too
                assert head is not None and stored is not None
                self._check(branch, head, stored, kind)
        if stored is not None:
            # What was checked is what readers get: the snapshot's bytes travel in the entry
            # (and the root), or, too large to, their digest, which readers compare with what
            # they read: a writer that overwrites snapshots/<id> afterwards changes nothing a
            # reader of the head is shown.
            entry = dataclasses.replace(entry, snapshot_data=stored.encoded)
        by = self._by(caller, client)
        published = journal.append(branch, dataclasses.replace(entry, by=by))
        log.info(
            "%s (%s): %s of %s to %s: %s",
            caller.identity,
            caller.role,
            kind,
            branch,
            entry.snapshot,
            "published" if published else "lost the race",
        )
        return published

    def _kind(
        self, branch: str, entry: JournalEntry, current: str | None
    ) -> tuple[str, _Stored | None]:
        """What the entry does, from what it names as stored, and the snapshot it points at
        (decoded once, from the bytes read here: what is checked is what is published)."""
        if entry.snapshot is None:
            if current is None:
                raise RefNotFound(branch, "branch")
            return "delete", None
        storage = self.repo.core.storage
        key = snapshot_key(entry.snapshot)
        try:
            data = storage.get(key)
        except ObjectNotFound:
            raise InvalidArgument(
                f"entry {entry.seq} of {branch!r} names snapshot {entry.snapshot}, which is not "
                "stored: write the commit's objects first"
            ) from None
        if entry.snapshot_data is not None and entry.snapshot_data != data:
            raise InvalidArgument(
                f"entry {entry.seq} of {branch!r} carries other bytes than snapshot "
                f"{entry.snapshot} holds"
            )
        if (
            entry.snapshot_sha256 is not None
            and hashlib.sha256(data).hexdigest() != entry.snapshot_sha256
        ):
            raise InvalidArgument(
                f"entry {entry.seq} of {branch!r} vouches for other bytes than snapshot "
                f"{entry.snapshot} holds"
            )
        try:
            snap = Snapshot.decode(data, key)
        except (CorruptObject, UnsupportedFormat) as e:
            raise InvalidArgument(f"snapshot {entry.snapshot} cannot be read: {e}") from None
        if snap.id != entry.snapshot:
            raise InvalidArgument(f"snapshot object {key} holds snapshot {snap.id}")
        stored = _Stored(snap, data)
        if current is None:
            return "create", stored
        if snap.parents and snap.parents[0] == current:
            return ("merge" if len(snap.parents) > 1 else "commit"), stored
        return "reset", stored

    def _check(self, branch: str, head: JournalEntry, stored: _Stored, kind: str) -> None:
        core = self.repo.core
        assert head.snapshot is not None
        parent, built = core.objects.snapshot(head.snapshot), stored.snapshot
        written = functools.partial(written_between, core.objects, parent, built)
        # What checks run elsewhere (Jobs) read again and compare: both snapshots' digests, the
        # parent's as its entry carries it or vouches for it (what readers of it get), else
        # (an entry from before either) of its bytes as stored.
        if head.snapshot_data is not None:
            parent_digest = hashlib.sha256(head.snapshot_data).hexdigest()
        elif head.snapshot_sha256 is not None:
            parent_digest = head.snapshot_sha256
        else:
            stored_parent = core.storage.get(snapshot_key(head.snapshot))
            parent_digest = hashlib.sha256(stored_parent).hexdigest()
        self.repo.governance.check(
            branch,
            parent,
            built,
            written,
            merge=kind == "merge",
            digest=hashlib.sha256(stored.encoded).hexdigest(),
            parent_digest=parent_digest,
        )

    # -- merges and tags ---------------------------------------------------------------------------

    def merge(self, caller: Caller, body: Mapping[str, Any], client: str = "") -> str:
        source, into = body.get("source"), body.get("into")
        if not isinstance(source, str) or not isinstance(into, str):
            raise InvalidArgument("a merge names a source ref and a branch to merge into")
        self._acting.by = self._by(caller, client)
        try:
            with self._refusals(caller, f"merge of {source!r} into {into!r}"):
                head = self.repo.merge(
                    source,
                    into,
                    message=_opt_str(body, "message"),
                    author=_opt_str(body, "author") or caller.identity,
                    strategy=_opt_str(body, "strategy"),
                )
        finally:
            self._acting.by = None
        log.info(
            "%s (%s): merge of %s into %s: %s", caller.identity, caller.role, source, into, head
        )
        return head

    def create_tag(self, caller: Caller, name: str, snapshot: str) -> None:
        self.repo.create_tag(name, snapshot)
        log.info("%s (%s): tag %s at %s", caller.identity, caller.role, name, snapshot)

    def delete_tag(self, caller: Caller, name: str) -> None:
        with self._refusals(caller, f"deletion of tag {name!r}"):
            if caller.role != "admin":
                raise ReadOnlyError(f"deleting tag {name!r} needs an admin token")
            self.repo.delete_tag(name)
        log.info("%s (%s): deleted tag %s", caller.identity, caller.role, name)


_ACTIONS = {
    "commit": "commit to",
    "merge": "merge into",
    "create": "creation of",
    "reset": "reset of",
    "delete": "deletion of",
}


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string")
    return value


def error_body(e: ZarrlakeError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body that say ``e`` to a :class:`ServiceClient`."""
    body: dict[str, Any] = {"error": type(e).__name__, "message": str(e)}
    if isinstance(e, BranchProtected):
        body.update(branch=e.branch, rule=e.rule)
        return 403, body
    if isinstance(e, CheckFailed):
        body.update(check=e.check, branch=e.branch, problems=list(e.problems))
        return 422, body
    if isinstance(e, ConflictError):
        body["conflicts"] = [
            {"kind": str(c.kind), "path": c.path, "chunk": c.chunk} for c in e.conflicts
        ]
        return 409, body
    if isinstance(e, RefNotFound):
        body.update(ref=e.ref, kind=e.kind)
        return 404, body
    if isinstance(e, ReadOnlyError):
        return 403, body
    if isinstance(e, InvalidArgument):
        body["error"] = "InvalidArgument"
        return 400, body
    if type(e).__name__ in ("TagExists", "BranchExists"):
        return 409, body
    return 500, body


def app(repo: Repository, tokens: Mapping[str, Caller], *, refused: Refused | None = None) -> Any:
    """The service as an ASGI application (Starlette), for uvicorn; ``refused`` is told of
    every change it refuses (:class:`Refusal`)."""
    import anyio.to_thread
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    service = CommitService(repo, refused=refused)
    keyed = [(t.encode(), c) for t, c in tokens.items()]

    def caller_of(request: Request) -> Caller | None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        found = None
        for token, caller in keyed:  # every one compared: no early exit to time
            if hmac.compare_digest(token, given.encode()):
                found = caller
        return found

    def endpoint(
        work: Callable[[Caller, dict[str, Any]], dict[str, Any]], *, body: bool = True
    ) -> Callable[[Request], Any]:
        async def handle(request: Request) -> JSONResponse:
            caller = caller_of(request)
            if caller is None:
                return JSONResponse({"error": "Unauthorized", "message": "no valid token"}, 401)
            doc: dict[str, Any] = {}
            if body:
                try:
                    doc = json.loads(await request.body())
                except ValueError:
                    return JSONResponse({"error": "InvalidArgument", "message": "not JSON"}, 400)
                if not isinstance(doc, dict):
                    return JSONResponse(
                        {"error": "InvalidArgument", "message": "the body is a JSON object"}, 400
                    )
            doc["_client"] = request.headers.get("user-agent", "")
            try:
                answer = await anyio.to_thread.run_sync(work, caller, doc)
            except ZarrlakeError as e:
                status, err = error_body(e)
                if status == 500:
                    log.warning("%s: %s", request.url.path, e)
                return JSONResponse(err, status)
            return JSONResponse(answer)

        return handle

    def append(caller: Caller, doc: dict[str, Any]) -> dict[str, Any]:
        branch, encoded = doc.get("branch"), doc.get("entry")
        if not isinstance(branch, str) or not isinstance(encoded, str):
            raise InvalidArgument("an append names a branch and carries an entry")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("the entry is not base64") from None
        return {"published": service.append(caller, branch, data, doc.get("_client", ""))}

    def merge(caller: Caller, doc: dict[str, Any]) -> dict[str, Any]:
        return {"snapshot": service.merge(caller, doc, doc.get("_client", ""))}

    def tag(caller: Caller, doc: dict[str, Any]) -> dict[str, Any]:
        name, snapshot = doc.get("name"), doc.get("snapshot")
        if not isinstance(name, str) or not isinstance(snapshot, str):
            raise InvalidArgument("a tag names itself and a snapshot")
        service.create_tag(caller, name, snapshot)
        return {}

    def untag(caller: Caller, doc: dict[str, Any]) -> dict[str, Any]:
        name = doc.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("name the tag to delete")
        service.delete_tag(caller, name)
        return {}

    def whoami(caller: Caller, doc: dict[str, Any]) -> dict[str, Any]:
        return {"identity": caller.identity, "role": caller.role, "repository": repo.id}

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    routes = [
        Route("/v1/append", endpoint(append), methods=["POST"]),
        Route("/v1/merge", endpoint(merge), methods=["POST"]),
        Route("/v1/tags", endpoint(tag), methods=["POST"]),
        Route("/v1/tags/delete", endpoint(untag), methods=["POST"]),
        Route("/v1/whoami", endpoint(whoami, body=False), methods=["GET"]),
        Route("/healthz", health, methods=["GET"]),
    ]
    return Starlette(routes=routes)
