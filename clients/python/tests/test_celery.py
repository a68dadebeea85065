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

from conftest import TOKEN, admin_view, closed_port, start_server

pytestmark = pytest.mark.celery

celery = pytest.importorskip("celery")

from kombu import Connection  # noqa: E402

import celery_orders  # noqa: E402
from idemgate_client import Client, Completed, Reserved  # noqa: E402
from idemgate_client.celery import label_for, lease_for, task_key  # noqa: E402

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
        """SIGKILL to one of its pool processes (the worker requeues its task);
        False if it has none within 5 s (it is starting)."""
        deadline = time.monotonic() + 5
        while not (children := self.pool_processes()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
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


class Orders:
    """A test's own world: idemgate serve on a SQLite file, a queue (with its
    dead-letter exchange and queue), the ledger, a producer, the workers."""

    def __init__(self, broker: str, work: Path) -> None:
        self.broker = broker
        self.work = work
        self.queue = f"idemgate-test-orders-{uuid.uuid4().hex[:10]}"
        self.ledger_path = work / "ledger.db"
        celery_orders.create_ledger(str(self.ledger_path))
        self.port = closed_port()
        self.database = f"sqlite://{work / 'keys.db'}"
        self.server = start_server(self.database, work / "serve-1", port=self.port)
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)]),
            "PYTHONDONTWRITEBYTECODE": "1",
            "ORDERS_QUEUE": self.queue,
            "ORDERS_LEDGER": str(self.ledger_path),
            "ORDERS_IDEMGATE_URL": self.server.base_url,
            "ORDERS_IDEMGATE_TOKEN": TOKEN,
            "ORDERS_BROKER": broker,
            "ORDERS_LEASE": "5",
        }
        self.producer = celery.Celery("orders-producer", broker=broker)
        self.producer.conf.update(task_queues=celery_orders.task_queues(self.queue), task_default_queue=self.queue)
        with Connection(broker) as conn:
            celery_orders.dead_letter_queue(self.queue)(conn.default_channel).declare()
            for declared in celery_orders.task_queues(self.queue):
                declared(conn.default_channel).declare()
        self.workers: list[Worker] = []
        self.db = celery_orders.ledger(str(self.ledger_path))
        self.restarts = 0

    def worker(self, n: int) -> Worker:
        started = Worker(f"w{n}-{self.queue[-10:]}", self.env, self.work)
        self.workers.append(started)
        return started

    def enqueue(self, task: str, *args: Any) -> str:
        task_id = str(uuid.uuid4())
        self.producer.send_task(task, args=list(args), task_id=task_id, queue=self.queue)
        return task_id

    def restart_server(self) -> None:
        """idemgate killed with SIGKILL, then started again on its database and
        port within a second."""
        self.server.process.send_signal(signal.SIGKILL)
        self.server.process.wait()
        time.sleep(random.uniform(0.2, 1.0))
        self.restarts += 1
        self.server = start_server(self.database, self.work / f"serve-{self.restarts + 1}", port=self.port)

    def wait_settled(self, task_ids: set[str], within: float) -> None:
        """Until every task id came to an end and the queue has nothing ready."""
        deadline = time.monotonic() + within
        while True:
            settled = _settled(self.db, task_ids)
            if len(settled) == len(task_ids) and _ready(self.broker, self.queue) == 0:
                return
            assert time.monotonic() < deadline, (
                f"{len(task_ids) - len(settled)} of {len(task_ids)} messages never came to an end (lost?)"
            )
            time.sleep(0.5)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.server.process.kill()
        self.server.process.wait()
        self.db.close()
        _drop_queues(self.broker, self.queue)


@pytest.fixture
def orders(tmp_path: Path) -> Iterator[Orders]:
    url = celery_orders.broker_url()
    if not _broker_answers(url):
        if os.environ.get("CI"):
            pytest.fail(f"RabbitMQ does not answer at {urlparse(url).hostname}:{urlparse(url).port} (CI requires it)")
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 (ORDERS_BROKER); CI requires it")
    world = Orders(url, tmp_path)
    try:
        yield world
    finally:
        world.close()


