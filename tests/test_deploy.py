"""docs/deploy.md's recipes are checked, not pasted: the Kubernetes manifests parse and hold
together (kinds, replicas, probes on the metrics port, the password from the Secret, scraping),
the ingester accepts their arguments, and the systemd unit names what the ingester reads."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from kvredis.cli.ingest import ingest

DEPLOY = Path(__file__).resolve().parent.parent / "docs" / "deploy.md"
TEXT = DEPLOY.read_text(encoding="utf-8")


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", TEXT, re.MULTILINE | re.DOTALL)


def _manifests() -> dict[str, dict[str, Any]]:
    (block,) = _blocks("yaml")
    docs = [d for d in yaml.safe_load_all(block) if d]
    return {d["kind"]: d for d in docs}


MANIFESTS = _manifests()


def _container() -> dict[str, Any]:
    (container,) = MANIFESTS["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def _ingest_args(args: list[str]) -> dict[str, Any]:
    """Parse the arguments with the real ``kvredis ingest`` command (nothing runs)."""
    ctx = ingest.make_context("ingest", list(args), resilient_parsing=False)
    return dict(ctx.params)


def test_the_manifests_have_every_kind_a_deployment_needs() -> None:
    assert set(MANIFESTS) == {"Secret", "Deployment", "Service", "ServiceMonitor"}
    for doc in MANIFESTS.values():
        assert doc["apiVersion"] and doc["metadata"]["name"]
    namespaces = {doc["metadata"]["namespace"] for doc in MANIFESTS.values()}
    assert len(namespaces) == 1


def test_the_ingester_runs_as_two_replicas_that_the_selector_matches() -> None:
    spec = MANIFESTS["Deployment"]["spec"]
    assert spec["replicas"] == 2
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()


def test_probes_and_scraping_point_at_the_metrics_port_the_ingester_serves() -> None:
    container = _container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    params = _ingest_args(container["args"][1:])
    assert container["args"][0] == "ingest"
    assert params["metrics_port"] == ports["metrics"]
    assert params["metrics_address"] == "0.0.0.0"  # probes come from the kubelet, not loopback
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = MANIFESTS["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]
    service = MANIFESTS["Service"]["spec"]
    assert service["selector"].items() <= (
        MANIFESTS["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    )
    (service_port,) = service["ports"]
    assert service_port["targetPort"] == "metrics"
    monitor = MANIFESTS["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= MANIFESTS["Service"]["metadata"][
        "labels"
    ].items()
    assert monitor["endpoints"][0]["port"] == service_port["name"]


def test_the_password_comes_from_the_secret_and_never_from_the_arguments() -> None:
    container = _container()
    env = {e["name"]: e for e in container["env"]}
    ref = env["KVREDIS_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    secret = MANIFESTS["Secret"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert env["KVREDIS_REDIS_URL"]["value"].startswith("redis://")
    assert "@" not in env["KVREDIS_REDIS_URL"]["value"]
    assert not any("password" in a.lower() for a in container["args"])


def test_every_engine_group_names_its_pod_and_model() -> None:
    args = _container()["args"][1:]
    params = _ingest_args(args)
    assert params  # the command accepted them
    groups = " ".join(args).split("--endpoint=")[1:]
    assert len(groups) == 2
    for group in groups:
        assert "--pod=" in group and "--model=" in group and "--replay=" in group


def test_the_systemd_unit_runs_the_ingester_with_the_documented_settings() -> None:
    (unit_text,) = _blocks("ini")
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    # systemd repeats Environment=: keep every line
    environment = re.findall(r"^Environment=(\w+)=(.*)$", unit_text, re.MULTILINE)
    unit.read_string(re.sub(r"^Environment=.*\n", "", unit_text, flags=re.MULTILINE))
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    command = shlex.split(service["ExecStart"])
    assert command[0].endswith("/kvredis") and command[1] == "ingest"
    params = _ingest_args(command[2:])
    assert params["metrics_port"] == 9464
    names = dict(environment)
    assert {"KVREDIS_REDIS_URL", "KVREDIS_REDIS_PASSWORD_FILE"} <= set(names)
    assert service["Restart"] == "on-failure"
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.parametrize(
    "name", ["KVREDIS_REDIS_URL", "KVREDIS_NAMESPACE", "KVREDIS_REDIS_PASSWORD_FILE"]
)
def test_the_variables_the_recipes_set_are_the_ones_the_ingester_reads(name: str) -> None:
    envvars = {
        p.envvar for p in ingest.params if isinstance(p, click.Option) and p.envvar
    }
    assert name in envvars


def _systemd_setup() -> str:
    (block,) = [b for b in _blocks("sh") if "systemctl" in b]
    return block


def test_the_systemd_recipe_creates_the_user_it_runs_as() -> None:
    (unit_text,) = _blocks("ini")
    user = re.search(r"^User=(\S+)$", unit_text, re.MULTILINE)
    assert user is not None
    lines = _systemd_setup().splitlines()
    created = [
        n
        for n, line in enumerate(lines)
        if re.match(r"(useradd|adduser)\b", line) and line.split()[-1] == user.group(1)
    ]
    assert created, f"the recipe never creates the user {user.group(1)!r}"
    used = [n for n, line in enumerate(lines) if re.search(rf"-[og] {user.group(1)}\b", line)]
    assert used and created[0] < min(used)  # created before the files it owns
    assert "--system" in lines[created[0]] and "nologin" in lines[created[0]]


def test_the_recipes_install_the_built_wheel_not_a_package_index_name() -> None:
    (dockerfile,) = _blocks("dockerfile")
    assert re.search(r"^COPY dist/kvredis-\*\.whl ", dockerfile, re.MULTILINE)
    assert re.search(r"^RUN pip install .*/kvredis-\*\.whl", dockerfile, re.MULTILINE)
    container = _container()
    assert "command" not in container  # the image's entry point is kvredis
    assert not container["image"].startswith("python:")
    assert "kvredis-*.whl" in _systemd_setup()
