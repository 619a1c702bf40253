"""deploy/: the Kubernetes manifests validate against Kubernetes' own schemas
(`kubernetes-validate`, strict: no unknown fields) and say what the server does (probe
paths it serves, a grace period longer than its drain, the deploy overlay it parses);
KEDA's ScaledObject (a custom resource the validator has no schema for) and the
Grafana dashboard query series the server exports; the Dockerfiles copy what exists and
start the server's own CLI. (No cluster or Docker daemon runs here: nothing is
applied or built.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.31"


def _docs() -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                doc["__file"] = path.name
                out.append(doc)
    return out


def _by_kind(kind: str, name: str | None = None) -> dict:
    return next(d for d in _docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def test_every_builtin_resource_validates_against_the_kubernetes_schema():
    import kubernetes_validate

    builtin = [d for d in _docs() if not d["apiVersion"].startswith(("keda.sh/", "kustomize.config.k8s.io/"))]
    assert {d["kind"] for d in builtin} >= {"Deployment", "Service", "PodDisruptionBudget", "Secret"}
    for doc in builtin:
        body = {k: v for k, v in doc.items() if k != "__file"}
        kubernetes_validate.validate(body, K8S_VERSION, strict=True)  # raises ValidationError naming the field


def test_a_bad_manifest_is_caught():
    """The validator is not a rubber stamp: a misspelt probe field fails it."""
    import kubernetes_validate

    dep = {k: v for k, v in _by_kind("Deployment", "omni-rt").items() if k != "__file"}
    dep = json.loads(json.dumps(dep))
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {"path": "/livez"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_the_deployment_matches_what_the_server_does():
    from omni_rt.specs import parse_overlay

    dep = _by_kind("Deployment", "omni-rt")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez" and c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["startupProbe"]["httpGet"]["path"] == "/livez"
    assert "omni-rt drain" in " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    # the deploy overlay in the Secret is one the server accepts, and the grace period outlasts its drain
    secret = _by_kind("Secret", "omni-rt")
    overlay = parse_overlay(yaml.safe_load(secret["stringData"]["deploy.yaml"]), "deploy/kubernetes/secret.yaml")
    assert overlay.sessions.store == "redis" and overlay.server.host == "0.0.0.0"
    assert pod["terminationGracePeriodSeconds"] > overlay.server.drain_timeout_s + 30
    redis_svc = _by_kind("Service", "omni-rt-redis")
    assert f"//{redis_svc['metadata']['name']}:{redis_svc['spec']['ports'][0]['port']}/" in overlay.sessions.redis_url
    assert _by_kind("Service", "omni-rt")["spec"]["sessionAffinity"] == "ClientIP"
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _series(expr: str) -> set[str]:
    return {m[: -len(suffix)] if (suffix := next((s for s in ("_bucket",) if m.endswith(s)), "")) else m
            for m in re.findall(r"\b(omni_rt_[a-z_]+)", expr)}


def _exported() -> set[str]:
    from prometheus_client import REGISTRY

    import omni_rt.metrics  # noqa: F401 - registers the series

    names = set()
    for fam in REGISTRY.collect():
        names.add(fam.name)
        names.add(fam.name + "_total")
    return names


def test_keda_and_grafana_read_series_the_server_exports():
    exported = _exported()
    keda = _by_kind("ScaledObject")
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["spec"]["scaleTargetRef"]["name"] == "omni-rt"
    assert keda["spec"]["minReplicaCount"] >= 2
    for trig in keda["spec"]["triggers"]:
        assert trig["type"] == "prometheus" and float(trig["metadata"]["threshold"]) > 0
        used = _series(trig["metadata"]["query"])
        assert used and used <= exported, used - exported
    dash = json.loads((REPO / "deploy" / "grafana" / "omni-rt.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set().union(*(_series(e) for e in exprs))
    assert {"omni_rt_requests_running", "omni_rt_requests_waiting", "omni_rt_admission_headroom_sessions", "omni_rt_sessions_active"} <= used
    assert used <= exported, used - exported


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_the_dockerfiles_copy_what_exists_and_run_the_servers_cli(name):
    text = (REPO / "deploy" / name).read_text()
    for src in re.findall(r"^COPY (\S+)", text, re.M):
        assert (REPO / src).exists(), src
    assert 'ENTRYPOINT ["omni-rt", "serve", "--host", "0.0.0.0"' in text
    assert "pipecat-ai" in text and "onnxruntime" in text  # semantic_vad's end-of-turn model (server.turn_model default)