def test_killed_workers_and_server_never_charge_an_order_twice(orders: Orders) -> None:
    started = time.monotonic()
    rng = random.Random()
    amounts = {f"order-{n:04d}": 100 + n for n in range(ORDERS)}
    tasks: dict[str, str] = {}  # task id -> order
    for order, amount in amounts.items():
        tasks[orders.enqueue(TASK, order, amount)] = order
    workers = [orders.worker(n) for n in range(2)]

    kills = Counter[str]()
    twice = rng.sample(sorted(amounts), TWICE)
    for k in range(KILLS):
        time.sleep(rng.uniform(0.8, 2.2))
        if k == 2:
            for order in twice:  # a second enqueue of the same order: a new task id
                tasks[orders.enqueue(TASK, order, amounts[order])] = order
        if k == KILLS // 2:
            orders.restart_server()
            kills["idemgate server"] += 1
        worker = rng.choice(workers)
        # Both kinds, in turn: a pool process (the worker requeues its
        # task) and a whole worker (RabbitMQ redelivers what it held).
        if k % 2 == 0 and worker.kill_pool_process():
            kills["pool process"] += 1
        else:
            worker.kill()
            kills["worker"] += 1
            time.sleep(rng.uniform(0.1, 0.8))
            worker.start()

    orders.wait_settled(set(tasks), within=120)
    # A message redelivered after its end (a worker killed before the ack)
    # runs once more: a replay or another dead letter. Let the workers
    # finish those, then stop them.
    time.sleep(3)
    for worker in workers:
        worker.kill()

    db, broker, queue, server = orders.db, orders.broker, orders.queue, orders.server

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


def _events(db: sqlite3.Connection, task_id: str) -> list[tuple[str, str]]:
    return [(row[0], row[1]) for row in db.execute("SELECT event, detail FROM events WHERE task_id = ? ORDER BY at", (task_id,))]


def test_in_flight_is_retried_another_payload_dead_lettered_a_refusal_released(orders: Orders) -> None:
    """No kills: a key another holder keeps is a retry with a countdown (the
    worker is not held), and the holder's result is the task's; the same
    order with another amount is dead-lettered as key_reused, never charged
    again; an effect that proves it never acted releases its key."""
    request = {"method": "POST", "path": f"/tasks/{TASK}", "body": {"order_id": "order-held", "amount": 7}}
    with Client(orders.server.base_url, token=TOKEN) as client:
        held = client.reserve(task_key(tenant="acme", task=TASK, business_id="order-held"), request=request,
                              lease_seconds=20, on_lease_expiry="hold")
        assert isinstance(held, Reserved)
        first = orders.enqueue(TASK, "order-same", 5)
        held_task = orders.enqueue(TASK, "order-held", 7)
        orders.worker(0)
        orders.wait_settled({first}, within=60)
        other = orders.enqueue(TASK, "order-same", 6)
        refused = orders.enqueue("orders.refuse", "order-refused")
        deadline = time.monotonic() + 30
        while ("retry", "InFlight") not in _events(orders.db, held_task):
            assert time.monotonic() < deadline, _events(orders.db, held_task)
            time.sleep(0.2)
        client.commit(held.reservation_id, status=200, body=json.dumps({"charge": "ch_held"}))
        orders.wait_settled({first, held_task, other, refused}, within=60)

        effects = Counter(row[0] for row in orders.db.execute("SELECT order_id FROM effects"))
        assert effects == {"order-same": 1}, effects
        assert _events(orders.db, held_task)[-1] == ("success", "ch_held")
        letters = {(row[0], row[1], row[2])
                   for row in orders.db.execute("SELECT order_id, reason, task_id FROM dead_letters")}
        assert letters == {("order-same", "key_reused", other)}, letters
        time.sleep(1)
        in_dlq = {letter["task_id"]: letter["order"] for letter in _dead_lettered(orders.broker, orders.queue)}
        # The refusal failed (NotExecuted) and, with acks_on_failure_or_timeout
        # off, was rejected to the dead-letter queue too, without a dead letter.
        assert in_dlq == {other: "order-same", refused: "order-refused"}, in_dlq
        assert _events(orders.db, refused)[-1][0] == "failure"
        # Released: the next reserve of its key is a new reservation.
        again = client.reserve(task_key(tenant="acme", task="orders.refuse", business_id="order-refused"),
                               request={"method": "POST", "path": "/tasks/orders.refuse",
                                        "body": {"order_id": "order-refused"}})
        assert isinstance(again, Reserved) and again.attempt == 1
        assert admin_view(orders.server.base_url, task_key(tenant="acme", task=TASK, business_id="order-same"))[
            "state"] == "completed"


