"""The deployment's shipped files as the tests read them: deploy/versions.env, and YAML
loaded the strict way (a duplicate key is an error, as it is for Compose)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ROOT / "deploy" / "versions.env"


def versions() -> dict[str, str]:
    """deploy/versions.env as a dict (KEY=VALUE lines; # comments)."""
    out = {}
    for line in VERSIONS.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


class StrictLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; Compose refuses the file."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        duplicates = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        if duplicates:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicates}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path):
    return yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader)
