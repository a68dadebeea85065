"""Celery: a task's effect run at most once per business id.

::

    from celery import Celery
    from idemgate_client import Client
    from idemgate_client.celery import guarded_task

    app = Celery("shop", broker="amqp://…")

    @guarded_task(app, client=lambda: Client(url, token=token), tenant="acme", business_id="order_id")
    def charge(order_id: str, amount: int) -> dict[str, str]:
        return payments.charge(order_id, amount)

    charge.delay("order-1042", 500)   # enqueued twice, redelivered, retried: charged once

The key is :func:`task_key`: ``derive_key(tenant=tenant, run=<business id>,
step=step, tool=<task name>)``. The business id is what the application
calls the work — the order, the invoice — read from the task's arguments
(``business_id="order_id"``, the argument of that name, or a function of the
arguments). Never the task id: a second ``delay()`` of the same order gets a
new task id, and a key from it charges the order again. The task's
arguments (bound to its signature, defaults applied) are the request's
fingerprint, so the same order enqueued with another amount is
``key_reused``, never a second charge. The reserve carries the label
``"<task name> <business id>"`` (:func:`label_for`: cut to 200 characters,
a control character as ``?``), which the operators' views show beside the
key.

What each outcome does:

- the effect returned: its result is committed and is the task's result; a
  later run of the same business id (a second enqueue, a redelivery after a
  crash) returns that stored result without running the effect (a replay);
- the key is held by another run (:class:`~idemgate_client.InFlight` past a
  short ``wait_budget``, 2 s by default) or idemgate did not answer the
  reserve (:class:`~idemgate_client.StoreUnavailable`, also a 429
  ``TenantLimit``): ``task.retry(countdown=…)`` — until the holder's lease
  ends, or the server's ``Retry-After``, or a backoff, at most
  ``max_countdown`` — so the worker is free meanwhile; past the task's
  ``max_retries`` (10 unless the task sets it) the message is dead-lettered;
- the outcome is unknown (:class:`~idemgate_client.OutcomeUnknown`: a
  worker died while it held the key, and its lease ended), the effect acted
  but its result could not be committed
  (:class:`~idemgate_client.ResultNotCommitted`), the effect raised
  something that does not prove it never acted (the guard marked the key
  unknown), or the business id was enqueued with other arguments
  (:class:`~idemgate_client.KeyReused`): the message is **dead-lettered**:
  ``on_dead_letter(task, letter)`` is called if given (a
  :class:`DeadLetter`: ``reason``, the key, the business id, the error, the
  result if any), then :class:`celery.exceptions.Reject` with
  ``requeue=False``, so RabbitMQ routes the message to the queue's
  dead-letter exchange (the queue's argument ``x-dead-letter-exchange``) and
  Celery records the task as failed. It is never acked as if done, and never
  run again by itself: an operator settles the key (``idemgate keys``), then
  redrives the message, which replays or runs;
- the effect raised something that proves it never acted (the guard's
  ``classify_failure``: ``NotExecuted``, a connection refused): the key is
  released and the exception is the task's (``autoretry_for`` applies).

The guard holds (``on_lease_expiry="hold"``): a worker killed in the middle
of the effect leaves the key in flight until its lease ends, then unknown,
never run a second time by itself. The lease (:func:`lease_for`) is
``lease_seconds`` if given, else the task's hard time limit (per call, the
task's ``time_limit`` or ``task_time_limit``; else the soft one) plus 5 s,
else 30 s, at most 3600 s (the server's default longest lease); the guard
extends it every third of it while the effect runs. A lease the length of
the hard limit outlives the effect however the heartbeats fare, since the
pool kills a task at that limit; a shorter one dead-letters a crashed
worker's message sooner.

The task is registered with ``bind=True`` and, unless given otherwise,
``acks_late=True`` (the message is acked after the task, so a worker's death
redelivers it), ``reject_on_worker_lost=True`` (a pool process killed
mid-task requeues its message instead of acking it),
``acks_on_failure_or_timeout=False`` (a task that fails, or is killed at its
hard time limit, is rejected, not acked: to the dead-letter exchange, or
redelivered) and ``max_retries=10``. Every other keyword is Celery's task
option. ``client`` makes the idemgate client: it is called once in each
worker process (after the pool forks), never shared across a fork.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import threading
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Generic, Mapping, NoReturn, ParamSpec, Protocol, Sequence, TypeVar

from celery.exceptions import Reject  # type: ignore[import-untyped]

from .api import Client
from .errors import KeyReused, OutcomeUnknown, Problem, ResultNotCommitted, StoreUnavailable, TenantLimit
from .guard import DEFAULT_LEASE_SECONDS, Failure, Guard, Holding, InFlight, _verdict, classify_failure
from .keys import derive_key

__all__ = ["DeadLetter", "GuardedTask", "guarded_task", "label_for", "lease_for", "task_key"]

P = ParamSpec("P")
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Added to a task's time limit to size its lease: the commit after the effect.
LEASE_MARGIN_SECONDS = 5
#: The server's default longest lease (``IDEMGATE_MAX_LEASE``).
LONGEST_LEASE_SECONDS = 3600
#: What a guarded task's options default to (each may be given otherwise).
TASK_DEFAULTS: Mapping[str, Any] = {
    "acks_late": True,
    "reject_on_worker_lost": True,
    "acks_on_failure_or_timeout": False,
    "max_retries": 10,
}


def task_key(*, tenant: str, task: str, business_id: str, step: str | int = 1) -> str:
    """The key of a guarded task's effect: ``derive_key(tenant=tenant,
    run=business_id, step=step, tool=task)``; the same for every enqueue,
    redelivery and retry of that business id, never from the task id."""
    return derive_key(tenant=tenant, run=business_id, step=step, tool=task)


#: What idemgate refuses in a label besides control characters: Unicode's
#: bidirectional formatting characters (they reorder what an operator reads).
_BIDI_CONTROLS = frozenset(
    ["\u200e", "\u200f", "\u061c"] + [chr(c) for c in range(0x202A, 0x202F)] + [chr(c) for c in range(0x2066, 0x206A)]
)


def label_for(task: str, business_id: str) -> str:
    """The label a guarded task reserves with: ``"<task name> <business id>"``,
    cut to 200 characters, a control or bidirectional formatting character
    (which idemgate refuses in a label) shown as ``?``."""
    text = f"{task} {business_id}"[:200]
    return "".join("?" if unicodedata.category(c) == "Cc" or c in _BIDI_CONTROLS else c for c in text)


@dataclass(frozen=True)
class DeadLetter:
    """Why a guarded task's message is dead-lettered, for ``on_dead_letter``."""

    reason: str
    """``outcome_unknown``, ``result_not_committed``, ``key_reused``,
    ``idempotency_in_flight`` or ``store_unavailable`` (the last two once
    the task's retries ran out)."""
    key: str
    business_id: str
    task_id: str | None
    error: Exception
    result: Any = None
    """The effect's result when it acted but was not committed
    (``result_not_committed``): what an operator completes the key with."""


