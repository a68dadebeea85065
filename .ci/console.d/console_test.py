"""The operators' console (docs/operations.md) in a real browser, used as a
person uses it: headless Chromium with no route anywhere but 127.0.0.1, on both
doors (`serve`'s listener and a proxy's admin listener), on SQLite and on
PostgreSQL.

    console_test.py --bin target/debug/idemgate --chromium /usr/lib/chromium/chromium \
        --docs docs --pg-url postgres://postgres@127.0.0.1:5432/postgres

Each case prints one line per check; the run ends with 'N passed, N failed'
and exits 1 on any failure, leaving its logs, the page's text and a
screenshot of each tab of the failed case in the directory it names.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
import urllib.request

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

from harness import (Checks, Failed, Forwarder, Idemgate, Origin, Postgres, bearer, call,
                     clean_env, elapsed, free_port, key_hash, wait_until)
from page import Console, count_waiting, field, parse_age, short
from stuck import Proxy, Serve, new_key, sf_string

CHROMIUM_ARGS = [
    # Every host name but the loopback address fails to resolve: a page that
    # needs a CDN shows nothing. Plus nothing of Chromium's own that phones home.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--no-first-run",
]
PROXY_TIMEOUT = 4  # the proxy's upstream timeout; its lease is this plus 5
PROXY_LEASE = PROXY_TIMEOUT + 5
BULK_KEYS = 2000
BULK_TENANTS = ["north", "south", "east"]
COMPLETE_BODY = '{"charge":1,"settled_by":"ops"}'


class World:
    """Everything the cases share: servers, origins, the browser."""

    def __init__(self, args, work: str):
        self.args = args
        self.work = work
        self.checks = Checks()
        self.pg = Postgres(args.pg_url)
        self.ops_token = "ops-" + secrets.token_hex(16)
        self.admin = {"ops": self.ops_token}
        self.admin_env = f"ops:{self.ops_token}"
        self.browser = None
        self.consoles: list[Console] = []  # the current case's tabs
        self.offsite: list[str] = []  # requests to anywhere but 127.0.0.1
        self.bulk_error: BaseException | None = None
        self.bulk_done = threading.Event()

    # --- servers -----------------------------------------------------------

    def serve(self, name: str, database_url: str, tokens: dict[str, str],
              admin: dict[str, str]) -> Serve:
        port = free_port()
        env = clean_env(DATABASE_URL=database_url)
        if tokens:
            env["IDEMGATE_TOKENS"] = ",".join(f"{t}:{v}" for t, v in tokens.items())
        if admin:
            env["IDEMGATE_ADMIN_TOKENS"] = ",".join(f"{n}:{v}" for n, v in admin.items())
        base = f"http://127.0.0.1:{port}"
        proc = Idemgate(self.args.bin, name, ["serve", "--listen", f"127.0.0.1:{port}"], env,
                        self.work, f"{base}/healthz").start()
        return Serve(proc, base, tokens, admin)

    def proxy(self, name: str, database_url: str, origin: Origin) -> Proxy:
        port, admin_port = free_port(), free_port()
        env = clean_env(DATABASE_URL=database_url, IDEMGATE_ADMIN_TOKENS=self.admin_env)
        args = ["proxy", "--upstream", origin.url, "--listen", f"127.0.0.1:{port}",
                "--admin-listen", f"127.0.0.1:{admin_port}",
                "--upstream-timeout", str(PROXY_TIMEOUT), "--on-lease-expiry", "hold"]
        proc = Idemgate(self.args.bin, name, args, env, self.work,
                        f"http://127.0.0.1:{admin_port}/healthz").start()
        return Proxy(proc, port, admin_port, origin, self.admin, PROXY_LEASE)

    def setup(self) -> None:
        c = self.checks
        run = f"idemgate_console_{os.getpid()}"
        pg_proxy_url = self.pg.create(f"{run}_proxy")
        pg_serve_db = f"{run}_serve"
        self.pg.create(pg_serve_db)
        self.forwarder = Forwarder(self.pg.host, self.pg.port)
        self.forwarder.start()
        pg_serve_url = self.pg.url_of(pg_serve_db, "127.0.0.1", self.forwarder.port)
        c.note(f"PostgreSQL {self.pg.redacted()}: databases {run}_proxy and {pg_serve_db} "
               f"(the latter through a forwarder on 127.0.0.1:{self.forwarder.port})")

        self.origins = {"SQLite": Origin(3.0), "PostgreSQL": Origin(3.0)}
        self.proxies = {
            "SQLite": self.proxy("proxy-sqlite", f"sqlite://{self.work}/proxy.db",
                                 self.origins["SQLite"]),
            "PostgreSQL": self.proxy("proxy-pg", pg_proxy_url, self.origins["PostgreSQL"]),
        }
        self.tenant_tokens = {"acme": "acme-" + secrets.token_hex(8),
                              "globex": "globex-" + secrets.token_hex(8)}
        self.main = self.serve("serve-sqlite", f"sqlite://{self.work}/serve.db",
                               self.tenant_tokens, self.admin)
        self.bulk = self.serve("serve-pg", pg_serve_url,
                               {t: f"{t}-{secrets.token_hex(8)}" for t in BULK_TENANTS}, self.admin)
        self.open_serve = self.serve("serve-open", f"sqlite://{self.work}/open.db", {}, {})
        self.disabled = self.serve("serve-no-admin", f"sqlite://{self.work}/no-admin.db",
                                   {"acme": self.tenant_tokens["acme"]}, {})
        for p in Idemgate.all:
            p.wait_ready()
        c.ok(f"started {len(Idemgate.all)} idemgate processes: 2 proxies (SQLite, PostgreSQL) "
             "and 4 serve (SQLite; PostgreSQL; no tokens; tenant tokens without admin tokens)")

        # Case 1 and 2 start now: their leases lapse while the other cases run.
        self.proxy_keys = {}
        for store, proxy in self.proxies.items():
            a, b = new_key("charge-a"), new_key("charge-b")
            proxy.kill_mid_call([a, b])
            self.proxy_keys[store] = (a, b)
            c.ok(f"proxy ({store}): two charges sent, the proxy killed (SIGKILL) while the "
                 "origin worked on them, and started again on the same store")

        threading.Thread(target=self._make_bulk, daemon=True).start()

        m = self.main
        self.case3 = m.lapsed("acme", lease=1)
        self.case7 = m.lapsed("globex", lease=1)
        # Each described by its request, as a backend that calls the
        # reservation API around a charge, a refund and a shipment would.
        self.shots = [
            m.marked_unknown("acme", "the payment provider timed out after the request was sent",
                             checkpoint="card-authorized",
                             request={"method": "POST", "path": "/v1/charges",
                                      "body": {"amount": 4200, "currency": "eur"}},
                             label="order 1042"),
            m.lapsed("globex", lease=1,
                     request={"method": "POST", "path": "/v1/refunds?charge=ch_3Pq",
                              "body": {"amount": 1500}}),
            m.marked_unknown("acme", "the worker lost its connection mid-call",
                             request={"method": "PUT", "path": "/v1/orders/1042/shipment"}),
        ]
        self.narrow_key = self.shots[1]
        self.open_key = self.open_serve.lapsed("default", lease=1)
        c.ok("serve (SQLite): 5 keys made stuck for acme and globex (3 leases lapsed under "
             "hold, 2 marked unknown by their holder); serve without tokens: 1")

    def _make_bulk(self) -> None:
        try:
            t0 = time.monotonic()
            self.bulk_keys = self.bulk.many_unknown(BULK_TENANTS, BULK_KEYS)
            self.bulk_seconds = time.monotonic() - t0
        except BaseException as e:
            self.bulk_error = e
        finally:
            self.bulk_done.set()

    # --- the browser -------------------------------------------------------

    def context(self, **kw):
        kw.setdefault("viewport", {"width": 1280, "height": 800})
        ctx = self.browser.new_context(**kw)
        ctx.set_default_timeout(10000)

        def guard(request):
            host = urllib.parse.urlsplit(request.url).hostname
            if request.url.startswith(("data:", "blob:", "about:")):
                return
            if host != "127.0.0.1":
                self.offsite.append(request.url)
        ctx.on("request", guard)
        return ctx

    def tab(self, ctx, base: str, name: str) -> Console:
        c = Console(ctx, base, name)
        self.consoles.append(c)
        return c

    def console(self, base: str, name: str, token: str | None = None, **ctx_kw) -> Console:
        """A new context, one tab on /console, the token pasted if given."""
        c = self.tab(self.context(**ctx_kw), base, name)
        c.open()
        if token is not None:
            c.use_token(token)
        return c


# === the cases ===============================================================


def case_refusals(w: World) -> None:
    """5: a tenant's token is refused (forbidden), no or a wrong token where
    tokens are required is unauthorized, and a server with tenant tokens but
    no admin tokens is admin-disabled."""
    c = w.checks
    t = w.console(w.main.base, "serve (SQLite)")
    c.that(t.heading() == "idemgate console", 'GET /console on serve: h1 "idemgate console"',
           f"h1 is {t.heading()!r}")
    assets = [r.url for r in t.requests if "/console/assets/" in r.url]
    c.that(assets, f"its assets come from idemgate itself ({len(assets)} under /console/assets/)",
           "no request under /console/assets/")
    t.wait_text(r"unauthorized")
    c.that(t.token_form_shown(), 'no token: the page says "unauthorized" and shows the token form')
    said_once(w, t, "unauthorized")
    t.use_token("not-a-token-" + secrets.token_hex(4))
    t.wait_text(r"unauthorized")
    wait_until(t.token_form_shown, 5, what="the token form back after a refused token")
    c.ok('a wrong token: "Token set for this tab", then "unauthorized" and the token form again')
    t.forget_token()
    wait_until(lambda: t.token_form_shown() and "Token set for this tab" not in t.text(), 5,
               what="the token form back after Forget token")
    c.ok('"Forget token" brings the token form back')

    t.use_token(w.tenant_tokens["acme"])
    t.wait_text(r"forbidden")
    said_once(w, t, "forbidden")
    listed = t.rows() if t.page.locator("#queue").count() else []
    c.that(not listed, "a tenant's token (acme): the page shows the refusal \"forbidden\" "
           "and lists no key", f"it lists {[r['link'] for r in listed]}")

    d = w.console(w.disabled.base, "serve without admin tokens")
    d.wait_text(r"admin-disabled")
    c.ok('serve with IDEMGATE_TOKENS and no IDEMGATE_ADMIN_TOKENS, no token: "admin-disabled"')
    said_once(w, d, "admin-disabled")
    d.use_token(w.tenant_tokens["acme"])
    d.wait_text(r"admin-disabled")
    listed = d.rows() if d.page.locator("#queue").count() else []
    c.that(not listed, 'the same with a tenant\'s token pasted: "admin-disabled", nothing listed',
           f"it lists {[r['link'] for r in listed]}")


def said_once(w: World, t: Console, slug: str) -> None:
    """The refusal `slug` is shown once, where the keys would be; the
    counts only say there are none to show."""
    t.wait_text(r"No counts", 10, "#counts")
    t.quiet()
    problems = t.page.locator(".problem")
    shown = [problems.nth(i).inner_text() for i in range(problems.count())]
    w.checks.that(len(shown) == 1 and slug in shown[0],
                  f'"{slug}" is shown once (the counts say "No counts …")',
                  f"{len(shown)} problems: {[short(x, 80) for x in shown]}")


def case_open(w: World) -> None:
    """With no admin tokens, no tenant tokens and a loopback listener, the
    console works without a token."""
    c = w.checks
    _, h = w.open_key
    t = w.console(w.open_serve.base, "serve without tokens")
    row = t.wait_row(h, 15)
    c.that(row.get("state", "").lower() == "unknown",
           "serve without any token: the queue lists its stuck key, no token asked", f"row {row}")
    c.that("unauthorized" not in t.text().lower(), 'and nowhere says "unauthorized"')
    open_key_page(t, row)
    t.settle_form().wait_for(timeout=10000)
    t.fill_settle("release", "development: nothing was sent")
    t.settle_button().click()
    t.wait_text(r"released", 10, "#settle-result")
    logged = resolutions(w.open_serve.proc, h)
    c.that(len(logged) == 1 and "by=loopback" in logged[0],
           "and settles it without a token: released, recorded as by loopback", f"{logged}")


def case_serve_lapsed(w: World) -> None:
    """3: a reservation whose lease lapsed under hold, on serve (SQLite):
    listed as unknown, shown, released; the next reservation runs afresh."""
    c = w.checks
    key, h = w.case3
    t = w.console(w.main.base, "serve (SQLite)", token=w.ops_token)
    stored = t.page.evaluate("() => Object.values(sessionStorage)")
    c.that(w.ops_token in stored, "the admin token is kept in the tab's sessionStorage",
           f"sessionStorage holds {len(stored)} values, none the token")
    local = t.page.evaluate("() => Object.values(localStorage).join(' ') + ' ' + document.cookie")
    cookies = " ".join(x["value"] for x in t.context.cookies())
    c.that(w.ops_token not in local and w.ops_token not in cookies,
           "and not in localStorage or a cookie")
    row = t.wait_row(h, 15)
    c.that(row.get("state", "").lower() == "unknown" and row.get("tenant") == "acme",
           f"the queue lists key {h[:12]} (acme, lease of 1 s lapsed under hold) as unknown",
           f"row {row}")
    frags = [r for r in t.fragment_requests(since_token=True) if r.url.startswith(w.main.base)]
    authed = [r for r in frags if r.headers.get("authorization") == f"Bearer {w.ops_token}"]
    c.that(frags and len(authed) == len(frags),
           f"every fragment request since carries Authorization: Bearer ({len(frags)} requests)",
           f"{len(frags) - len(authed)} of {len(frags)} without it: "
           f"{[r.url for r in frags if r not in authed][:3]}")
    c.that(row["href"] == f"/console/keys/acme/{h}",
           "its link is /console/keys/acme/<64-hex hash>", f"href {row['href']!r}")

    open_key_page(t, row)
    key_page_view(w, t, "acme", h, "unknown")
    t.fill_settle("release", "the ledger shows no charge: nothing happened")
    t.settle_button().click()
    result = t.wait_text(r"released", 10, "#settle-result")
    c.that(re.search(r"A retry now runs the request again", result),
           'Release: #settle-result says "released" and "A retry now runs the request again"',
           f"it says {short(result)}")
    c.that(t.page.locator("#settle-result").get_attribute("role") == "status",
           "#settle-result has role=status")
    logged = resolutions(w.main.proc, h)
    c.that(len(logged) == 1 and 'action="release"' in logged[0] and "by=ops" in logged[0],
           "serve logged one resolution of it: release, by ops", f"{logged}")
    r = call("POST", f"{w.main.base}/v1/reservations", {"fingerprint": f"fp-{key}"},
             {"idempotency-key": sf_string(key), **bearer(w.tenant_tokens["acme"])})
    c.that(r.status == 201, "the holder's retry reserves the key again (201): it runs afresh", repr(r))


def resolutions(proc: Idemgate, h: str) -> list[str]:
    """The lines in which `proc` logged that an operator resolved key `h`."""
    return [ln for ln in proc.log_text().splitlines()
            if "a stuck key was resolved by an operator" in ln and f"key.hash={h[:12]}" in ln]


def open_key_page(t: Console, row: dict) -> None:
    """Follows a queue row's link, as a person clicks it."""
    t.page.get_by_role("link", name=row["link"], exact=True).first.click()
    t.page.wait_for_url(re.compile(re.escape(row["href"]) + r"$"), timeout=10000)


