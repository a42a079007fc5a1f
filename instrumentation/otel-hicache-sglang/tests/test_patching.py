"""The adapter's patching (:mod:`otel_hicache_sglang.patching`, on wrapt): wrap on import,
all or nothing, restore exactly, and wrappers that read parameters either way.

Each test writes its own small modules under ``tmp_path`` with unique names, so
that a genuine ``import`` happens (and with it wrapt's post-import hook) and no
test sees another test's modules or hooks.
"""

from __future__ import annotations

import gc
import importlib
import logging
import sys
import uuid
import weakref
from typing import Any, Callable

import pytest

from otel_hicache_sglang.patching import MISSING, Group, Incompatible, Patcher, arg, missing

SOURCE = '''
calls = []

class Base:
    def m(self, x):
        calls.append("base")
        return x + 1

class Cls(Base):
    def m(self, x):
        calls.append("original")
        return x * 2
    @staticmethod
    def s(x):
        return x - 1
    @classmethod
    def c(cls, x):
        return cls.__name__, x

class Sub(Base):
    pass

class Frozen(type):
    def __setattr__(cls, name, value):
        raise TypeError("frozen class")

class Locked(metaclass=Frozen):
    def m(self, x):
        return x

def func(x):
    calls.append("func")
    return x * 10
'''


class Recorder:
    """A wrapper in wrapt's style: logs each call and what it was given."""

    def __init__(self, log: list | None = None) -> None:
        self.log = [] if log is None else log
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __call__(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        self.log.append("wrapper")
        self.calls.append((instance, args, kwargs))
        return wrapped(*args, **kwargs)


def raising(exc: Exception) -> Callable[[], None]:
    """A ``check`` that raises ``exc``."""
    def check() -> None:
        raise exc
    return check


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "otel_hicache" and r.levelno >= logging.WARNING]


