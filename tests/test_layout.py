"""The tree shows the two sides, and the core uses the public OpenTelemetry API only.

* ``otel_hicache/capture/`` runs in the serving process, ``otel_hicache/sinks/`` in the
  telemetry process (or embedded): neither imports the other; what both import is the shared
  record format and settings (the modules at the top of the package that import neither side).
* No private name of the OpenTelemetry SDK anywhere in the core: every ``_name`` attribute the
  core reads or writes is one the core itself defines, and no ``opentelemetry`` module path has a
  private part.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "otel_hicache"
SHARED = {"adapters", "record", "semconv", "environment_variables", "diagnostics", "version"}
BOOTSTRAP = {"__init__", "configuration", "doctor", "testing"}  # where the two sides meet
NOT_THE_SDKS = {"_current_frames"}  # sys._current_frames: CPython's only view of another thread's frame


def modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(CORE).with_suffix("")).replace("/", "."): ast.parse(path.read_text())
            for path in CORE.rglob("*.py")}


def imported(name: str, tree: ast.Module) -> set[str]:
    """The otel_hicache modules ``name`` imports, as dotted paths under the package."""
    package = name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("otel_hicache"):
                target = node.module.removeprefix("otel_hicache").lstrip(".")
            else:
                continue
            found.add(target)
            found |= {f"{target}.{alias.name}".lstrip(".") for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("otel_hicache.") for a in node.names if a.name.startswith("otel_hicache.")}
    return {m for m in found if m in MODULES}


MODULES = modules()


def side(module: str) -> str:
    top = module.split(".")[0]
    if top in ("capture", "sinks"):
        return top
    return "shared" if top in SHARED else "bootstrap" if top in BOOTSTRAP else "unknown"


def test_every_module_has_a_side():
    assert {m: side(m) for m in MODULES if side(m) == "unknown"} == {}
    assert {side(m) for m in MODULES} == {"capture", "sinks", "shared", "bootstrap"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if side(m) in ("capture", "sinks", "shared")))
def test_no_side_imports_the_other(module):
    mine = side(module)
    allowed = {"capture": {"capture", "shared", "bootstrap"}, "sinks": {"sinks", "shared"},
               "shared": {"shared"}}[mine]
    wrong = {m for m in imported(module, MODULES[module]) if side(m) not in allowed}
    assert wrong == set(), f"{module} ({mine}) imports {sorted(wrong)}"


def test_the_capture_reaches_the_sinks_only_through_the_bootstrap():
    """capture.telemetry asks configuration for its channel; nothing else of the capture goes there."""
    users = {m for m in MODULES if side(m) == "capture" and any(side(i) == "bootstrap"
                                                                 for i in imported(m, MODULES[m]))}
    assert users == {"capture.telemetry"}


def _defined_private_names() -> set[str]:
    names = set()
    for tree in MODULES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_")}


def test_no_private_name_of_the_sdk_in_the_core():
    ours = _defined_private_names() | NOT_THE_SDKS
    foreign = {}
    for module, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in ours:
                foreign.setdefault(module, set()).add(node.attr)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                paths = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for path in paths:
                    if path.startswith("opentelemetry") and any(p.startswith("_") for p in path.split(".")):
                        foreign.setdefault(module, set()).add(path)
    assert foreign == {}, foreign


def test_the_guard_sees_a_private_sdk_name():
    """The check above can fail: a core module reading an SDK private would be caught."""
    tree = ast.parse("def f(provider):\n    return provider._active_span_processor\n")
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert names - _defined_private_names() == {"_active_span_processor"}


def test_importing_the_package_loads_the_capture_only():
    """A serving process that imports otel_hicache pays for the capture, not the sinks'
    modules (spans, metrics, providers, exporters): those load where they run."""
    import subprocess
    import sys

    code = "import sys, otel_hicache; print(sorted(m for m in sys.modules if m.startswith('otel_hicache.sinks')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=CORE.parent, check=True)
    assert done.stdout.strip() == "[]", done.stdout
