"""The runtime (:mod:`healsweep.runtime`): one object owns the process's executors, in-memory
stores and counters; runtimes share nothing; a closed one says so; no module keeps mutable
state of its own (an AST check over the package, so the rule stays enforced)."""

from __future__ import annotations

import ast
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import healsweep
from healsweep import runtime
from healsweep.cache import RecentEntries, StageCache, activity, content_key
from healsweep.runtime import Runtime, RuntimeClosedError, use

PACKAGE = Path(healsweep.__file__).parent
SLOT = ("runtime.py", "_SLOT")  # the one module-level slot: the process's current runtime


def _compute_once(cache: StageCache, key: str):
    return cache.get_or_compute("stage", key, lambda: ({"w": np.arange(6.0)}, {"m": 1}))


def test_two_runtimes_share_no_store_and_no_counter(tmp_path, monkeypatch):
    from healsweep.model.resident import ResidentLayers

    monkeypatch.setenv("HEALSWEEP_RECENT_GB", "1")
    key = content_key("stage", 1, {"x": 1})
    with Runtime() as a, Runtime() as b:
        assert a.owned(RecentEntries) is not b.owned(RecentEntries)
        assert a.owned(ResidentLayers) is not b.owned(ResidentLayers)
        assert a.owned(RecentEntries) is a.owned(RecentEntries)  # one per runtime
        assert a.executor("pool", 1) is not b.executor("pool", 1)
        with use(a):
            _compute_once(StageCache(tmp_path), key)
            assert activity()["computed"] == {"stage": 1}
        assert a.activity.snapshot()["computed"] == {"stage": 1}
        assert b.activity.snapshot() == {kind: {} for kind in b.activity.KINDS}
        assert len(a.owned(RecentEntries)) == 1 and len(b.owned(RecentEntries)) == 0
        with use(b):
            cache = StageCache(tmp_path)
            _compute_once(cache, key)  # on disk already: a hit, counted in b alone
            assert cache.hits["stage"] == 1 and cache.computed["stage"] == 0
        assert b.activity.snapshot()["hits"] == {"stage": 1}
        assert a.activity.snapshot()["hits"] == {}
        assert len(b.owned(RecentEntries)) == 1
        assert a.first_time("notice") and b.first_time("notice") and not a.first_time("notice")
        assert a.memo("k", lambda: 1) == 1 and b.memo("k", lambda: 2) == 2
        assert a.memo("k", lambda: 3) == 1


def test_use_installs_for_the_block_and_puts_the_previous_back():
    outer = runtime.current()
    assert runtime.current() is outer  # kept for the process
    with Runtime() as mine:
        with use(mine):
            assert runtime.current() is mine
        assert runtime.current() is outer


def test_close_shuts_the_pools_down_and_a_closed_runtime_says_so(tmp_path):
    done = []
    with Runtime() as rt:
        pool = rt.executor("work", 2)
        assert rt.executor("work", 2) is pool
        with pytest.raises(ValueError, match="has 2 threads, asked for 1"):
            rt.executor("work", 1)
        pool.submit(done.append, 1)
        rt.owned(RecentEntries).get("k", lambda: ({}, {}, 10))
        recent = rt.owned(RecentEntries)
    assert done == [1] and rt.closed and len(recent) == 0  # waited for, then emptied
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(done.append, 2)
    for use_it in (
        lambda: rt.executor("work", 2),
        lambda: rt.owned(RecentEntries),
        lambda: rt.activity,
        lambda: rt.memo("k", lambda: 1),
        lambda: rt.first_time("notice"),
        lambda: rt.entry_lock("path"),
    ):
        with pytest.raises(RuntimeClosedError, match="Runtime was closed; make a new one"):
            use_it()
    with use(rt), pytest.raises(RuntimeClosedError, match="was closed"):  # left installed
        _compute_once(StageCache(tmp_path), content_key("stage", 1, {"x": 2}))
    rt.close()  # a second close is a no-op


def test_a_runtime_stays_in_its_process():
    with Runtime() as rt, pytest.raises(TypeError, match="belongs to the process that made it"):
        pickle.dumps(rt)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX's threads, if loaded