@pytest.fixture
def new_module(tmp_path, monkeypatch) -> Any:
    """Write a module with a unique name (not imported yet); return its name. Unimported at teardown."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(source: str = SOURCE) -> str:
        names.append(f"_patching_target_{uuid.uuid4().hex}")
        (tmp_path / f"{names[-1]}.py").write_text(source)
        importlib.invalidate_caches()
        return names[-1]

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def patcher() -> Any:
    """Make a Patcher of ``{group name: targets}``; each is uninstrumented at teardown."""
    made: list[Patcher] = []

    def make(groups: dict[str, list[tuple[str, str, Any]]], check: Callable[[], None] | None = None) -> Patcher:
        made.append(Patcher("testframework", [Group(name, targets, check) for name, targets in groups.items()]))
        return made[-1]

    yield make
    for p in made:
        p.uninstrument()


def test_instrument_on_imported_module_wraps_at_once_and_uninstrument_puts_back_the_original(new_module,
                                                                                            patcher):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    p = patcher({"g": [(mod.__name__, "Cls.m", Recorder(mod.calls))]})
    p.instrument()
    assert mod.Cls.__dict__["m"] is not original and mod.Cls.__dict__["m"].__wrapped__ is original
    assert mod.Cls().m(3) == 6 and mod.calls == ["wrapper", "original"]
    p.uninstrument()
    assert mod.Cls.__dict__["m"] is original


def test_instrument_before_import_wraps_when_the_module_is_imported(new_module, patcher):
    name = new_module()
    rec = Recorder()
    p = patcher({"g": [(name, "Cls.m", rec)]})
    p.instrument()
    assert name not in sys.modules and p.applied() == []
    mod = importlib.import_module(name)
    assert p.applied() == ["g"]
    original = mod.Cls.__dict__["m"].__wrapped__
    assert mod.Cls().m(4) == 8 and rec.log == ["wrapper"]
    p.uninstrument()
    assert mod.Cls.__dict__["m"] is original


def test_a_wrapper_sees_positional_and_keyword_calls_as_they_were_made(new_module, patcher):
    mod = importlib.import_module(new_module())
    rec = Recorder()
    patcher({"g": [(mod.__name__, "Cls.m", rec), (mod.__name__, "func", rec)]}).instrument()
    obj = mod.Cls()
    assert obj.m(3) == obj.m(x=3) == mod.Cls.m(obj, 3) == mod.Cls.m(obj, x=3) == 6
    assert mod.func(2) == mod.func(x=2) == 20
    assert [(instance is obj, args, kwargs) for instance, args, kwargs in rec.calls[:4]] == [
        (True, (3,), {}), (True, (), {"x": 3}), (True, (3,), {}), (True, (), {"x": 3})]
    assert [(instance, args, kwargs) for instance, args, kwargs in rec.calls[4:]] == [
        (None, (2,), {}), (None, (), {"x": 2})]
    # what the adapter's wrappers read them with
    assert {arg(args, kwargs, 0, "x") for _, args, kwargs in rec.calls} == {3, 2}
    assert arg((), {"y": 3}, 0, "x") is MISSING and arg((), {}, 1, "z", "default") == "default"


def test_missing_warns_once_per_function_and_parameter(new_module, warnings_log):
    mod = importlib.import_module(new_module())
    for _ in range(3):
        missing(mod.func, "x", "nothing is counted")
    missing(mod.Cls.m, "x", "nothing is counted")
    messages = warnings_of(warnings_log)
    assert len(messages) == 2
    assert "func() without a parameter 'x'" in messages[0] and "nothing is counted" in messages[0]
    assert "Cls.m()" in messages[1]


def test_inherited_method_wrapped_on_subclass_is_inherited_again_after_uninstrument(new_module, patcher):
    mod = importlib.import_module(new_module())
    rec = Recorder()
    p = patcher({"g": [(mod.__name__, "Sub.m", rec)]})
    p.instrument()
    assert "m" in mod.Sub.__dict__
    assert mod.Sub().m(1) == 2 and rec.log == ["wrapper"] and mod.Base().m(1) == 2 and rec.log == ["wrapper"]
    p.uninstrument()
    assert "m" not in mod.Sub.__dict__
    assert mod.Sub.m is mod.Base.m


def test_staticmethod_stays_static_when_wrapped_and_is_restored_exactly(new_module, patcher):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["s"]
    rec = Recorder()
    p = patcher({"g": [(mod.__name__, "Cls.s", rec)]})
    p.instrument()
    assert mod.Cls.__dict__["s"] is not original
    assert mod.Cls.s(5) == 4 and mod.Cls().s(5) == 4 and mod.Cls.s(x=5) == 4
    assert rec.calls == [(None, (5,), {}), (None, (5,), {}), (None, (), {"x": 5})]
    p.uninstrument()
    assert mod.Cls.__dict__["s"] is original
    assert mod.Cls().s(5) == 4


def test_classmethod_stays_a_classmethod_when_wrapped_and_is_restored_exactly(new_module, patcher):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["c"]
    rec = Recorder()
    p = patcher({"g": [(mod.__name__, "Cls.c", rec)]})
    p.instrument()
    assert mod.Cls.c(1) == ("Cls", 1) and mod.Cls().c(1) == ("Cls", 1)
    assert [instance for instance, _, _ in rec.calls] == [mod.Cls, mod.Cls]
    p.uninstrument()
    assert mod.Cls.__dict__["c"] is original


def test_module_level_function_is_wrapped_and_restored(new_module, patcher):
    mod = importlib.import_module(new_module())
    original = mod.func
    p = patcher({"g": [(mod.__name__, "func", Recorder(mod.calls))]})
    p.instrument()
    assert mod.func is not original
    assert mod.func(2) == 20 and mod.calls == ["wrapper", "func"]
    p.uninstrument()
    assert mod.func is original and vars(mod)["func"] is original


def test_group_with_a_missing_attribute_wraps_nothing_and_warns_once(new_module, patcher, warnings_log):
    mod = importlib.import_module(new_module())
    original_m, original_func = mod.Cls.__dict__["m"], mod.func
    p = patcher({
        "broken-group": [(mod.__name__, "Cls.m", Recorder()), (mod.__name__, "Cls.missing", Recorder())],
        "good-group": [(mod.__name__, "func", Recorder())],
    })
    p.instrument()
    assert mod.Cls.__dict__["m"] is original_m
    assert "missing" not in mod.Cls.__dict__
    assert mod.func is not original_func and p.applied() == ["good-group"]
    messages = warnings_of(warnings_log)
    assert len(messages) == 1
    assert f"{mod.__name__}.Cls.missing not found" in messages[0] and "broken-group" in messages[0]
    p.uninstrument()
    p.instrument()
    p.uninstrument()
    assert len(warnings_of(warnings_log)) == 1
    assert mod.func is original_func


def test_a_target_that_cannot_be_wrapped_unwraps_the_rest_of_its_group(new_module, patcher, warnings_log):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    p = patcher({"g": [(mod.__name__, "Cls.m", Recorder()), (mod.__name__, "Locked.m", Recorder())]})
    p.instrument()
    assert mod.Cls.__dict__["m"] is original and p.applied() == []
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "cannot wrap" in messages[0] and "frozen class" in messages[0]


def test_check_raising_incompatible_skips_the_group_with_its_message(new_module, patcher, warnings_log):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    check = raising(Incompatible("HiCacheAck has no field num_bytes"))
    p = patcher({"g": [(mod.__name__, "Cls.m", Recorder())]}, check=check)
    p.instrument()
    assert mod.Cls.__dict__["m"] is original and p.applied() == []
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "HiCacheAck has no field num_bytes" in messages[0]


def test_check_raising_any_other_exception_skips_the_group_and_never_breaks_the_import(new_module, patcher,
                                                                                      warnings_log):
    name = new_module()
    p = patcher({"g": [(name, "Cls.m", Recorder())]}, check=raising(RuntimeError("unexpected in check")))
    p.instrument()
    mod = importlib.import_module(name)  # the check runs in the post-import hook
    assert mod.Cls().m(1) == 2 and p.applied() == []
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "unexpected in check" in messages[0] and "RuntimeError" in messages[0]


def test_group_spanning_two_modules_is_applied_once_both_are_imported(new_module, patcher):
    first, second = new_module(), new_module()
    rec = Recorder()
    p = patcher({"g": [(first, "Cls.m", rec), (second, "func", rec)]})
    p.instrument()
    mod1 = importlib.import_module(first)
    assert p.applied() == []
    assert mod1.Cls().m(1) == 2 and rec.log == []
    mod2 = importlib.import_module(second)
    assert p.applied() == ["g"]
    assert mod1.Cls().m(1) == 2 and mod2.func(1) == 10 and rec.log == ["wrapper", "wrapper"]


def test_a_module_still_executing_when_another_hook_fires_is_not_wrapped_half_built(new_module, patcher,
                                                                                   warnings_log):
    """The opentelemetry-instrument path: ``first`` imports ``second`` before defining its
    classes, so ``second``'s hook fires while ``first`` is in ``sys.modules`` half built."""
    second = new_module()
    first = new_module(f"import {second}\n" + SOURCE)
    rec = Recorder()
    p = patcher({"g": [(first, "Cls.m", rec), (second, "func", rec)]})
    p.instrument()
    mod1 = importlib.import_module(first)
    assert p.applied() == ["g"] and warnings_of(warnings_log) == []
    assert mod1.Cls().m(1) == 2 and rec.log == ["wrapper"]


