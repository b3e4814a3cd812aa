"""Upgrading the chart upgrades the CRDs, and loses nothing.

The chart renders the CRDs as templates (``templates/crds.yaml``), so ``helm upgrade`` applies
them; releases up to 0.1.0 shipped them in Helm's ``crds/`` folder, which Helm installs once.
``tests/operator/previous_release/<version>/crds/`` keeps what each earlier release installed.

- Statically: every CRD, version and field an earlier release served is still served, with the
  same type, no new required field, no enum value taken away (any of those would make objects
  already stored unreadable, pruned or impossible to update); and the checks are shown to fail.
- On the emulated API (real HTTP, the CRDs' schemas and CEL rules enforced) with the real
  operator process: the previous release's CRDs, one resource of every kind, then the current
  chart's CRDs applied as ``helm upgrade`` applies them. Every resource keeps its uid, spec and
  generation; the CRDs carry the new schema (a field the old one pruned is now kept); and the
  operator goes on reconciling, the new field included.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from k8s_env import CREDENTIALS, wait_for

from zarrlake_operator import kube
from zarrlake_testkit.emulated import LocalCluster, start_operator
from zarrlake_testkit.kubeapi import KubeAPI
from zarrlake_testkit.servers import stop

pytestmark = [pytest.mark.operator, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "zarrlake-operator"
PREVIOUS = Path(__file__).resolve().parent / "previous_release"
RELEASES = sorted(p.name for p in PREVIOUS.iterdir() if (p / "crds").is_dir())
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NS = "default"
MERGE = "application/merge-patch+json"


def previous_crds(release: str) -> dict[str, dict[str, Any]]:
    """name -> CRD, as that release's chart installed it (Helm's crds/ folder)."""
    found = {}
    for path in sorted((PREVIOUS / release / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        found[crd["metadata"]["name"]] = crd
    return found


def current_crds(**values: Any) -> dict[str, dict[str, Any]]:
    """name -> CRD, as the current chart renders them for ``helm upgrade``."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(
            values or None, name="zarrlake-operator", namespace=NS, is_upgrade=True
        )
    return {
        doc["metadata"]["name"]: doc
        for path, text in manifests.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] == "CustomResourceDefinition"
    }


def _schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
    return schema


