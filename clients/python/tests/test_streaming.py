"""Server-sent events through a real idemgate proxy, read by httpx as an agent
reads a model API's stream: each event as it is sent, the whole stream
replayed to a retry."""

from __future__ import annotations

import threading
import time
import uuid

import httpx

WHOLE = "data: token 0\n\ndata: token 1\n\ndata: token 2\n\n"


def test_events_arrive_as_sent_and_the_retry_gets_the_whole_stream(proxied):
    url, origin = proxied
    key = f'"{uuid.uuid4()}"'
    headers = {"Idempotency-Key": key, "content-type": "application/json"}
    origin.gates[key] = gate = threading.Event()
    received: list[tuple[float, str]] = []
    waited: list[httpx.Response] = []

    def duplicate() -> None:
        # Sent while the stream runs: it waits for the end, then has it all.
        waited.append(httpx.post(f"{url}/events", content=b"{}",
                                 headers={**headers, "Prefer": "wait=10"}, timeout=15))

    with httpx.Client(timeout=15) as client:
        with client.stream("POST", f"{url}/events", content=b"{}", headers=headers) as res:
            assert res.status_code == 200
            assert res.headers["content-type"] == "text/event-stream"
            for line in res.iter_lines():
                if line:
                    received.append((time.monotonic(), line))
                    if len(received) == 1:
                        waiter = threading.Thread(target=duplicate)
                        waiter.start()
                        time.sleep(0.2)
                    if len(received) < 3:
                        gate.set()
        waiter.join()

    assert [line for _, line in received] == ["data: token 0", "data: token 1", "data: token 2"]
    sent = origin.events_sent[key]
    # Each event was in the client's hands before the origin sent the next.
    assert received[0][0] < sent[1]
    assert received[1][0] < sent[2]

    [late] = waited
    assert late.status_code == 200
    assert late.headers.get("idempotent-replayed") == "true"
    assert late.text == WHOLE

    again = httpx.post(f"{url}/events", content=b"{}", headers=headers, timeout=15)
    assert again.status_code == 200
    assert again.headers["content-type"] == "text/event-stream"
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.text == WHOLE
    assert origin.calls[key] == 1, "the origin streamed once"