def test_a_forked_child_makes_its_own_runtime():
    parent = runtime.current()
    parent.memo("pid", os.getpid)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only this, then out
        try:
            child = runtime.current()
            same = child is parent or child.memo("pid", os.getpid) != os.getpid()
            os.write(write, b"shared" if same else b"own")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"own" and runtime.current() is parent


# Module-level state is made by these; a constant table (a dict literal, a comprehension of
# constants, a tuple, a frozenset) is not state unless a function changes it, checked below.
STATEFUL_CALLS = {
    "dict", "list", "set", "bytearray", "Counter", "defaultdict", "OrderedDict", "deque",
    "ThreadPoolExecutor", "ProcessPoolExecutor", "Lock", "RLock", "Condition", "Event",
    "Semaphore", "local", "Queue", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet",
    "BoundedLRU", "ResidentLayers", "RecentEntries", "Runtime", "Activity", "_Slot",
}  # fmt: skip
MUTATORS = {
    "append", "add", "update", "setdefault", "pop", "popitem", "clear", "discard", "remove",
    "extend", "insert", "move_to_end", "__setitem__", "__delitem__",
}  # fmt: skip


def _top_level(body: list[ast.stmt]):
    """The module's own statements, into ``if``/``try``/``with`` blocks, not into defs."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)
        else:
            yield node


def _called(value: ast.expr) -> str | None:
    if isinstance(value, ast.Call):
        func = value.func
        return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return None


def _locals(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    args = fn.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    names |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def module_state(source: str, where: str) -> list[str]:
    """``where:line what`` for each piece of module-level mutable state in ``source``: a
    module-level container, lock, executor or store made empty or by a stateful constructor;
    any ``global`` statement; a function that changes a module-level name (a mutating method,
    an item or attribute store, ``del`` of an item)."""
    tree = ast.parse(source)
    found, module_names = [], set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            module_names.update(names)
            value = node.value
            empty = isinstance(value, (ast.List, ast.Dict, ast.Set)) and not (
                getattr(value, "elts", None) or getattr(value, "keys", None)
            )
            made = value is not None and any(
                _called(part) in STATEFUL_CALLS for part in ast.walk(value)
            )  # also inside a table: {"hits": Counter()}
            if empty or made:
                found += [
                    f"{where}:{node.lineno} {name} = {ast.unparse(value)[:40]}" for name in names
                ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{where}:{node.lineno} global {', '.join(node.names)}")
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        shared = module_names - _locals(fn)
        for node in ast.walk(fn):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MUTATORS:
                    target = node.func.value
            elif isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(
                node.ctx, (ast.Store, ast.Del)
            ):
                target = node.value
            if isinstance(target, ast.Name) and target.id in shared:
                found.append(f"{where}:{node.lineno} changes {target.id}: {ast.unparse(node)[:50]}")
    return sorted(set(found))


def test_the_state_check_finds_each_kind_of_module_state():
    source = (
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "A = {}\nB: set[str] = set()\nC = ThreadPoolExecutor(2)\nD = threading.Lock()\n"
        "TABLE = {'x': 1}\nNAMES = ('a',)\nREG = {'k': 0}\nCOUNTS = {'hits': Counter()}\n"
        "def f(key):\n    REG[key] = 1\n"
        "def g():\n    global A\n    A = {1: 2}\n"
        "def h(NAMES):\n    NAMES.append(1)\n    TABLE.get('x')\n"
        "def k():\n    REG.setdefault('k', 2)\n"
    )
    found = [line.split(" ", 1)[1] for line in module_state(source, "m.py")]
    assert sorted(found) == sorted([
        "A = {}", "B = set()", "C = ThreadPoolExecutor(2)", "D = threading.Lock()",
        "COUNTS = {'hits': Counter()}",
        "changes REG: REG[key]", "global A", "changes REG: REG.setdefault('k', 2)",
    ])  # fmt: skip


def test_no_module_keeps_mutable_state_but_the_runtime_slot():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        found += module_state(path.read_text(encoding="utf-8"), where)
    slot_file, slot = SLOT
    allowed = [f for f in found if f.startswith(f"{slot_file}:") and f" {slot}" in f]
    assert allowed, "the runtime's slot moved: update SLOT"
    assert sorted(set(found) - set(allowed)) == []
