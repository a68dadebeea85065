"""The reservation API through the client openapi-python-client generates
from openapi/openapi.json, against a running `idemgate serve`.

Every call goes through the generated functions and models, so a document
that generates a client which cannot make a call, or cannot read an answer,
fails here. Each step checks the status, the body, and the headers a client
relies on.

Then a key its holder marks unknown through the generated
`mark_reservation_unknown`: the record comes back `unknown` with the reason,
a duplicate is `409 outcome-unknown` at once (no Retry-After), an empty
reason is `400`, an unknown id `404`, and the holder's late commit settles
it into a replay.

Then one stuck key settled through the generated admin operations: a key
reserved under `on_lease_expiry: hold` with a one-second lease and left
alone is `409 outcome-unknown`; `list_keys` (state=unknown, with the admin
token) finds it by the SHA-256 of the key; `resolve_key` completes it with a
response; and the next reserve replays that response.

    python driver.py BASE_URL TOKEN ADMIN_TOKEN TENANT

TENANT is the name the server gives TOKEN's tenant; ADMIN_TOKEN is one of
its IDEMGATE_ADMIN_TOKENS.
"""

import hashlib
import sys
import time
import traceback
import uuid
from http import HTTPStatus

from idemgate_client import AuthenticatedClient, errors
from idemgate_client.api.admin import list_keys, resolve_key
from idemgate_client.api.reservations import (
    commit_reservation,
    create_reservation,
    extend_reservation,
    mark_reservation_unknown,
    release_reservation,
)
from idemgate_client.models import (
    Action,
    CommitBody,
    CompletedState,
    CompletedView,
    ExtendedView,
    KeyList,
    KeyState,
    KeyView,
    LeaseExpiry,
    Problem,
    RecordView,
    ReserveBody,
    ReservedState,
    ReservedView,
    ResolutionView,
    ResolveBody,
    ShownState,
    StateFilter,
    UnknownBody,
)
from idemgate_client.types import UNSET, Response


class CheckFailed(Exception):
    """A step's answer was not what the document and the server promise."""


# The step under way, for the message when something other than a check
# fails (the generated client raising, say).
current = {"step": "starting"}


def check(ok: bool, step: str, what: str, res: Response | None = None) -> None:
    if not ok:
        seen = ""
        if res is not None:
            seen = f"\n  got {int(res.status_code)}: {res.content[:400]!r}"
        raise CheckFailed(f"{step}: {what}{seen}")


def reserve_answer(step: str, res: Response) -> ReservedView | CompletedView:
    """A reserve's 201 or 200 replay; the caller tells them apart by state."""
    answer = res.parsed
    check(
        isinstance(answer, (ReservedView, CompletedView)),
        step,
        "expected a ReservedView or a CompletedView",
        res,
    )
    return answer


def reserved(step: str, res: Response) -> ReservedView:
    check(res.status_code == HTTPStatus.CREATED, step, "expected 201", res)
    answer = reserve_answer(step, res)
    if answer.state == ReservedState.RESERVED:
        assert isinstance(answer, ReservedView)
        check(
            res.headers.get("location") == f"/v1/reservations/{answer.reservation_id}",
            step,
            "expected Location: /v1/reservations/{id}",
            res,
        )
        check("idempotency-expires" in res.headers, step, "expected Idempotency-Expires", res)
        return answer
    raise CheckFailed(f"{step}: expected state reserved, got {answer.state!r}")


def completed(step: str, res: Response) -> CompletedView:
    check(res.status_code == HTTPStatus.OK, step, "expected 200", res)
    answer = reserve_answer(step, res)
    if answer.state == CompletedState.COMPLETED:
        assert isinstance(answer, CompletedView)
        check("idempotency-expires" in res.headers, step, "expected Idempotency-Expires", res)
        return answer
    raise CheckFailed(f"{step}: expected state completed, got {answer.state!r}")


def problem(step: str, res: Response, status: int, slug: str) -> Problem:
    check(res.status_code == status, step, f"expected {status}", res)
    check(
        res.headers.get("content-type") == "application/problem+json",
        step,
        "expected application/problem+json",
        res,
    )
    body = res.parsed
    check(isinstance(body, Problem), step, "expected a Problem", res)
    assert isinstance(body, Problem)
    check(body.type_.endswith(f"/{slug}"), step, f"expected the {slug} problem", res)
    check(body.status == status, step, f"expected status {status} in the problem", res)
    return body