def test_the_label_and_the_lease_follow_the_task() -> None:
    """No broker: the label idemgate accepts, and the lease from the time limits."""
    assert label_for("orders.charge", "order-1042") == "orders.charge order-1042"
    assert label_for("orders.charge", "o\x1b[2J\u202e1") == "orders.charge o?[2J?1"
    assert len(label_for("orders.charge", "x" * 500)) == 200

    app = celery.Celery("lease-test", set_as_current=False)

    @app.task(bind=True, time_limit=120, soft_time_limit=100)
    def limited(self: Any) -> None: ...

    @app.task(bind=True, soft_time_limit=40)
    def soft(self: Any) -> None: ...

    @app.task(bind=True)
    def unlimited(self: Any) -> None: ...

    assert lease_for(limited) == 125
    assert lease_for(soft) == 45
    assert lease_for(unlimited) == 30
    assert lease_for(unlimited, 7) == 7
    app.conf.task_time_limit = 10_000
    assert lease_for(unlimited) == 3600


def test_idemgate_away_is_a_retry_before_the_effect_and_a_dead_letter_with_the_result_after(orders: Orders) -> None:
    """idemgate killed while an effect runs and kept away past the commit's
    budget (the lease, 5 s): the effect's result is dead-lettered as
    result_not_committed, with the result, never run again; a task that
    finds idemgate away before its effect retries and, once it is back, runs."""
    orders.worker(0)
    slow = orders.enqueue("orders.charge_slowly", "order-unsaved", 9)
    deadline = time.monotonic() + 30
    while not orders.db.execute("SELECT 1 FROM effects WHERE order_id = 'order-unsaved'").fetchone():
        assert time.monotonic() < deadline, "the slow charge never ran"
        time.sleep(0.05)
    server_pid = orders.server.process.pid
    orders.server.process.send_signal(signal.SIGKILL)
    orders.server.process.wait()
    killed = time.monotonic()
    later = orders.enqueue(TASK, "order-later", 11)
    deadline = time.monotonic() + 30
    while ("retry", "StoreUnavailable") not in _events(orders.db, later):
        assert time.monotonic() < deadline, _events(orders.db, later)
        time.sleep(0.2)
    # Away past the effect's last 2 s and the commit's budget (the 5 s lease).
    time.sleep(max(0.0, killed + 2 + 5 + 2 - time.monotonic()))
    orders.restarts += 1
    orders.server = start_server(orders.database, orders.work / "serve-back", port=orders.port)
    assert orders.server.process.pid != server_pid
    orders.wait_settled({slow, later}, within=60)

    effects = Counter(row[0] for row in orders.db.execute("SELECT order_id FROM effects"))
    assert effects == {"order-unsaved": 1, "order-later": 1}, effects
    (reason, result), = orders.db.execute(
        "SELECT reason, result FROM dead_letters WHERE order_id = 'order-unsaved'").fetchall()
    charge = orders.db.execute("SELECT charge FROM effects WHERE order_id = 'order-unsaved'").fetchone()[0]
    assert reason == "result_not_committed" and json.loads(result)["charge"] == charge
    assert _events(orders.db, later)[-1][0] == "success"
    time.sleep(1)
    in_dlq = {letter["task_id"]: letter["order"] for letter in _dead_lettered(orders.broker, orders.queue)}
    assert in_dlq == {slow: "order-unsaved"}, in_dlq
    # The key is not completed: an operator completes it with the letter's result.
    view = admin_view(orders.server.base_url, task_key(tenant="acme", task="orders.charge_slowly",
                                                       business_id="order-unsaved"))
    assert view["state"] in ("in_flight", "unknown"), view