def schema_regressions(old: dict[str, Any], new: dict[str, Any], path: str = "") -> list[str]:
    """What in ``new`` would hurt an object valid under ``old``: a field gone (pruned on the next
    write), a type changed, a field newly required, an enum value dropped, a free-form object
    given a closed shape."""
    found = []
    where = path or "<root>"
    if old.get("type") != new.get("type"):
        found.append(f"{where}: type {old.get('type')} -> {new.get('type')}")
    if old.get("x-kubernetes-int-or-string") != new.get("x-kubernetes-int-or-string"):
        found.append(f"{where}: int-or-string changed")
    if old.get("x-kubernetes-preserve-unknown-fields") and not new.get(
        "x-kubernetes-preserve-unknown-fields"
    ):
        found.append(f"{where}: unknown fields no longer kept")
    added = sorted(set(new.get("required", [])) - set(old.get("required", [])))
    if added:
        found.append(f"{where}: newly required {added}")
    if "enum" in old:
        dropped = [v for v in old["enum"] if v not in new.get("enum", old["enum"])]
        if dropped:
            found.append(f"{where}: enum values dropped {dropped}")
    for name, sub in (old.get("properties") or {}).items():
        if name not in (new.get("properties") or {}):
            found.append(f"{path}.{name}: field removed")
        else:
            found += schema_regressions(sub, new["properties"][name], f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(old.get(key), dict):
            if not isinstance(new.get(key), dict):
                found.append(f"{where}.{key}: removed")
            else:
                found += schema_regressions(old[key], new[key], f"{path}.{key}")
    return found


def upgrade_regressions(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every way the CRD ``new`` fails objects stored under ``old``."""
    name = old["metadata"]["name"]
    served = {v["name"]: v for v in new["spec"]["versions"]}
    found = []
    for key in ("group", "scope"):
        if old["spec"][key] != new["spec"][key]:
            found.append(f"{name}: spec.{key} changed")
    if old["spec"]["names"]["kind"] != new["spec"]["names"]["kind"]:
        found.append(f"{name}: kind changed")
    for version in old["spec"]["versions"]:
        if not version.get("served", True):
            continue
        if version["name"] not in served or not served[version["name"]].get("served", True):
            found.append(f"{name}: {version['name']} no longer served")
            continue
        found += [
            f"{name} {version['name']}: {problem}"
            for problem in schema_regressions(
                _schema(old, version["name"]), _schema(new, version["name"])
            )
        ]
    return found


@pytest.mark.parametrize("release", RELEASES)
def test_the_crds_keep_everything_an_earlier_release_served(release: str) -> None:
    old, new = previous_crds(release), current_crds()
    assert len(old) == 5 and sorted(old) <= sorted(new), (sorted(old), sorted(new))
    problems = [p for name in old for p in upgrade_regressions(old[name], new[name])]
    assert problems == []


def test_the_upgrade_checks_catch_what_would_hurt_stored_objects() -> None:
    (release, *_) = RELEASES
    old = previous_crds(release)["repositories.zarrlake.io"]
    assert upgrade_regressions(old, old) == []

    def changed(edit: Any) -> list[str]:
        new = copy.deepcopy(old)
        edit(_schema(new, "v1alpha1")["properties"]["spec"], new)
        return upgrade_regressions(old, new)

    storage = "storage"
    assert changed(lambda s, _: s["properties"][storage]["properties"].pop("prefix")) == [
        "repositories.zarrlake.io v1alpha1: .spec.storage.prefix: field removed"
    ]
    assert (
        "type string -> integer"
        in changed(
            lambda s, _: s["properties"][storage]["properties"]["bucket"].update(type="integer")
        )[0]
    )
    assert (
        "newly required ['region']"
        in changed(
            lambda s, _: s["properties"][storage].setdefault("required", []).append("region")
        )[0]
    )
    assert (
        "enum values dropped ['Delete']"
        in changed(lambda s, _: s["properties"]["reclaimPolicy"].update(enum=["Retain"]))[0]
    )
    assert changed(lambda _, crd: crd["spec"]["versions"][0].update(served=False)) == [
        "repositories.zarrlake.io: v1alpha1 no longer served"
    ]


def test_the_chart_renders_the_generated_crds_and_keeps_them() -> None:
    """templates/crds.yaml changes nothing of `make crds`'s output but the metadata it adds."""
    rendered = current_crds()
    generated = {
        crd["metadata"]["name"]: crd
        for crd in (yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml")))
    }
    assert sorted(rendered) == sorted(generated)
    for name, crd in rendered.items():
        meta = crd["metadata"]
        # Uninstalling the chart (or switching crds.install off) never deletes a CRD, and so
        # never every resource of its kind; Argo CD is told the same in its own words.
        assert meta["annotations"]["helm.sh/resource-policy"] == "keep"
        assert set(meta["annotations"]["argocd.argoproj.io/sync-options"].split(",")) == {
            "Delete=false",
            "Prune=false",
        }
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        assert generated[name]["metadata"]["labels"].items() <= meta["labels"].items()
        assert {k: v for k, v in crd.items() if k != "metadata"} == {
            k: v for k, v in generated[name].items() if k != "metadata"
        }
    assert current_crds(crds={"install": False}) == {}


# -- helm upgrade on the emulated API --------------------------------------------------------------


def _kinds(endpoint: str) -> list[dict[str, Any]]:
    """One resource of every kind, as a user of the previous release would have them."""
    storage = {"endpointURL": endpoint, "region": "us-east-1", "credentialsSecret": {"name": "s3"}}
    return [
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "Repository",
            "metadata": {"name": "climate", "namespace": NS},
            "spec": {
                "storage": {
                    "bucket": "zl-upgrade-climate",
                    "prefix": "repos/climate",
                    "provision": True,
                    **storage,
                },
                "lockService": {"mode": "managed"},
                "reclaimPolicy": "Retain",
            },
        },
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "Branch",
            "metadata": {"name": "experiment", "namespace": NS},
            "spec": {"repository": "climate", "from": "main"},
        },
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "Tag",
            "metadata": {"name": "v1", "namespace": NS},
            "spec": {"repository": "climate", "ref": "main"},
        },
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "RetentionPolicy",
            "metadata": {"name": "climate-retention", "namespace": NS},
            "spec": {
                "repository": "climate",
                "rules": {"default": {"days": 30}},
                "gc": {"schedule": "0 3 * * *", "grace": "7d"},
            },
        },
        {
            "apiVersion": "zarrlake.io/v1alpha1",
            "kind": "Mirror",
            "metadata": {"name": "climate-west", "namespace": NS},
            "spec": {
                "repository": "climate",
                "destination": {
                    "bucket": "zl-upgrade-climate-west",
                    "prefix": "repos/climate",
                    "provision": True,
                    **storage,
                },
            },
        },
    ]


