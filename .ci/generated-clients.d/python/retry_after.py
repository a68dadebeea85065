"""A client nobody here wrote honouring Retry-After: requests with urllib3's
Retry, which sleeps what a 409 tells it before it asks again.

A duplicate of a key whose first request is still running gets 409 with
Retry-After; the first request is committed 1.5 s later. The retrying client
must have its replay within a few seconds (what the first request took), not
after the 30 s lease a Retry-After of the whole lease would have had it wait.

    python retry_after.py BASE_URL TOKEN
"""

import sys
import threading
import time
import uuid

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry


def main() -> int:
    base, token = sys.argv[1], sys.argv[2]
    auth = {"Authorization": f"Bearer {token}"}
    key = {"Idempotency-Key": f'"urllib3-{uuid.uuid4()}"'}
    body = {"fingerprint": "urllib3-retry-after"}

    first = requests.post(f"{base}/v1/reservations", json=body, headers={**auth, **key}, timeout=10)
    if first.status_code != 201:
        print(f"reserve: expected 201, got {first.status_code}: {first.text}", file=sys.stderr)
        return 1
    rid = first.json()["reservation_id"]

    def commit_later() -> None:
        time.sleep(1.5)
        requests.post(
            f"{base}/v1/reservations/{rid}/commit",
            json={"status": 201, "headers": [["content-type", "text/plain"]], "body": "charged"},
            headers=auth,
            timeout=10,
        ).raise_for_status()

    committer = threading.Thread(target=commit_later)
    committer.start()

    retry = Retry(
        total=20,
        status_forcelist=[409],
        allowed_methods=None,  # POST too: the key makes it safe to retry
        respect_retry_after_header=True,
        backoff_factor=0,
        raise_on_status=False,
    )
    session = requests.Session()
    session.mount("http://", HTTPAdapter(max_retries=retry))
    started = time.monotonic()
    res = session.post(f"{base}/v1/reservations", json=body, headers={**auth, **key}, timeout=60)
    took = time.monotonic() - started
    committer.join()

    problems = []
    if res.status_code != 200 or res.headers.get("idempotent-replayed") != "true":
        problems.append(f"expected the 200 replay, got {res.status_code}: {res.text[:300]}")
    elif res.json()["response"]["body"] != "charged":
        problems.append(f"replayed another response: {res.text[:300]}")
    if took > 6:
        problems.append(f"the retrying client waited {took:.1f} s for a request that took 1.5 s")
    for p in problems:
        print(f"urllib3 Retry: {p}", file=sys.stderr)
    if not problems:
        print(f"urllib3 Retry honoured Retry-After and had its replay after {took:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
