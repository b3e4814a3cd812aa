"""A user's first minutes with the ``zarrlake`` command: ``init`` where it should not (a directory
of someone's files, a directory it cannot create) and the tables the first commands print, which
are the same bytes whether or not ``rich`` happens to be installed."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zarr

import zarrlake
from cli_helpers import Result, assert_one_line_error

# -- tables, with and without rich ---------------------------------------------------------------

#: Run ``zarrlake.cli.main`` on ``sys.argv[2:]``; ``sys.argv[1]`` == "no-rich" first makes
#: ``rich`` really absent (every import of it, or of a submodule, raises ModuleNotFoundError), as
#: in an installation without it.
BOOTSTRAP = """
import sys

class NoRich:
    def find_spec(self, name, path=None, target=None):
        if name == "rich" or name.startswith("rich."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

if sys.argv[1] == "no-rich":
    sys.meta_path.insert(0, NoRich())
    for name in [n for n in sys.modules if n == "rich" or n.startswith("rich.")]:
        del sys.modules[name]
    try:
        import rich  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("rich is still importable")
else:
    import rich  # noqa: F401  (installed: the normal run uses it wherever the CLI would)

from zarrlake.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_cli(mode: str, *argv: str) -> subprocess.CompletedProcess[bytes]:
    p = subprocess.run(
        [sys.executable, "-c", BOOTSTRAP, mode, *argv], capture_output=True, timeout=120
    )
    assert p.returncode == 0, p.stderr.decode()
    assert p.stderr == b""
    return p


def width(text: str) -> int:
    """Terminal columns (wide characters two), computed independently of the CLI's own code."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


@pytest.fixture
def small_repository(tmp_path: Path) -> str:
    """Two commits (one by an author whose name holds a terminal escape), a branch, a tag, and
    nodes whose names are wide characters."""
    path = tmp_path / "repo"
    repo = zarrlake.Repository.create(zarrlake.Storage.local(path))
    session = repo.writable_session("main")
    root = zarr.open_group(session.store, mode="w")
    arr = root.create_group("気温").create_array("日別", shape=(4, 4), chunks=(2, 2), dtype="f8")
    arr[:] = 1.0
    root.create_array("t", shape=(3,), chunks=(3,), dtype="i2")
    head = session.commit("add temperatures", author="ana")
    repo.create_branch("dev")
    repo.create_tag("v1", head)
    session = repo.writable_session("dev")
    zarr.open_array(session.store, path="t", mode="r+")[:] = 7
    session.commit("sevens\nsecond line", author="bo\x1b[31m")
    return str(path)


def test_tables_are_the_same_bytes_with_and_without_rich(small_repository: str) -> None:
    pytest.importorskip("rich")  # the comparison needs rich installed for the normal run
    url = small_repository
    commands = [
        ["log", url, "--ref", "dev"],
        ["branch", url, "list"],
        ["tag", url, "list"],
        ["ls", url],
        ["ls", url, "--ref", "dev", "/気温"],
    ]
    for argv in commands:
        with_rich = run_cli("rich", *argv).stdout
        without = run_cli("no-rich", *argv).stdout
        assert with_rich == without, argv
        # The one format: a header row, then rows; aligned by display width; nothing trailing.
        lines = with_rich.decode().splitlines()
        assert lines[0].split()[0] in ("SNAPSHOT", "BRANCH", "TAG", "PATH"), lines
        assert len(lines) >= 2 and all(ln == ln.rstrip() for ln in lines)
        assert b"\x1b" not in with_rich and "─" not in lines[1]  # no escapes, no rule
        for ln in lines:  # each row's second column starts where its header does
            assert second_column_at(ln) == second_column_at(lines[0]), (ln, lines[0])

    log = run_cli("rich", "log", url, "--ref", "dev").stdout.decode().splitlines()
    assert [ln.split()[0] for ln in log[1:]] == [c.id for c in open_log(url, "dev")]
    assert "bo\\x1b[31m" in log[1] and "sevens" in log[1] and "second line" not in log[1]
    ls = run_cli("no-rich", "ls", url).stdout.decode().splitlines()
    assert [ln.split()[0] for ln in ls[1:]] == ["/", "/t", "/気温", "/気温/日別"]


def second_column_at(line: str) -> int:
    """The display column where the second cell of ``line`` starts (the first cell holds no two
    spaces in a row)."""
    first, gap, rest = line.partition("  ")
    return width(first + gap) + len(rest) - len(rest.lstrip(" "))


def open_log(url: str, ref: str) -> list[Any]:
    return list(zarrlake.Repository.open(zarrlake.Storage.local(url)).log(ref))


# -- init where it should not --------------------------------------------------------------------


def tree(path: Path) -> list[tuple[str, bool, bytes | None, int]]:
    """Every entry below ``path``: name, whether a folder, the file's bytes, its mtime."""
    return sorted(
        (
            str(p.relative_to(path)),
            p.is_dir(),
            None if p.is_dir() else p.read_bytes(),
            p.stat().st_mtime_ns,
        )
        for p in path.rglob("*")
    )


@pytest.fixture
def users_files(tmp_path: Path) -> Path:
    """A directory of someone's files (one in a subfolder)."""
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "todo.txt").write_text("buy milk\n")
    (home / "notes" / "a.md").write_text("# a\n")
    return home


