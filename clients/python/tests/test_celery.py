"""``idemgate_client.celery`` under real Celery workers on a real RabbitMQ,
killed with SIGKILL at random moments, and idemgate itself killed -9 and
restarted once.

Orders are enqueued as ``orders.charge`` tasks (tests/celery_orders.py),
some twice under two task ids (the same order), into a queue of the test's
own whose dead-letter exchange routes to ``<queue>.dlq``. Two prefork
workers (acks_late, reject_on_worker_lost) run them; while they do, the test
kills a pool process or a whole worker (then starts it again), and the
idemgate server. Once every message has come to an end, a checker reads the
history: the effect ledger (one row per execution of the effect, written by
the effect), the dead-letter queue's messages, the dead letters the task
recorded (their reasons), and each order's key at idemgate. It asserts that
no order's effect ran twice, and that every order either ran once (its key
completed, a replay answering its charge) or was dead-lettered (its message
in the dead-letter queue, with a reason): none lost, none acked unsettled.

RabbitMQ on 127.0.0.1:5672 (guest/guest, or ORDERS_BROKER): skipped when it
does not answer, failed under CI (``CI`` set). Run alone (marker
``celery``): it starts its own processes and kills them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import pytest

from conftest import TOKEN, Server, admin_view, closed_port, start_server

pytestmark = pytest.mark.celery

celery = pytest.importorskip("celery")

from kombu import Connection  # noqa: E402

import celery_orders  # noqa: E402
from idemgate_client import Client, Completed  # noqa: E402
from idemgate_client.celery import task_key  # noqa: E402

TESTS = Path(__file__).parent
ORDERS = 150
TWICE = 30  # orders enqueued a second time, under a new task id
KILLS = 8
TASK = "orders.charge"


def _broker_answers(url: str) -> bool:
    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 5672), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def broker() -> Iterator[str]:
    url = celery_orders.broker_url()
    if not _broker_answers(url):
        if os.environ.get("CI"):
            pytest.fail(f"RabbitMQ does not answer at {urlparse(url).hostname}:{urlparse(url).port} (CI requires it)")
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 (ORDERS_BROKER); CI requires it")
    yield url


class Worker:
    """One `celery worker` (prefork, 2 processes) in a process group of its own."""

    def __init__(self, name: str, env: dict[str, str], work: Path) -> None:
        self.name = name
        self.env = env
        self.log = work / f"worker-{name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "celery_orders", "worker", "--pool=prefork",
                 "--concurrency=2", "-n", f"{self.name}@%h", "-Q", self.env["ORDERS_QUEUE"],
                 "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING"],
                cwd=TESTS, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def pool_processes(self) -> list[int]:
        assert self.process is not None
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid …: comm may hold spaces, so after the last ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                children.append(int(entry))
        return children

    def kill_pool_process(self) -> bool:
        """SIGKILL to one of its pool processes (the worker requeues its task)."""
        children = self.pool_processes()
        if not children:
            return False
        try:
            os.kill(random.choice(children), signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL to the whole worker: RabbitMQ redelivers what it held."""
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def _sigkill_server(server: Server) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()


def _enqueue(producer: Any, queue: str, order: str, amount: int) -> str:
    task_id = str(uuid.uuid4())
    producer.send_task(TASK, args=[order, amount], task_id=task_id, queue=queue)
    return task_id


def _settled(db: sqlite3.Connection, task_ids: set[str]) -> set[str]:
    """The task ids that came to an end: a success, a failure (a rejection
    included) or a dead letter recorded."""
    ended = {row[0] for row in db.execute("SELECT task_id FROM events WHERE event IN ('success', 'failure')")}
    ended |= {row[0] for row in db.execute("SELECT task_id FROM dead_letters")}
    return task_ids & ended


def _ready(broker: str, queue: str) -> int:
    with Connection(broker) as conn:
        _, ready, _ = conn.default_channel.queue_declare(queue=queue, passive=True)
        return int(ready)


def _dead_lettered(broker: str, queue: str) -> list[dict[str, Any]]:
    """Every message of the dead-letter queue: its task id, order and x-death."""
    found = []
    with Connection(broker) as conn:
        channel = conn.default_channel
        while True:
            message = channel.basic_get(f"{queue}.dlq", no_ack=True)
            if message is None:
                return found
            headers = message.headers or {}
            args, _kwargs, _embed = json.loads(message.body)
            found.append({"task_id": headers.get("id"), "order": args[0], "x-death": headers.get("x-death")})


def _drop_queues(broker: str, queue: str) -> None:
    with Connection(broker) as conn:
        channel = conn.default_channel
        for name in (queue, f"{queue}.dlq"):
            channel.queue_delete(name)
        for name in (queue, f"{queue}.dlx"):
            channel.exchange_delete(name)