def test_uninstrument_leaves_a_foreign_replacement_in_place_and_warns(new_module, patcher, warnings_log):
    mod = importlib.import_module(new_module())
    p = patcher({"g": [(mod.__name__, "Cls.m", Recorder())]})
    p.instrument()

    def theirs(self, x):
        return "theirs"

    mod.Cls.m = theirs
    p.uninstrument()
    assert mod.Cls.__dict__["m"] is theirs
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "Cls.m" in messages[0] and "replaced by someone else" in messages[0]


def test_stale_hook_after_uninstrument_does_not_wrap_and_instrument_again_does(new_module, patcher):
    name = new_module()
    rec = Recorder()
    p = patcher({"g": [(name, "Cls.m", rec)]})
    p.instrument()
    p.uninstrument()
    mod = importlib.import_module(name)
    assert p.applied() == [] and not hasattr(mod.Cls.__dict__["m"], "__wrapped__")
    assert mod.Cls().m(2) == 4 and rec.log == []
    p.instrument()
    assert p.applied() == ["g"]
    assert mod.Cls().m(2) == 4 and rec.log == ["wrapper"]


def test_a_hook_for_a_module_never_imported_does_not_keep_an_uninstrumented_patcher_alive(new_module):
    # wrapt keeps a post-import hook until its module is imported; SGLang never imports some
    # of the adapter's modules (a feature not in use)
    held = Recorder()
    p = Patcher("testframework", [Group("g", [(new_module(), "Cls.m", held)])])
    p.instrument()
    p.uninstrument()
    gone, wrapper = weakref.ref(p), weakref.ref(held)
    del p, held
    gc.collect()
    assert gone() is None and wrapper() is None


