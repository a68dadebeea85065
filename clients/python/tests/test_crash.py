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

from idemgate_client import Client, Guard, Holding, derive_key

from conftest import TOKEN

CHARGE = {"method": "POST", "path": "/charges", "body": {"amount": 500}}

AGENT = textwrap.dedent(
    """
    import sys, time
    from idemgate_client import Client, Guard
    url, token, key, marker = sys.argv[1:5]

    def charge(holding):
        # The charge went out; the process dies before it can commit.
        holding.checkpoint("charge-sent", {"charge": "ch_42"})
        open(marker, "w").write(str(holding.attempt))
        time.sleep(60)
        return {"charge": "never"}

    Guard(Client(url, token=token), lease_seconds=2).run(
        key, charge, request={"method": "POST", "path": "/charges", "body": {"amount": 500}})
    """
)


def test_a_killed_holder_is_taken_over_with_its_recovery_point(server, tmp_path: Path):
    key = derive_key(tenant="acme", run=f"run-{uuid.uuid4()}", step=1, tool="charge")
    marker = tmp_path / "acted"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    agent = subprocess.Popen([sys.executable, "-c", AGENT, server.base_url, TOKEN, key, str(marker)], env=env)
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert agent.poll() is None, "the agent exited before acting"
        assert time.monotonic() < deadline, "the agent did not act within 20 s"
        time.sleep(0.05)
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    killed = time.monotonic()

    seen: list[Holding] = []

    def reconcile(holding: Holding) -> dict[str, object]:
        seen.append(holding)
        # A takeover must look before it acts: the charge was sent already.
        assert holding.recovery is not None and holding.recovery.recovery_point == "charge-sent"
        return {"charge": holding.recovery.data["charge"], "reconciled": True}

    with Client(server.base_url, token=TOKEN) as client:
        result = Guard(client, wait_budget=15).run(key, reconcile, request=CHARGE)
        again = Guard(client).run(key, reconcile, request=CHARGE)
    assert result == again == {"charge": "ch_42", "reconciled": True}
    assert len(seen) == 1 and seen[0].attempt == 2
    # Within the dead holder's last lease (2 s) and a poll or two.
    assert time.monotonic() - killed < 8
