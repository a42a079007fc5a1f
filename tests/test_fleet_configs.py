"""The fleet's Collector configs (deploy/otel-collector/agent.yaml, gateway.yaml) as shipped:
TLS and a bearer token between agents and gateways, nothing between them in plaintext, the
agents' unauthenticated receivers on loopback by default; and the real Collector accepts them.

e2e/test_fleet.py runs them: data flows through TLS and the token, and a gateway refuses a
client without the token, with a wrong one, or in plaintext.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from deploy_files import ROOT, load_yaml

CONFIGS = ROOT / "deploy" / "otel-collector"
AGENT, GATEWAY = CONFIGS / "agent.yaml", CONFIGS / "gateway.yaml"


def _default(value: str) -> str:
    """The value a ${env:NAME:-default} string has with NAME unset."""
    return re.sub(r"\$\{env:[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _authenticator(config: dict, name: str) -> dict:
    """The bearertokenauth extension `name`, which the service must enable."""
    assert name.split("/")[0] == "bearertokenauth", name
    assert name in config["service"]["extensions"], f"{name} is configured but not enabled"
    extension = config["extensions"][name]
    assert extension.get("filename") and not extension.get("token") and not extension.get("tokens"), \
        f"{name}: the token comes from a file, never from the config itself"
    return extension


def test_every_gateway_receiver_takes_only_tls_with_the_token():
    config = load_yaml(GATEWAY)
    protocols = config["receivers"]["otlp"]["protocols"]
    assert set(protocols) == {"grpc", "http"}
    for name, protocol in protocols.items():
        tls = protocol.get("tls") or {}
        assert tls.get("cert_file") and tls.get("key_file"), f"gateway OTLP {name}: no TLS certificate"
        assert "insecure" not in tls
        _authenticator(config, protocol["auth"]["authenticator"])


def test_every_agent_export_to_a_gateway_is_tls_with_the_token():
    config = load_yaml(AGENT)
    exporters = {k: v for k, v in config["exporters"].items() if k.startswith("load_balancing")}
    assert set(exporters) == {"load_balancing/traces", "load_balancing/metrics"}
    for name, exporter in exporters.items():
        otlp = exporter["protocol"]["otlp"]
        tls = otlp.get("tls") or {}
        assert tls.get("ca_file"), f"{name}: the gateways' certificates are not checked against a CA"
        assert not tls.get("insecure") and not tls.get("insecure_skip_verify"), f"{name}: {tls}"
        _authenticator(config, otlp["auth"]["authenticator"])
    for pipeline in config["service"]["pipelines"].values():
        assert set(pipeline["exporters"]) <= set(exporters), "an agent exports somewhere else"


def test_the_agent_and_gateway_read_the_same_token_file():
    agent = load_yaml(AGENT)["extensions"]["bearertokenauth/client"]["filename"]
    gateway = load_yaml(GATEWAY)["extensions"]["bearertokenauth/server"]["filename"]
    assert agent == gateway and "HICACHE_FLEET_TOKEN_FILE" in agent


def test_the_agents_unauthenticated_receivers_bind_loopback_by_default():
    for name, protocol in load_yaml(AGENT)["receivers"]["otlp"]["protocols"].items():
        assert "auth" not in protocol and "tls" not in protocol
        assert _default(protocol["endpoint"]).startswith("127.0.0.1:"), f"agent OTLP {name}: {protocol['endpoint']}"


def _stack(command: str, timeout_s: float) -> str | None:
    out = subprocess.run(["bash", str(ROOT / "deploy" / "local" / "stack.sh"), command, "otelcol"],
                         capture_output=True, text=True, timeout=timeout_s)
    path = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    return path if path and os.access(path, os.X_OK) else None


def _otelcol() -> str | None:
    """The Collector binary stack.sh installed (CI's stack step runs this test after its install)."""
    return _stack("path", 60)


@pytest.mark.stack
@pytest.mark.parametrize("name", ["agent.yaml", "gateway.yaml", "config.yaml"])
def test_the_real_collector_validates_the_config(name):
    otelcol = _otelcol()
    if otelcol is None:
        reason = "no Collector binary (deploy/local/stack.sh install builds it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTELCOL_", "HICACHE_", "JAEGER_"))}
    out = subprocess.run([otelcol, "validate", f"--config={CONFIGS / name}"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=Path(ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
