"""A missing optional dependency is a :class:`zarrlake.MissingDependency` that names the extra to
install, raised where the feature is first asked for (a storage's construction, an entry point),
and a one-line error in the CLI.

Nothing is mocked: each case runs in a fresh interpreter in which the blocked top-level modules
cannot be imported, exactly as if they were not installed (a ``sys.meta_path`` finder raises the
``ModuleNotFoundError`` that ``import`` raises for an absent module).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

import zarrlake

# Runs before anything else in the child: ``sys.argv[1]`` is the comma-separated blocked modules.
BOOTSTRAP = textwrap.dedent(
    """
    import sys

    class _NotInstalled:
        def __init__(self, blocked):
            self.blocked = blocked

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in self.blocked:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    _blocked = set(sys.argv.pop(1).split(","))
    for _name in [m for m in sys.modules if m.partition(".")[0] in _blocked]:
        del sys.modules[_name]
    sys.meta_path.insert(0, _NotInstalled(_blocked))
    """
)

# Prints what the call ``CALL`` raised, as JSON: the facts of a MissingDependency, else its type.
REPORT = textwrap.dedent(
    """
    import json, zarrlake

    def report(call):
        try:
            call()
        except zarrlake.MissingDependency as e:
            assert isinstance(e, ImportError) and isinstance(e, zarrlake.ZarrlakeError)
            out = {"module": e.module, "extra": e.extra, "feature": e.feature, "message": str(e)}
        except Exception as e:
            out = {"raised": type(e).__name__, "name": getattr(e, "name", None), "message": str(e)}
        else:
            out = {"raised": None}
        print(json.dumps(out))
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZARRLAKE_", "STORAGE_EMU"))}
    env["AZURE_STORAGE_ACCOUNT_NAME"] = "devstoreaccount1"
    return env