def test_a_patcher_held_by_its_owner_still_wraps_a_module_imported_later(new_module):
    name = new_module()
    p = Patcher("testframework", [Group("g", [(name, "Cls.m", Recorder())])])
    p.instrument()
    gc.collect()  # the hook holds the patcher weakly: its owner (here, this test) keeps it
    try:
        mod = importlib.import_module(name)
        assert p.applied() == ["g"] and hasattr(mod.Cls.__dict__["m"], "__wrapped__")
    finally:
        p.uninstrument()


def test_instrument_twice_is_idempotent(new_module, patcher):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    rec = Recorder(mod.calls)
    p = patcher({"g": [(mod.__name__, "Cls.m", rec)]})
    p.instrument()
    p.instrument()
    assert mod.Cls.__dict__["m"].__wrapped__ is original  # wrapped once, not a wrapper of a wrapper
    assert mod.Cls().m(1) == 2 and mod.calls == ["wrapper", "original"]
    p.uninstrument()
    p.uninstrument()
    assert mod.Cls.__dict__["m"] is original


def test_applied_names_the_groups_in_place_and_is_empty_after_uninstrument(new_module, patcher):
    mod = importlib.import_module(new_module())
    p = patcher({
        "methods": [(mod.__name__, "Cls.m", Recorder())],
        "absent": [(mod.__name__, "Cls.nope", Recorder())],
        "functions": [(mod.__name__, "func", Recorder())],
    })
    assert p.applied() == []
    p.instrument()
    assert p.applied() == ["methods", "functions"]
    p.uninstrument()
    assert p.applied() == []


# -- a plain method gets a plain function (no wrapt proxy: it runs on every HiCache op) --------------------

def test_a_plain_method_gets_a_plain_function_restored_exactly(new_module, patcher):
    import types

    import wrapt

    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    rec = Recorder(mod.calls)
    p = patcher({"g": [(mod.__name__, "Cls.m", rec)]})
    p.instrument()
    installed = mod.Cls.__dict__["m"]
    assert isinstance(installed, types.FunctionType) and not isinstance(installed, wrapt.ObjectProxy)
    assert installed.__wrapped__ is original and installed.__name__ == "m" and installed.__qualname__ == "Cls.m"
    obj = mod.Cls()
    assert obj.m(3) == 6 and obj.m(x=4) == 8
    assert rec.calls == [(obj, (3,), {}), (obj, (), {"x": 4})]
    assert mod.calls == ["wrapper", "original", "wrapper", "original"]
    p.uninstrument()
    assert mod.Cls.__dict__["m"] is original


def test_anything_else_than_a_plain_method_goes_through_wrapt(new_module, patcher):
    """A class method (or another tool's wrapper, a module's function) is wrapped by wrapt."""
    import wrapt

    mod = importlib.import_module(new_module())
    p = patcher({"g": [(mod.__name__, "Cls.c", Recorder()), (mod.__name__, "func", Recorder())]})
    p.instrument()
    assert isinstance(mod.Cls.__dict__["c"], wrapt.FunctionWrapper) and isinstance(mod.func, wrapt.FunctionWrapper)
