"""The Helm chart, the CRDs and the example resources, checked offline: no cluster, no mocks.

- The chart is rendered and linted by Helm's own engine (``helm-python-sdk``) with several sets of
  values, and every rendered object is validated: built-in kinds against the Kubernetes OpenAPI
  schemas that ``kubernetes-validate`` bundles (strict: unknown fields are errors).
- RBAC is compared with the exact permission table the operator needs, so that any extra (or
  missing) verb fails; the Deployment's arguments are parsed by the operator's own CLI parser.
- ``values.schema.json`` is shown to refuse typos and wrong types by rendering with bad values.
- The CRDs must be valid, structural and identical to a fresh generation from the models.
- Every custom resource in ``examples/**/*.yaml`` must satisfy its CRD's OpenAPI schema and parse
  through the operator's Pydantic model.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from zarrlake_operator import crds as crd_gen
from zarrlake_operator.__main__ import build_parser
from zarrlake_operator.models import GROUP, KINDS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "zarrlake-operator"
# The chart's copy of crds/ (`make crds` writes both), rendered by templates/crds.yaml.
CRD_DIRS = {"crds": ROOT / "crds", "chart-crds": CHART / "files" / "crds"}
EXAMPLES = ROOT / "examples"

RELEASE = "zl"
NAMESPACE = "zarrlake-system"
# The chart's minimum (Chart.yaml kubeVersion) and the newest version kubernetes-validate knows.
KUBE_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
LEASE = f"{RELEASE}-zarrlake-operator"  # the release's full name

SCENARIOS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"watchNamespaces": ["a", "b"]},
    "replicas": {"replicaCount": 2},
    "standalone": {"leaderElection": {"enabled": False}},
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    # Every optional block switched on, so that each reaches the validators at least once.
    "everything": {
        "image": {
            "repository": "registry.example/zarrlake",
            "tag": "1.2.3",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "registry"}],
        "jobImage": "registry.example/zarrlake-jobs:1.2.3",
        "serve": {
            "image": "registry.example/zarrlake-serve:1.2.3",
            "resources": {"requests": {"cpu": "250m", "memory": 1073741824}},
        },
        "replicaCount": 3,
        "watchNamespaces": ["data"],
        "logLevel": "DEBUG",
        "extraEnv": [
            {"name": "AWS_REGION", "value": "eu-west-1"},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "serviceAccount": {"create": False, "name": "existing-sa"},
        "podAnnotations": {"example.com/note": "x"},
        "podLabels": {"team": "data"},
        "priorityClassName": "system-cluster-critical",
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {
                                "matchLabels": {"app.kubernetes.io/name": "zarrlake-operator"}
                            },
                        },
                    }
                ]
            }
        },
        "metrics": {"port": 8443, "service": {"type": "NodePort", "annotations": {"a": "b"}}},
        "serviceMonitor": {"enabled": True, "interval": "1m", "scrapeTimeout": "10s"},
        "prometheusRule": {
            "enabled": True,
            "labels": {"release": "prom"},
            "jobLabel": "zarrlake",
            "additionalAlertLabels": {"team": "data"},
            "notReadyFor": "30m",
            "maintenanceMaxAgeHours": 36,
        },
        "grafanaDashboard": {
            "enabled": True,
            "namespace": "monitoring",
            "annotations": {"grafana_folder": "zarrlake"},
        },
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"},
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
            ],
            "apiServer": {"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [443]},
            "objectStorage": {"ports": [443, 9000]},
            "extraEgress": [{"ports": [{"port": 8200, "protocol": "TCP"}]}],
        },
    },
    # The observability and hygiene toggles alone, on top of the defaults.
    "observability": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
        "podDisruptionBudget": {"enabled": True},
        "networkPolicy": {"enabled": True},
    },
}


# -- helpers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's objects for these values, as ``helm template`` would print them."""
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["operator"]
    return pod["containers"][0]