def key_page_view(w: World, t: Console, tenant: str, h: str, state: str) -> str:
    """A key's page: its heading, its view and its timeline. Returns the
    timeline's text."""
    c = w.checks
    t.wait_text(rf"Key {h[:12]}", 10, "h2")
    c.ok(f'the key\'s page: h2 "Key {h[:12]}"')
    dl = t.wait_text(re.escape(h), 10, "dl")
    for want in (tenant, state):
        c.that(re.search(rf"\b{re.escape(want)}\b", dl),
               f"its description list shows {want!r}", f"it says {short(dl)}")
    c.ok("its description list shows the full key hash")
    items = t.page.locator("#timeline li")
    wait_until(lambda: items.count() > 0, 10, what="#timeline to have items")
    c.that(t.page.locator("#timeline").evaluate("e => e.tagName") == "OL",
           f"#timeline is an ordered list ({items.count()} entries)")
    timeline = t.page.locator("#timeline").inner_text()
    c.that(re.search(r"reserved", timeline, re.I), 'the timeline starts with "reserved"',
           f"it says {short(timeline)}")
    return timeline


def case_proxy(w: World, store: str) -> None:
    """1 and 2: the proxy killed mid-call. Key A is completed by an operator
    (the retry replays the operator's answer, the origin ran once); key B is
    released with a double click, and settled again from a second tab (one
    resolution; the retry runs the request again, once)."""
    c = w.checks
    proxy = w.proxies[store]
    origin = proxy.origin
    a, b = w.proxy_keys[store]
    ha, hb = key_hash(a), key_hash(b)
    origin.wait_charged([sf_string(a), sf_string(b)])
    before = origin.charges()["by_key"]
    c.that(before.get(sf_string(a)) == 1 and before.get(sf_string(b)) == 1,
           f"proxy ({store}): the origin charged each key once although the proxy died",
           f"by key: {before}")
    r = proxy.charge(a)
    c.that(r.status == 409 and "outcome-unknown" in r.text,
           "a retry through the restarted proxy is refused 409 outcome-unknown", repr(r))

    t = w.console(proxy.admin_base, f"proxy ({store}) admin", token=w.ops_token)
    remaining = PROXY_LEASE - (time.monotonic() - proxy.reserved_at)
    row = t.wait_row(ha, max(remaining, 0) + 15)
    c.that(row.get("state", "").lower() == "unknown",
           f"on the proxy's admin listener the queue lists key {ha[:12]} as unknown once its "
           f"{PROXY_LEASE} s lease is over", f"row {row}")
    age = parse_age(row.get("age", ""))
    c.that(age is not None, f"its age reads {row.get('age')!r}", f"row {row}")

    def older():
        t.filter()
        time.sleep(0.5)
        r2 = next((x for x in t.rows() if x["link"] == ha[:12]), None)
        return r2 if r2 and (parse_age(r2.get("age", "")) or 0) > age else None
    later = wait_until(older, 8, 1.0, "the key's age to grow")
    c.ok(f"its age grows: {row.get('age')!r}, then {later.get('age')!r}")
    tenant = urllib.parse.unquote(row["href"].split("/")[3])
    c.that("POST /charges" in row.get("text", ""),
           "the queue's row names what the key was for: POST /charges", f"row {row}")

    # Found by the look-up box, as a person who has the key from the
    # client's log finds it: the key as sent and its tenant.
    field(t.page, "Its tenant").fill(tenant, timeout=5000)
    field(t.page, "Key, hash or prefix").fill(sf_string(a), timeout=5000)
    t.page.get_by_role("button", name="Find", exact=True).click()
    t.page.wait_for_url(re.compile(re.escape(row["href"]) + r"$"), timeout=10000)
    c.ok("the look-up box, given the key as the client sent it and its tenant, opens its page")
    timeline = key_page_view(w, t, tenant, ha, "unknown")
    request = t.wait_text(r"POST /charges", 10, "#key-request")
    c.that("POST /charges" in request, 'the key\'s page names its request: "POST /charges"',
           f"it says {short(request)}")
    c.that(re.search(r"lease ended", timeline, re.I), "the timeline says the lease ended",
           f"it says {short(timeline)}")
    chosen = t.settle_form().locator("input[name=action]:checked").count()
    c.that(chosen == 0, "the settle form chooses nothing for the operator (no radio checked)",
           f"{chosen} checked")
    field(t.settle_form(), "Reason").fill("checked the books: charged once", timeout=5000)
    t.settle_button().click()
    said = t.wait_text(r"choose what happened", 10, "#settle-result")
    c.that(t.settle_form().count() == 1 and "unknown" in t.page.locator("dl").first.inner_text(),
           'Settle without a choice: "choose what happened", beside the form; nothing settled',
           f"it says {short(said)}")
    waiting = count_waiting(t.counts())
    t.fill_settle("complete", "checked the books: charged once", status="201",
                  headers="content-type: application/json", body=COMPLETE_BODY)
    t.settle_button().click()
    result = t.wait_text(r"completed", 10, "#settle-result")
    c.that(re.search(r"A retry now replays 201", result),
           'Complete 201: #settle-result says "completed" and "A retry now replays 201"',
           f"it says {short(result)}")
    settle_post = (t.sends("POST") or [{}])[-1]
    c.that(settle_post.get("settleDisabled") is True,
           "the Settle button was disabled while the settle was in flight",
           f"when the POST left it was {settle_post.get('settleDisabled')!r}")
    counted = [s for s in t.sends("GET") if "/fragments/counts" in s["url"]
               and s["at"] >= settle_post.get("at", 0)]
    c.that(counted and counted[0]["at"] - settle_post["at"] < 1500,
           "the counts are asked again as the settle answers, not at the next 5 s tick",
           f"counts asked {[x['at'] - settle_post.get('at', 0) for x in counted]} ms after")
    after = wait_until(lambda: (lambda n: str(n) if n is not None and waiting is not None
                                and n == waiting - 1 else None)(count_waiting(t.counts())),
                       2, 0.1, f"#counts to say {waiting} - 1 keys wait")
    c.ok(f"#counts says {after} keys wait (one fewer) within 2 s of the settle")
    timeline = t.page.locator("#timeline").inner_text()
    c.that(re.search(r"lease ended", timeline, re.I) and re.search(r"by ops", timeline),
           'settled, the timeline still says the lease ended, then "completed by ops"',
           f"it says {short(timeline)}")

    t.page.reload()
    resp = t.wait_text(r"201", 10, "#response")
    c.that(COMPLETE_BODY in resp or COMPLETE_BODY in t.page.locator("#response").inner_html(),
           "reloaded, the key's page shows the stored response (#response: 201 and the body)",
           f"#response says {short(resp)}")
    timeline = t.page.locator("#timeline").inner_text()
    c.that(re.search(r"(resolved|completed|settled)\b.{0,20}\bby ops", timeline, re.I)
           and "checked the books: charged once" in timeline,
           "its timeline says resolved by ops, and why", f"it says {short(timeline)}")
    c.that(re.search(r"lease ended", timeline, re.I),
           "reloaded, the timeline still says the lease ended", f"it says {short(timeline)}")

    r = proxy.charge(a)
    c.that(r.status == 201 and r.text == COMPLETE_BODY
           and r.headers.get("idempotent-replayed") == "true",
           f"the retry through the proxy: 201, exactly the operator's body, Idempotent-Replayed: true",
           repr(r))
    after = origin.charges()["by_key"]
    c.that(after.get(sf_string(a)) == 1,
           "GET /charges on the origin: key A charged 1 time (the origin ran once)", f"{after}")

    # 2: key B, released with a double click; a second tab settles it again.
    t.open("/console")
    row = t.wait_row(hb, 10)
    other = w.tab(t.context, proxy.admin_base, f"proxy ({store}) admin, second tab")
    other.open(row["href"])
    c.that(other.token_form_shown()
           and w.ops_token not in other.page.evaluate("() => Object.values(sessionStorage)"),
           "a second tab has no token: it asks for it again (sessionStorage is per tab)")
    other.use_token(w.ops_token)
    other.settle_form().wait_for(timeout=10000)
    open_key_page(t, row)
    t.settle_form().wait_for(timeout=10000)
    t.fill_settle("release", "the origin's log shows the call never ran")
    t.settle_button().dblclick()
    result = t.wait_text(r"released|already settled", 10, "#settle-result")
    t.quiet()
    posts = [s for s in t.sends("POST")]
    result = t.page.locator("#settle-result").inner_text()
    if len(posts) == 1:
        c.that("released" in result and re.search(r"A retry now runs the request again", result),
               'a double click on Settle sends one settle (the button is disabled): "released", '
               '"A retry now runs the request again"', f"it says {short(result)}")
    else:
        c.that(len(posts) == 2 and re.search(r"already settled by ops", result),
               'a double click sent two settles: the second shows "already settled by ops"',
               f"{len(posts)} POSTs; it says {short(result)}")
    other.fill_settle("release", "tab 2: settling again")
    other.settle_button().click()
    other.wait_text(r"already settled by ops", 10)
    c.ok('settling it again from the second tab: the page says "already settled by ops"')
    box = other.page.locator("#settle-result")
    inside = box.count() and "already settled by ops" in box.first.inner_text()
    c.soft(inside, 'in #settle-result',
           "no #settle-result holds it" + ("" if box.count() else " (the page has no #settle-result)")
           + f"; the page says {short(other.text())}")
    resolved = resolutions(proxy.proc, hb)
    c.that(len(resolved) == 1 and 'action="release"' in resolved[0] and "by=ops" in resolved[0],
           "exactly one resolution of key B: the proxy logged one release, by ops",
           f"{len(resolved)} in its log: {resolved}")

    r = proxy.charge(b)
    c.that(r.status == 201 and r.headers.get("idempotent-replayed") is None,
           "the retry through the proxy runs the request again (201, not a replay)", repr(r))
    r2 = proxy.charge(b)
    c.that(r2.status == 201 and r2.headers.get("idempotent-replayed") == "true" and r2.text == r.text,
           "the next retry replays it", repr(r2))
    after = origin.charges()["by_key"]
    c.that(after.get(sf_string(b)) == 2,
           "GET /charges on the origin: key B charged once more (2: the killed call and the rerun)",
           f"{after}")


