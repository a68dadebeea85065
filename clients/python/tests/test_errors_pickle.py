"""Every exception the package defines survives pickle and deepcopy with its
class, message and fields: Celery and ``multiprocessing`` move exceptions by
pickle, and an ``OutcomeUnknown`` that arrives as something else is not
dead-lettered."""

from __future__ import annotations

import concurrent.futures
import copy
import importlib
import inspect
import multiprocessing
import pickle
import pkgutil
from datetime import datetime, timezone
from typing import Any, Callable
from uuid import UUID

import httpx
import pytest

import idemgate_client
from idemgate_client import InFlight, OutcomeUnknown, Problem, ResultNotCommitted, StoreUnavailable

RESERVATION = UUID("0190f3c2-7c1e-7a3b-9d2e-5f6a7b8c9d0e")
LEASE = "2026-12-07T10:15:30Z"


def _modules() -> list[Any]:
    """The package and each of its modules (an integration whose framework is
    not installed is left out: it cannot be imported, nor raise)."""
    found = [idemgate_client]
    for info in pkgutil.walk_packages(idemgate_client.__path__, "idemgate_client."):
        try:
            found.append(importlib.import_module(info.name))
        except ImportError:
            continue
    return found


def _exception_classes() -> list[type[BaseException]]:
    classes: dict[str, type[BaseException]] = {}
    for module in _modules():
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__.startswith("idemgate_client"):
                classes[f"{value.__module__}.{value.__qualname__}"] = value
    return [classes[name] for name in sorted(classes)]


def _problem(cls: type[Problem]) -> Problem:
    slug = cls.slug or "some-problem"
    return cls(
        409,
        {
            "type": f"https://idemgate.dev/problems/{slug}",
            "title": "A title",
            "detail": f"what the server said about {slug}",
            "status": 409,
            "lease_expires_at": LEASE,
            "retry_after_seconds": 2,
        },
        2.0,
    )


#: Classes whose constructor is not (status, body, retry_after) or a message.
BUILDERS: dict[type[BaseException], Callable[[], BaseException]] = {
    InFlight: lambda: InFlight("order-42", 30.4, datetime(2026, 12, 7, 10, 15, 30, tzinfo=timezone.utc)),
    ResultNotCommitted: lambda: ResultNotCommitted.of(
        RESERVATION,
        {"charge": "ch_1", "amount": 500},
        '{"charge": "ch_1", "amount": 500}',
        31.2,
        StoreUnavailable.unreachable(
            "POST", f"/v1/reservations/{RESERVATION}/commit", httpx.ConnectError("All connection attempts failed")
        ),
    ),
}


def build(cls: type[BaseException]) -> BaseException:
    if cls in BUILDERS:
        return BUILDERS[cls]()
    if issubclass(cls, Problem):
        return _problem(cls)
    try:
        return cls("what went wrong")
    except TypeError as error:  # a new class with another constructor: give it a builder here
        raise AssertionError(f"add a builder for {cls.__qualname__} to BUILDERS: {error}") from error


CLASSES = _exception_classes()


def test_the_classes_are_discovered():
    names = {cls.__qualname__ for cls in CLASSES}
    # A few that must be there: the discovery works, and it is not hand-listed.
    assert {"IdemgateError", "Problem", "OutcomeUnknown", "StoreUnavailable", "ResultNotCommitted", "InFlight",
            "NotExecuted"} <= names
    assert len(CLASSES) >= 20


def _same(original: BaseException, back: BaseException) -> None:
    assert type(back) is type(original)
    assert str(back) == str(original)
    assert back.args == original.args
    assert vars(back) == vars(original)
    for name in dir(original):
        if name.startswith("__") or name in ("with_traceback", "add_note"):
            continue
        value = getattr(original, name)
        if callable(value):
            continue
        assert getattr(back, name) == value, name


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__qualname__)
def test_every_exception_survives_pickle_and_deepcopy(cls: type[BaseException]):
    original = build(cls)
    try:
        raise original from ValueError("the cause")
    except BaseException as raised:
        add_note = getattr(raised, "add_note", None)
        if add_note is not None:
            add_note("idemgate: a note")
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        _same(original, pickle.loads(pickle.dumps(original, protocol=protocol)))
    _same(original, copy.deepcopy(original))
    _same(original, copy.copy(original))


def test_the_fields_that_matter_come_back():
    unknown = pickle.loads(pickle.dumps(_problem(OutcomeUnknown)))
    assert isinstance(unknown, OutcomeUnknown)
    assert unknown.dead_letter_reason == "outcome_unknown"
    assert unknown.status == 409 and unknown.retry_after == 2.0
    assert unknown.lease_expires_at == datetime(2026, 12, 7, 10, 15, 30, tzinfo=timezone.utc)
    assert unknown.detail == "what the server said about outcome-unknown"

    unsaved = pickle.loads(pickle.dumps(BUILDERS[ResultNotCommitted]()))
    assert isinstance(unsaved, ResultNotCommitted) and isinstance(unsaved, StoreUnavailable)
    assert unsaved.result == {"charge": "ch_1", "amount": 500}
    assert unsaved.reservation_id == RESERVATION and unsaved.waited == 31.2
    assert unsaved.dead_letter_reason == "result_not_committed" and not unsaved.answered


def _raise_outcome_unknown() -> None:
    raise _problem(OutcomeUnknown)


def test_an_exception_raised_in_a_worker_process_arrives_as_itself():
    # multiprocessing moves the worker's exception to the parent by pickle.
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        with pytest.raises(OutcomeUnknown) as raised:
            pool.submit(_raise_outcome_unknown).result()
    assert raised.value.dead_letter_reason == "outcome_unknown"
    assert raised.value.detail == "what the server said about outcome-unknown"