def test_init_refuses_a_directory_of_other_files(
    users_files: Path, cli: Callable[..., Result]
) -> None:
    before = tree(users_files)
    msg = assert_one_line_error(cli("init", str(users_files)), 1)
    assert str(users_files) in msg and "not empty" in msg and "--force" in msg
    assert tree(users_files) == before  # nothing added (not even a temporary folder), none moved
    assert not zarrlake.Repository.exists(zarrlake.Storage.local(users_files))
    # Its file:// form is the same directory.
    assert assert_one_line_error(cli("init", users_files.as_uri()), 1) == msg
    assert tree(users_files) == before


def test_init_force_and_directories_that_need_no_force(
    users_files: Path, tmp_path: Path, cli: Callable[..., Result]
) -> None:
    before = tree(users_files)
    r = cli("init", str(users_files), "--force")
    assert (r.code, r.err) == (0, "")
    repo = zarrlake.Repository.open(zarrlake.Storage.local(users_files))
    assert repo.id == r.out.strip() and list(repo.list_branches()) == ["main"]
    after = {entry[0]: entry for entry in tree(users_files)}
    assert all(after[entry[0]] == entry for entry in before if not entry[1])  # files untouched
    # Now it is a repository: init says so, with or without --force.
    assert "already exists" in assert_one_line_error(cli("init", str(users_files)), 1)
    assert "already exists" in assert_one_line_error(cli("init", str(users_files), "--force"), 1)

    (tmp_path / "empty").mkdir()
    (tmp_path / "only-folders" / "sub").mkdir(parents=True)  # no file in it: empty
    for target in [tmp_path / "empty", tmp_path / "only-folders", tmp_path / "new" / "deeper"]:
        r = cli("init", str(target))
        assert (r.code, r.err) == (0, ""), target
        assert zarrlake.Repository.open(zarrlake.Storage.local(target)).id == r.out.strip()


@pytest.mark.xdist_group("moto")
def test_init_refuses_a_bucket_prefix_holding_other_objects(
    moto_s3: Any, cli: Callable[..., Result]
) -> None:
    storage = moto_s3.storage()
    storage.put("exports/2024.csv", b"a,b\n")
    url = moto_s3.url(storage.prefix.rstrip("/"))
    msg = assert_one_line_error(cli("init", url), 1)
    assert "not empty" in msg and "--force" in msg
    assert storage.list_keys() == ["exports/2024.csv"]
    r = cli("init", url, "--force")
    assert (r.code, r.err) == (0, "")
    assert zarrlake.Repository.open(storage).id == r.out.strip()
    assert storage.get("exports/2024.csv") == b"a,b\n"


def cannot_mkdir(path: str) -> str:
    """The OS's reason for refusing to create ``path`` (skips where it would not refuse)."""
    try:
        os.mkdir(path)
    except OSError as e:
        return e.strerror
    os.rmdir(path)
    pytest.skip(f"{path} can be created here")


def test_init_names_the_directory_it_cannot_create(cli: Callable[..., Result]) -> None:
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    reason = cannot_mkdir("/proc/x")
    expected = f"cannot create directory /proc/x: {reason}"
    assert assert_one_line_error(cli("init", "/proc/x"), 1) == expected
    assert assert_one_line_error(cli("init", "/proc/x", "--force"), 1) == expected
    with pytest.raises(zarrlake.StorageError) as e:
        zarrlake.Repository.create(zarrlake.Storage.local("/proc/x"))
    assert str(e.value) == expected and "txlogs" not in str(e.value)


def test_init_names_a_directory_that_takes_no_files(
    tmp_path: Path, cli: Callable[..., Result]
) -> None:
    if os.geteuid() == 0:
        # Root ignores permission bits: /proc is a directory that takes no files even for root
        # (and holds others' objects, so it takes --force).
        if not os.path.isdir("/proc/self"):
            pytest.skip("needs Linux's /proc or a user other than root")
        msg = assert_one_line_error(cli("init", "/proc", "--force"), 1)
        assert msg.startswith("cannot write to directory /proc: ") and "txlogs" not in msg
        assert "/proc" in assert_one_line_error(cli("init", "/proc"), 1)
        return
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH)
    try:
        reason = os.strerror(errno.EACCES)
        msg = assert_one_line_error(cli("init", str(ro)), 1)
        assert msg == f"cannot write to directory {ro}: {reason}"
        msg = assert_one_line_error(cli("init", str(ro / "sub")), 1)
        assert msg == f"cannot create directory {ro / 'sub'}: {reason}"
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(stat.S_IRWXU)