def _condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


def _settled(kind: str, name: str) -> dict[str, Any] | None:
    """The object once the operator has reported on its current generation."""
    obj = kube.get(kind, NS, name)
    status = (obj or {}).get("status") or {}
    if obj is None or not _condition(obj, "Ready"):
        return None
    seen = status.get("observedGeneration", _condition(obj, "Ready").get("observedGeneration"))
    return obj if seen == obj["metadata"]["generation"] else None


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KubeAPI]:
    api = KubeAPI().start()
    try:
        kube.use_kubeconfig(str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        yield api
    finally:
        api.stop()
        if os.environ.get("KUBECONFIG"):  # the shared operator cluster's, for later tests
            kube.use_kubeconfig(os.environ["KUBECONFIG"])


@pytest.mark.parametrize("release", RELEASES[-1:])
def test_helm_upgrade_from_the_previous_release_loses_nothing(
    release: str, cluster: KubeAPI, tmp_path: Path, moto_s3: Any
) -> None:
    # helm install of the previous release: its crds/ folder, created as they are.
    for crd in previous_crds(release).values():
        kube._call("POST", CRDS, body=crd)
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3", "namespace": NS},
            "stringData": CREDENTIALS,
        }
    )
    resources = _kinds(moto_s3.endpoint)
    for obj in resources:
        kube.create(obj)
    operator = local = None
    try:
        operator, _, _ = start_operator(
            tmp_path / "kubeconfig", log_path=tmp_path / "operator.log", resync_seconds=1
        )
        local = LocalCluster(tmp_path, [NS]).start(interval=0.2)  # runs the lock's Redis
        lock = "zl-climate-lock"

        def log() -> str:
            return "\n".join((tmp_path / "operator.log").read_text().splitlines()[-30:])

        before: dict[tuple[str, str], dict[str, Any]] = {}
        for obj in resources:
            kind, name = obj["kind"], obj["metadata"]["name"]
            try:
                before[(kind, name)] = wait_for(
                    f"{kind}/{name}", lambda k=kind, n=name: _settled(k, n)
                )
            except AssertionError as e:
                raise AssertionError(f"{e}\noperator log:\n{log()}") from None
        before[("Repository", "climate")] = wait_for(
            "the lock service up",
            lambda: (
                (r := _settled("Repository", "climate"))
                and _condition(r, "LockServiceReady").get("status") == "True"
                and r
            ),
        )
        # The Mirror waits for its replicator, which no kubelet runs here: reported, not Ready.
        before[("Mirror", "climate-west")] = wait_for(
            "the Mirror waiting for its replicator",
            lambda: (
                (m := _settled("Mirror", "climate-west"))
                and _condition(m, "Ready").get("reason") == "WaitingForReplicator"
                and m
            ),
        )
        for kind in ("Repository", "Branch", "Tag", "RetentionPolicy"):
            (name,) = [n for k, n in before if k == kind]
            assert _condition(before[(kind, name)], "Ready")["status"] == "True", kind
        deployment = wait_for("the lock Deployment", lambda: kube.get("Deployment", NS, lock))
        assert "podAntiAffinity" in deployment["spec"]["template"]["spec"]["affinity"]
        # The previous schema has no serve (and 0.1.0's no lockService.affinity): the API
        # server prunes what it does not know.
        schema = previous_crds(release)["repositories.zarrlake.io"]["spec"]["versions"][0]
        spec_fields = schema["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        knows_affinity = "affinity" in spec_fields["lockService"]["properties"]
        patch: dict[str, Any] = {"serve": {"enabled": True}}
        if not knows_affinity:
            patch["lockService"] = {"affinity": {"x": 1}}
        kube.merge_patch("Repository", NS, "climate", {"spec": patch})
        pruned = kube.get("Repository", NS, "climate") or {}
        if not knows_affinity:
            assert "affinity" not in pruned["spec"]["lockService"], pruned["spec"]
        assert "serve" not in pruned["spec"], pruned["spec"]

        # helm upgrade: the chart's rendered CRDs over the live ones (Helm's three-way merge
        # leaves what only the live object has, e.g. its status, and replaces the rest).
        for name, crd in current_crds().items():
            kube._call("PATCH", f"{CRDS}/{name}", body=crd, content_type=MERGE)

        for name, crd in current_crds().items():
            live = kube._call("GET", f"{CRDS}/{name}")
            assert live["spec"]["versions"] == crd["spec"]["versions"], name
            assert live["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
            assert live["status"]["storedVersions"] == ["v1alpha1"]
        for (kind, name), old in before.items():
            now = kube.get(kind, NS, name)
            assert now is not None, f"{kind}/{name} is gone"
            for key in ("uid", "creationTimestamp", "generation"):
                assert now["metadata"][key] == old["metadata"][key], (kind, name, key)
            assert now["spec"] == old["spec"], (kind, name)
            assert _condition(now, "Ready")["status"] == _condition(old, "Ready")["status"]

        # A version that objects are stored in cannot be dropped by a later upgrade.
        dropped = copy.deepcopy(current_crds()["tags.zarrlake.io"])
        dropped["spec"]["versions"][0]["name"] = "v1beta1"
        with pytest.raises(kube.KubeError) as refused:
            kube._call("PATCH", f"{CRDS}/tags.zarrlake.io", body=dropped, content_type=MERGE)
        assert refused.value.status == 422 and "storedVersions" in str(refused.value)

        # The operator goes on: the new field is kept now, and reaches the Redis Deployment.
        spread = [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "lock-service"}},
            }
        ]
        kube.merge_patch(
            "Repository",
            NS,
            "climate",
            {"spec": {"lockService": {"affinity": {}, "topologySpreadConstraints": spread}}},
        )
        repo = wait_for("Repository reconciled", lambda: _settled("Repository", "climate"))
        assert repo["spec"]["lockService"]["topologySpreadConstraints"] == spread
        assert (
            repo["metadata"]["generation"]
            > before[("Repository", "climate")]["metadata"]["generation"]
        )

        def rescheduled() -> dict[str, Any] | None:
            pod = (kube.get("Deployment", NS, lock) or {})["spec"]["template"]["spec"]
            return pod if pod.get("topologySpreadConstraints") == spread else None

        pod = wait_for("the lock Deployment rescheduled", rescheduled)
        assert not pod.get("affinity"), pod.get("affinity")
        # A field added since (spec.serve, optional): kept now, and acted on.
        kube.merge_patch("Repository", NS, "climate", {"spec": {"serve": {"enabled": True}}})
        served = wait_for(
            "the Repository served",
            lambda: (
                (r := _settled("Repository", "climate"))
                and _condition(r, "ServeReady").get("status") == "True"
                and r
            ),
        )
        assert served["spec"]["serve"]["replicas"] == 1  # the new schema's default
        assert kube.get("Deployment", NS, "zl-climate-serve") is not None
        kube.create(
            {
                "apiVersion": "zarrlake.io/v1alpha1",
                "kind": "Branch",
                "metadata": {"name": "after-upgrade", "namespace": NS},
                "spec": {"repository": "climate", "from": "v1"},
            }
        )
        branch = wait_for("a new Branch", lambda: _settled("Branch", "after-upgrade"))
        assert _condition(branch, "Ready")["status"] == "True", branch["status"]
    finally:
        if local is not None:
            local.stop()
        stop(operator)
