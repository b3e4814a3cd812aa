"""Write a CycloneDX 1.5 SBOM (JSON) of the image's software, from the locks: ``make sbom``.

    python requirements/sbom.py --output dist/sbom/zarrlake-image.cdx.json

What the image is made of is decided by files in this repository, not by what a build happened to
fetch: the base image (``requirements/base-image.env``: tag and, once recorded, digest), every
Python package (``requirements/image.txt``: version and the sha256 of each file pip may install)
and zarrlake itself (``pyproject.toml``). The SBOM lists exactly those, so it can be made and
reviewed without Docker or a registry, and two runs on one commit give the same bytes (no
timestamp; the serial number is derived from the content). Packages of ``requirements/build.txt``
build the wheel in a discarded stage: listed with ``scope: excluded`` (unless the image installs
the same version anyway). Licences are not in the locks and are not guessed.

What it does not cover: the Debian packages inside the base image (a scanner that reads the
image, e.g. ``syft <image>``, lists those once the image exists).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tomllib
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LOCK = ROOT / "requirements" / "image.txt"
BUILD_LOCK = ROOT / "requirements" / "build.txt"
BASE_IMAGE = ROOT / "requirements" / "base-image.env"
#: uuid5 namespace of the serial numbers: one SBOM content, one serial number.
SERIAL_NAMESPACE = uuid.UUID("6b1f2f3e-6f1d-4c55-9d0e-5a7a11a2c0de")


def locked(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, sha256s) of a pip lock written by ``requirements/lock.py``."""
    pins: dict[str, tuple[str, list[str]]] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pin, *options = line.split()
        name, sep, version = pin.partition("==")
        hashes = [o.removeprefix("--hash=sha256:") for o in options if o.startswith("--hash=")]
        if not sep or not hashes:
            raise ValueError(f"{path.name}: {pin!r} is not pinned with hashes")
        pins[name] = (version, hashes)
    return pins


def base_image(path: Path) -> tuple[str, str]:
    """(image reference by tag, digest or "") of ``requirements/base-image.env``."""
    values = dict(
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    return values["PYTHON_IMAGE"], values.get("PYTHON_IMAGE_DIGEST", "")


def _package(name: str, version: str, hashes: list[str], scope: str) -> dict[str, Any]:
    return {
        "type": "library",
        "bom-ref": f"pkg:pypi/{name}@{version}",
        "name": name,
        "version": version,
        "purl": f"pkg:pypi/{name}@{version}",
        "scope": scope,
        "hashes": [{"alg": "SHA-256", "content": h} for h in hashes],
    }


def sbom(root: Path = ROOT) -> dict[str, Any]:
    """The SBOM document; raises ValueError if a lock entry is not pinned with hashes."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    image_lock = locked(root / IMAGE_LOCK.relative_to(ROOT))
    build_lock = locked(root / BUILD_LOCK.relative_to(ROOT))
    reference, digest = base_image(root / BASE_IMAGE.relative_to(ROOT))
    repository, _, tag = reference.rpartition(":")
    base: dict[str, Any] = {
        "type": "container",
        "bom-ref": f"base:{reference}",
        "name": repository,
        "version": tag,
        "scope": "required",
    }
    if digest:
        base["hashes"] = [{"alg": "SHA-256", "content": digest.removeprefix("sha256:")}]
        base["purl"] = f"pkg:docker/{repository}@{digest}?tag={tag}"
    else:
        base["description"] = "digest not recorded yet (make lock-base)"
    runtime = [_package(n, v, h, "required") for n, (v, h) in sorted(image_lock.items())]
    # A build tool the image also installs (same version) is listed once, as the image's.
    build = [
        {**_package(n, v, h, "excluded"), "bom-ref": f"build:pkg:pypi/{n}@{v}"}
        for n, (v, h) in sorted(build_lock.items())
        if image_lock.get(n, ("",))[0] != v
    ]
    me = f"pkg:pypi/zarrlake@{project['version']}"
    document: dict[str, Any] = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "component": {
                "type": "container",
                "bom-ref": me,
                "name": "zarrlake",
                "version": project["version"],
                "description": "zarrlake operator and maintenance jobs image",
                "purl": me,
            },
            "tools": {
                "components": [{"type": "application", "name": "requirements/sbom.py"}],
            },
        },
        "components": [base, *runtime, *build],
        "dependencies": [
            {"ref": me, "dependsOn": [base["bom-ref"], *(c["bom-ref"] for c in runtime)]}
        ],
    }
    content = json.dumps(document, sort_keys=True).encode()
    serial = uuid.uuid5(SERIAL_NAMESPACE, hashlib.sha256(content).hexdigest())
    return {"serialNumber": f"urn:uuid:{serial}", **document}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--output", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    document = sbom()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {len(document['components'])} components to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