def next_page_button(t: Console, name: str):
    p = t.page
    return p.get_by_role("link", name=name, exact=True).or_(
        p.get_by_role("button", name=name, exact=True)).first


def case_bulk(w: World) -> None:
    """4: thousands of stuck keys across tenants (serve, PostgreSQL): the
    counts, paging, the tenant filter and the age filter."""
    c = w.checks
    if not w.bulk_done.wait(120):
        raise Failed(f"making {BULK_KEYS} stuck keys took over 120 s")
    if w.bulk_error:
        raise Failed(f"making {BULK_KEYS} stuck keys: {w.bulk_error!r}")
    c.ok(f"serve (PostgreSQL): {BULK_KEYS} keys reserved and marked unknown for "
         f"{', '.join(BULK_TENANTS)} in {w.bulk_seconds:.0f} s")
    t = w.console(w.bulk.base, "serve (PostgreSQL)", token=w.ops_token)
    counts = wait_until(lambda: count_waiting(t.counts()) == BULK_KEYS and t.counts(), 15,
                        what=f"#counts to say {BULK_KEYS} keys wait")
    c.ok(f"#counts says {BULK_KEYS} keys wait for a person: {short(counts, 120)!r}")
    c.that(re.search(r"oldest:", counts, re.I) and re.search(r"store:\s*up", counts, re.I),
           '#counts shows "oldest: …" and "store: up"', f"it says {short(counts)}")
    first = wait_until(lambda: t.rows(), 10, what="the queue's first page")
    t.quiet()
    first = t.rows()
    c.that(len(first) == 50, "the first page shows 50 rows", f"{len(first)} rows")
    page1 = [r["link"] for r in first]
    next_page_button(t, "Next page").click()
    second = wait_until(lambda: (lambda rs: rs if rs and rs[0]["link"] not in page1 else None)(t.rows()),
                        10, what="the next page")
    t.quiet()
    second = [r["link"] for r in t.rows()]
    c.that(len(second) == 50 and not set(second) & set(page1),
           '"Next page" shows the next 50, none of the first page\'s',
           f"{len(second)} rows, {len(set(second) & set(page1))} shared")
    next_page_button(t, "First page").click()
    wait_until(lambda: [r["link"] for r in t.rows()] == page1, 10, what="the first page again")
    c.ok('"First page" shows the first 50 again')

    t.filter(tenant="south")
    rows = wait_until(lambda: (lambda rs: rs if rs and all(r.get("tenant") == "south" for r in rs)
                               else None)(t.rows()), 10, what="only south's keys")
    t.quiet()
    rows = t.rows()
    c.that(len(rows) == 50 and all(r.get("tenant") == "south" for r in rows),
           'Tenant "south": 50 rows, every row\'s tenant cell is south',
           f"tenants {sorted({r.get('tenant') for r in rows})}, {len(rows)} rows")
    t.filter(tenant="", older_than_minutes="60")
    t.wait_text(r"No keys", 10, "#queue")
    c.that(not t.rows(), 'Older than 60 minutes (older than every key): "No keys"')
    said = t.text().count("No keys")
    c.that(said == 1, '"No keys" is said once on the page', f"{said} times")


