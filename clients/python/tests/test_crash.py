"""A process killed in the middle of its effect, and the takeover after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from idemgate_client import Client, Guard, Holding, OutcomeUnknown, Reconciled, derive_key

from conftest import TOKEN

CHARGE = {"method": "POST", "path": "/charges", "body": {"amount": 500}}

AGENT = textwrap.dedent(
    """
    import sys, time
    from idemgate_client import Client, Guard
    url, token, key, marker, mode = sys.argv[1:6]

    def charge(holding):
        # The charge went out; the process dies before it can commit.
        holding.checkpoint("charge-sent", {"charge": "ch_42"})
        open(marker, "w").write(str(holding.attempt))
        time.sleep(60)
        return {"charge": "never"}

    # "takeover": the caller's own choice, the effect reconciles by itself;
    # "reconcile": a reconcile function (so takeover); "default": neither (hold).
    guard = Guard(Client(url, token=token), lease_seconds=2,
                  on_lease_expiry="takeover" if mode == "takeover" else None)
    guard.run(key, charge, request={"method": "POST", "path": "/charges", "body": {"amount": 500}},
              reconcile=(lambda holding: None) if mode == "reconcile" else None)
    """
)


def kill_after_acting(server, key: str, tmp_path: Path, mode: str) -> float:
    """Runs the agent until its charge went out, kills it: the kill's time."""
    marker = tmp_path / "acted"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    agent = subprocess.Popen([sys.executable, "-c", AGENT, server.base_url, TOKEN, key, str(marker), mode], env=env)
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert agent.poll() is None, "the agent exited before acting"
        assert time.monotonic() < deadline, "the agent did not act within 20 s"
        time.sleep(0.05)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    return time.monotonic()


def test_a_killed_holder_is_taken_over_with_its_recovery_point(server, tmp_path: Path):
    key = derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")
    killed = kill_after_acting(server, key, tmp_path, "takeover")

    seen: list[Holding] = []

    def reconcile(holding: Holding) -> dict[str, object]:
        seen.append(holding)
        # A takeover must look before it acts: the charge was sent already.
        assert holding.recovery is not None and holding.recovery.recovery_point == "charge-sent"
        return {"charge": holding.recovery.data["charge"], "reconciled": True}

    with Client(server.base_url, token=TOKEN) as client:
        result = Guard(client, wait_budget=15, on_lease_expiry="takeover").run(key, reconcile, request=CHARGE)
        again = Guard(client, on_lease_expiry="takeover").run(key, reconcile, request=CHARGE)
    assert result == again == {"charge": "ch_42", "reconciled": True}
    assert len(seen) == 1 and seen[0].attempt == 2
    # Within the dead holder's last lease (2 s) and a poll or two.
    assert time.monotonic() - killed < 8


def test_a_killed_holder_is_reconciled_from_its_recovery_point(server, tmp_path: Path):
    key = derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")
    kill_after_acting(server, key, tmp_path, "reconcile")
    seen: list[Holding] = []
    runs = 0

    def charge(_: Holding) -> dict[str, object]:
        nonlocal runs
        runs += 1
        return {"charge": "ch_again"}

    def reconcile(holding: Holding) -> Reconciled[dict[str, object]] | None:
        seen.append(holding)
        if holding.recovery is not None and holding.recovery.recovery_point == "charge-sent":
            return Reconciled({"charge": holding.recovery.data["charge"], "reconciled": True})
        return None

    with Client(server.base_url, token=TOKEN) as client:
        result = Guard(client, wait_budget=15).run(key, charge, request=CHARGE, reconcile=reconcile)
        again = Guard(client).run(key, charge, request=CHARGE, reconcile=reconcile)
    assert result == again == {"charge": "ch_42", "reconciled": True}
    assert runs == 0 and len(seen) == 1 and seen[0].attempt == 2


def test_a_killed_holder_under_the_default_is_never_run_again(server, tmp_path: Path):
    key = derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")
    kill_after_acting(server, key, tmp_path, "default")
    runs = 0

    def charge(_: Holding) -> dict[str, object]:
        nonlocal runs
        runs += 1
        return {"charge": "ch_again"}

    with Client(server.base_url, token=TOKEN) as client:
        # Within the lease: in flight, waited for; past it: unknown, not run.
        with pytest.raises(OutcomeUnknown):
            Guard(client, wait_budget=15).run(key, charge, request=CHARGE)
        with pytest.raises(OutcomeUnknown):
            Guard(client).run(key, charge, request=CHARGE, reconcile=lambda h: None)
    assert runs == 0
