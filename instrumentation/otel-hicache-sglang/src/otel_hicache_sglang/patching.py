"""Wrap SGLang's functions when their modules are imported, and restore them exactly.

* A :class:`Group` lists targets ``(module, "Class.method", wrapper)``; the
  wrappers take ``(wrapped, instance, args, kwargs)`` and are applied with
  ``wrapt.wrap_function_wrapper``. A :class:`Method` wrapper (the methods called
  on every HiCache op) replaces a plain function with a plain function instead:
  wrapt's bound-call proxy costs more per call than a Python frame, and these
  run on the scheduler thread between two device ops (``docs/performance.md``).
* :meth:`Patcher.instrument` registers a ``wrapt.register_post_import_hook``
  per module (wrapt calls it at once for a module already imported), so
  ``opentelemetry-instrument``'s ``sitecustomize`` can instrument before SGLang
  is imported. A group is applied once every one of its modules has finished
  executing: a module that is still being imported (one of its own imports
  fired another hook) is in ``sys.modules`` with its classes not defined yet.
* All or nothing: a group whose ``check`` (the version guard) raises, or one
  of whose targets is missing, gets one WARNING naming it and stays unwrapped;
  SGLang keeps serving.
* Wrappers call ``wrapped(*args, **kwargs)`` unchanged and read what they need
  with :func:`arg`, by position or by name, never re-declaring SGLang's
  signature: a parameter a later SGLang renames and passes by keyword is
  :data:`MISSING` (one WARNING, from :func:`missing`), never a ``TypeError``.
* :meth:`Patcher.uninstrument` puts back the very objects that were there
  (``opentelemetry.instrumentation.utils.unwrap``, except where it cannot:
  see :func:`_unwrap`), and leaves alone a target someone else replaced since.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from typing import Any, Callable, NamedTuple, Sequence

from opentelemetry.instrumentation.utils import unwrap
from wrapt import register_post_import_hook, wrap_function_wrapper

from otel_hicache.diagnostics import logger, warn_once

_INHERITED = object()  # the owner itself had no such attribute: it came from a base class
MISSING: Any = object()  # a parameter the call did not pass (under the name the adapter knows)


def arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = MISSING) -> Any:
    """Parameter ``name`` (at ``position`` after ``self``) of a wrapped call, passed either way."""
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def missing(wrapped: Any, name: str, lost: str) -> None:
    """One WARNING: SGLang called ``wrapped`` without parameter ``name``; ``lost`` says what is not reported."""
    where = getattr(wrapped, "__qualname__", None) or repr(wrapped)
    warn_once(f"missing:{where}:{name}", "otel-hicache: SGLang called %s() without a parameter %r (renamed?); "
              "%s", where, name, lost)


class Method(NamedTuple):
    """A wrapper for a hot method, installed as a plain function (no wrapt proxy).

    ``make(original)`` returns the replacement ``(self, *args, **kwargs)``, which calls
    ``original(self, *args, **kwargs)`` unchanged (and reads parameters with
    :func:`arg`). Used where the owner holds (or inherits) a plain function; anything
    else there (another tool's wrapper, a descriptor) is wrapped with wrapt as usual,
    ``make`` called per call with the bound ``wrapped``."""

    make: Callable[[Callable[..., Any]], Callable[..., Any]]


def _method_via_wrapt(method: Method) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return method.make(lambda _self, *a, **kw: wrapped(*a, **kw))(instance, *args, **kwargs)
    return wrapper


def _apply(module: Any, path: str, owner: Any, attribute: str, own: Any, wrapper: Any) -> Any:
    """Install ``wrapper`` on ``owner.attribute``; returns what was installed."""
    if isinstance(wrapper, Method):
        original = getattr(owner, attribute) if own is _INHERITED else own
        if isinstance(original, types.FunctionType) and isinstance(owner, type):
            replacement = functools.wraps(original)(wrapper.make(original))
            setattr(owner, attribute, replacement)
            return replacement
        wrapper = _method_via_wrapt(wrapper)
    return wrap_function_wrapper(module, path, wrapper)


class Incompatible(Exception):
    """A target does not look as the adapter expects (raised by a group's check)."""


class Group(NamedTuple):
    """Targets wrapped all or nothing: ``(module, "Class.method" or "function", wrapper)``."""

    name: str
    targets: Sequence[tuple[str, str, Callable[..., Any]]]
    check: Callable[[], None] | None = None


def _finished(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _resolve(module: str, path: str) -> tuple[Any, str, Any]:
    """(owner, attribute, what the owner itself holds or ``_INHERITED``)."""
    owner: Any = sys.modules[module]
    *parents, attribute = path.split(".")
    try:
        for part in parents:
            owner = getattr(owner, part)
        getattr(owner, attribute)
    except AttributeError as exc:
        raise Incompatible(f"{module}.{path} not found") from exc
    return owner, attribute, vars(owner).get(attribute, _INHERITED)


def _unwrap(owner: Any, attribute: str, own: Any, wrapper: Any) -> None:
    if vars(owner).get(attribute) is not wrapper:
        warn_once(f"restore:{id(owner)}:{attribute}",
                  "otel-hicache: %s.%s was replaced by someone else since; left as it is",
                  getattr(owner, "__name__", owner), attribute)
    elif own is _INHERITED:  # unwrap() would leave the base class's function on the subclass
        delattr(owner, attribute)
    elif isinstance(own, (staticmethod, classmethod)) or isinstance(wrapper, types.FunctionType):
        setattr(owner, attribute, own)  # unwrap() would put back what it binds to (or: a Method's function)
    else:
        unwrap(owner, attribute)


def why_not_applied(group: Group) -> str | None:
    """Why ``group`` would stay unwrapped, its modules imported: what :meth:`Patcher._wrap` checks
    (the version guard, then every target), None when it would be wrapped. Wraps nothing
    (``otel-hicache doctor``)."""
    try:
        if group.check is not None:
            group.check()
        for module, path, _ in group.targets:
            _resolve(module, path)
    except Incompatible as exc:
        return str(exc)
    except Exception as exc:  # pylint: disable=broad-except
        return repr(exc)
    return None


def _post_import(patcher: "weakref.ref[Patcher]", generation: int, module: Any) -> None:
    """The hook wrapt keeps for a module until it is imported (a hook cannot be removed): it
    holds the patcher weakly, so one uninstrumented and dropped goes, with what its wrappers
    hold (the telemetry, its providers)."""
    alive = patcher()
    if alive is not None:
        alive._imported(generation, module)  # pylint: disable=protected-access


class Patcher:
    """Groups wrapped when their modules are imported, restored by :meth:`uninstrument`."""

    def __init__(self, framework: str, groups: Sequence[Group]) -> None:
        self.framework = framework
        self._groups = list(groups)
        self._modules = sorted({module for group in self._groups for module, _, _ in group.targets})
        self._lock = threading.RLock()
        self._generation = 0  # a hook registered before the last (un)instrument() does nothing
        self._active = False
        self._executed: set[str] = set()  # modules whose post-import hook ran
        self._done: set[str] = set()  # groups applied or found incompatible
        self._applied: dict[str, list[tuple[Any, str, Any, Any]]] = {}  # group -> (owner, attribute, own, wrapper)

    def instrument(self) -> None:
        with self._lock:
            if self._active:
                return
            self._active = True
            self._generation += 1
            hook = functools.partial(_post_import, weakref.ref(self), self._generation)
        for module in self._modules:
            register_post_import_hook(hook, module)

    def uninstrument(self) -> None:
        with self._lock:
            self._active = False
            self._generation += 1
            for name in reversed(list(self._applied)):
                for owner, attribute, own, wrapper in reversed(self._applied.pop(name)):
                    _unwrap(owner, attribute, own, wrapper)
            self._done.clear()

    def applied(self) -> list[str]:
        """Names of the groups in place (tests, diagnostics)."""
        with self._lock:
            return [group.name for group in self._groups if group.name in self._applied]

    def _imported(self, generation: int, module: Any) -> None:
        """A module finished executing (the hook runs before the import machinery
        marks it done): wrap every group now complete. Never raises into the import."""
        try:
            with self._lock:
                if not self._active or generation != self._generation:
                    return
                self._executed.add(getattr(module, "__name__", ""))
                for group in self._groups:
                    if group.name not in self._done and all(
                            m in self._executed or _finished(m) for m, _, _ in group.targets):
                        self._done.add(group.name)
                        self._wrap(group)
        except Exception:  # pylint: disable=broad-except
            logger.debug("otel-hicache: %s: post-import hook failed", self.framework, exc_info=True)

    def _wrap(self, group: Group) -> None:
        try:
            if group.check is not None:
                group.check()
            resolved = [_resolve(module, path) for module, path, _ in group.targets]
        except Incompatible as exc:
            return self._incompatible(group, str(exc))
        except Exception as exc:  # pylint: disable=broad-except
            return self._incompatible(group, repr(exc))
        applied: list[tuple[Any, str, Any, Any]] = []
        try:
            for (module, path, wrapper), (owner, attribute, own) in zip(group.targets, resolved):
                applied.append((owner, attribute, own, _apply(sys.modules[module], path, owner, attribute, own,
                                                              wrapper)))
        except Exception as exc:  # pylint: disable=broad-except  # wrap nothing
            for entry in reversed(applied):
                _unwrap(*entry)
            return self._incompatible(group, f"cannot wrap: {exc!r}")
        self._applied[group.name] = applied
        logger.debug("otel-hicache: %s: instrumented %s", self.framework, group.name)
        return None

    def _incompatible(self, group: Group, why: str) -> None:
        warn_once(f"incompatible:{self.framework}:{group.name}",
                  "otel-hicache: this %s does not match the adapter (%s); %s is not instrumented, "
                  "everything else keeps working", self.framework, why, group.name)
