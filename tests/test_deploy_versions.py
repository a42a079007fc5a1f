"""One set of versions for the telemetry stack (deploy/versions.env): the images of
docker-compose.yml, the Go modules deploy/local/stack.sh builds, and the versions the docs
name must all be the same releases. Any drift fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from deploy_files import ROOT, VERSIONS, StrictLoader, load_yaml, versions

# compose image -> the versions.env variable its tag comes from, and the tag's prefix
IMAGES = {
    "otel/opentelemetry-collector-contrib": ("OTELCOL_VERSION", ""),
    "jaegertracing/jaeger": ("JAEGER_VERSION", ""),
    "prom/prometheus": ("PROMETHEUS_VERSION", "v"),
    "grafana/grafana": ("GRAFANA_VERSION", ""),
}


def test_strict_loader_refuses_duplicate_keys():
    with pytest.raises(yaml.constructor.ConstructorError, match="duplicate keys"):
        yaml.load("a:\n  image: x\n  image: y\n", Loader=StrictLoader)


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/otel-collector/config.yaml",
                                  "deploy/jaeger/config.yaml", "deploy/prometheus/prometheus.yml"])
def test_shipped_yaml_has_no_duplicate_keys(path):
    assert load_yaml(ROOT / path)


def requires(go_mod: Path) -> dict[str, str]:
    """module -> version of every require line (direct and indirect)."""
    out = {}
    for m in re.finditer(r"^\s*(?:require\s+)?([\w./-]+\.[\w./-]+)\s+(v[\w.+-]+)", go_mod.read_text(), re.M):
        out[m.group(1)] = m.group(2)
    return out


def test_versions_file_is_what_compose_reads():
    env = ROOT / ".env"
    assert env.is_symlink() and env.resolve() == VERSIONS.resolve(), ".env must link to deploy/versions.env"
    v = versions()
    assert set(v) == {"OTELCOL_VERSION", "JAEGER_VERSION", "JAEGER_MODULE_VERSION", "PROMETHEUS_VERSION",
                      "PROMETHEUS_MODULE_VERSION", "GRAFANA_VERSION"}
    for key, value in v.items():
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", value), f"{key}={value}: one release, no range or tag"


def test_compose_images_take_their_tags_from_versions_env():
    compose = load_yaml(ROOT / "docker-compose.yml")
    seen = set()
    for name, service in compose["services"].items():
        image = service["image"]
        repo, _, tag = image.partition(":")
        assert repo in IMAGES, f"service {name}: image {image} is not one of the pinned ones"
        var, prefix = IMAGES[repo]
        assert re.fullmatch(re.escape(prefix) + r"\$\{" + var + r":\?[^}]*\}", tag), \
            f"service {name}: the tag of {image} must be {prefix}${{{var}:?...}} (deploy/versions.env)"
        seen.add(repo)
    assert seen == set(IMAGES)


def test_collector_modules_are_at_the_compose_release():
    v = versions()["OTELCOL_VERSION"]
    mods = requires(ROOT / "deploy/local/otelcol/go.mod")
    contrib = {m: ver for m, ver in mods.items() if m.startswith("github.com/open-telemetry/opentelemetry-collector-contrib/")}
    # the unstable core modules (v0.x) move in lockstep with contrib; the stable ones are v1.x
    core = {m: ver for m, ver in mods.items() if m.startswith("go.opentelemetry.io/collector/") and ver.startswith("v0.")}
    assert contrib and core
    off = {m: ver for m, ver in {**contrib, **core}.items() if ver != f"v{v}"}
    assert not off, f"not at v{v} (deploy/versions.env): {off}"


def test_jaeger_module_is_the_compose_release():
    v = versions()
    assert requires(ROOT / "deploy/local/jaeger/go.mod")["github.com/jaegertracing/jaeger"] == v["JAEGER_MODULE_VERSION"]
    # Jaeger v2.N.P is published as module v1.(N+63).P
    major, minor, patch = map(int, v["JAEGER_VERSION"].split("."))
    assert major == 2 and v["JAEGER_MODULE_VERSION"] == f"v1.{minor + 63}.{patch}"


def test_prometheus_module_is_the_compose_release():
    v = versions()
    assert (requires(ROOT / "deploy/local/prometheus/go.mod")["github.com/prometheus/prometheus"]
            == v["PROMETHEUS_MODULE_VERSION"])
    # Prometheus 3.MM.P is published as module v0.3MM.P
    major, minor, patch = map(int, v["PROMETHEUS_VERSION"].split("."))
    assert major == 3 and v["PROMETHEUS_MODULE_VERSION"] == f"v0.{300 + minor}.{patch}"


DOCS = ["README.md", "deploy/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_only_the_pinned_releases(doc):
    v = versions()
    text = (ROOT / doc).read_text(encoding="utf-8")
    pinned = {
        r"opentelemetry-collector-contrib:v?(\d+\.\d+\.\d+)": v["OTELCOL_VERSION"],
        r"jaegertracing/jaeger:v?(\d+\.\d+\.\d+)": v["JAEGER_VERSION"],
        r"prom/prometheus:v?(\d+\.\d+\.\d+)": v["PROMETHEUS_VERSION"],
        r"grafana/grafana:v?(\d+\.\d+\.\d+)": v["GRAFANA_VERSION"],
    }
    for pattern, want in pinned.items():
        for found in re.findall(pattern, text):
            assert found == want, f"{doc} names {pattern.split(':')[0]} {found}; deploy/versions.env pins {want}"


def test_stack_sh_starts_prometheus_with_the_compose_flags():
    compose = load_yaml(ROOT / "docker-compose.yml")
    flags = [f for f in compose["services"]["prometheus"]["command"]
             if not f.startswith(("--config.file=", "--storage.tsdb.path="))]
    stack = (ROOT / "deploy/local/stack.sh").read_text(encoding="utf-8")
    for flag in flags:
        assert flag in stack, f"deploy/local/stack.sh does not start Prometheus with {flag} (docker-compose.yml does)"
    mounts = {m.split(":")[0] for svc in compose["services"].values() for m in svc.get("volumes") or []
              if m.startswith("./")}
    for path in ("./deploy/otel-collector/config.yaml", "./deploy/jaeger/config.yaml", "./deploy/prometheus"):
        assert path in mounts, f"compose no longer mounts {path}"
        assert path[2:] in stack, f"deploy/local/stack.sh does not run {path[2:]}, which compose mounts"
