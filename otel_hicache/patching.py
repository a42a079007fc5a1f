"""Patch framework functions when their module is imported, and restore them exactly.

What every framework adapter needs, kept out of the adapters:

* a :class:`Patch` names ``module``, an owner inside it (a class, or the module
  itself with ``owner=None``) and an attribute, and how to wrap it;
* :class:`PatchSet` applies its patches once the module is imported (now, if it
  already is: a post-import hook otherwise, so ``opentelemetry-instrument``'s
  ``sitecustomize`` can instrument before the framework is imported), and
  :meth:`PatchSet.restore` puts back the very objects it replaced;
* a *group* of patches is applied all or nothing: when one target is missing
  (a renamed method, an unsupported framework version) the group is skipped
  with one WARNING, and the framework keeps running uninstrumented;
* ``check`` callables run first, for the version guard (fields a wrapper relies
  on); they raise :class:`Incompatible` with a message for the warning.

Wrappers are plain functions that take the original; they must never raise
into the framework themselves (see the adapters).
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any, Callable, Iterable

from .diagnostics import logger, warn_once

_MISSING = object()


class Incompatible(Exception):
    """A target does not look as the adapter expects."""


class Patch:
    """Replace ``module[.owner].attribute`` with ``wrap(original)``."""

    __slots__ = ("module", "owner", "attribute", "wrap")

    def __init__(self, module: str, owner: str | None, attribute: str, wrap: Callable[[Any], Any]) -> None:
        self.module = module
        self.owner = owner
        self.attribute = attribute
        self.wrap = wrap

    @property
    def target(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.attribute) if p)


class _Group:
    __slots__ = ("name", "patches", "check", "applied", "modules", "done")

    def __init__(self, name: str, patches: list[Patch], check: Callable[[], None] | None) -> None:
        self.name = name
        self.patches = patches
        self.check = check
        # (owner object, attribute, what was in the owner's __dict__ or _MISSING, wrapper)
        self.applied: list[tuple[Any, str, Any, Any]] = []
        self.modules = sorted({p.module for p in patches})
        self.done = False


def _imported(name: str) -> bool:
    """In ``sys.modules`` and done executing: a module that is still being
    imported (one of its own imports fired a hook) is in ``sys.modules`` too,
    with its classes not defined yet."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _owner(patch: Patch) -> Any:
    obj: Any = sys.modules[patch.module]
    for part in (patch.owner or "").split(".") if patch.owner else ():
        obj = getattr(obj, part)
    return obj


class PatchSet:
    """Groups of patches applied on import, restored on :meth:`restore`."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        self._groups: list[_Group] = []
        self._lock = threading.RLock()
        self._generation = 0
        self._active = False
        self._executed: set[str] = set()  # modules whose post-import hook ran

    def add(self, name: str, patches: Iterable[Patch], check: Callable[[], None] | None = None) -> None:
        """A group: every patch or none. ``check`` runs once its modules are imported."""
        self._groups.append(_Group(name, list(patches), check))

    # -- apply -------------------------------------------------------------
    def apply(self) -> None:
        """Apply each group now if its modules are imported, else when they are."""
        with self._lock:
            if self._active:
                return
            self._active = True
            self._generation += 1
            generation = self._generation
        modules = sorted({m for g in self._groups for m in g.modules})
        for module in modules:
            if _imported(module):
                self._on_import(generation, sys.modules[module])
            else:  # not imported yet, or still importing: when it is done
                self._register_hook(module, generation)

    def _register_hook(self, module: str, generation: int) -> None:
        try:
            from wrapt import register_post_import_hook
        except ImportError:  # no wrapt: patch what is importable now
            try:
                importlib.import_module(module)
            except Exception as exc:  # pylint: disable=broad-except
                warn_once(f"patch-import:{module}", "otel-hicache: %s: cannot import %s (%r); not instrumented",
                          self.framework, module, exc)
                return
            self._on_import(generation, sys.modules[module])
            return
        register_post_import_hook(lambda mod: self._on_import(generation, mod), module)

    def _on_import(self, generation: int, module: Any) -> None:
        """A target module finished executing: apply every group now complete."""
        with self._lock:
            if not self._active or generation != self._generation:
                return  # restored (or re-applied) since this hook was registered
            # the hook runs before the import machinery marks the module done
            self._executed.add(getattr(module, "__name__", ""))
            for group in self._groups:
                if not group.done and all(m in self._executed or _imported(m) for m in group.modules):
                    group.done = True
                    self._apply_group(group)

    def _apply_group(self, group: _Group) -> None:
        try:
            if group.check is not None:
                group.check()
            resolved = []
            for patch in group.patches:
                try:
                    owner = _owner(patch)
                    original = getattr(owner, patch.attribute)
                except (AttributeError, KeyError) as exc:
                    raise Incompatible(f"{patch.target} not found") from exc
                resolved.append((patch, owner, original))
        except Incompatible as exc:
            self._incompatible(group, str(exc))
            return
        except Exception as exc:  # pylint: disable=broad-except
            self._incompatible(group, repr(exc))
            return
        try:
            replacements = [self._replacement(patch, owner, original) for patch, owner, original in resolved]
        except Exception as exc:  # pylint: disable=broad-except  # a wrap() that fails: patch nothing
            self._incompatible(group, f"cannot wrap: {exc!r}")
            return
        for (patch, owner, _original), (own, wrapper) in zip(resolved, replacements):
            setattr(owner, patch.attribute, wrapper)
            group.applied.append((owner, patch.attribute, own, wrapper))
        logger.debug("otel-hicache: %s: instrumented %s", self.framework, group.name)

    @staticmethod
    def _replacement(patch: Patch, owner: Any, original: Any) -> tuple[Any, Any]:
        """(what the owner itself held, what to put there). Static and class
        methods stay what they were: ``wrap`` gets the plain function (a class
        method's takes ``cls`` first, as a method's takes ``self``)."""
        own = vars(owner).get(patch.attribute, _MISSING) if isinstance(owner, type) else original
        if isinstance(own, staticmethod):
            return own, staticmethod(patch.wrap(own.__func__))
        if isinstance(own, classmethod):
            return own, classmethod(patch.wrap(own.__func__))
        return own, patch.wrap(original)

    def _incompatible(self, group: _Group, why: str) -> None:
        warn_once(
            f"incompatible:{self.framework}:{group.name}",
            "otel-hicache: this %s does not match the adapter (%s); %s is not instrumented, "
            "everything else keeps working",
            self.framework,
            why,
            group.name,
        )

    # -- restore -----------------------------------------------------------
    def restore(self) -> None:
        """Put back exactly what was replaced (only where our wrapper is still in place)."""
        with self._lock:
            self._active = False
            self._generation += 1
            for group in self._groups:
                for owner, attribute, own, wrapper in reversed(group.applied):
                    current = vars(owner).get(attribute, _MISSING)
                    if current is not wrapper:
                        warn_once(f"restore:{id(owner)}:{attribute}",
                                  "otel-hicache: %s.%s was replaced by someone else since; left as it is",
                                  getattr(owner, "__name__", owner), attribute)
                        continue
                    if own is _MISSING:
                        delattr(owner, attribute)  # it was inherited: inherit again
                    else:
                        setattr(owner, attribute, own)
                group.applied = []
                group.done = False

    def applied(self) -> list[str]:
        """Names of the groups in place (tests, diagnostics)."""
        with self._lock:
            return [g.name for g in self._groups if g.applied]
