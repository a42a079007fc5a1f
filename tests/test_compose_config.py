"""docker-compose.yml as Compose itself resolves it, without a Docker engine.

deploy/local/composecheck is a small Go program around the Compose specification's own
loader (compose-go, what `docker compose config` runs): the `.env` next to the compose
file, ${...} interpolation, schema validation and consistency checks, paths resolved. It
prints the resolved project as JSON; these tests assert on that, so a YAML slip, a
missing required variable or a port opened on every interface fails here, the way
`docker compose up` would refuse it or, worse, would accept it.

The binary is built once with Go by `deploy/local/stack.sh build composecheck` (into the
stack's cache, keyed by its pins) and reused while those stay the same. Without Go the
tests are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from deploy_files import ROOT, versions
COMPOSE = ROOT / "docker-compose.yml"
MODULE = ROOT / "deploy" / "local" / "composecheck"
PASSWORD_VAR = "GF_SECURITY_ADMIN_PASSWORD"

# service -> the image it must run, from the versions.env variable and the tag's prefix
IMAGES = {
    "otel-collector": ("otel/opentelemetry-collector-contrib:{}", "OTELCOL_VERSION"),
    "jaeger": ("jaegertracing/jaeger:{}", "JAEGER_VERSION"),
    "prometheus": ("prom/prometheus:v{}", "PROMETHEUS_VERSION"),
    "grafana": ("grafana/grafana:{}", "GRAFANA_VERSION"),
}
# service -> the ports a user connects to (on the host, the same number as in the container)
USER_PORTS = {
    "otel-collector": (4317, 4318),  # OTLP gRPC, OTLP HTTP
    "jaeger": (16686,),  # UI and query API
    "prometheus": (9090,),
    "grafana": (3000,),
}
# dependencies that must be healthy, not merely started, before their dependents start
HEALTHY_DEPENDENCIES = ("jaeger", "prometheus")


# the loader is built with Go: CI runs these in its stack step (pytest -m stack), never the test command
pytestmark = pytest.mark.stack

# -- the loader binary ------------------------------------------------------------------


@pytest.fixture(scope="session")
def composecheck() -> Path:
    if shutil.which("go") is None and not os.environ.get("HICACHE_COMPOSECHECK_BIN"):
        reason = "the compose loader (deploy/local/composecheck, compose-go) needs Go to build: go is not on PATH"
        if os.environ.get("CI", "").lower() == "true":  # CI's machines have Go: a skip there would hide it
            pytest.fail(reason)
        pytest.skip(reason)
    built = subprocess.run(["bash", str(ROOT / "deploy/local/stack.sh"), "build", "composecheck"],
                           capture_output=True, text=True, timeout=1800)
    if built.returncode != 0:
        pytest.fail(f"building deploy/local/composecheck failed:\n{built.stderr[-3000:]}")
    return Path(built.stdout.strip().splitlines()[-1])


def load(binary: Path, *env: str) -> subprocess.CompletedProcess[str]:
    """Run the loader on docker-compose.yml from the repository root, the way `docker compose
    config` would there, with only the repository's .env and the given --env KEY=VALUE.
    The shell's values of the versions.env variables, of the Grafana password and of COMPOSE_*
    are left out so the result is the repository's, not this machine's."""
    removed = set(versions()) | {PASSWORD_VAR}
    clean = {k: v for k, v in os.environ.items() if k not in removed and not k.startswith("COMPOSE_")}
    args = [str(binary), "-f", str(COMPOSE)]
    for item in env:
        args += ["--env", item]
    return subprocess.run(args, cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def project(composecheck: Path) -> dict[str, Any]:
    result = load(composecheck, f"{PASSWORD_VAR}=only-for-this-test")
    if result.returncode != 0:
        pytest.fail(
            f"docker-compose.yml does not load with {PASSWORD_VAR} set; the Compose loader says:\n"
            f"{result.stderr.strip()}",
            pytrace=False,
        )
    return json.loads(result.stdout)


def services(project: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return project["services"]


# -- (a) it loads, with the pinned images ----------------------------------------------


def test_loads_with_the_images_of_versions_env(project: dict[str, Any]) -> None:
    v = versions()
    assert sorted(services(project)) == sorted(IMAGES), (
        f"services of docker-compose.yml: {sorted(services(project))}, expected {sorted(IMAGES)}"
    )
    for name, (pattern, var) in IMAGES.items():
        expected = pattern.format(v[var])
        got = services(project)[name].get("image")
        assert got == expected, f"service {name}: image resolves to {got!r}, expected {expected!r} ({var} of deploy/versions.env)"


# -- (b) no Grafana without a password ---------------------------------------------------


@pytest.mark.parametrize("password", [None, ""], ids=["unset", "empty"])
def test_refuses_to_load_without_a_grafana_password(composecheck: Path, password: str | None) -> None:
    result = load(composecheck) if password is None else load(composecheck, f"{PASSWORD_VAR}={password}")
    how = "unset" if password is None else "empty"
    assert result.returncode != 0, (
        f"docker-compose.yml loads with {PASSWORD_VAR} {how}: Grafana would start with its default admin/admin; "
        f"grafana's environment must use ${{{PASSWORD_VAR}:?...}}"
    )
    assert PASSWORD_VAR in result.stderr, (
        f"with {PASSWORD_VAR} {how} the loader fails, but its error does not name {PASSWORD_VAR} "
        f"(so it fails for another reason):\n{result.stderr.strip()}"
    )


# -- (c) loopback only ----------------------------------------------------------------


def test_every_published_port_binds_loopback(project: dict[str, Any]) -> None:
    for name, service in services(project).items():
        for port in service.get("ports") or []:
            host_ip = port.get("host_ip") or "(every interface)"
            assert host_ip == "127.0.0.1", (
                f"service {name}: port {port.get('published') or '(random)'}->{port.get('target')} binds {host_ip}, "
                f"not 127.0.0.1 (nothing in this stack authenticates OTLP or Prometheus)"
            )


# -- (d) bind mounts: files of this repository, read-only -------------------------------


def test_bind_mounts_exist_in_the_repository_and_are_read_only(project: dict[str, Any]) -> None:
    binds = 0
    for name, service in services(project).items():
        for volume in service.get("volumes") or []:
            if volume.get("type") != "bind":
                continue
            binds += 1
            source = Path(volume["source"])
            target = volume.get("target")
            resolved = source.resolve()
            assert resolved.is_relative_to(ROOT.resolve()), (
                f"service {name}: bind mount {source} -> {target} is outside the repository"
            )
            assert resolved.exists(), (
                f"service {name}: bind mount source {resolved.relative_to(ROOT.resolve())} -> {target} does not exist "
                f"(Docker would create an empty directory in its place)"
            )
            assert volume.get("read_only") is True, (
                f"service {name}: bind mount {resolved.relative_to(ROOT.resolve())} -> {target} is writable; mount it :ro"
            )
    assert binds > 0, "no bind mounts at all: the configs under deploy/ are not mounted"


# -- (e) health checks and start order ---------------------------------------------------


def test_every_healthcheck_has_a_start_period(project: dict[str, Any]) -> None:
    for name, service in services(project).items():
        check = service.get("healthcheck")
        if not check or check.get("disable"):
            continue
        assert check.get("start_period"), (
            f"service {name}: healthcheck without start_period: a slow start counts against its retries"
        )


def test_jaeger_has_a_healthcheck_and_a_memory_limit(project: dict[str, Any]) -> None:
    jaeger = services(project)["jaeger"]
    check = jaeger.get("healthcheck") or {}
    assert check.get("test") and not check.get("disable"), "service jaeger: no healthcheck"
    assert int(jaeger.get("mem_limit") or 0) > 0, (
        "service jaeger: no mem_limit: its in-memory trace store can take the host's memory"
    )


def test_dependents_wait_for_healthy_jaeger_and_prometheus(project: dict[str, Any]) -> None:
    all_services = services(project)
    for dependency in HEALTHY_DEPENDENCIES:
        check = all_services[dependency].get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), (
            f"service {dependency}: no healthcheck, so nothing can wait for it to be healthy"
        )
    for name, service in all_services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            if dependency not in HEALTHY_DEPENDENCIES:
                continue
            condition = (spec or {}).get("condition")
            assert condition == "service_healthy", (
                f"service {name}: depends_on {dependency} with condition {condition!r}, expected 'service_healthy' "
                f"(it would start before {dependency} is ready)"
            )


# -- (f) the ports a user needs -----------------------------------------------------------


@pytest.mark.parametrize(
    "service,port", [(s, p) for s, ports in USER_PORTS.items() for p in ports], ids=lambda x: str(x)
)
def test_user_ports_are_published(project: dict[str, Any], service: str, port: int) -> None:
    ports = services(project)[service].get("ports") or []
    published = [(p.get("host_ip"), p.get("published"), p.get("target")) for p in ports]
    assert any(str(p.get("published")) == str(port) and int(p.get("target", 0)) == port for p in ports), (
        f"service {service}: container port {port} is not published on host port {port} "
        f"(published: {published or 'none'})"
    )
