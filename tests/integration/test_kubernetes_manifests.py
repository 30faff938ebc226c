"""The Kubernetes manifests as an operator applies them: each overlay rendered by
`kubectl kustomize` (with certificates made by `gearshift certs init`, as the README says; agents enrol
by bootstrap token),
valid against the two newest Kubernetes minor versions kubernetes-validate knows
(strict: unknown fields are errors), and holding what the deployment relies on."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.agents.config import load_agent_config
from gearshift.controller.enrolment.certificate_authority import init_certs

kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate.utils import all_versions  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = ("single", "ha")
NODE = "gpu-node-1"
DB_URL = "postgresql+psycopg://gearshift:secret@db.example:5432/gearshift"


def _newest_minors(n: int = 2) -> list[str]:
    by_minor: dict[str, str] = {}
    for v in all_versions():
        major, minor = v.split(".")[:2]
        by_minor[f"{major}.{minor}"] = v  # sorted: the last patch of each minor wins
    return [by_minor[m] for m in sorted(by_minor, key=lambda m: tuple(map(int, m.split("."))))[-n:]]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (it renders the Kustomize overlays)")
    tree = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(KUBE, tree, ignore=shutil.ignore_patterns("secrets"))
    init_certs(tree / "base" / "secrets",
               sans=["gearshift-controller", "*.gearshift-controller-headless.gearshift.svc"],
               days=1)
    (tree / "overlays" / "ha" / "secrets").mkdir()
    (tree / "overlays" / "ha" / "secrets" / "db-url").write_text(DB_URL)
    out = {}
    for overlay in OVERLAYS:
        proc = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[overlay] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def _pod(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_for_the_newest_kubernetes(rendered: dict[str, list[dict[str, Any]]],
                                                    overlay: str) -> None:
    versions = _newest_minors()
    assert len(versions) == 2
    for version in versions:
        for doc in rendered[overlay]:
            kubernetes_validate.validate(doc, version, strict=True)  # raises on an error


def test_validation_is_strict() -> None:
    """The check above can fail: an unknown field is refused."""
    bad = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "x"},
           "automountServiceAcountToken": False}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, _newest_minors()[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_hardened_and_probed(rendered: dict[str, list[dict[str, Any]]],
                                          overlay: str) -> None:
    docs = rendered[overlay]
    assert all(d["metadata"].get("namespace") == "gearshift" for d in docs
               if d["kind"] != "Namespace")
    ns = _one(docs, "Namespace", "gearshift")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")]
    assert {d["metadata"]["name"] for d in workloads} == {
        "gearshift-controller", "gearshift-gateway", "gearshift-agent", "gearshift-policy-apply"}
    for w in workloads:
        pod = _pod(w)
        name = w["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["serviceAccountName"] == name, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert "memory" in c["resources"]["requests"], (name, c["name"])
        if w["kind"] == "Job":
            continue
        (main,) = pod["containers"]
        assert main["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert main["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        probe_port = main["readinessProbe"]["httpGet"]["port"]
        metrics = next(p for p in main["ports"] if p["name"] == probe_port)
        assert f"--metrics-listen=0.0.0.0:{metrics['containerPort']}" in main["args"], name
    for name in ("gearshift-controller", "gearshift-gateway"):
        assert _one(docs, "PodDisruptionBudget", name)
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["gearshift-default-deny-ingress"]["spec"]["podSelector"] == {}
    assert len(policies) == 4


def _mounted_secrets(workload: dict[str, Any]) -> set[str]:
    pod = _pod(workload)
    names = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    for v in pod["volumes"]:
        names |= {s["secret"]["name"] for s in v.get("projected", {}).get("sources", [])
                  if "secret" in s}
    for c in pod.get("initContainers", []) + pod["containers"]:
        names |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}
        names |= {f["secretRef"]["name"] for f in c.get("envFrom", []) if "secretRef" in f}
    return names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_role_gets_only_its_secrets(rendered: dict[str, list[dict[str, Any]]],
                                         overlay: str) -> None:
    docs = rendered[overlay]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    gateway_secret = _one(docs, "Secret", "gearshift-gateway")
    assert sorted(gateway_secret["data"]) == ["ca.pem", "gateway-key.pem", "gateway.pem",
                                              "read.token"]
    gateway = _one(docs, "Deployment", "gearshift-gateway")
    assert _mounted_secrets(gateway) == {gateway_secret["metadata"]["name"]}  # hashed name
    controller_tokens = _one(docs, "Secret", "gearshift-controller-tokens")
    assert sorted(controller_tokens["data"]) == ["tokens.yaml"]
    assert "admin.token" in _one(docs, "Secret", "gearshift-admin")["data"]
    # The CA key (it signs enrolled agents) is the controller's alone.
    controller_tls = _one(docs, "Secret", "gearshift-controller-tls")
    assert "ca-key.pem" in controller_tls["data"]
    assert [n for n, d in secrets.items() if "ca-key.pem" in d.get("data", {})] == [
        controller_tls["metadata"]["name"]]
    workloads = {d["metadata"]["name"]: d for d in docs
                 if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job")}
    assert [n for n, w in workloads.items()
            if controller_tls["metadata"]["name"] in _mounted_secrets(w)] == [
        "gearshift-controller"]
    # Agents join by bootstrap token: they mount one Secret, made by kubectl (README), with
    # the CA and the token, and no other workload mounts it. No rendered Secret holds an
    # agent's certificate or the token; no Secret the agents mount holds a private key.
    agent = workloads["gearshift-agent"]
    assert _mounted_secrets(agent) == {"gearshift-agent-bootstrap"}
    assert "gearshift-agent-bootstrap" not in secrets
    assert [n for n, w in workloads.items()
            if "gearshift-agent-bootstrap" in _mounted_secrets(w)] == ["gearshift-agent"]
    for name, secret in secrets.items():
        assert not any(k.startswith("agent") or "bootstrap" in k for k in secret["data"]), name
    for name in _mounted_secrets(agent) & set(secrets):
        assert not any("PRIVATE KEY" in base64.b64decode(v).decode()
                       for v in secrets[name]["data"].values()), name
    assert "initContainers" not in _pod(agent)
    # No certificate or key in any ConfigMap.
    for cm in (d for d in docs if d["kind"] == "ConfigMap"):
        assert not any("PRIVATE KEY" in v for v in cm["data"].values()), cm["metadata"]["name"]


def test_single_runs_one_controller_on_its_own_volume(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    sts = _one(rendered["single"], "StatefulSet", "gearshift-controller")
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    (c,) = _pod(sts)["containers"]
    assert not any(e["name"] == "GEARSHIFT_DB" for e in c["env"])  # SQLite under the data dir
    assert {"name": "data", "mountPath": "/var/lib/gearshift/data"} in c["volumeMounts"]


def test_ha_controllers_share_postgresql_and_advertise_pod_dns(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["ha"]
    sts = _one(docs, "StatefulSet", "gearshift-controller")
    assert sts["spec"]["replicas"] == 3 and "volumeClaimTemplates" not in sts["spec"]
    (c,) = _pod(sts)["containers"]
    db = next(e for e in c["env"] if e["name"] == "GEARSHIFT_DB")
    db_secret = _one(docs, "Secret", "gearshift-db")
    assert db["valueFrom"]["secretKeyRef"] == {"name": db_secret["metadata"]["name"], "key": "url"}
    headless = _one(docs, "Service", "gearshift-controller-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    assert ("--advertise=$(POD_NAME).gearshift-controller-headless.$(POD_NAMESPACE).svc:50051"
            in c["args"])
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} \
        in c["env"]


@pytest.mark.parametrize(("overlay", "gpus"), [("single", 1), ("ha", 8)])
def test_agent_daemonset_per_node(rendered: dict[str, list[dict[str, Any]]], overlay: str,
                                  gpus: int) -> None:
    ds = _one(rendered[overlay], "DaemonSet", "gearshift-agent")
    pod = _pod(ds)
    assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    if gpus > 1:
        assert pod["nodeSelector"]["nvidia.com/gpu.count"] == str(gpus)
    (agent,) = pod["containers"]
    assert agent["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert "--host-id=$(NODE_NAME)" in agent["args"]
    env = {e["name"]: e for e in agent["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["GEARSHIFT_BIND_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert mounts["/var/cache/gearshift"] == "model-cache"
    # Enrolment: the CA and the bootstrap token from the Secret, no certificate; the key
    # and certificate it gets live in its work dir, on a volume of the pod.
    bootstrap = volumes[mounts["/etc/gearshift/bootstrap"]]["secret"]["secretName"]
    assert bootstrap == "gearshift-agent-bootstrap"
    assert env["GEARSHIFT_TLS_CA"]["value"] == "/etc/gearshift/bootstrap/ca.pem"
    assert env["GEARSHIFT_BOOTSTRAP_TOKEN_FILE"]["value"] == \
        "/etc/gearshift/bootstrap/bootstrap.token"
    assert not {"GEARSHIFT_TLS_CERT", "GEARSHIFT_TLS_KEY", "GEARSHIFT_BOOTSTRAP_TOKEN"} & set(env)
    config = _one(rendered[overlay], "ConfigMap", "gearshift-agent")
    parsed = load_agent_config(None, {**yaml.safe_load(config["data"]["agent.yaml"]),
                                      "host_id": NODE, "bind_host": "10.0.0.7"},
                               defaults={"tls": {"ca": "/etc/gearshift/bootstrap/ca.pem"}})
    assert parsed.controller == "gearshift-controller:50051" and parsed.enrols
    assert "emptyDir" in volumes[mounts[str(parsed.workdir.parent)]]
    # The enrolment listener it dials: the controller's, through its Service, let in by the
    # controller's NetworkPolicy for agents.
    enrol_host, _, enrol_port = parsed.enrol_controller.partition(":")
    sts = _one(rendered[overlay], "StatefulSet", "gearshift-controller")
    (controller,) = _pod(sts)["containers"]
    assert f"--enrol-listen=0.0.0.0:{enrol_port}" in controller["args"]
    assert "--ca-key=/etc/gearshift/tls/ca-key.pem" in controller["args"]
    assert {"name": "enrol", "containerPort": int(enrol_port)} in controller["ports"]
    (service,) = [d for d in rendered[overlay]
                  if d["kind"] == "Service" and d["metadata"]["name"] == enrol_host]
    assert {"name": "enrol", "port": int(enrol_port), "targetPort": "enrol"} in \
        service["spec"]["ports"]
    policy = _one(rendered[overlay], "NetworkPolicy", "gearshift-controller")
    assert [r["from"] for r in policy["spec"]["ingress"]
            if {"protocol": "TCP", "port": int(enrol_port)} in r.get("ports", [])] == [
        [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gearshift-agent"}}}]]


def _relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus's relabelling (keep, drop, replace; regexes anchored) of one target's
    labels; None when dropped."""
    labels = dict(labels)
    for rc in configs:
        value = rc.get("separator", ";").join(labels.get(n, "")
                                              for n in rc.get("source_labels", []))
        found = re.fullmatch(rc.get("regex", "(.*)"), value)
        action = rc.get("action", "replace")
        if (action == "keep" and found is None) or (action == "drop" and found is not None):
            return None
        if action == "replace" and found is not None:
            labels[rc["target_label"]] = found.expand(
                re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rc.get("replacement", "$1")))
        elif action not in ("keep", "drop", "replace"):
            raise AssertionError(f"relabel action {action!r} is not simulated here")
    return labels