def run(base_url: str, token: str, admin_token: str, tenant: str) -> int:
    client = AuthenticatedClient(base_url=base_url, token=token, raise_on_unexpected_status=True)
    admin = AuthenticatedClient(base_url=base_url, token=admin_token, raise_on_unexpected_status=True)
    key = f"python-{uuid.uuid4()}"
    charge = ReserveBody(fingerprint="POST /charges amount=500")
    steps = 0

    step = current["step"] = "reserve a new key"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=charge)
    first = reserved(step, res)
    check(first.attempt == 1, step, "expected attempt 1", res)
    steps += 1

    step = current["step"] = "reserve the same key while it is in flight"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=charge)
    in_flight = problem(step, res, 409, "request-in-flight")
    retry = in_flight.retry_after_seconds
    check(isinstance(retry, int) and retry >= 1, step, "expected retry_after_seconds >= 1", res)
    check(res.headers.get("retry-after") == str(retry), step, "expected Retry-After to match", res)
    steps += 1

    step = current["step"] = "commit the response"
    res = commit_reservation.sync_detailed(
        first.reservation_id,
        client=client,
        body=CommitBody(
            status=201,
            headers=[["content-type", "application/json"], ["x-charge", "ch_1"]],
            body='{"id":"ch_1"}',
        ),
    )
    stored = completed(step, res)
    check(stored.response.status == 201, step, "expected the stored status 201", res)
    steps += 1

    step = current["step"] = "reserve the completed key again"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=charge)
    check(
        res.headers.get("idempotent-replayed") == "true",
        step,
        "expected Idempotent-Replayed: true",
        res,
    )
    replay = completed(step, res)
    check(replay.response.status == 201, step, "expected the stored status", res)
    check(
        replay.response.headers == [["content-type", "application/json"], ["x-charge", "ch_1"]],
        step,
        "expected the stored header lines",
        res,
    )
    check(replay.response.body == '{"id":"ch_1"}', step, "expected the stored body", res)
    steps += 1

    step = current["step"] = "reserve the same key with another payload"
    other = ReserveBody(fingerprint="POST /charges amount=501")
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=other)
    problem(step, res, 422, "key-reused")
    steps += 1

    # A body left out: the generated client must send none (or {}), not its
    # "unset" marker.
    fresh = f"python-{uuid.uuid4()}"
    step = current["step"] = "reserve a new key with no body"
    res = create_reservation.sync_detailed(client=client, idempotency_key=fresh)
    held = reserved(step, res)
    steps += 1

    step = current["step"] = "extend with no body"
    res = extend_reservation.sync_detailed(held.reservation_id, client=client)
    check(res.status_code == HTTPStatus.OK, step, "expected 200", res)
    extended = res.parsed
    check(isinstance(extended, ExtendedView), step, "expected an ExtendedView", res)
    assert isinstance(extended, ExtendedView)
    check(extended.reservation_id == held.reservation_id, step, "expected the same id", res)
    steps += 1

    step = current["step"] = "release"
    res = release_reservation.sync_detailed(held.reservation_id, client=client)
    check(res.status_code == HTTPStatus.NO_CONTENT, step, "expected 204", res)
    check(res.content == b"", step, "expected no body", res)
    steps += 1

    step = current["step"] = "reserve the released key again"
    res = create_reservation.sync_detailed(client=client, idempotency_key=fresh)
    again = reserved(step, res)
    check(again.reservation_id != held.reservation_id, step, "expected a new reservation id", res)
    check(again.attempt == 1, step, "expected attempt 1: the key is new again", res)
    steps += 1

    steps += mark_unknown_one(client)
    steps += resolve_one(client, admin, tenant)

    print(f"python client (openapi-python-client): {steps} steps passed, an unknown mark and a resolve included")
    return 0


def mark_unknown_one(client: AuthenticatedClient) -> int:
    """A key its holder marks unknown (the provider timed out after the
    request was sent), then settles with its own late commit; the steps it
    took."""
    key = f"python-{uuid.uuid4()}"
    charge = ReserveBody(fingerprint="POST /payouts amount=900")
    reason = "the provider timed out after the request was sent"
    steps = 0

    step = current["step"] = "reserve a key (under takeover, the default)"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=charge)
    first = reserved(step, res)
    steps += 1

    step = current["step"] = "mark it unknown"
    res = mark_reservation_unknown.sync_detailed(first.reservation_id, client=client, body=UnknownBody(reason=reason))
    check(res.status_code == HTTPStatus.OK, step, "expected 200", res)
    record = res.parsed
    check(isinstance(record, RecordView), step, "expected a RecordView", res)
    assert isinstance(record, RecordView)
    check(record.state == KeyState.UNKNOWN, step, "expected state unknown", res)
    check(record.reservation_id == first.reservation_id, step, "expected the same reservation id", res)
    marked = record.marked_unknown
    check(marked not in (None, UNSET) and getattr(marked, "reason", None) == reason, step,
          "expected marked_unknown with the reason", res)
    steps += 1

    step = current["step"] = "reserve the marked key again"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=charge)
    unknown = problem(step, res, 409, "outcome-unknown")
    check("retry-after" not in res.headers, step, "expected no Retry-After: waiting will not settle it", res)
    check(unknown.retry_after_seconds in (None, UNSET), step, "expected no retry_after_seconds", res)
    steps += 1

    step = current["step"] = "mark it with an empty reason"
    res = mark_reservation_unknown.sync_detailed(first.reservation_id, client=client, body=UnknownBody(reason=""))
    problem(step, res, 400, "invalid-request")
    steps += 1

    step = current["step"] = "mark an unknown reservation id"
    res = mark_reservation_unknown.sync_detailed(uuid.uuid4(), client=client, body=UnknownBody(reason=reason))
    problem(step, res, 404, "not-found")
    steps += 1

    step = current["step"] = "commit the marked key late (its holder still can)"
    res = commit_reservation.sync_detailed(
        first.reservation_id, client=client, body=CommitBody(status=201, headers=[], body='{"id":"po_1"}')
    )
    completed(step, res)
    steps += 1

    step = current["step"] = "reserve the settled key again"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=charge)
    check(res.headers.get("idempotent-replayed") == "true", step, "expected Idempotent-Replayed: true", res)
    replay = completed(step, res)
    check(replay.response.body == '{"id":"po_1"}', step, "expected the late commit's body", res)
    steps += 1
    return steps