def case_store_away(w: World) -> None:
    """6: the store goes away under serve (PostgreSQL through a forwarder
    that is cut) and comes back; the counts say so by themselves."""
    c = w.checks
    t = w.console(w.bulk.base, "serve (PostgreSQL)", token=w.ops_token)
    t.wait_text(r"store:\s*up", 10, "#counts")
    navigations = []
    t.page.on("framenavigated", lambda f: navigations.append(f.url) if f == t.page.main_frame else None)
    t.page.evaluate("() => { window.__stayed = true; }")
    w.forwarder.stop()
    t0 = time.monotonic()
    try:
        t.wait_text(r"store:\s*unavailable", 20, "#counts")
        took = time.monotonic() - t0
        c.that(took <= 15, f"the database cut off: #counts says \"store: unavailable\" after {took:.0f} s",
               f"after {took:.0f} s (over 15)")
        t.wait_text(r"store-unavailable", 10, "#queue-section")
        said = t.text().count("store is unavailable")
        c.that(said == 1, "the queue says why (store-unavailable) and the counts do not repeat it",
               f"said {said} times: {short(t.text(), 300)}")
    finally:
        w.forwarder.start()
    t1 = time.monotonic()
    t.wait_text(r"store:\s*up", 25, "#counts")
    c.ok(f"the database back: #counts says \"store: up\" again after {time.monotonic() - t1:.0f} s")
    c.that(t.page.evaluate("() => window.__stayed === true") and not navigations,
           "by itself: the page was not reloaded", f"navigations: {navigations}")


