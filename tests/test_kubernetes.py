"""deploy/kubernetes (docs/deployment.md "Kubernetes"): the manifests validate against the
Kubernetes API's own schema (`kubernetes-validate`, strict: an unknown field fails), and
what they tell the daemon is what the daemon takes — its command line parses, its config
and profiles load, the paths the engine resolves are the node's, and the stop fits in
the grace period."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from substrate.cli.main import build_parser
from substrate.config import PROJECT_ROOT, load_config
from substrate.sandbox.profiles import load_profile_set

KUBE = PROJECT_ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes the manifests are checked against (sidecar-free, stable APIs).
KUBERNETES_VERSION = "1.29.0"
#: How long the daemon's own stop may take (docs/deployment.md, the systemd unit's
#: TimeoutStopSec): cut off commands, conclude layers, remove sandboxes.
DAEMON_STOP_S = 120


def manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    (doc,) = [
        d
        for _, d in manifests()
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    return doc


def api_objects() -> list[tuple[str, dict[str, Any]]]:
    """Every manifest but those of other tools' APIs (kustomize, the Prometheus Operator)."""
    return [
        (name, d)
        for name, d in manifests()
        if d["apiVersion"].split("/")[0] not in ("kustomize.config.k8s.io", "monitoring.coreos.com")
    ]


@pytest.mark.parametrize(
    "name,doc", api_objects(), ids=[f"{n}:{d['kind']}" for n, d in api_objects()]
)
def test_each_manifest_validates_against_the_kubernetes_schema(
    name: str, doc: dict[str, Any]
) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_invalid_manifest_is_refused_by_the_validator() -> None:
    # The check above is a real one: a field the API does not have fails it.
    ds = one("DaemonSet")
    broken = {**ds, "spec": {**ds["spec"], "replicas": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_api_manifest() -> None:
    kustomization = one("Kustomization")
    listed = set(kustomization["resources"])
    assert listed == {name for name, _ in api_objects()}
    assert all((KUBE / name).is_file() for name in listed)


def test_service_monitor_selects_the_service_and_its_metrics_port() -> None:
    monitor, service = one("ServiceMonitor"), one("Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    container = daemon_container()
    assert ports["metrics"]["targetPort"] in {p["name"] for p in container["ports"]}


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = one("DaemonSet")["spec"]["template"]["spec"]
    return spec


def daemon_container() -> dict[str, Any]:
    (container,) = pod_spec()["containers"]
    return container  # type: ignore[no-any-return]


def every_command() -> list[list[str]]:
    spec = pod_spec()
    c = daemon_container()
    commands = [c["command"] + c["args"]]
    commands += [init["command"] for init in spec["initContainers"]]
    commands.append(c["readinessProbe"]["exec"]["command"])
    commands.append(c["livenessProbe"]["exec"]["command"])
    commands.append(c["lifecycle"]["preStop"]["exec"]["command"])
    return commands


@pytest.mark.parametrize("argv", every_command(), ids=lambda a: " ".join(a[1:4]))
def test_every_command_in_the_pod_parses_with_the_cli(argv: list[str]) -> None:
    assert argv[0] == "substrate"
    build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown flag


def test_the_image_is_the_package_version() -> None:
    version = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["version"]
    spec = pod_spec()
    images = {c["image"] for c in spec["containers"] + spec["initContainers"]}
    assert images == {f"substrate:{version}"}


def test_the_configmap_is_current() -> None:
    done = subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "scripts" / "kubernetes-configmap"), "--check"],
        capture_output=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()


def test_config_and_profiles_in_the_configmaps_load(tmp_path: Path) -> None:
    mounts = {m["name"]: m["mountPath"] for m in daemon_container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    assert volumes["config"]["configMap"]["name"] == "substrate-config"
    assert volumes["profiles"]["configMap"]["name"] == "substrate-profiles"
    config_text = one("ConfigMap", "substrate-config")["data"]["substrate.toml"]
    (tmp_path / "substrate.toml").write_text(config_text)
    config = load_config(tmp_path / "substrate.toml", {})
    assert config.profiles_dir == mounts["profiles"]
    profiles = one("ConfigMap", "substrate-profiles")["data"]
    # The shipped profiles, unedited: a change to profiles/ must reach the ConfigMap too.
    shipped = {p.name: p.read_text() for p in (PROJECT_ROOT / "profiles").glob("*.toml")}
    assert profiles == shipped
    placed = tmp_path / "profiles"
    placed.mkdir()
    for name, text in profiles.items():
        (placed / name).write_text(text)
    loaded = load_profile_set(placed, PROJECT_ROOT / "seccomp")
    assert {Path(n).stem for n in shipped} == set(loaded.profiles)


def test_host_paths_are_the_same_on_both_sides_and_layers_propagate() -> None:
    spec = pod_spec()
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in daemon_container()["volumeMounts"]}
    config = tomllib.loads(one("ConfigMap", "substrate-config")["data"]["substrate.toml"])
    # The engine resolves bind sources on the node: the checkouts and the state dir (where
    # the working layers are mounted) must have the node's paths inside the pod too.
    for name in ("state", "checkouts", "engine-socket", "cgroup"):
        assert mounts[name]["mountPath"] == volumes[name]["hostPath"]["path"], name
    assert mounts["state"]["mountPropagation"] == "Bidirectional"
    assert daemon_container()["securityContext"]["privileged"] is True  # Bidirectional needs it
    assert spec["hostPID"] is True
    args = daemon_container()["args"]
    assert args[args.index("--state-dir") + 1] == mounts["state"]["mountPath"]
    for root in config["adopt_roots"]:
        assert Path(root).is_relative_to(mounts["checkouts"]["mountPath"])


def test_the_drain_and_the_daemons_stop_fit_in_the_grace_period() -> None:
    stop = daemon_container()["lifecycle"]["preStop"]["exec"]["command"]
    drain_s = float(stop[stop.index("--timeout") + 1])
    assert drain_s + DAEMON_STOP_S < pod_spec()["terminationGracePeriodSeconds"]
    readiness = daemon_container()["readinessProbe"]["exec"]["command"]
    assert readiness[-2:] == ["status", "--ready"]


def test_secrets_are_loaded_from_the_secret_never_from_argv_or_env() -> None:
    spec = pod_spec()
    (loader,) = [c for c in spec["initContainers"] if c["name"] == "secrets"]
    (mount,) = [m for m in loader["volumeMounts"] if m["name"] == "secrets"]
    assert loader["command"][-3:] == ["secret", "load", mount["mountPath"]]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "secrets"]
    assert volume["secret"]["secretName"] == one("Secret")["metadata"]["name"]
    for container in spec["containers"] + spec["initContainers"]:
        assert "env" not in container and "envFrom" not in container