def run_without(blocked: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter where the modules ``blocked`` (comma-separated top-level
    names) are not installed."""
    return subprocess.run(
        [sys.executable, "-c", BOOTSTRAP + code, blocked, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )


def raised_without(blocked: str, call: str) -> dict[str, Any]:
    """What the expression ``call`` raises without ``blocked``: a MissingDependency's facts."""
    p = run_without(blocked, REPORT + f"\nreport(lambda: {call})\n")
    assert p.returncode == 0, p.stderr
    result: dict[str, Any] = json.loads(p.stdout.splitlines()[-1])
    return result


def assert_missing(found: dict[str, Any], module: str, extra: str) -> None:
    assert found.get("module") == module, found
    assert found["extra"] == extra
    assert found["feature"] and found["feature"] in found["message"]
    assert f"needs {module}, which is not installed" in found["message"]
    assert found["message"].endswith(f"pip install 'zarrlake[{extra}]'")


# -- storage backends: at construction, before any request -----------------------------------------

STORAGES = [
    ("boto3", "boto3", "s3", "zarrlake.Storage.s3('b', 'x')"),
    (
        "boto3",
        "boto3",
        "s3",
        "zarrlake.Storage.from_url('s3://b/x?endpoint_url=http://127.0.0.1:1')",
    ),
    ("boto3", "boto3", "s3", "zarrlake.Repository.open(zarrlake.Storage.from_url('s3a://b/x'))"),
    ("google", "google.auth", "gcs", "zarrlake.Storage.gcs('b', 'x')"),
    ("google", "google.auth", "gcs", "zarrlake.Storage.from_url('gs://b/x')"),
    ("urllib3", "urllib3", "gcs", "zarrlake.Storage.gcs('b', anonymous=True)"),
    ("obstore", "obstore", "azure", "zarrlake.Storage.azure('cont', 'x', account_name='a')"),
    ("obstore", "obstore", "azure", "zarrlake.Storage.from_url('az://cont/x?account_name=a')"),
    ("urllib3", "urllib3", "http", "zarrlake.Storage.http('https://127.0.0.1:1/repo')"),
    ("urllib3", "urllib3", "http", "zarrlake.Storage.from_url('http://127.0.0.1:1/repo')"),
]


@pytest.mark.parametrize(("blocked", "module", "extra", "call"), STORAGES)
def test_a_storage_without_its_extra_says_which_to_install(
    blocked: str, module: str, extra: str, call: str
) -> None:
    assert_missing(raised_without(blocked, call), module, extra)


def test_an_unpickled_storage_without_its_extra_says_which_to_install() -> None:
    # A worker (a Spark executor, a dask worker) that lacks the extra gets the same error.
    shipped = pickle.dumps(
        zarrlake.Storage.s3("b", "x", endpoint_url="http://127.0.0.1:1", allow_http=True)
    )
    found = raised_without("boto3", f"__import__('pickle').loads({shipped!r})")
    assert_missing(found, "boto3", "s3")


def test_s3_needs_boto3_not_obstore() -> None:
    # obstore is the S3 backend's fast path, not a requirement (urllib3 serves without it): its
    # absence is no error, and without both the error names boto3.
    assert raised_without("obstore", "zarrlake.Storage.s3('b', 'x')") == {"raised": None}
    assert_missing(raised_without("obstore,boto3", "zarrlake.Storage.s3('b', 'x')"), "boto3", "s3")


# -- the CLI: one line naming the extra, the exit status of bad input ------------------------------


def test_cli_without_boto3_prints_one_line_naming_the_extra() -> None:
    code = "import runpy, sys\nsys.argv = ['zarrlake', *sys.argv[1:]]\n"
    code += "runpy.run_module('zarrlake', run_name='__main__')\n"
    p = run_without("boto3", code, "log", "s3://bucket/x")
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.endswith("\n"), p.stderr
    assert p.stderr.startswith("zarrlake: error: the S3 storage backend needs boto3")
    assert p.stderr.rstrip("\n").endswith("pip install 'zarrlake[s3]'")
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr


def test_cli_lock_without_redis_prints_one_line_naming_the_extra(tmp_path: Path) -> None:
    path = str(tmp_path / "r")
    zarrlake.Repository.create(zarrlake.Storage.local(path))
    code = "import runpy, sys\nsys.argv = ['zarrlake', *sys.argv[1:]]\n"
    code += "runpy.run_module('zarrlake', run_name='__main__')\n"
    p = run_without("redis", code, "--lock", "redis://127.0.0.1:1/0", "branch", path, "create", "x")
    assert p.returncode == 2, p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr == (
        "zarrlake: error: RedisLock needs redis, which is not installed: "
        "pip install 'zarrlake[redis]'\n"
    )
    assert zarrlake.Repository.open(zarrlake.Storage.local(path)).list_branches().keys() == {"main"}


# -- helpers: at their entry points --------------------------------------------------------------

HELPERS = [
    ("dask", "dask", "dask", "__import__('zarrlake.dask').dask.to_zarrlake(None, None)"),
    (
        "pyspark",
        "pyspark",
        "spark",
        "__import__('zarrlake.spark').spark.write_partitions("
        "None, None, writer=print, message='m')",
    ),
    (
        "pyspark",
        "pyspark",
        "spark",
        "__import__('zarrlake.spark').spark.read_array(None, None, 'a')",
    ),
    (
        "pyspark",
        "pyspark",
        "spark",
        "__import__('zarrlake.maintenance.spark_jobs').maintenance.spark_jobs.spark_session('x')",
    ),
    ("kubernetes", "kubernetes", "kubernetes", "zarrlake.Repository.from_kubernetes('r', 'ns')"),
    ("redis", "redis", "redis", "zarrlake.RedisLock('redis://127.0.0.1:1/0')"),
]


@pytest.mark.parametrize(("blocked", "module", "extra", "call"), HELPERS)
def test_a_helper_without_its_extra_says_which_to_install(
    blocked: str, module: str, extra: str, call: str
) -> None:
    assert_missing(raised_without(blocked, call), module, extra)


def test_the_redis_extra_exists() -> None:
    # The hint must be installable: every extra a MissingDependency names is declared.
    import tomllib

    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert "redis" in extras and any(r.startswith("redis") for r in extras["redis"])
    for name in ("s3", "gcs", "azure", "http", "spark", "dask", "kubernetes"):
        assert name in extras


# -- the error itself ---------------------------------------------------------------------------


def test_missing_dependency_pickles_whole() -> None:
    e = zarrlake.MissingDependency("boto3", "s3", "the S3 storage backend")
    assert str(e) == (
        "the S3 storage backend needs boto3, which is not installed: pip install 'zarrlake[s3]'"
    )
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is zarrlake.MissingDependency
    assert (again.module, again.extra, again.feature, str(again)) == (
        "boto3",
        "s3",
        "the S3 storage backend",
        str(e),
    )
    assert again.name == "boto3"  # ImportError's own attribute: the module that is missing
    assert isinstance(again, ImportError) and isinstance(again, zarrlake.ZarrlakeError)


def test_a_raised_missing_dependency_pickles_across_processes() -> None:
    code = REPORT + textwrap.dedent(
        """
        import pickle
        try:
            zarrlake.Storage.s3("b")
        except zarrlake.MissingDependency as e:
            print(pickle.dumps(e).hex())
        """
    )
    p = run_without("boto3", code)
    assert p.returncode == 0, p.stderr
    e = pickle.loads(bytes.fromhex(p.stdout.split()[-1]))
    assert isinstance(e, zarrlake.MissingDependency)
    assert (e.module, e.extra) == ("boto3", "s3") and "zarrlake[s3]" in str(e)


# -- never a wrong label --------------------------------------------------------------------------


def test_a_broken_dependency_of_an_installed_package_is_not_relabelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zarrlake.extras import require

    package = f"installed_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        require(package, extra="s3", feature="a feature")
    assert not isinstance(e.value, zarrlake.MissingDependency)
    assert e.value.name == "not_installed_anywhere_xyz"
    # Installed and importable: the module itself.
    (tmp_path / "fine_pkg_ok.py").write_text("VALUE = 3\n")
    assert require("fine_pkg_ok", extra="s3", feature="a feature").VALUE == 3


def test_s3_with_boto3_but_without_urllib3_names_urllib3() -> None:
    # botocore needs urllib3: the error is Python's own, naming urllib3, not "boto3 is missing".
    found = raised_without("urllib3", "zarrlake.Storage.s3('b', 'x')")
    assert found["raised"] == "ModuleNotFoundError" and found["name"] == "urllib3", found


def test_a_missing_parent_of_a_dotted_module_is_that_dependency_missing() -> None:
    code = "from zarrlake.extras import require\n"
    code += "report(lambda: require('google.auth', extra='gcs', feature='GCS'))\n"
    p = run_without("google", REPORT + code)
    assert p.returncode == 0, p.stderr
    assert_missing(json.loads(p.stdout), "google.auth", "gcs")