def _discovered_targets(docs: list[dict[str, Any]]) -> list[tuple[str, int, dict[str, str]]]:
    """What Prometheus's pod discovery gives for the rendered workloads: one target per
    declared container port of a running pod, (workload, port, meta labels)."""
    out = []
    for w in docs:
        if w["kind"] not in ("StatefulSet", "Deployment", "DaemonSet", "Job"):
            continue
        template = w["spec"]["template"]
        meta = {"__meta_kubernetes_namespace": w["metadata"]["namespace"],
                "__meta_kubernetes_pod_name": f"{w['metadata']['name']}-0",
                "__meta_kubernetes_pod_node_name": NODE,
                "__meta_kubernetes_pod_phase": "Running"}
        for key, value in template["metadata"].get("labels", {}).items():
            meta["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
        for c in template["spec"]["containers"]:
            for port in c.get("ports", []):
                out.append((w["metadata"]["name"], port["containerPort"], {
                    **meta, "__address__": f"10.0.0.7:{port['containerPort']}",
                    "__meta_kubernetes_pod_container_name": c["name"],
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])}))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_each_roles_ops_port_under_the_alerts_job_names(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """deploy/prometheus/kubernetes.yml, applied to the rendered pods as its pod discovery
    would see them: each job the alerts name selects exactly its role's pods, on the
    port of their --metrics-listen, and names the pod as `instance`."""
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "kubernetes.yml").read_text())
    rules = (REPO / "deploy" / "prometheus" / "rules.yaml").read_text()
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    # The job names of prometheus.yml, which the alerts (and runbooks) use.
    assert set(jobs) == {"gearshift-controller", "gearshift-gateway", "gearshift-agent"}
    assert set(re.findall(r'job="([a-z-]+)"', rules)) <= set(jobs)
    docs = rendered[overlay]
    targets = _discovered_targets(docs)
    for job_name, job in jobs.items():
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod"
        kept = [(workload, port, labels) for workload, port, meta in targets
                if meta["__meta_kubernetes_namespace"] in sd["namespaces"]["names"]
                and (labels := _relabel(meta, job["relabel_configs"])) is not None]
        workload = next(d for d in docs if d["metadata"]["name"] == job_name
                        and d["kind"] in ("StatefulSet", "Deployment", "DaemonSet"))
        (main,) = _pod(workload)["containers"]
        (listen,) = [a for a in main["args"] if a.startswith("--metrics-listen=")]
        ops_port = int(listen.rpartition(":")[2])
        assert [(w, p) for w, p, _ in kept] == [(job_name, ops_port)], (job_name, kept)
        assert kept[0][2]["instance"] == f"{job_name}-0"
        assert kept[0][2]["node"] == NODE
    # The filter can drop: a pod that is not running is not a target.
    _, _, meta = targets[0]
    assert _relabel({**meta, "__meta_kubernetes_pod_phase": "Succeeded"},
                    jobs["gearshift-controller"]["relabel_configs"]) is None