def test_killed_workers_and_server_never_charge_an_order_twice(broker: str, tmp_path: Path) -> None:
    started = time.monotonic()
    rng = random.Random()
    queue = f"idemgate-test-orders-{uuid.uuid4().hex[:10]}"
    ledger_path = tmp_path / "ledger.db"
    celery_orders.create_ledger(str(ledger_path))
    port = closed_port()
    database = f"sqlite://{tmp_path / 'keys.db'}"
    server = start_server(database, tmp_path / "serve-1", port=port)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "ORDERS_QUEUE": queue,
        "ORDERS_LEDGER": str(ledger_path),
        "ORDERS_IDEMGATE_URL": server.base_url,
        "ORDERS_IDEMGATE_TOKEN": TOKEN,
        "ORDERS_BROKER": broker,
        "ORDERS_LEASE": "5",
    }
    producer = celery.Celery("orders-producer", broker=broker)
    producer.conf.update(task_queues=celery_orders.task_queues(queue), task_default_queue=queue)
    workers: list[Worker] = []
    try:
        with Connection(broker) as conn:
            celery_orders.dead_letter_queue(queue)(conn.default_channel).declare()
            for declared in celery_orders.task_queues(queue):
                declared(conn.default_channel).declare()
        amounts = {f"order-{n:04d}": 100 + n for n in range(ORDERS)}
        tasks: dict[str, str] = {}  # task id -> order
        for order, amount in amounts.items():
            tasks[_enqueue(producer, queue, order, amount)] = order
        workers = [Worker(f"w{n}-{queue[-10:]}", env, tmp_path) for n in range(2)]

        kills = Counter[str]()
        twice = rng.sample(sorted(amounts), TWICE)
        for k in range(KILLS):
            time.sleep(rng.uniform(0.8, 2.2))
            if k == 2:
                for order in twice:  # a second enqueue of the same order: a new task id
                    tasks[_enqueue(producer, queue, order, amounts[order])] = order
            if k == KILLS // 2:
                _sigkill_server(server)
                kills["idemgate server"] += 1
                time.sleep(rng.uniform(0.2, 1.0))
                server = start_server(database, tmp_path / "serve-2", port=port)
            worker = rng.choice(workers)
            if rng.random() < 0.5 and worker.kill_pool_process():
                kills["pool process"] += 1
            else:
                worker.kill()
                kills["worker"] += 1
                time.sleep(rng.uniform(0.1, 0.8))
                worker.start()

        db = celery_orders.ledger(str(ledger_path))
        deadline = time.monotonic() + 120
        while True:
            settled = _settled(db, set(tasks))
            if len(settled) == len(tasks) and _ready(broker, queue) == 0:
                break
            assert time.monotonic() < deadline, (
                f"{len(tasks) - len(settled)} of {len(tasks)} messages never came to an end (lost?): "
                f"{sorted(tasks[t] for t in set(tasks) - settled)[:20]}"
            )
            time.sleep(0.5)
        # A message redelivered after its end (a worker killed before the
        # ack) runs once more: a replay or another dead letter. Let the
        # workers finish those, then stop them.
        time.sleep(3)
        for worker in workers:
            worker.kill()

        effects = Counter(row[0] for row in db.execute("SELECT order_id FROM effects"))
        charges = {row[0]: row[1] for row in db.execute("SELECT order_id, charge FROM effects")}
        reasons: dict[str, set[str]] = {}
        for order, reason in db.execute("SELECT order_id, reason FROM dead_letters"):
            reasons.setdefault(order, set()).add(reason)
        events = Counter(row[0] for row in db.execute("SELECT event FROM events"))
        letters = _dead_lettered(broker, queue)
        in_dlq = Counter(letter["order"] for letter in letters)

        twice_run = sorted(order for order, n in effects.items() if n > 1)
        ran_once: list[str] = []
        dead: list[str] = []
        lost: list[str] = []
        unexplained = [letter for letter in letters if letter["order"] not in reasons]
        silently_acked = sorted(order for order in reasons if order not in in_dlq)
        not_rejected = [letter for letter in letters
                        if not letter["x-death"] or letter["x-death"][0].get("reason") != "rejected"]
        with Client(server.base_url, token=TOKEN) as client:
            for order, amount in amounts.items():
                key = task_key(tenant="acme", task=TASK, business_id=order)
                if order in in_dlq:
                    dead.append(order)
                    continue
                request = {"method": "POST", "path": f"/tasks/{TASK}",
                           "body": {"order_id": order, "amount": amount}}
                answer = client.reserve(key, request=request)
                if (isinstance(answer, Completed) and effects[order] == 1
                        and json.loads(answer.response.text())["charge"] == charges[order]):
                    ran_once.append(order)
                else:
                    lost.append(order)
            labelled = admin_view(server.base_url, task_key(tenant="acme", task=TASK, business_id="order-0000"))

        by_reason = Counter(reason for order in dead for reason in reasons.get(order, ()))
        print(
            f"\ncelery: {ORDERS} orders ({len(tasks)} messages, {TWICE} orders enqueued twice); "
            f"kills: {dict(kills)}; ran once: {len(ran_once)}; dead-lettered: {len(dead)} "
            f"(reasons {dict(by_reason)}; {len(letters)} messages in the DLQ); effect ran twice: {len(twice_run)}; "
            f"lost: {len(lost)}; task events: {dict(events)}; {time.monotonic() - started:.0f} s"
        )
        assert twice_run == [], f"orders whose effect ran twice: {twice_run}"
        assert lost == [], f"orders neither committed once nor dead-lettered: {lost}"
        assert silently_acked == [], f"orders dead-lettered by the task but not in the DLQ: {silently_acked}"
        assert unexplained == [], f"DLQ messages without a recorded reason: {unexplained}"
        assert not_rejected == [], f"DLQ messages not rejected by the task: {not_rejected}"
        assert len(ran_once) + len(dead) == ORDERS
        assert sum(kills.values()) == KILLS + 1
        assert labelled.get("label") == f"{TASK} order-0000", labelled
    finally:
        for worker in workers:
            worker.kill()
        server.process.kill()
        server.process.wait()
        _drop_queues(broker, queue)
