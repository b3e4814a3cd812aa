"""CustomResourceDefinitions from the Pydantic models (``make crds``).

Kubernetes wants *structural* OpenAPI v3 schemas: no ``$ref``, no ``anyOf`` at the top of a
property, a ``type`` everywhere, and ``properties`` never beside ``additionalProperties``.
Pydantic's JSON Schema has all of those, so :func:`structural` rewrites it; everything else
(descriptions, patterns, enums, defaults, bounds, CEL rules) passes through.

Usage: ``python -m zarrlake_operator.crds OUT_DIR [OUT_DIR ...]`` writes one file per kind.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from zarrlake_operator.models import API_VERSION, CATEGORY, GROUP, KINDS, VERSION

_DROP = {"title", "discriminator"}


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A Pydantic JSON Schema rewritten as a Kubernetes structural schema."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
            extra = {k: v for k, v in node.items() if k != "$ref"}
            return walk({**target, **extra})
        node = {k: v for k, v in node.items() if k not in _DROP and k != "$defs"}
        options = node.pop("anyOf", None)
        if options is not None:
            real = [o for o in options if o.get("type") != "null"]
            nullable = len(real) < len(options)
            if {o.get("type") for o in real} == {"integer", "string"}:
                node["x-kubernetes-int-or-string"] = True
            elif len(real) == 1:
                node = {**walk(real[0]), **node}
            else:
                raise ValueError(f"cannot express a union in a structural schema: {options}")
            if nullable and node.get("default", ...) is None:
                node.pop("default")  # optional field: absence, not null
        if node.get("default", ...) is None:
            node.pop("default")
        if node.get("x-kubernetes-int-or-string"):
            node.pop("type", None)
        if node.get("additionalProperties") is False or "properties" in node:
            node.pop("additionalProperties", None)
        if (
            node.get("type") == "object"
            and "properties" not in node
            and (node.get("additionalProperties") in (None, True, {}))
        ):
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
        return {k: walk(v) for k, v in node.items()}

    out: dict[str, Any] = walk(schema)
    return out


def _object_schema(model: type[BaseModel]) -> dict[str, Any]:
    return structural(model.model_json_schema(by_alias=True, mode="validation"))


def _field_model(model: type[BaseModel], field: str) -> type[BaseModel]:
    """The model class of one of ``model``'s fields (``spec``, ``status``)."""
    annotation = model.model_fields[field].annotation
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        raise TypeError(f"{model.__name__}.{field} is not a model: {annotation!r}")
    return annotation


def crd(kind: str) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind."""
    entry = KINDS[kind]
    model = entry["model"]
    spec_schema = _object_schema(_field_model(model, "spec"))
    status_schema = _object_schema(_field_model(model, "status"))
    schema: dict[str, Any] = {
        "type": "object",
        "description": (model.__doc__ or "").strip(),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    limit = entry.get("name_max")
    if limit:
        schema["x-kubernetes-validations"] = [
            {
                "rule": f"self.metadata.name.size() <= {limit}",
                "message": f"{kind} names are at most {limit} characters (label value limit)",
            }
        ]
    plural = entry["plural"]
    version: dict[str, Any] = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}},
        "additionalPrinterColumns": entry["columns"],
    }
    if entry.get("selectable"):
        version["selectableFields"] = [{"jsonPath": path} for path in entry["selectable"]]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "zarrlake"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": entry["short"],
                "categories": [CATEGORY],
            },
            "versions": [version],
        },
    }


def render(kind: str) -> str:
    header = (
        f"# {kind} ({API_VERSION}). Generated from zarrlake/resources.py by `make crds`;\n"
        "# do not edit by hand.\n"
    )
    return header + str(yaml.safe_dump(crd(kind), sort_keys=False, width=100))


def filenames() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    return {f"{GROUP}_{KINDS[k]['plural']}.yaml": render(k) for k in KINDS}


def main(argv: list[str] | None = None) -> int:
    out_dirs = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or [Path("crds")]
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob(f"{GROUP}_*.yaml"):
            old.unlink()
        for name, text in filenames().items():
            (out / name).write_text(text)
        print(f"wrote {len(KINDS)} CRDs to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