def case_person(w: World) -> None:
    """7: keyboard alone, labels, a narrow window, dark mode."""
    c = w.checks
    _, h = w.case7
    t = w.console(w.main.base, "serve (SQLite)", token=w.ops_token)
    row = t.wait_row(h, 15)
    t.quiet()
    missing = t.unlabelled()
    c.that(not missing, "the queue page: every input, select and textarea has a label",
           f"unlabelled: {missing}")
    state = field(t.page, "State")
    options = state.evaluate("s => [...s.options].map(o => [o.value, o.textContent.trim()])")
    chosen = state.evaluate("s => s.selectedOptions[0] ? s.selectedOptions[0].textContent.trim() : ''")
    c.soft(chosen == "Waiting for a person", 'the State filter starts on "Waiting for a person"',
           f"it starts on {chosen!r}")
    # The contract named `unknown`; the page sends `stuck` (unknown, or in
    # flight past the lease: what the gauge counts), which the list endpoint
    # takes too. Either is the work queue.
    c.soft(state.input_value() in ("unknown", "stuck"), 'whose value is "stuck" (or "unknown")',
           f"its value is {state.input_value()!r}")
    values = [v for v, _ in options]
    c.soft(all(v in values for v in ("in_flight", "completed", "")) and ["", "Any"] in options,
           'it offers in_flight, completed and "Any" (empty)', f"options {options}")

    t.open(row["href"])
    t.settle_form().wait_for(timeout=10000)
    t.quiet()
    missing = t.unlabelled()
    c.that(not missing, "the key's page: every input, select and textarea has a label",
           f"unlabelled: {missing}")
    kb = t.page.keyboard
    t.page.locator("body").evaluate("b => { document.activeElement && document.activeElement.blur(); }")
    path = []
    for _ in range(80):
        kb.press("Tab")
        a = t.active()
        path.append(a.get("name") or a["tag"])
        if a.get("inSettle") and a.get("type") == "radio":
            break
    else:
        raise Failed(f"80 presses of Tab never reached a radio button of #settle: {path[:40]}")
    c.ok(f"Tab reaches the settle form ({len(path)} presses)")
    for _ in range(4):
        a = t.active()
        if a.get("type") == "radio" and a.get("value") == "release":
            kb.press("Space")
            break
        kb.press("ArrowDown")
    release = field(t.settle_form(), "Release: nothing happened")
    c.that(release.is_checked(), 'the arrow keys and Space choose "Release: nothing happened"',
           f"focus on {t.active()}")
    for _ in range(12):
        kb.press("Tab")
        if t.active().get("name", "").lower().startswith("reason"):
            break
    else:
        raise Failed(f"Tab from the radio never reached Reason (at {t.active()})")
    kb.type("typed with the keyboard: the job was never queued")
    for _ in range(12):
        kb.press("Tab")
        a = t.active()
        if a["tag"] in ("button", "input") and re.fullmatch(r"settle", a.get("name", "") or a.get("value", ""), re.I):
            break
    else:
        raise Failed(f"Tab from Reason never reached the Settle button (at {t.active()})")
    kb.press("Enter")
    result = t.wait_text(r"released", 10, "#settle-result")
    c.that(re.search(r"A retry now runs the request again", result),
           "Reason typed, Enter on Settle: the key is released, keyboard alone",
           f"it says {short(result)}")

    # A narrow window: no sideways scrolling, on the queue and on a key's page.
    _, narrow_h = w.narrow_key
    n = w.console(w.main.base, "serve (SQLite), 375 wide", token=w.ops_token,
                  viewport={"width": 375, "height": 740})
    nrow = n.wait_row(narrow_h, 15)
    n.quiet()
    for where in ("the queue", "a key's page"):
        if where == "a key's page":
            open_key_page(n, nrow)
            n.settle_form().wait_for(timeout=10000)
            n.quiet()
        sw, iw = n.page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        c.that(sw <= iw, f"375×740: {where} has no horizontal scroll (scrollWidth {sw} ≤ {iw})",
               f"scrollWidth {sw} > innerWidth {iw}")

    # Dark mode.
    d = w.console(w.main.base, "serve (SQLite), dark", color_scheme="dark")
    colour = d.page.evaluate("""() => {
        const bg = e => getComputedStyle(e).backgroundColor;
        const body = bg(document.body);
        return /rgba\\(0, 0, 0, 0\\)|transparent/.test(body) ? bg(document.documentElement) : body;
    }""")
    lum = luminance(colour)
    c.that(lum is not None and lum < 0.3,
           f"dark mode: the background is dark ({colour}, luminance {lum if lum is None else round(lum, 3)})",
           f"background {colour}")


