"""An async guarded run that a caller's cancellation does not cut off.

An agent framework cancels a tool or a node that runs past its timeout
(pydantic-ai's ``timeout=``, LangGraph's ``TimeoutPolicy``). Cancelling the
effect in the middle does not undo it: the charge may already be on its way,
and the key would be left in flight with nobody to commit it (under the
guard's default ``hold``, an unknown outcome for an operator). So the run
goes on in a task of its own, to its commit, and the cancelled caller only
stops waiting for it. A duplicate of the key in the same event loop (the
model calls the tool again after the timeout) waits for that same task
instead of asking idemgate again (only one with the same key *and* the same
request: another payload still goes to idemgate, for its 422); a duplicate
anywhere else waits through idemgate (``Prefer: wait``), as every guarded run
does.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Awaitable, Callable, Hashable, Mapping, TypeVar

T = TypeVar("T")

def slot(key: str, request: Mapping[str, Any] | None, fingerprint: str | None) -> Hashable:
    """What makes two runs the same: the key and what the fingerprint covers."""
    return (key, fingerprint, json.dumps(request, sort_keys=True, default=str) if request is not None else None)


_tasks: dict[Hashable, "asyncio.Task[Any]"] = {}
_lock = threading.Lock()


async def shielded(slot: Hashable, run: Callable[[], Awaitable[T]]) -> T:
    """``await run()``, in a task that outlives this caller's cancellation,
    shared with every caller of the same ``slot`` (the key and the request) in
    this event loop while it runs."""
    loop = asyncio.get_running_loop()
    with _lock:
        task = _tasks.get(slot)
        if task is None or task.done() or task.get_loop() is not loop:
            task = loop.create_task(_awaited(run))
            _tasks[slot] = task
            task.add_done_callback(lambda done: _forget(slot, done))
    result: T = await asyncio.shield(task)
    return result


async def _awaited(run: Callable[[], Awaitable[T]]) -> T:
    return await run()


def _forget(slot: Hashable, task: "asyncio.Task[Any]") -> None:
    with _lock:
        if _tasks.get(slot) is task:
            del _tasks[slot]
    if not task.cancelled():
        task.exception()  # retrieved here: every awaiter that is still there gets it too