def group_of(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def chart_crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(group, kind) -> CRD, for every CRD the chart installs."""
    found = {}
    for path in sorted(CRD_DIRS["chart-crds"].glob("*.yaml")):
        for crd in load_yaml_docs(path):
            found[(crd["spec"]["group"], crd["spec"]["names"]["kind"])] = crd
    return found


# -- OpenAPI (Kubernetes flavour) -> JSON Schema ---------------------------------------------------

_SCHEMA_MAPS = ("properties", "patternProperties", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
_SCHEMA_ONE = ("items", "additionalProperties", "not")


def json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """A CRD's OpenAPI v3 schema as a draft-7 JSON Schema with the API server's semantics.

    - ``x-kubernetes-int-or-string``: an integer or a string.
    - Objects with ``properties`` refuse unknown fields unless ``x-kubernetes-preserve-unknown-
      fields`` is set, as the API server's strict field validation (kubectl's default) does.
    - ``nullable`` admits null; OpenAPI 3.0's boolean ``exclusiveMinimum/Maximum`` become draft-7's
      numeric ones.
    - Every other ``x-kubernetes-*`` key (CEL rules, list and map types) is dropped: those constrain
      updates or merges, not the shape of one document.

    Only schema positions are rewritten; ``default``, ``enum`` and ``example`` values are copied as
    they are.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "example", "externalDocs"):
            continue
        if key in _SCHEMA_MAPS:
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS:
            out[key] = [json_schema(sub) for sub in value]
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = json_schema(value)
        else:
            out[key] = copy.deepcopy(value)
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(bound), bool) and out.pop(bound) and limit in out:
            out[bound] = out.pop(limit)
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def crd_validator(crd: dict[str, Any], version: str) -> jsonschema.Draft7Validator:
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = json_schema(entry["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(
        schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )


def custom_resource_errors(obj: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Why the API server would refuse this custom resource (empty: it would accept it)."""
    version = obj["apiVersion"].rpartition("/")[2]
    served = {v["name"] for v in crd["spec"]["versions"] if v["served"]}
    if version not in served:
        return [f"version {version} is not served (served: {sorted(served)})"]
    errors = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in crd_validator(crd, version).iter_errors(obj)
    ]
    metadata = obj.get("metadata") or {}
    name = metadata.get("name", "")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    if crd["spec"]["scope"] == "Cluster" and "namespace" in metadata:
        errors.append("a cluster-scoped object has metadata.namespace")
    return errors


def validate_builtin(obj: dict[str, Any]) -> None:
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(map(str, e.path)) or "<root>"
            pytest.fail(
                f"{obj['kind']}/{obj['metadata']['name']} on Kubernetes {version}: {where}: "
                f"{e.message}"
            )


# -- rendering, linting, validating ----------------------------------------------------------------


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_helm_lint_is_clean(values):
    report = helm.lint(
        CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSIONS[0]}"
    )
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); warnings and errors are not tolerated.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_every_rendered_object_validates(chart, values):
    objects = render(chart, values)
    crds = chart_crds()
    assert objects
    for obj in objects:
        group = group_of(obj["apiVersion"])
        if (group, obj["kind"]) in crds:
            errors = custom_resource_errors(obj, crds[(group, obj["kind"])])
            assert errors == [], f"{obj['kind']}/{obj['metadata']['name']}: {errors}"
        elif group == "monitoring.coreos.com":
            # No schema for prometheus-operator's CRDs here: the ServiceMonitor test checks the
            # one, prometheus_rule_errors the other.
            assert obj["kind"] in ("ServiceMonitor", "PrometheusRule")
            if obj["kind"] == "PrometheusRule":
                assert prometheus_rule_errors(obj) == []
        else:
            validate_builtin(obj)


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_recommended_labels_everywhere(chart, values):
    for obj in render(chart, values):
        labels = obj["metadata"]["labels"]
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert labels["app.kubernetes.io/name"] == "zarrlake-operator", where
        assert labels["app.kubernetes.io/instance"] == RELEASE, where
        assert labels["app.kubernetes.io/version"] == "0.4.0", where
        assert labels["app.kubernetes.io/managed-by"] == "Helm", where
        assert labels["app.kubernetes.io/part-of"] == "zarrlake", where
        assert labels["helm.sh/chart"] == "zarrlake-operator-0.4.0", where


def test_chart_metadata_and_crds_seen_by_helm(chart):
    meta = chart.metadata
    assert (meta["apiVersion"], meta["name"], meta["version"], meta["appVersion"]) == (
        "v2",
        "zarrlake-operator",
        "0.4.0",
        "0.4.0",
    )
    assert meta["kubeVersion"] == f">={KUBE_VERSIONS[0]}-0"  # what the objects are validated for
    # The CRDs are templates (applied on install and on every upgrade), not Helm's crds/ folder:
    # a CRD in both would be created by the first and then refused by the second (not owned).
    assert chart.crds == []
    expected = {f"{KINDS[k]['plural']}.{GROUP}" for k in KINDS}
    for upgrade in (False, True):
        manifests = chart.render(
            None, name=RELEASE, namespace=NAMESPACE, is_install=not upgrade, is_upgrade=upgrade
        )
        rendered = [
            doc
            for path, text in manifests.items()
            if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text)
            if doc
        ]
        names = {c["metadata"]["name"] for c in of_kind(rendered, "CustomResourceDefinition")}
        assert names == expected, (upgrade, names)


# -- RBAC ------------------------------------------------------------------------------------------

ZARRLAKE_KINDS = [KINDS[k]["plural"] for k in KINDS]
READ = {"get", "list", "watch"}
SECRET_VERBS = {"get", "create", "delete"}  # never list, watch, patch or update
CHILD_VERBS = {"get", "create", "patch", "delete"}

# Each row is what the operator's code calls (kube.get/create/merge_patch/delete/list_, Kopf's
# watches, patches and events), so a grant without a caller fails here.
NAMESPACED_PERMISSIONS: dict[tuple[str, str], set[str]] = {
    **{("zarrlake.io", r): READ | {"patch"} for r in ZARRLAKE_KINDS},
    **{("zarrlake.io", f"{r}/status"): {"patch"} for r in ZARRLAKE_KINDS},
    **{("zarrlake.io", f"{r}/finalizers"): {"update"} for r in ZARRLAKE_KINDS},
    ("", "secrets"): SECRET_VERBS,
    ("", "services"): CHILD_VERBS,
    ("apps", "deployments"): CHILD_VERBS,
    ("policy", "poddisruptionbudgets"): CHILD_VERBS,  # the managed Redis'
    ("networking.k8s.io", "networkpolicies"): CHILD_VERBS,
    ("", "persistentvolumeclaims"): {"get", "create", "delete"},  # made once, never patched
    ("batch", "cronjobs"): CHILD_VERBS | {"list", "watch"},  # watched: idle resyncs compare
    # A commit service that runs checks as Jobs (spec.commitService.checks) gets a Role with
    # jobs create/get/delete and pods get/list, its ServiceAccount and RoleBinding: the
    # operator must hold those rights to grant them.
    ("batch", "jobs"): READ | {"create", "delete"},
    ("", "pods"): {"get", "list"},
    ("", "serviceaccounts"): CHILD_VERBS,
    ("rbac.authorization.k8s.io", "roles"): CHILD_VERBS,
    ("rbac.authorization.k8s.io", "rolebindings"): CHILD_VERBS,
    # Kopf's Events, and a commit service's (spec.commitService.events: it counts repeats).
    ("", "events"): {"create", "patch"},
}
# engine: spark (values spark.rbac, on by default): ScheduledSparkApplications, their runs'
# driver pods (watched), and the driver ServiceAccount + Role the operator creates per policy,
# whose rights (executor pods, services, configmaps) it must hold itself to grant them.
EVERYTHING = READ | {"create", "update", "patch", "delete", "deletecollection"}
SPARK_PERMISSIONS: dict[tuple[str, str], set[str]] = {
    ("sparkoperator.k8s.io", "scheduledsparkapplications"): CHILD_VERBS | {"list"},
    ("sparkoperator.k8s.io", "sparkapplications"): READ,
    ("", "serviceaccounts"): CHILD_VERBS,
    ("rbac.authorization.k8s.io", "roles"): CHILD_VERBS,
    ("rbac.authorization.k8s.io", "rolebindings"): CHILD_VERBS,
    ("", "pods"): EVERYTHING,
    ("", "services"): EVERYTHING,
    ("", "configmaps"): EVERYTHING,
    ("", "persistentvolumeclaims"): EVERYTHING,
}


def union(*tables: dict[tuple[str, str], set[str]]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for table in tables:
        for key, verbs in table.items():
            out[key] |= verbs
    return dict(out)


CLUSTER_PERMISSIONS: dict[tuple[str, str], set[str]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): READ,
    ("", "namespaces"): READ,
}
# Leader election: the Lease in the release namespace, read, created once and renewed (a PUT).
LEASE_PERMISSIONS: dict[tuple[str, str], set[str]] = {
    ("coordination.k8s.io", "leases"): {"get", "watch", "create", "update"}
}


def granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs that a Role or ClusterRole grants; refuses wildcards."""
    table: dict[tuple[str, str], set[str]] = defaultdict(set)
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, rule  # no nonResourceURLs etc.
        for field in ("apiGroups", "resources", "verbs"):
            assert rule[field], f"empty {field} in {rule}"
            assert not any("*" in item for item in rule[field]), f"wildcard {field} in {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                table[(group, resource)] |= set(rule["verbs"])
    return dict(table)


def lease_role(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The leader-election Role, checked with its binding: in the release namespace, only the
    Lease rights, bound to the operator's ServiceAccount."""
    name = f"{RELEASE}-zarrlake-operator-leader-election"
    (role,) = [r for r in of_kind(objects, "Role") if r["metadata"]["name"] == name]
    (binding,) = [b for b in of_kind(objects, "RoleBinding") if b["metadata"]["name"] == name]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert granted(role) == LEASE_PERMISSIONS
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": name,
    }
    sa = one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    return role


def test_rbac_cluster_wide(chart):
    objects = render(chart)
    # Namespaced: only the Lease's Role, in the release namespace.
    assert of_kind(objects, "Role") == [lease_role(objects)]
    assert len(of_kind(objects, "RoleBinding")) == 1
    role = one(objects, "ClusterRole")
    expected = union(NAMESPACED_PERMISSIONS, SPARK_PERMISSIONS, CLUSTER_PERMISSIONS)
    assert granted(role) == expected
    assert granted(role)[("", "secrets")] == SECRET_VERBS
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    sa = one(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_rbac_namespaced(chart):
    objects = render(chart, SCENARIOS["namespaced"])
    sa_name = one(objects, "ServiceAccount")["metadata"]["name"]
    subject = [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]

    # Cluster-wide: only what Kopf reads there.
    cluster_role = one(objects, "ClusterRole")
    assert granted(cluster_role) == CLUSTER_PERMISSIONS
    cluster_binding = one(objects, "ClusterRoleBinding")
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert cluster_binding["subjects"] == subject

    lease = lease_role(objects)
    roles = {r["metadata"]["namespace"]: r for r in of_kind(objects, "Role") if r != lease}
    bindings = {
        b["metadata"]["namespace"]: b
        for b in of_kind(objects, "RoleBinding")
        if b["roleRef"]["name"] != lease["metadata"]["name"]
    }
    assert set(roles) == set(bindings) == {"a", "b"}
    for namespace, role in roles.items():
        expected = union(NAMESPACED_PERMISSIONS, SPARK_PERMISSIONS)
        assert granted(role) == expected, namespace
        assert granted(role)[("", "secrets")] == SECRET_VERBS
        assert bindings[namespace]["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert bindings[namespace]["subjects"] == subject


def test_rbac_without_spark_grants_only_the_local_engines_rights(chart):
    role = one(render(chart, {"spark": {"rbac": False}}), "ClusterRole")
    assert granted(role) == union(NAMESPACED_PERMISSIONS, CLUSTER_PERMISSIONS)
    assert granted(role)[("", "pods")] == {"get", "list"}  # no watch, no create


def test_spark_defaults_reach_the_operator(chart):
    defaults = {e["name"]: e.get("value") for e in container(render(chart))["env"]}
    assert defaults["ZARRLAKE_SPARK_IMAGE"] == chart.values["spark"]["image"] != ""
    assert defaults["ZARRLAKE_SPARK_SERVICE_ACCOUNT"] == ""
    values = {"spark": {"image": "registry.example/spark:1", "serviceAccountName": "spark"}}
    env = {e["name"]: e.get("value") for e in container(render(chart, values))["env"]}
    assert env["ZARRLAKE_SPARK_IMAGE"] == "registry.example/spark:1"
    assert env["ZARRLAKE_SPARK_SERVICE_ACCOUNT"] == "spark"
    # Without the Spark rights the operator must not watch driver pods (it may not).
    assert defaults["ZARRLAKE_SPARK_RBAC"] == "true"
    off = {
        e["name"]: e.get("value")
        for e in container(render(chart, {"spark": {"rbac": False}}))["env"]
    }
    assert off["ZARRLAKE_SPARK_RBAC"] == "false"


def test_serve_defaults_reach_the_operator(chart):
    """The image and resources of the servers a Repository's spec.serve asks for: the job
    image and the chart's defaults unless set, in the form the operator reads them."""
    from zarrlake_operator import desired

    env = {e["name"]: e.get("value") for e in container(render(chart))["env"]}
    assert env["ZARRLAKE_SERVE_IMAGE"] == env["ZARRLAKE_JOB_IMAGE"] != ""
    assert json.loads(env["ZARRLAKE_SERVE_RESOURCES"]) == chart.values["serve"]["resources"]
    assert chart.values["serve"]["resources"] == desired.DEFAULT_SERVE_RESOURCES  # one default
    env = {e["name"]: e.get("value") for e in container(render(chart, {"jobImage": "j:1"}))["env"]}
    assert env["ZARRLAKE_SERVE_IMAGE"] == "j:1"
    values = SCENARIOS["everything"]["serve"]
    env = {e["name"]: e.get("value") for e in container(render(chart, {"serve": values}))["env"]}
    assert env["ZARRLAKE_SERVE_IMAGE"] == values["image"]
    # Merged into the defaults, as Helm merges values (a limit goes with `limits: null`).
    assert json.loads(env["ZARRLAKE_SERVE_RESOURCES"]) == {
        "requests": {"cpu": "250m", "memory": 1073741824},
        "limits": {"memory": "1Gi"},
    }


def test_rbac_binds_an_existing_service_account(chart):
    objects = render(chart, SCENARIOS["everything"])
    assert of_kind(objects, "ServiceAccount") == []
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing-sa"
    for binding in of_kind(objects, "ClusterRoleBinding") + of_kind(objects, "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "existing-sa", "namespace": NAMESPACE}
        ]


def test_service_account_annotations_for_irsa(chart):
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/zarrlake-operator"}
    objects = render(chart, {"serviceAccount": {"annotations": irsa}})
    sa = one(objects, "ServiceAccount")
    assert sa["metadata"]["annotations"] == irsa
    assert sa["automountServiceAccountToken"] is True
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]


# -- the Deployment --------------------------------------------------------------------------------


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_operator_runs_unprivileged(chart, values):
    objects = render(chart, values)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    pod_sc = pod["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == 10001
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(objects)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc or sc["privileged"] is False
    # The read-only root needs a writable /tmp.
    mounts = {m["mountPath"]: m["name"] for m in container(objects)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_probes_ports_and_env(chart, values):
    objects = render(chart, values)
    c = container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert (get["path"], port) == ("/healthz", 8080), probe

    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    image = c["image"]
    job_image = values.get("jobImage") or image
    assert env["ZARRLAKE_JOB_IMAGE"]["value"] == job_image
    assert env["ZARRLAKE_LOG_LEVEL"]["value"] == values.get("logLevel", "INFO")
    for extra in values.get("extraEnv", []):
        assert env[extra["name"]] == extra

    assert c["command"] == ["python", "-m", "zarrlake_operator"]
    namespaces = values.get("watchNamespaces")
    if namespaces:
        scope = [a for ns in namespaces for a in ("--namespace", ns)]
    else:
        scope = ["--all-namespaces"]
    if values.get("leaderElection", {}).get("enabled", True):
        election = ["--lease-name", LEASE, "--lease-duration", "10"]
        election += ["--lease-renew-deadline", "7"]  # the renew interval: the operator's
        election += ["--lease-retry-period", "2"]
    else:
        election = ["--standalone"]
    common = ["--liveness-port", "8080", "--metrics-port", "9090"]
    verbose = ["--verbose"] if values.get("logLevel") == "DEBUG" else []
    assert c["args"] == ["run", *scope, *election, *common, *verbose]


@pytest.mark.parametrize("values", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_operator_cli_accepts_the_arguments(chart, values):
    c = container(render(chart, values))
    assert c["command"][-1] == "zarrlake_operator"
    args = build_parser().parse_args(c["args"])
    assert args.command == "run"
    assert args.all_namespaces is not bool(values.get("watchNamespaces"))
    assert args.namespace == values.get("watchNamespaces", [])
    elects = values.get("leaderElection", {}).get("enabled", True)
    assert args.standalone is not elects
    if elects:  # the chart's defaults are the operator's own
        defaults = build_parser().parse_args(["run"])
        assert args.lease_name == LEASE
        assert (
            args.lease_duration,
            args.lease_renew_deadline,
            args.lease_renew_interval,
            args.lease_retry_period,
        ) == (
            defaults.lease_duration,
            defaults.lease_renew_deadline,
            defaults.lease_renew_interval,
            defaults.lease_retry_period,
        )
    assert (args.liveness_port, args.metrics_port) == (8080, 9090)
    assert args.verbose is (values.get("logLevel") == "DEBUG")


def test_image_defaults_to_app_version(chart):
    objects = render(chart)
    assert container(objects)["image"] == "ghcr.io/zarrlake/zarrlake:0.4.0"
    objects = render(chart, SCENARIOS["everything"])
    assert container(objects)["image"] == "registry.example/zarrlake:1.2.3"
    assert container(objects)["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(("values", "replicas"), [({}, 1), ({"replicaCount": 2}, 2)])
def test_replicas(chart, values, replicas):
    objects = render(chart, values)
    assert one(objects, "Deployment")["spec"]["replicas"] == replicas


def test_selector_matches_pod_labels(chart):
    for values in SCENARIOS.values():
        objects = render(chart, values)
        deployment = one(objects, "Deployment")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        assert set(selector) == {"app.kubernetes.io/name", "app.kubernetes.io/instance"}


# -- leader election, metrics ---------------------------------------------------------------------


def test_leader_election_values_reach_the_operator(chart):
    values = {
        "replicaCount": 3,
        "leaderElection": {
            "leaseName": "zl-leader",
            "leaseDuration": 20,
            "renewDeadline": 12.5,
            "renewInterval": 6,
            "retryPeriod": 3,
        },
    }
    objects = render(chart, values)
    args = build_parser().parse_args(container(objects)["args"])
    assert (args.lease_name, args.standalone) == ("zl-leader", False)
    assert (
        args.lease_duration,
        args.lease_renew_deadline,
        args.lease_renew_interval,
        args.lease_retry_period,
    ) == (
        20,
        12.5,
        6,
        3,
    )
    assert one(objects, "Deployment")["spec"]["replicas"] == 3
    # The Lease's namespace is the pod's own, where the Role grants it.
    env = {e["name"]: e for e in container(objects)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert lease_role(objects)["metadata"]["namespace"] == NAMESPACE


def test_standalone_has_no_lease_rights_and_one_replica(chart):
    objects = render(chart, SCENARIOS["standalone"])
    assert "--standalone" in container(objects)["args"]
    assert of_kind(objects, "Role") == [] and of_kind(objects, "RoleBinding") == []
    with pytest.raises(helm.HelmRenderError, match=r"replicaCount > 1 needs leaderElection"):
        render(chart, {**SCENARIOS["standalone"], "replicaCount": 2})


@pytest.mark.parametrize(
    "timings",
    [
        {"leaseDuration": 7, "renewDeadline": 7},
        {"renewDeadline": 2, "retryPeriod": 2},
        {"leaseDuration": 5, "renewDeadline": 8, "retryPeriod": 1},
    ],
)
def test_leader_election_timings_must_nest(chart, timings):
    with pytest.raises(helm.HelmRenderError, match="leaseDuration > renewDeadline > retryPeriod"):
        render(chart, {"leaderElection": timings})


@pytest.mark.parametrize("interval", [7, 9])
def test_the_leader_renews_before_its_renew_deadline(chart, interval):
    with pytest.raises(helm.HelmRenderError, match="renewDeadline > renewInterval > 0"):
        render(chart, {"leaderElection": {"renewInterval": interval}})


def test_short_timings_work_without_a_renew_interval(chart):
    """Timings chosen before the renew interval existed (a renew deadline of 4 s or less) still
    render, and the operator derives an interval the deadline allows."""
    timings = {"leaseDuration": 5, "renewDeadline": 3, "retryPeriod": 1}
    args = build_parser().parse_args(container(render(chart, {"leaderElection": timings}))["args"])
    assert args.lease_renew_interval is None
    assert (args.lease_duration, args.lease_renew_deadline, args.lease_retry_period) == (5, 3, 1)


def test_metrics_service(chart):
    objects = render(chart)
    service = one(objects, "Service")
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert of_kind(objects, "ServiceMonitor") == []
    assert of_kind(render(chart, {"metrics": {"enabled": False}}), "Service") == []


def test_service_monitor(chart):
    objects = render(chart, SCENARIOS["servicemonitor"])
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s"
    # The operator's series name the resource's namespace: kept, not renamed exported_namespace.
    assert endpoint["honorLabels"] is True


def test_service_monitor_needs_the_metrics_service(chart):
    bad = {"metrics": {"enabled": False}, "serviceMonitor": {"enabled": True}}
    with pytest.raises(helm.HelmRenderError, match=r"needs metrics\.enabled"):
        render(chart, bad)


# -- values.schema.json ----------------------------------------------------------------------------

BAD_VALUES = {
    "typo-top-level": ({"replicaCont": 2}, "replicaCont"),
    "wrong-type": ({"replicaCount": "two"}, "replicaCount"),
    "typo-nested": ({"image": {"tga": "1.0"}}, "tga"),
    "namespaces-not-a-list": ({"watchNamespaces": "a"}, "watchNamespaces"),
    "bad-namespace-name": ({"watchNamespaces": ["Not_A_Namespace"]}, "watchNamespaces"),
    "unknown-log-level": ({"logLevel": "verbose"}, "logLevel"),
    "negative-replicas": ({"replicaCount": -1}, "replicaCount"),
    "typo-leader-election": (
        {"leaderElection": {"leaseDurationSeconds": 10}},
        "leaseDurationSeconds",
    ),
    "zero-retry-period": ({"leaderElection": {"retryPeriod": 0}}, "retryPeriod"),
    "zero-renew-interval": ({"leaderElection": {"renewInterval": 0}}, "renewInterval"),
    "bad-lease-name": ({"leaderElection": {"leaseName": "Not_A_Name"}}, "leaseName"),
    "typo-spark": ({"spark": {"imgae": "x"}}, "imgae"),
    "bad-spark-account": (
        {"spark": {"serviceAccountName": "Not_An_Account"}},
        "serviceAccountName",
    ),
    "typo-serve": ({"serve": {"replicas": 2}}, "replicas"),
    "serve-quantity-not-a-quantity": (
        {"serve": {"resources": {"limits": {"memory": ["1Gi"]}}}},
        "memory",
    ),
    "typo-prometheus-rule": ({"prometheusRule": {"enable": True}}, "enable"),
    "bad-not-ready-for": ({"prometheusRule": {"notReadyFor": "15 minutes"}}, "notReadyFor"),
    "bad-error-ratio": ({"prometheusRule": {"reconcileErrorRatio": 5}}, "reconcileErrorRatio"),
    "negative-maintenance-age": (
        {"prometheusRule": {"maintenanceMaxAgeHours": -1}},
        "maintenanceMaxAgeHours",
    ),
    "typo-dashboard": ({"grafanaDashboard": {"lables": {}}}, "lables"),
    "dashboard-label-not-a-string": (
        {"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}},
        "grafana_dashboard",
    ),
    "typo-pdb": ({"podDisruptionBudget": {"minAvailable": 1}}, "minAvailable"),
    "bad-pdb-max": ({"podDisruptionBudget": {"maxUnavailable": "half"}}, "maxUnavailable"),
    "typo-network-policy": ({"networkPolicy": {"egress": []}}, "egress"),
    "bad-network-port": ({"networkPolicy": {"redis": {"ports": [70000]}}}, "ports"),
    "network-peers-not-a-list": ({"networkPolicy": {"metricsFrom": {"a": "b"}}}, "metricsFrom"),
}


@pytest.mark.parametrize(("values", "key"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_refuses_bad_values(chart, values, key):
    with pytest.raises(helm.HelmValuesError, match=re.escape(key)):
        render(chart, values)
    report = helm.lint(CHART, values, namespace=NAMESPACE)
    assert any(key in error for error in report["errors"]), report


def test_schema_accepts_the_defaults(chart):
    chart.validate_schema(chart.values)
    for values in SCENARIOS.values():
        chart.validate_schema(chart.merge_values(values))


# -- CRDs ------------------------------------------------------------------------------------------

# OpenAPI keywords the API server refuses in CRD schemas.
_FORBIDDEN = {
    "$ref",
    "$schema",
    "$defs",
    "definitions",
    "dependencies",
    "additionalItems",
    "patternProperties",
    "id",
    "const",
    "examples",
}


def structural_problems(node: dict[str, Any], path: str = "") -> list[str]:
    """What would make the API server call this schema non-structural or invalid."""
    problems = []
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if "x-kubernetes-preserve-unknown-fields" in node and not preserve:
        problems.append(f"{path}: x-kubernetes-preserve-unknown-fields must be true if set")
    for key in sorted(_FORBIDDEN & set(node)):
        problems.append(f"{path}: {key} is not allowed")
    if "type" not in node and not (int_or_string or preserve):
        problems.append(f"{path or '<root>'}: no type")
    if int_or_string and "type" in node:
        problems.append(f"{path}: int-or-string must not set a type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    if node.get("uniqueItems") is True:
        problems.append(f"{path}: uniqueItems is not allowed")
    if node.get("type") == "array" and "items" not in node:
        problems.append(f"{path}: array without items")
    for name, sub in node.get("properties", {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += structural_problems(node[key], f"{path}.{key}")
    for key in ("allOf", "anyOf", "oneOf"):
        for i, sub in enumerate(node.get(key, [])):
            if "type" in sub or "default" in sub:
                problems.append(f"{path}.{key}[{i}]: type/default inside a junctor")
    return problems


def column_resolves(schema: dict[str, Any], json_path: str) -> bool:
    """Whether a printer column's simple JSONPath leads somewhere in the schema."""
    node = schema
    for step in re.sub(r"\[[^\]]*\]", ".[]", json_path).strip(".").split("."):
        if node.get("x-kubernetes-preserve-unknown-fields") or (
            node.get("type") == "object" and "properties" not in node
        ):
            return True  # open object (e.g. metadata): anything may be there
        if step == "[]":
            if node.get("type") != "array":
                return False
            node = node["items"]
        elif step in node.get("properties", {}):
            node = node["properties"][step]
        else:
            return False
    return True


def all_crd_files() -> list[Path]:
    return [p for d in CRD_DIRS.values() for p in sorted(d.glob("*.yaml"))]


@pytest.mark.parametrize("path", all_crd_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_crd_is_valid_and_structural(path):
    (crd,) = load_yaml_docs(path)
    assert (crd["apiVersion"], crd["kind"]) == (
        "apiextensions.k8s.io/v1",
        "CustomResourceDefinition",
    )
    validate_builtin(crd)  # strict: unknown keys anywhere in the schema are errors
    spec = crd["spec"]
    names = spec["names"]
    assert crd["metadata"]["name"] == f"{names['plural']}.{spec['group']}"
    assert path.name == f"{spec['group']}_{names['plural']}.yaml"
    assert names["singular"] == names["kind"].lower()
    assert names["listKind"] == f"{names['kind']}List"
    assert spec["scope"] in ("Namespaced", "Cluster")
    assert [v["storage"] for v in spec["versions"]].count(True) == 1
    for version in spec["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        assert schema["type"] == "object"
        assert structural_problems(schema) == []
        crd_validator(crd, version["name"])  # converts to a well-formed JSON Schema
        for column in version.get("additionalPrinterColumns", []):
            assert column_resolves(schema, column["jsonPath"]), column


def test_chart_ships_exactly_our_crds():
    ours = set(crd_gen.filenames())
    assert {p.name for p in CRD_DIRS["crds"].glob("*.yaml")} == ours
    assert {p.name for p in CRD_DIRS["chart-crds"].glob("*.yaml")} == ours


@pytest.mark.parametrize("directory", CRD_DIRS.values(), ids=CRD_DIRS.keys())
def test_crds_match_the_models(directory):
    fresh = crd_gen.filenames()
    on_disk = {p.name: p.read_text() for p in directory.glob(f"{GROUP}_*.yaml")}
    missing = sorted(set(fresh) - set(on_disk))
    stale = sorted(set(on_disk) - set(fresh))
    changed = sorted(n for n in set(fresh) & set(on_disk) if fresh[n] != on_disk[n])
    assert not (missing or stale or changed), (
        f"{directory.relative_to(ROOT)}/ is out of date with zarrlake_operator/models.py "
        f"(missing: {missing}, stale: {stale}, changed: {changed}); run `make crds`"
    )


# -- the schema conversion itself, so that the example checks cannot pass vacuously ----------------


def _repository(**storage: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": "demo", "namespace": "data"},
        "spec": {"storage": {"bucket": "my-bucket", **storage}},
    }


def test_custom_resource_validation_catches_mistakes():
    crd = chart_crds()[(GROUP, "Repository")]
    assert custom_resource_errors(_repository(), crd) == []
    assert custom_resource_errors(_repository(prefix="a/b", region="eu-west-1"), crd) == []
    assert custom_resource_errors(_repository(bucket="Not_A_Bucket"), crd)
    assert custom_resource_errors(_repository(bukcet="typo"), crd)  # unknown field
    assert custom_resource_errors(_repository(provision="yes"), crd)  # wrong type
    lock = _repository()
    lock["spec"]["lockService"] = {"mode": "managed", "resources": {"limits": {"cpu": "500m"}}}
    assert custom_resource_errors(lock, crd) == []
    lock["spec"]["lockService"]["resources"]["limits"]["memory"] = 1073741824  # int-or-string
    assert custom_resource_errors(lock, crd) == []
    lock["spec"]["lockService"]["resources"]["limits"]["memory"] = ["1Gi"]
    assert custom_resource_errors(lock, crd)
    lock["spec"]["lockService"] = {"mode": "sometimes"}
    assert custom_resource_errors(lock, crd)
    no_spec = _repository()
    del no_spec["spec"]
    assert custom_resource_errors(no_spec, crd)
    wrong_version = _repository()
    wrong_version["apiVersion"] = f"{GROUP}/v9"
    assert custom_resource_errors(wrong_version, crd)


# -- examples/**/*.yaml ----------------------------------------------------------------------------

# examples/*.yaml and any subdirectory of examples/ (e.g. examples/kubernetes/).
EXAMPLE_FILES = sorted(
    p
    for p in [*EXAMPLES.rglob("*.yaml"), *EXAMPLES.rglob("*.yml")]
    if p.name != "kustomization.yaml"  # kustomize's own file, not a resource
)


@pytest.mark.parametrize(
    "path",
    EXAMPLE_FILES or [None],
    ids=[str(p.relative_to(EXAMPLES)) for p in EXAMPLE_FILES] or ["none"],
)
def test_example_resources_are_valid(path):
    assert path is not None, (
        f"no example resources in {EXAMPLES.relative_to(ROOT)}/**/*.yaml: "
        "add Repository/Branch/Tag/RetentionPolicy examples"
    )
    docs = load_yaml_docs(path)
    assert docs, f"{path.name} is empty"
    crds = chart_crds()
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path.name}: {doc}"
        where = f"{path.name}: {doc['kind']}/{doc['metadata'].get('name')}"
        group = group_of(doc["apiVersion"])
        if (group, doc["kind"]) in crds:
            errors = custom_resource_errors(doc, crds[(group, doc["kind"])])
            assert errors == [], f"{where}: {errors}"
            if group == GROUP:
                # The operator parses every resource through its model: that must succeed too.
                KINDS[doc["kind"]]["model"].model_validate(doc)
        elif group == "sparkoperator.k8s.io":
            assert spark_application_errors(doc) == [], where
        else:
            try:
                validate_builtin(doc)
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"{where}: neither a built-in kind nor one of the chart's CRDs")


def spark_application_errors(doc: dict) -> list[str]:
    """The fields of the Kubeflow Spark operator's SparkApplication (v1beta2) that the examples
    rely on; its CRD is not ours to ship, so no schema of it is at hand."""
    errors = []
    if doc["apiVersion"] != "sparkoperator.k8s.io/v1beta2" or doc["kind"] != "SparkApplication":
        errors.append(f"unexpected {doc['apiVersion']} {doc['kind']}")
    spec = doc.get("spec") or {}
    if spec.get("type") not in ("Python", "Scala", "Java", "R"):
        errors.append(f"spec.type {spec.get('type')!r}")
    if spec.get("mode") not in ("cluster", "client"):
        errors.append(f"spec.mode {spec.get('mode')!r}")
    for key in ("image", "mainApplicationFile", "sparkVersion"):
        if not isinstance(spec.get(key), str) or not spec[key]:
            errors.append(f"spec.{key} missing")
    if not all(isinstance(a, str) for a in spec.get("arguments") or []):
        errors.append("spec.arguments must be strings")
    for role in ("driver", "executor"):
        part = spec.get(role) or {}
        if not part.get("serviceAccount"):
            errors.append(f"spec.{role}.serviceAccount missing")
        if not isinstance(part.get("cores", 1), int):
            errors.append(f"spec.{role}.cores must be an integer")
    return errors


def test_examples_include_zarrlake_resources():
    kinds = {
        doc["kind"]
        for path in EXAMPLE_FILES
        for doc in load_yaml_docs(path)
        if group_of(doc.get("apiVersion", "")) == GROUP
    }
    assert kinds, f"no zarrlake.io resources in {EXAMPLES.relative_to(ROOT)}/**/*.yaml"


def test_kind_overlay_renders_the_examples_for_the_cluster(tmp_path: Path) -> None:
    """e2e/kind.sh applies this overlay with `kubectl apply -k`; it must build (kustomize
    refuses files outside its root, so the examples are a base of their own)."""
    from zarrlake_testkit.emulated import kubectl_binary

    done = subprocess.run(
        [kubectl_binary(), "kustomize", str(ROOT / "e2e" / "kind")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECACHEDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    docs = {d["kind"]: d for d in yaml.safe_load_all(done.stdout)}
    assert set(docs) == {"Secret", "Repository", "RetentionPolicy"}
    assert docs["Repository"]["spec"]["storage"]["endpointURL"] == "http://s3:5000"
    policy = docs["RetentionPolicy"]["spec"]
    assert policy["rules"] == {"default": {"last": 1}, "branches": {}}
    assert policy["gc"]["grace"] == "0s" and policy["gc"]["force"] is True


# -- alerts, dashboard, disruption budget, network policy ------------------------------------------

# Series Prometheus makes itself (not the operator's to export).
PROMETHEUS_SERIES = {"up"}
# PromQL words that are not series names (operators, modifiers).
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
}
# The samples each kind of prometheus_client metric family exports, by suffix.
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
PROM_DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")


def promql_series(expr: str) -> set[str]:
    """The series names a PromQL expression reads (not functions, keywords, label names)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        word, call = match.groups()
        if not call and word not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def exported_series() -> set[str]:
    """Every series name the operator's registry can export (also metrics without samples
    yet: a labelled metric appears once a label set is set)."""
    from zarrlake_operator.metrics import REGISTRY

    return {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def test_promql_series_finds_the_series_and_nothing_else():
    expr = (
        'sum by (kind, le) (rate(a_total{outcome="error", x=~"b|c"}[5m] offset 1h)) '
        "/ on (kind) group_left (name) histogram_quantile(0.95, b_bucket) > 1e3 "
        'and time() - c_seconds{namespace=~"$namespace"} > 0.05 unless absent(up == 1)'
    )
    assert promql_series(expr) == {"a_total", "b_bucket", "c_seconds", "up"}


def alert_rules(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rule = one(objects, "PrometheusRule")
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def prometheus_rule_errors(obj: dict[str, Any]) -> list[str]:
    """What prometheus-operator's PrometheusRule schema (monitoring.coreos.com/v1) and
    Prometheus' rule loader would refuse, for the fields the chart uses."""
    errors = []
    if obj.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"apiVersion {obj.get('apiVersion')}")
    if set(obj) - {"apiVersion", "kind", "metadata", "spec"}:
        errors.append(f"unknown top-level fields {sorted(set(obj) - {'apiVersion', 'kind'})}")
    groups = (obj.get("spec") or {}).get("groups")
    if set(obj.get("spec") or {}) != {"groups"} or not isinstance(groups, list) or not groups:
        return [*errors, "spec must hold a non-empty list of groups"]
    names = [g.get("name") for g in groups]
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        errors.append(f"group names must be unique and non-empty: {names}")
    for group in groups:
        if set(group) - {"name", "interval", "rules"} or not group.get("rules"):
            errors.append(f"group {group.get('name')}: unknown fields or no rules")
            continue
        for rule in group["rules"]:
            where = f"{group['name']}/{rule.get('alert') or rule.get('record')}"
            if set(rule) - {"alert", "record", "expr", "for", "labels", "annotations"}:
                errors.append(f"{where}: unknown fields {sorted(rule)}")
            if ("alert" in rule) == ("record" in rule):
                errors.append(f"{where}: exactly one of alert and record")
            if "alert" in rule and not re.fullmatch(r"[A-Z][A-Za-z0-9]*", rule["alert"]):
                errors.append(f"{where}: alert names are CamelCase")
            expr = rule.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                errors.append(f"{where}: expr must be a non-empty string")
            elif any(expr.count(a) != expr.count(b) for a, b in ("()", "{}", "[]")):
                errors.append(f"{where}: unbalanced brackets in {expr!r}")
            elif "{{" in expr:
                errors.append(f"{where}: an unrendered template in {expr!r}")
            if "for" in rule and not PROM_DURATION.fullmatch(str(rule["for"])):
                errors.append(f"{where}: for {rule['for']!r} is not a duration")
            for field in ("labels", "annotations"):
                value = rule.get(field, {})
                if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items()
                ):
                    errors.append(f"{where}: {field} must map strings to strings")
            if "alert" in rule:
                annotations = rule.get("annotations") or {}
                if not annotations.get("summary") or not annotations.get("description"):
                    errors.append(f"{where}: a summary and a description")
                if (rule.get("labels") or {}).get("severity") not in ("critical", "warning"):
                    errors.append(f"{where}: severity critical or warning")
    return errors


def test_prometheus_rule_validation_catches_mistakes(chart):
    rule = one(render(chart, SCENARIOS["observability"]), "PrometheusRule")
    assert prometheus_rule_errors(rule) == []
    for breakage in (
        lambda r: r["spec"]["groups"][0]["rules"][0].update(expr="sum(rate(x[5m])"),
        lambda r: r["spec"]["groups"][0]["rules"][0].update({"for": "15 minutes"}),
        lambda r: r["spec"]["groups"][0]["rules"][0].update(labels={"severity": 1}),
        lambda r: r["spec"]["groups"][0]["rules"][0].update(alert="not camel"),
        lambda r: r["spec"]["groups"][0]["rules"][0].update(record="x"),
        lambda r: r["spec"]["groups"][0]["rules"][0].update(exprr="x"),
        lambda r: r["spec"]["groups"][1].update(name=r["spec"]["groups"][0]["name"]),
        lambda r: r["spec"]["groups"][0]["rules"][0].pop("annotations"),
        lambda r: r["spec"].update(groups=[]),
    ):
        broken = copy.deepcopy(rule)
        breakage(broken)
        assert prometheus_rule_errors(broken), breakage


def test_observability_is_off_by_default(chart):
    objects = render(chart)
    for kind in ("PrometheusRule", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"):
        assert of_kind(objects, kind) == [], kind


def test_prometheus_rule_alerts(chart):
    objects = render(chart, SCENARIOS["observability"])
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["namespace"] == NAMESPACE
    alerts = alert_rules(objects)
    assert set(alerts) == {
        "ZarrlakeOperatorAbsent",
        "ZarrlakeOperatorDown",
        "ZarrlakeReconcileErrors",
        "ZarrlakeResourceNotReady",
        "ZarrlakeLockServiceUnhealthy",
        "ZarrlakeMaintenanceFailed",
        "ZarrlakeMaintenanceStale",
    }
    # The operator's scrape target, as the ServiceMonitor names it (its Service's name).
    service = one(objects, "Service")["metadata"]["name"]
    target = f'up{{job="{service}", namespace="{NAMESPACE}"}}'
    assert alerts["ZarrlakeOperatorAbsent"]["expr"] == f"absent({target} == 1)"
    assert alerts["ZarrlakeOperatorDown"]["expr"] == f"{target} == 0"
    assert alerts["ZarrlakeOperatorAbsent"]["labels"]["severity"] == "critical"
    assert alerts["ZarrlakeResourceNotReady"]["expr"] == "zarrlake_operator_resource_ready == 0"
    assert alerts["ZarrlakeResourceNotReady"]["for"] == "15m"
    assert "> 0.05" in alerts["ZarrlakeReconcileErrors"]["expr"]
    assert 'outcome="error"' in alerts["ZarrlakeReconcileErrors"]["expr"]
    assert alerts["ZarrlakeMaintenanceStale"]["expr"].endswith("> 192")
    # Prometheus' own templates reach the rule unrendered by Helm.
    summary = alerts["ZarrlakeResourceNotReady"]["annotations"]["summary"]
    assert "{{ $labels.kind }} {{ $labels.namespace }}/{{ $labels.name }}" in summary


def test_prometheus_rule_follows_its_values(chart):
    objects = render(chart, SCENARIOS["everything"])
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = alert_rules(objects)
    assert alerts["ZarrlakeOperatorAbsent"]["expr"] == (
        f'absent(up{{job="zarrlake", namespace="{NAMESPACE}"}} == 1)'
    )
    assert alerts["ZarrlakeResourceNotReady"]["for"] == "30m"
    assert alerts["ZarrlakeMaintenanceStale"]["expr"].endswith("> 36")
    for name, alert in alerts.items():
        assert alert["labels"]["team"] == "data", name


def dashboard(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (config_map,) = of_kind(objects, "ConfigMap")
    (text,) = config_map["data"].values()
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL query of the dashboard: panel targets, and the metrics its variables
    list label values of."""
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else ""
        queries += re.findall(r"label_values\(\s*([a-zA-Z_:][\w:]*)", text)
    return queries


def test_grafana_dashboard_config_map(chart):
    objects = render(chart, SCENARIOS["observability"])
    config_map = one(objects, "ConfigMap")
    assert config_map["metadata"]["namespace"] == NAMESPACE
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = dashboard(objects)
    assert board["uid"] == "zarrlake-operator" and board["title"]
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    # The shipped file, byte for byte (Helm does not template it: Grafana's {{label}} legends).
    shipped = (CHART / "dashboards" / "zarrlake-operator.json").read_text()
    assert json.loads(shipped) == board
    assert '"{{kind}} {{outcome}}"' in shipped

    # The sidecar's label and the ConfigMap's namespace are the user's to choose.
    # (Helm merges maps with the defaults: null drops the default label.)
    labels = {"dashboards": "zarrlake", "grafana_dashboard": None}
    custom = render(chart, {"grafanaDashboard": {"enabled": True, "labels": labels}})
    assert one(custom, "ConfigMap")["metadata"]["labels"]["dashboards"] == "zarrlake"
    assert "grafana_dashboard" not in one(custom, "ConfigMap")["metadata"]["labels"]
    elsewhere = one(render(chart, SCENARIOS["everything"]), "ConfigMap")
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert elsewhere["metadata"]["annotations"] == {"grafana_folder": "zarrlake"}


def test_alerts_and_dashboard_read_only_series_the_operator_exports(chart):
    """A metric renamed or dropped in the operator must fail here, not leave an alert that can
    never fire or a panel that stays empty."""
    objects = render(chart, SCENARIOS["observability"])
    exported = exported_series()
    assert "zarrlake_operator_reconciles_total" in exported
    assert "zarrlake_operator_reconcile_duration_seconds_bucket" in exported
    used: dict[str, set[str]] = {}
    for name, alert in alert_rules(objects).items():
        series = promql_series(alert["expr"])
        assert series, f"{name} reads no series"
        used[f"alert {name}"] = series
    for i, query in enumerate(dashboard_queries(dashboard(objects))):
        series = promql_series(query)
        assert series, f"dashboard query {query!r} reads no series"
        used[f"dashboard query {i}: {query}"] = series
    stale = {
        where: sorted(series - exported - PROMETHEUS_SERIES)
        for where, series in used.items()
        if series - exported - PROMETHEUS_SERIES
    }
    assert stale == {}, stale
    # And what the operator reports of the resources is all on show.
    everywhere = set().union(*used.values())
    for name in (
        "zarrlake_operator_resource_ready",
        "zarrlake_operator_lock_service_ready",
        "zarrlake_operator_maintenance_last_result",
        "zarrlake_operator_maintenance_last_success_timestamp_seconds",
        "zarrlake_operator_maintenance_last_duration_seconds",
        "zarrlake_operator_branch_head_age_seconds",
        "zarrlake_operator_errors_total",
        "zarrlake_operator_reconcile_duration_seconds_bucket",
    ):
        assert name in everywhere, name


def test_a_stale_metric_name_is_caught():
    """The check above, shown to fail on a name the operator does not export."""
    exported = exported_series()
    assert promql_series("zarrlake_operator_resource_ready == 0") <= exported
    assert promql_series("zarrlake_operator_resource_readiness == 0") - exported == {
        "zarrlake_operator_resource_readiness"
    }


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, None),
        ({"replicaCount": 2}, 1),
        ({"podDisruptionBudget": {"enabled": True}}, 1),
        ({"podDisruptionBudget": {"enabled": True, "maxUnavailable": "50%"}}, "50%"),
    ],
)
def test_operator_pod_disruption_budget(chart, values, expected):
    objects = render(chart, values)
    budgets = of_kind(objects, "PodDisruptionBudget")
    if expected is None:
        assert budgets == []
        return
    (pdb,) = budgets
    validate_builtin(pdb)
    assert pdb["spec"]["maxUnavailable"] == expected
    assert "minAvailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def egress_ports(policy: dict[str, Any]) -> set[tuple[str, int]]:
    return {(p["protocol"], p["port"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}


def test_operator_network_policy(chart):
    objects = render(chart, SCENARIOS["observability"])
    policy = one(objects, "NetworkPolicy")
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    # In: the metrics port only, from anyone by default.
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert "from" not in ingress
    assert "metrics" in {p["name"] for p in container(objects)["ports"]}
    # Out: the API server, object storage, Redis, DNS; nothing else.
    assert egress_ports(policy) == {
        ("TCP", 443),
        ("TCP", 6443),
        ("TCP", 6379),
        ("UDP", 53),
        ("TCP", 53),
    }
    assert all("to" not in rule for rule in policy["spec"]["egress"])


def test_operator_network_policy_follows_its_values(chart):
    values = SCENARIOS["everything"]["networkPolicy"]
    policy = one(render(chart, SCENARIOS["everything"]), "NetworkPolicy")
    (ingress,) = policy["spec"]["ingress"]
    assert ingress["from"] == values["metricsFrom"]
    rules = policy["spec"]["egress"]
    api = [r for r in rules if r.get("to") == values["apiServer"]["to"]]
    assert len(api) == 1 and api[0]["ports"] == [{"port": 443, "protocol": "TCP"}]
    assert rules[-1] == values["extraEgress"][0]
    assert ("TCP", 9000) in egress_ports(policy) and ("TCP", 6443) not in egress_ports(policy)


def test_the_operator_holds_every_right_it_grants_a_commit_service(chart):
    """Kubernetes refuses a Role with rights its creator lacks: the commit service's Role (for
    checks as Jobs and Events of refusals) must be within the operator's, with and without the
    Spark rights."""
    from zarrlake_operator import desired
    from zarrlake_operator.models import RepositorySpec

    body = {
        "apiVersion": "zarrlake.io/v1alpha1",
        "kind": "Repository",
        "metadata": {"name": "r", "namespace": "ns", "uid": "u"},
        "spec": {
            "storage": {"bucket": "lake", "prefix": "p"},
            "commitService": {
                "enabled": True,
                "tokensSecretRef": {"name": "t", "key": "k"},
                "checks": [{"name": "c", "image": "i"}],
            },
        },
    }
    spec = RepositorySpec.model_validate(body["spec"])
    role = next(o for o in desired.commit_service_rbac(body, spec) if o["kind"] == "Role")
    assert {r["resources"][0] for r in role["rules"]} == {"jobs", "pods", "events"}
    for values in ({}, {"spark": {"rbac": False}}):
        operator = granted(one(render(chart, values), "ClusterRole"))
        for key, verbs in granted(role).items():
            assert verbs <= operator.get(key, set()), (values, key)