def resolve_one(client: AuthenticatedClient, admin: AuthenticatedClient, tenant: str) -> int:
    """A key whose outcome is unknown, settled by an operator through the
    generated admin operations; the steps it took."""
    key = f"python-{uuid.uuid4()}"
    key_hash = hashlib.sha256(key.encode()).hexdigest()
    steps = 0

    step = current["step"] = "reserve a key under hold with a one-second lease"
    held = ReserveBody(fingerprint="POST /refunds amount=700", on_lease_expiry=LeaseExpiry.HOLD, lease_seconds=1)
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=held)
    first = reserved(step, res)
    steps += 1

    time.sleep(1.5)
    step = current["step"] = "reserve it again after its lease ended"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=held)
    unknown = problem(step, res, 409, "outcome-unknown")
    check("retry-after" not in res.headers, step, "expected no Retry-After: waiting will not settle it", res)
    check(unknown.retry_after_seconds in (None, UNSET), step, "expected no retry_after_seconds", res)
    steps += 1

    step = current["step"] = "list the unknown keys (admin token)"
    res = list_keys.sync_detailed(client=admin, state=StateFilter.UNKNOWN, tenant=tenant)
    check(res.status_code == HTTPStatus.OK, step, "expected 200", res)
    page = res.parsed
    check(isinstance(page, KeyList), step, "expected a KeyList", res)
    assert isinstance(page, KeyList)
    found = [view for view in page.keys if view.key_hash == key_hash]
    check(len(found) == 1, step, f"expected the key's hash {key_hash} among the unknown keys", res)
    view = found[0]
    check(view.tenant == tenant, step, f"expected tenant {tenant}", res)
    check(view.state == ShownState.UNKNOWN, step, "expected state unknown", res)
    check(view.on_lease_expiry == LeaseExpiry.HOLD, step, "expected on_lease_expiry hold", res)
    check(str(view.reservation_id) == str(first.reservation_id), step, "expected the holder's reservation id", res)
    steps += 1

    step = current["step"] = "resolve it: complete, with the response that happened"
    lines = [["content-type", "application/json"], ["x-refund", "re_1"]]
    res = resolve_key.sync_detailed(
        view.tenant,
        view.key_hash,
        client=admin,
        body=ResolveBody(
            action=Action.COMPLETE,
            reason="the refund went through (checked with the bank)",
            response=CommitBody(status=201, headers=lines, body='{"id":"re_1"}'),
        ),
    )
    check(res.status_code == HTTPStatus.OK, step, "expected 200", res)
    settled = res.parsed
    check(isinstance(settled, KeyView), step, "expected a KeyView", res)
    assert isinstance(settled, KeyView)
    check(settled.state == ShownState.COMPLETED, step, "expected state completed", res)
    check(settled.status == 201, step, "expected the stored status 201", res)
    resolution = settled.resolution
    check(isinstance(resolution, ResolutionView), step, "expected the resolution kept with the key", res)
    assert isinstance(resolution, ResolutionView)
    check(resolution.action == Action.COMPLETE, step, "expected the resolution's action complete", res)
    steps += 1

    step = current["step"] = "reserve the resolved key again"
    res = create_reservation.sync_detailed(client=client, idempotency_key=key, body=held)
    check(res.headers.get("idempotent-replayed") == "true", step, "expected Idempotent-Replayed: true", res)
    replay = completed(step, res)
    check(replay.response.status == 201, step, "expected the resolved status", res)
    check(replay.response.headers == lines, step, "expected the resolved header lines", res)
    check(replay.response.body == '{"id":"re_1"}', step, "expected the resolved body", res)
    steps += 1
    return steps


def main() -> int:
    if len(sys.argv) != 5:
        print("usage: driver.py BASE_URL TOKEN ADMIN_TOKEN TENANT", file=sys.stderr)
        return 2
    try:
        return run(*sys.argv[1:5])
    except CheckFailed as e:
        print(f"python client: FAILED at {e}", file=sys.stderr)
    except errors.UnexpectedStatus as e:
        print(
            f"python client: FAILED at {current['step']}: a status the document does not "
            f"declare: {e.status_code} {e.content[:400]!r}",
            file=sys.stderr,
        )
    except Exception:
        traceback.print_exc()
        print(f"python client: FAILED at {current['step']}: the exception above", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
