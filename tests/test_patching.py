"""Unit tests for :mod:`otel_hicache.patching`: patch on import, all or nothing, restore exactly.

Each test writes its own small modules under ``tmp_path`` with unique names, so
that a genuine ``import`` happens (and with it wrapt's post-import hook) and no
test sees another test's modules or hooks.
"""

from __future__ import annotations

import importlib
import logging
import sys
import uuid
from typing import Any, Callable

import pytest

from otel_hicache.patching import Incompatible, Patch, PatchSet

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

def func(x):
    calls.append("func")
    return x * 10
'''


class Recorder:
    """A ``wrap`` factory: remembers each original it wraps and logs each wrapper call."""

    def __init__(self, log: list | None = None) -> None:
        self.log = [] if log is None else log
        self.originals: list[Any] = []

    def __call__(self, original: Callable[..., Any]) -> Callable[..., Any]:
        self.originals.append(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.log.append("wrapper")
            return original(*args, **kwargs)
        return wrapper


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
    def write() -> str:
        names.append(f"_patching_target_{uuid.uuid4().hex}")
        (tmp_path / f"{names[-1]}.py").write_text(SOURCE)
        importlib.invalidate_caches()
        return names[-1]
    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def patch_set() -> Any:
    """Make a PatchSet of ``{group name: patches}``; each set is restored at teardown."""
    made: list[PatchSet] = []
    def make(groups: dict[str, list[Patch]], check: Callable[[], None] | None = None) -> PatchSet:
        made.append(PatchSet("testframework"))
        for name, patches in groups.items():
            made[-1].add(name, patches, check)
        return made[-1]
    yield make
    for ps in made:
        ps.restore()


def test_apply_on_imported_module_patches_at_once_and_restore_puts_back_the_original(new_module, patch_set):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    ps = patch_set({"g": [Patch(mod.__name__, "Cls", "m", Recorder(mod.calls))]})
    ps.apply()
    assert mod.Cls.__dict__["m"] is not original
    assert mod.Cls().m(3) == 6 and mod.calls == ["wrapper", "original"]
    ps.restore()
    assert mod.Cls.__dict__["m"] is original


def test_apply_before_import_patches_when_the_module_is_imported(new_module, patch_set):
    name = new_module()
    rec = Recorder()
    ps = patch_set({"g": [Patch(name, "Cls", "m", rec)]})
    ps.apply()
    assert name not in sys.modules and rec.originals == [] and ps.applied() == []
    mod = importlib.import_module(name)
    assert ps.applied() == ["g"]
    assert mod.Cls().m(4) == 8 and rec.log == ["wrapper"]
    ps.restore()
    assert mod.Cls.__dict__["m"] is rec.originals[0]


def test_inherited_method_patched_on_subclass_is_inherited_again_after_restore(new_module, patch_set):
    mod = importlib.import_module(new_module())
    rec = Recorder()
    ps = patch_set({"g": [Patch(mod.__name__, "Sub", "m", rec)]})
    ps.apply()
    assert "m" in mod.Sub.__dict__
    assert mod.Sub().m(1) == 2 and rec.log == ["wrapper"]
    ps.restore()
    assert "m" not in mod.Sub.__dict__
    assert mod.Sub.m is mod.Base.m


def test_staticmethod_stays_static_when_patched_and_is_restored_exactly(new_module, patch_set):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["s"]
    rec = Recorder()
    ps = patch_set({"g": [Patch(mod.__name__, "Cls", "s", rec)]})
    ps.apply()
    assert isinstance(mod.Cls.__dict__["s"], staticmethod)
    assert mod.Cls.s(5) == 4 and mod.Cls().s(5) == 4 and rec.log == ["wrapper", "wrapper"]
    ps.restore()
    assert mod.Cls.__dict__["s"] is original


def test_classmethod_stays_a_classmethod_when_patched_and_is_restored_exactly(new_module, patch_set):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["c"]
    ps = patch_set({"g": [Patch(mod.__name__, "Cls", "c", Recorder())]})
    ps.apply()
    assert isinstance(mod.Cls.__dict__["c"], classmethod)
    assert mod.Cls.c(1) == ("Cls", 1) and mod.Cls().c(1) == ("Cls", 1)
    ps.restore()
    assert mod.Cls.__dict__["c"] is original


def test_module_level_function_is_patched_and_restored(new_module, patch_set):
    mod = importlib.import_module(new_module())
    original = mod.func
    ps = patch_set({"g": [Patch(mod.__name__, None, "func", Recorder(mod.calls))]})
    ps.apply()
    assert mod.func is not original
    assert mod.func(2) == 20 and mod.calls == ["wrapper", "func"]
    ps.restore()
    assert mod.func is original and vars(mod)["func"] is original


def test_group_with_a_missing_attribute_patches_nothing_and_warns_once(new_module, patch_set, warnings_log):
    mod = importlib.import_module(new_module())
    original_m, original_func = mod.Cls.__dict__["m"], mod.func
    ps = patch_set({
        "broken-group": [Patch(mod.__name__, "Cls", "m", Recorder()),
                         Patch(mod.__name__, "Cls", "missing", Recorder())],
        "good-group": [Patch(mod.__name__, None, "func", Recorder())],
    })
    ps.apply()
    assert mod.Cls.__dict__["m"] is original_m
    assert "missing" not in mod.Cls.__dict__
    assert mod.func is not original_func and ps.applied() == ["good-group"]
    messages = warnings_of(warnings_log)
    assert len(messages) == 1
    assert f"{mod.__name__}.Cls.missing" in messages[0] and "broken-group" in messages[0]
    ps.restore()
    ps.apply()
    ps.restore()
    assert len(warnings_of(warnings_log)) == 1


def test_check_raising_incompatible_skips_the_group_with_its_message(new_module, patch_set, warnings_log):
    mod = importlib.import_module(new_module())
    original = mod.Cls.__dict__["m"]
    check = raising(Incompatible("HiCacheAck has no field num_bytes"))
    ps = patch_set({"g": [Patch(mod.__name__, "Cls", "m", Recorder())]}, check=check)
    ps.apply()
    assert mod.Cls.__dict__["m"] is original and ps.applied() == []
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "HiCacheAck has no field num_bytes" in messages[0]


def test_check_raising_any_other_exception_skips_the_group_and_never_propagates(new_module, patch_set,
                                                                                 warnings_log):
    name = new_module()
    ps = patch_set({"g": [Patch(name, "Cls", "m", Recorder())]}, check=raising(RuntimeError("unexpected in check")))
    ps.apply()
    mod = importlib.import_module(name)  # the check runs in the post-import hook
    assert mod.Cls().m(1) == 2 and ps.applied() == []
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "unexpected in check" in messages[0] and "RuntimeError" in messages[0]


def test_group_spanning_two_modules_is_applied_once_both_are_imported(new_module, patch_set):
    first, second = new_module(), new_module()
    rec = Recorder()
    ps = patch_set({"g": [Patch(first, "Cls", "m", rec), Patch(second, None, "func", rec)]})
    ps.apply()
    mod1 = importlib.import_module(first)
    assert ps.applied() == [] and rec.originals == []
    assert mod1.Cls().m(1) == 2 and rec.log == []
    mod2 = importlib.import_module(second)
    assert ps.applied() == ["g"]
    assert mod1.Cls().m(1) == 2 and mod2.func(1) == 10 and rec.log == ["wrapper", "wrapper"]


def test_restore_leaves_a_foreign_replacement_in_place_and_warns(new_module, patch_set, warnings_log):
    mod = importlib.import_module(new_module())
    ps = patch_set({"g": [Patch(mod.__name__, "Cls", "m", Recorder())]})
    ps.apply()
    def theirs(self, x):
        return "theirs"
    mod.Cls.m = theirs
    ps.restore()
    assert mod.Cls.__dict__["m"] is theirs
    messages = warnings_of(warnings_log)
    assert len(messages) == 1 and "Cls.m" in messages[0] and "replaced by someone else" in messages[0]


def test_stale_hook_after_restore_does_not_patch_and_apply_again_does(new_module, patch_set):
    name = new_module()
    rec = Recorder()
    ps = patch_set({"g": [Patch(name, "Cls", "m", rec)]})
    ps.apply()
    ps.restore()
    mod = importlib.import_module(name)
    assert ps.applied() == [] and rec.originals == []
    assert mod.Cls().m(2) == 4 and rec.log == []
    ps.apply()
    assert ps.applied() == ["g"]
    assert mod.Cls().m(2) == 4 and rec.log == ["wrapper"]


def test_apply_twice_is_idempotent(new_module, patch_set):
    mod = importlib.import_module(new_module())
    rec = Recorder(mod.calls)
    ps = patch_set({"g": [Patch(mod.__name__, "Cls", "m", rec)]})
    ps.apply()
    ps.apply()
    assert len(rec.originals) == 1
    assert mod.Cls().m(1) == 2 and mod.calls == ["wrapper", "original"]


def test_applied_names_the_groups_in_place_and_is_empty_after_restore(new_module, patch_set):
    mod = importlib.import_module(new_module())
    ps = patch_set({
        "methods": [Patch(mod.__name__, "Cls", "m", Recorder())],
        "absent": [Patch(mod.__name__, "Cls", "nope", Recorder())],
        "functions": [Patch(mod.__name__, None, "func", Recorder())],
    })
    assert ps.applied() == []
    ps.apply()
    assert ps.applied() == ["methods", "functions"]
    ps.restore()
    assert ps.applied() == []