def luminance(css: str) -> float | None:
    m = re.match(r"rgba?\(([\d.]+),\s*([\d.]+),\s*([\d.]+)(?:,\s*([\d.]+))?\)", css or "")
    if not m or (m.group(4) is not None and float(m.group(4)) == 0):
        return None

    def lin(v: float) -> float:
        v /= 255
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(float(m.group(i))) for i in (1, 2, 3))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def case_screenshots(w: World) -> None:
    """8: the pictures in docs/, taken from the running console."""
    c = w.checks
    _, h = w.shots[0]
    t = w.console(w.main.base, "serve (SQLite)", token=w.ops_token)
    row = t.wait_row(h, 15)
    c.that("POST /v1/charges" in row.get("text", "") and "order 1042" in row.get("text", ""),
           "the queue's row shows the caller's label beside the request: POST /v1/charges order 1042",
           f"row {row}")
    wait_until(lambda: len(t.rows()) >= 3 and count_waiting(t.counts()), 10,
               what="three keys in the queue and the counts")
    t.quiet()
    os.makedirs(w.args.docs, exist_ok=True)
    queue_png = os.path.join(w.args.docs, "console-queue.png")
    t.page.screenshot(path=queue_png)
    c.ok(f"wrote {queue_png} (the queue, {len(t.rows())} stuck keys, 1280×800)")
    open_key_page(t, row)
    t.settle_form().wait_for(timeout=10000)
    shown = t.wait_text(r"order 1042", 10, "#key-request")
    c.that("order 1042" in shown, 'the key\'s page shows its label: "order 1042"', f"{shown!r}")
    t.page.locator("#timeline li").first.wait_for(timeout=10000)
    t.quiet()
    key_png = os.path.join(w.args.docs, "console-key.png")
    t.page.screenshot(path=key_png, full_page=True)
    c.ok(f"wrote {key_png} (a key's page: its timeline and the settle form)")


