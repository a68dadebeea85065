"""The Celery app of tests/test_celery.py: a guarded task, ``orders.charge``,
whose effect appends a row to a SQLite ledger (one row per execution, written
by the effect itself), ``orders.charge_slowly``, the same 2 s slower, and
``orders.refuse``, whose effect never acts, run
by real workers (``celery -A celery_orders
worker``) on RabbitMQ.

Its settings come from the environment the test starts the workers with:
ORDERS_QUEUE (the queue; its dead-letter exchange and queue are
``<queue>.dlx`` and ``<queue>.dlq``), ORDERS_LEDGER (the SQLite file),
ORDERS_IDEMGATE_URL, ORDERS_IDEMGATE_TOKEN, ORDERS_BROKER, ORDERS_LEASE.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
import uuid
from typing import Any

from kombu import Exchange, Queue


def task_queues(name: str) -> list[Queue]:
    """The orders queue, whose rejected messages go to ``<name>.dlx`` (and
    from there to ``<name>.dlq``), as the docs' recipe declares it."""
    return [
        Queue(
            name,
            Exchange(name, type="direct"),
            routing_key=name,
            queue_arguments={
                "x-dead-letter-exchange": f"{name}.dlx",
                "x-dead-letter-routing-key": f"{name}.dlq",
            },
        )
    ]


def dead_letter_queue(name: str) -> Queue:
    return Queue(f"{name}.dlq", Exchange(f"{name}.dlx", type="direct"), routing_key=f"{name}.dlq")


def ledger(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, timeout=60, isolation_level=None)
    db.execute("PRAGMA busy_timeout = 60000")
    return db


def create_ledger(path: str) -> None:
    db = ledger(path)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("CREATE TABLE effects (order_id TEXT, charge TEXT, amount INTEGER, pid INTEGER, at REAL)")
    db.execute("CREATE TABLE dead_letters (order_id TEXT, reason TEXT, task_id TEXT, at REAL, result TEXT)")
    db.execute("CREATE TABLE events (task_id TEXT, order_id TEXT, event TEXT, detail TEXT, at REAL)")
    db.close()


def broker_url() -> str:
    return os.environ.get("ORDERS_BROKER", "amqp://guest:guest@127.0.0.1:5672//")


if "ORDERS_QUEUE" in os.environ:
    from celery import Celery
    from celery.signals import task_failure, task_retry, task_success

    from idemgate_client import Client, NotExecuted
    from idemgate_client.celery import DeadLetter, guarded_task

    QUEUE = os.environ["ORDERS_QUEUE"]
    LEDGER = os.environ["ORDERS_LEDGER"]

    app = Celery("orders", broker=broker_url())
    app.conf.update(
        task_queues=task_queues(QUEUE),
        task_default_queue=QUEUE,
        task_default_exchange=QUEUE,
        task_default_routing_key=QUEUE,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
    )

    def _event(task_id: str | None, order_id: str | None, event: str, detail: str = "") -> None:
        db = ledger(LEDGER)
        db.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?)", (task_id, order_id, event, detail, time.time()))
        db.close()

    def record_dead_letter(task: Any, letter: DeadLetter) -> None:
        db = ledger(LEDGER)
        db.execute(
            "INSERT INTO dead_letters VALUES (?, ?, ?, ?, ?)",
            (letter.business_id, letter.reason, letter.task_id, time.time(), json.dumps(letter.result)),
        )
        db.close()

    # Both tasks guard alike: the test's idemgate, the order id, the
    # dead-letter table, a short lease and countdown.
    guarded: dict[str, Any] = dict(
        client=lambda: Client(os.environ["ORDERS_IDEMGATE_URL"], token=os.environ["ORDERS_IDEMGATE_TOKEN"], timeout=5),
        tenant="acme",
        business_id="order_id",
        on_dead_letter=record_dead_letter,
        lease_seconds=int(os.environ.get("ORDERS_LEASE", "5")),
        max_countdown=3,
    )

    @guarded_task(app, name="orders.charge", **guarded)
    def charge(order_id: str, amount: int) -> dict[str, Any]:
        """Charges the order: the ledger's row is the charge (the effect)."""
        time.sleep(random.uniform(0.0, 0.3))
        made = f"ch_{uuid.uuid4().hex[:16]}"
        db = ledger(LEDGER)
        db.execute("INSERT INTO effects VALUES (?, ?, ?, ?, ?)", (order_id, made, amount, os.getpid(), time.time()))
        db.close()
        time.sleep(random.uniform(0.0, 0.3))
        return {"charge": made, "order": order_id, "amount": amount}

    @guarded_task(app, name="orders.charge_slowly", **guarded)
    def charge_slowly(order_id: str, amount: int) -> dict[str, Any]:
        """As ``charge``, then 2 s before it returns (a test stops idemgate meanwhile)."""
        made = f"ch_{uuid.uuid4().hex[:16]}"
        db = ledger(LEDGER)
        db.execute("INSERT INTO effects VALUES (?, ?, ?, ?, ?)", (order_id, made, amount, os.getpid(), time.time()))
        db.close()
        time.sleep(2)
        return {"charge": made, "order": order_id, "amount": amount}

    @guarded_task(
        app,
        client=lambda: Client(os.environ["ORDERS_IDEMGATE_URL"], token=os.environ["ORDERS_IDEMGATE_TOKEN"], timeout=5),
        tenant="acme",
        business_id="order_id",
        on_dead_letter=record_dead_letter,
        name="orders.refuse",
    )
    def refuse(order_id: str) -> None:
        """The provider refused before anything happened: the key is released."""
        raise NotExecuted("card declined")

    @task_success.connect
    def _succeeded(sender: Any = None, result: Any = None, **_: Any) -> None:
        request = sender.request
        _event(request.id, (request.args or [None])[0], "success", str(result.get("charge") if result else ""))

    @task_retry.connect
    def _retried(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
        # reason: Celery's Retry, whose exc is what the task retried for.
        _event(request.id, (request.args or [None])[0], "retry", type(getattr(reason, "exc", reason)).__name__)

    @task_failure.connect
    def _failed(sender: Any = None, task_id: str | None = None, exception: Any = None, args: Any = None, **_: Any) -> None:
        _event(task_id, (args or [None])[0], "failure", f"{type(exception).__name__}: {exception}")