class GuardedTask(Protocol[P, T_co]):
    """What :func:`guarded_task` returns: the Celery task (its other
    attributes are Celery's)."""

    name: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T_co: ...

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Any: ...


def lease_for(task: Any, lease_seconds: int | None = None) -> int:
    """The lease a guarded task reserves with (see the module's doc)."""
    if lease_seconds is not None:
        return lease_seconds
    conf = task.app.conf
    hard, soft = getattr(task.request, "timelimit", None) or (None, None)
    hard = hard or task.time_limit or conf.task_time_limit
    soft = soft or task.soft_time_limit or conf.task_soft_time_limit
    limit = hard or soft
    if not limit:
        return DEFAULT_LEASE_SECONDS
    return min(LONGEST_LEASE_SECONDS, math.ceil(float(limit)) + LEASE_MARGIN_SECONDS)


class _PerProcess:
    """One client per worker process: made on first use after a fork."""

    def __init__(self, make: Callable[[], Client]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._pid = -1
        self._client: Client | None = None

    def get(self) -> Client:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client = self._make()
                self._pid = os.getpid()
            return self._client


@dataclass
class _Settings:
    clients: _PerProcess
    tenant: str
    business_id: str | Callable[..., str]
    step: str | int
    tool: str | None
    request: Callable[..., Mapping[str, Any]] | None
    on_dead_letter: Callable[[Any, DeadLetter], None] | None
    lease_seconds: int | None
    wait_budget: float
    commit_budget: float | None
    max_countdown: float
    classify_failure: Callable[[Exception], Failure]


@dataclass
class _Effect(Generic[T]):
    """The task's function as the guard's effect, remembering whether it ran
    and what it raised (the guard raises the effect's own exception)."""

    fn: Callable[..., T]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    raised: BaseException | None = None
    returned: bool = False
    result: Any = field(default=None, repr=False)

    def __call__(self, _holding: Holding) -> T:
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as error:
            self.raised = error
            raise
        self.returned, self.result = True, result
        return result


def guarded_task(
    app: Any,
    *,
    client: Callable[[], Client],
    tenant: str,
    business_id: str | Callable[..., str],
    step: str | int = 1,
    tool: str | None = None,
    request: Callable[..., Mapping[str, Any]] | None = None,
    on_dead_letter: Callable[[Any, DeadLetter], None] | None = None,
    lease_seconds: int | None = None,
    wait_budget: float = 2.0,
    commit_budget: float | None = None,
    max_countdown: float = 60.0,
    classify_failure: Callable[[Exception], Failure] = classify_failure,
    **options: Any,
) -> Callable[[Callable[P, T]], GuardedTask[P, T]]:
    """Registers the decorated function as a task of ``app`` whose effect runs
    at most once per business id (see the module's doc).

    ``business_id``: the name of the argument that holds it, or a function
    of the task's arguments returning it (a non-empty ``str``). ``tool``: the
    name the key is derived with, by default the task's name (renaming the
    task changes its keys). ``request``: a function of the arguments giving
    the reserve's ``request`` (``{"method", "path", "body"}``), by default
    ``POST /tasks/<task name>`` with the arguments by name as the body (so
    they must be JSON). ``options``: Celery's task options (``name``,
    ``time_limit``, ``queue``, …), over :data:`TASK_DEFAULTS`.
    """
    settings = _Settings(
        _PerProcess(client),
        tenant,
        business_id,
        step,
        tool,
        request,
        on_dead_letter,
        lease_seconds,
        wait_budget,
        commit_budget,
        max_countdown,
        classify_failure,
    )
    task_options = {**TASK_DEFAULTS, **options, "bind": True}

    def decorate(fn: Callable[P, T]) -> GuardedTask[P, T]:
        signature = inspect.signature(fn)

        def run(task: Any, *args: Any, **kwargs: Any) -> Any:
            return _run(task, settings, fn, signature, args, kwargs)

        # Celery names the task from these (``module.function``).
        run.__name__ = fn.__name__
        run.__qualname__ = fn.__qualname__
        run.__module__ = fn.__module__
        run.__doc__ = fn.__doc__
        registered: GuardedTask[P, T] = app.task(**task_options)(run)
        return registered

    return decorate


def _business_id(settings: _Settings, arguments: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    chosen = settings.business_id
    value = chosen(*args, **kwargs) if callable(chosen) else arguments.get(chosen)
    if not isinstance(value, str) or value == "":
        raise ValueError(
            "guarded_task: the business id must be a non-empty str "
            f"(got {type(value).__name__}): an empty one would make unrelated tasks share a key"
        )
    return value


def _run(
    task: Any,
    settings: _Settings,
    fn: Callable[..., Any],
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    business = _business_id(settings, arguments, args, kwargs)
    key = task_key(tenant=settings.tenant, task=settings.tool or task.name, business_id=business, step=settings.step)
    request = (
        settings.request(*args, **kwargs)
        if settings.request is not None
        else {"method": "POST", "path": f"/tasks/{task.name}", "body": arguments}
    )
    guard = Guard(
        settings.clients.get(),
        wait_budget=settings.wait_budget,
        lease_seconds=lease_for(task, settings.lease_seconds),
        on_lease_expiry="hold",
        classify_failure=settings.classify_failure,
        commit_budget=settings.commit_budget,
    )
    effect: _Effect[Any] = _Effect(fn, args, kwargs)
    try:
        return guard.run(key, effect, request=request, label=label_for(task.name, business))
    except Exception as error:
        letter = _letter(settings, error, effect, key, business, task.request.id)
        if letter is not None:
            _dead_letter(task, settings, letter)
        countdown = _countdown(settings, error, task.request.retries)
        if countdown is None:
            raise
        if task.max_retries is not None and task.request.retries >= task.max_retries:
            reason = error.dead_letter_reason if isinstance(error, InFlight) else "store_unavailable"
            _dead_letter(task, settings, DeadLetter(reason, key, business, task.request.id, error))
        raise task.retry(countdown=countdown, exc=error) from error


def _letter(
    settings: _Settings, error: Exception, effect: _Effect[Any], key: str, business: str, task_id: str | None
) -> DeadLetter | None:
    """The dead letter for ``error``, if it is one (see the module's doc)."""
    if effect.raised is error:
        # The effect's own exception: the guard released the key (it never
        # acted: the exception is the task's) or marked it unknown.
        if _verdict(settings.classify_failure, error) == "release":
            return None
        return DeadLetter(OutcomeUnknown.dead_letter_reason, key, business, task_id, error)
    if isinstance(error, ResultNotCommitted):
        return DeadLetter(error.dead_letter_reason, key, business, task_id, error, error.result)
    if isinstance(error, OutcomeUnknown):
        return DeadLetter(error.dead_letter_reason, key, business, task_id, error)
    if isinstance(error, KeyReused):
        return DeadLetter("key_reused", key, business, task_id, error)
    if effect.returned and isinstance(error, Problem) and not isinstance(error, StoreUnavailable):
        # The effect acted and the commit was refused (the lease was lost).
        return DeadLetter(ResultNotCommitted.dead_letter_reason, key, business, task_id, error, effect.result)
    return None


def _countdown(settings: _Settings, error: Exception, retries: int) -> float | None:
    """Seconds until the task's retry, for an error worth one (None: not)."""
    if isinstance(error, InFlight):
        if error.lease_expires_at is not None:
            left = (error.lease_expires_at - datetime.now(timezone.utc)).total_seconds()
            return _bounded(settings, left + random.uniform(0.2, 1.0))
        return _bounded(settings, random.uniform(1.0, 2.0))
    if isinstance(error, (StoreUnavailable, TenantLimit)) and not isinstance(error, ResultNotCommitted):
        if error.retry_after:
            return _bounded(settings, error.retry_after + random.uniform(0.0, 1.0))
        step = min(settings.max_countdown, float(2 ** min(retries, 16)))
        return _bounded(settings, random.uniform(step / 2, step))
    return None


def _bounded(settings: _Settings, seconds: float) -> float:
    return max(1.0, min(settings.max_countdown, seconds))


def _dead_letter(task: Any, settings: _Settings, letter: DeadLetter) -> NoReturn:
    """``on_dead_letter``, then the message rejected without requeue (to the
    queue's dead-letter exchange). Its reason, which Celery logs, names no
    key, argument or body."""
    if settings.on_dead_letter is not None:
        settings.on_dead_letter(task, letter)
    raise Reject(f"idemgate: {letter.reason} ({task.name})", requeue=False) from letter.error