def case_tls(w: World) -> None:
    """The console over TLS: a serve with --tls-cert/--tls-key (a certificate
    made for this run with openssl) loads /console over https, its assets
    and its queue too; Chromium is told to accept the run's own certificate
    (the context's ignore_https_errors), and the page's certificate is
    checked to be that one."""
    c = w.checks
    cert, key = os.path.join(w.work, "tls-cert.pem"), os.path.join(w.work, "tls-key.pem")
    subject = f"idemgate console TLS {os.getpid()}"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", f"/CN={subject}",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    env = clean_env(DATABASE_URL=f"sqlite://{w.work}/tls.db", IDEMGATE_TLS_CERT=cert,
                    IDEMGATE_TLS_KEY=key)
    proc = Idemgate(w.args.bin, "serve-tls", ["serve", "--listen", f"127.0.0.1:{port}"], env,
                    w.work, f"{base}/healthz").start()
    trust = ssl.create_default_context(cafile=cert)

    def up():
        if proc.proc.poll() is not None:
            raise Failed(f"serve-tls exited with {proc.proc.returncode}:\n" + proc.log_tail())
        with urllib.request.urlopen(f"{base}/healthz", context=trust, timeout=2) as r:
            return r.status == 200
    wait_until(up, 30, 0.1, "serve-tls to answer over https")
    c.ok("serve with IDEMGATE_TLS_CERT/IDEMGATE_TLS_KEY answers /healthz over https "
         "(Python's ssl trusting the run's certificate)")
    t = w.tab(w.context(ignore_https_errors=True), base, "serve over TLS")
    r = t.page.goto(f"{base}/console", wait_until="load")
    c.that(r is not None and r.status == 200, f"GET {base}/console in Chromium: 200",
           f"{r.status if r else 'no response'}")
    details = r.security_details() or {}
    c.that(subject in (details.get("subjectName") or ""),
           f"over TLS ({details.get('protocol')}), with the run's certificate",
           f"security details {details}")
    c.that(t.heading() == "idemgate console", 'its h1 is "idemgate console"',
           f"h1 is {t.heading()!r}")
    t.quiet()
    urls = [q.url for q in t.requests]
    c.that(urls and all(u.startswith(base) for u in urls),
           f"every request of the page went over https to the serve ({len(urls)}: its assets "
           "and its fragments)", f"{[u for u in urls if not u.startswith(base)][:5]}")
    failed = [q.url for q in t.requests if (q.response() is None or q.response().status >= 400)]
    c.that(not failed, "and each was answered", f"unanswered or refused: {failed[:5]}")
    c.that("unauthorized" not in t.text().lower(), 'no "unauthorized": TLS changed nothing else')


