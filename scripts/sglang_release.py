"""The SGLang releases the adapter is tested on: one lock file each, requirements/sglang/<release>.txt.

  python scripts/sglang_release.py list            the releases, oldest first
  python scripts/sglang_release.py torch RELEASE   the torch it pins (its lock's first line)
  python scripts/sglang_release.py lock RELEASE    (re)write its lock: requirements/sglang-cpu.in
                                                   resolved by pip at the versions the release's
                                                   wheel pins, torch included (what its users have)
  python scripts/sglang_release.py overlay RELEASE DIR
                                                   run with a venv's python: install into DIR
                                                   (--no-deps, --target) what of the lock this venv
                                                   lacks or has at another version (nothing when
                                                   the venv holds the release already)

A new SGLang release is one ``lock`` away from being tested (scripts/test-sglang.sh); the
adapter's ``_instruments`` must then say the new range (tests/test_release_locks.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements" / "sglang"
NAMES = ROOT / "requirements" / "sglang-cpu.in"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def releases() -> list[str]:
    return sorted((p.stem for p in LOCKS.glob("*.txt")), key=version_key)


def lock_pins(release: str) -> dict[str, str]:
    """``{normalized name: version}`` of a lock file."""
    pins = {}
    for line in (LOCKS / f"{release}.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_norm(name)] = version
    return pins


def _wheel_pins(release: str, cache: Path) -> dict[str, str]:
    """What the release's wheel pins (``name==version``, markers true here), torch included."""
    from packaging.requirements import Requirement

    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(cache),
                    f"sglang=={release}"], check=True)
    wheel = next(cache.glob(f"sglang-{release}-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    pins = {}
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            spec = list(req.specifier)
            if (req.marker is None or req.marker.evaluate({"extra": ""})) and len(spec) == 1 \
                    and spec[0].operator == "==":
                pins[_norm(req.name)] = spec[0].version
    return pins


def lock(release: str) -> Path:
    from packaging.requirements import Requirement

    names = [line.strip() for line in NAMES.read_text().splitlines() if line.strip() and not line.startswith("#")]
    with tempfile.TemporaryDirectory() as tmp:
        pins = _wheel_pins(release, Path(tmp))
        wanted = [f"{n}=={pins[_norm(n)]}" if _norm(n) in pins else n for n in names]
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
                        "--report", str(report), f"torch=={pins['torch']}", *wanted], check=True)
        resolved = {_norm(item["metadata"]["name"]): item["metadata"]
                    for item in json.loads(report.read_text())["install"]}
    # torch's own dependencies (CUDA wheels, triton...) come with torch in the venv: left out
    todo: list[tuple[str, frozenset[str]]] = [("torch", frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()  # (package, the extras asked of it)
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in resolved:
            continue
        seen.add((name, extras))
        for text in resolved[name].get("requires_dist") or ():
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                todo.append((_norm(req.name), frozenset(req.extras)))
    lines = [f"# SGLang {release} on CPU, for the adapter's tests. Generated: python scripts/sglang_release.py "
             f"lock {release}", "# (requirements/sglang-cpu.in at the versions this release pins). Do not edit.",
             f"torch=={pins['torch']}", f"sglang=={release}"]
    closure = {name for name, _ in seen}
    lines += sorted(f"{meta['name']}=={meta['version']}" for name, meta in resolved.items()
                    if name not in closure)
    path = LOCKS / f"{release}.txt"
    LOCKS.mkdir(exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def overlay(release: str, target: Path) -> None:
    pins = lock_pins(release)
    torch = pins.pop("torch")
    have = metadata.version("torch").split("+")[0]
    if have != torch:
        raise SystemExit(f"sglang_release: SGLang {release} pins torch {torch}; this venv has {have}")
    missing = []
    for name, version in pins.items():
        try:
            if metadata.version(name).split("+")[0] == version:  # a local build tag (+cu130) is the same release
                continue
        except metadata.PackageNotFoundError:
            pass
        missing.append(f"{name}=={version}")
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                        str(target), *missing], check=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["list"]:
        print("\n".join(releases()))
    elif argv[:1] == ["torch"] and len(argv) == 2:
        print(lock_pins(argv[1])["torch"])
    elif argv[:1] == ["lock"] and len(argv) == 2:
        print(lock(argv[1]))
    elif argv[:1] == ["overlay"] and len(argv) == 3:
        overlay(argv[1], Path(argv[2]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