CASES = [
    ("5 refusals", case_refusals),
    ("open console", case_open),
    ("3 serve: a lapsed lease, released", case_serve_lapsed),
    ("7 the person: keyboard, labels, narrow, dark", case_person),
    ("8 screenshots", case_screenshots),
    ("1+2 proxy killed (SQLite)", lambda w: case_proxy(w, "SQLite")),
    ("1+2 proxy killed (PostgreSQL)", lambda w: case_proxy(w, "PostgreSQL")),
    ("4 thousands of stuck keys (PostgreSQL)", case_bulk),
    ("6 the store away (PostgreSQL)", case_store_away),
    ("9 the console over TLS", case_tls),
]


def run_case(w: World, name: str, fn) -> None:
    c = w.checks
    print(f"\n-- case {name}", flush=True)
    c.case = f"case {name}"
    w.consoles = []
    w.offsite.clear()
    try:
        fn(w)
        errors = [e for t in w.consoles for e in t.errors]
        c.that(not errors, "no script error on the page", f"uncaught: {errors[:3]}")
        n = sum(len(t.requests) for t in w.consoles)
        c.that(not w.offsite, f"every request of the page went to 127.0.0.1 ({n} requests)",
               f"requests elsewhere: {w.offsite[:5]}")
    except Exception as e:
        c.fail(first_lines(str(e)))
        if not isinstance(e, (Failed, PlaywrightError)):
            traceback.print_exc(limit=6)
        dump(w, name)
    finally:
        for d in sorted({d for t in w.consoles for d in t.deviations}):
            c.fail(d)
        for t in w.consoles:
            try:
                t.context.close()
            except Exception:
                pass
        w.consoles = []


def first_lines(text: str, n: int = 4) -> str:
    """An error's first lines: Playwright's call logs go on for long."""
    lines = text.strip().splitlines()
    return "\n     ".join(lines[:n]) + (" …" if len(lines) > n else "")


def dump(w: World, name: str) -> None:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    seen = set()
    for i, t in enumerate(w.consoles):
        base = os.path.join(w.work, f"failure-{slug}-{i}")
        try:
            t.page.screenshot(path=base + ".png", full_page=True)
            with open(base + ".txt", "w") as f:
                f.write(f"{t.name}: {t.page.url}\n\n{t.text()}\n\n---- HTML\n{t.page.content()}\n")
            print(f"     {t.name}: the page ({t.page.url}) is in {base}.png and {base}.txt")
        except Exception as e:
            print(f"     {t.name}: could not dump the page: {e}")
        seen.add(t.base)
    for p in Idemgate.all:
        if any(b in p.ready_url for b in seen):
            print(f"     {p.name}'s log ({p.log_path}), its end:")
            print("       " + p.log_tail(8).replace("\n", "\n       "))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--chromium", required=True)
    ap.add_argument("--docs", default="docs")
    ap.add_argument("--pg-url", default=os.environ.get("DATABASE_URL")
                    or "postgres://postgres@127.0.0.1:5432/postgres")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--only", help="run only the cases whose name contains this")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="idemgate-console-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    w = World(args, work)
    c = w.checks
    ok = False
    try:
        try:
            w.setup()
        except (Failed, OSError) as e:
            c.fail(f"setting up: {e}")
            return 1
        with sync_playwright() as p:
            w.browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            c.ok(f"Chromium {w.browser.version} started headless, no host but 127.0.0.1 resolves")
            for name, fn in CASES:
                if args.only and args.only.lower() not in name.lower():
                    continue
                run_case(w, name, fn)
            w.browser.close()
        c.case = ""
        for p in Idemgate.all:
            if "panicked" in p.log_text():
                c.fail(f"{p.name} panicked: see {p.log_path}")
        ok = c.failed == 0
    finally:
        Idemgate.stop_all()
        for o in getattr(w, "origins", {}).values():
            o.close()
        if hasattr(w, "forwarder"):
            w.forwarder.stop()
        w.pg.drop_all()
        print(f"\nconsole: {c.passed} passed, {c.failed} failed")
        print(f"(in {elapsed()} s)")
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs, and the page of each failed case: {work}")
            for f in c.failures:
                print(f"  - {f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
