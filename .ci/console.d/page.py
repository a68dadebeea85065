"""The console as a person sees it: one browser tab, driven by the names a
person reads on it (headings, labels, buttons, link texts), and the few ids
the page's contract gives (#counts, #queue, #timeline, #response, #settle,
#settle-result).
"""

from __future__ import annotations

import re
import time
import urllib.parse

from harness import Failed, wait_until

# Every request the page sends, as the page sends it (htmx speaks XHR; a
# script of the page may use fetch): the method, the URL, and whether the
# Settle button was disabled when it left. Installed before any script of the
# page runs.
SEND_HOOK = """
(() => {
  window.__sends = [];
  const settleDisabled = () => {
    const form = document.querySelector('#settle');
    if (!form) return null;
    const b = [...form.querySelectorAll('button, input[type=submit]')]
      .find(b => /settle/i.test(b.textContent || b.value || ''));
    return b ? b.disabled : null;
  };
  const open = XMLHttpRequest.prototype.open;
  XMLHttpRequest.prototype.open = function (method, url) {
    this.__req = { method: String(method).toUpperCase(), url: String(url) };
    return open.apply(this, arguments);
  };
  const send = XMLHttpRequest.prototype.send;
  XMLHttpRequest.prototype.send = function () {
    if (this.__req) window.__sends.push({ ...this.__req, settleDisabled: settleDisabled(), at: Date.now() });
    return send.apply(this, arguments);
  };
  const f = window.fetch;
  window.fetch = function (input, init) {
    const method = ((init && init.method) || (input && input.method) || 'GET').toUpperCase();
    const url = typeof input === 'string' ? input : (input && input.url) || String(input);
    window.__sends.push({ method, url, settleDisabled: settleDisabled(), at: Date.now() });
    return f.apply(this, arguments);
  };
})();
"""

QUEUE_JS = """
() => {
  const t = document.querySelector('#queue');
  if (!t) return null;
  const heads = [...t.querySelectorAll('thead th')].map(th => th.innerText.trim().toLowerCase());
  const body = t.tBodies.length ? [...t.tBodies] : [t];
  const rows = body.flatMap(b => [...b.querySelectorAll(':scope > tr')]).map(tr => {
    const a = tr.querySelector('a');
    return {
      cells: [...tr.children].map(c => c.innerText.trim()),
      link: a ? a.textContent.trim() : null,
      href: a ? a.getAttribute('href') : null,
      text: tr.innerText.trim(),
    };
  });
  return { heads, rows, text: t.innerText };
}
"""

UNLABELLED_JS = """
() => [...document.querySelectorAll('input, select, textarea')]
  .filter(el => el.type !== 'hidden')
  .filter(el => {
    if ((el.getAttribute('aria-label') || '').trim()) return false;
    const by = el.getAttribute('aria-labelledby');
    if (by && by.split(/\\s+/).some(id => (document.getElementById(id)?.textContent || '').trim())) return false;
    // label.control is the element the label really labels: with two
    // elements of one id, a label[for] names only the first of them.
    if ([...document.querySelectorAll('label[for]')]
        .some(l => l.control === el && l.textContent.trim())) return false;
    return true;
  })
  .map(el => {
    const twin = el.id && document.querySelectorAll('#' + CSS.escape(el.id)).length > 1;
    return el.outerHTML.slice(0, 160) + (twin ? ` (another element has id "${el.id}")` : '');
  })
"""

ACTIVE_JS = """
() => {
  const el = document.activeElement;
  if (!el || el === document.body) return { tag: 'body' };
  const label = el.labels && el.labels.length ? el.labels[0] : null;
  return {
    tag: el.tagName.toLowerCase(), type: el.type || '', value: el.value || '',
    name: (el.getAttribute('aria-label') || (label && label.textContent) || el.textContent || '').trim(),
    inSettle: !!el.closest('#settle'), checked: !!el.checked,
  };
}
"""


def parse_age(text: str) -> int | None:
    """'2 min 10 s' → 130; '1 h 3 min' → 3780; None when there is no age."""
    units = {"d": 86400, "day": 86400, "days": 86400, "h": 3600, "hour": 3600, "hours": 3600,
             "min": 60, "mins": 60, "minute": 60, "minutes": 60, "m": 60,
             "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1}
    found = re.findall(r"(\d+)\s*(days?|d|hours?|h|minutes?|mins?|m|seconds?|secs?|s)\b", text)
    if not found:
        return None
    return sum(int(n) * units[u] for n, u in found)


def count_waiting(text: str) -> int | None:
    """'2,000 keys wait for a person' → 2000."""
    m = re.search(r"(\d[\d,.\u202f\u00a0 ]*)\s+keys?\s+waits?\s+for\s+a\s+person", text)
    if not m:
        m = re.search(r"\b(no)\s+keys?\s+waits?\s+for\s+a\s+person", text, re.I)
        return 0 if m else None
    return int(re.sub(r"\D", "", m.group(1)))


def field(scope, label: str):
    """The input, select or textarea labelled `label` (a region of the page
    may carry the same name as its aria-label)."""
    return scope.get_by_label(label, exact=True).and_(scope.locator("input, select, textarea")).first


class Console:
    """One tab on a console: the base URL of the door (serve's listener or a
    proxy's admin listener), and what the tab saw."""

    def __init__(self, context, base: str, name: str):
        self.context = context
        self.base = base
        self.name = name
        self.page = context.new_page()
        self.page.add_init_script(SEND_HOOK)
        self.requests: list = []  # every request of this tab
        self.errors: list[str] = []  # uncaught script errors
        self.deviations: set[str] = set()  # from the contract, worked around
        self.token_set_at = 0
        self.page.on("request", lambda r: self.requests.append(r))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    # --- navigation --------------------------------------------------------

    def open(self, path: str = "/console") -> "Console":
        r = self.page.goto(self.base + path, wait_until="load")
        if r is None or r.status != 200:
            raise Failed(f"GET {path} on {self.name}: {r.status if r else 'no response'}")
        return self

    def heading(self) -> str:
        h = self.page.locator("h1")
        return h.first.inner_text(timeout=5000).strip() if h.count() else ""

    def text(self) -> str:
        return self.page.locator("body").inner_text(timeout=5000)

    def wait_text(self, pattern: str, timeout: float = 10, where: str = "body") -> str:
        """Waits until the text of `where` matches the regex `pattern`
        (case-insensitive); returns that text."""
        rx = re.compile(pattern, re.I | re.S)

        def seen():
            loc = self.page.locator(where)
            if not loc.count():
                return None
            t = loc.first.inner_text(timeout=2000)
            return t if rx.search(t) else None
        try:
            return wait_until(seen, timeout, 0.2, f"{where} to say /{pattern}/")
        except Failed as e:
            loc = self.page.locator(where)
            now = loc.first.inner_text(timeout=2000) if loc.count() else f"(no {where} on the page)"
            raise Failed(f"{e}; it says: {short(now, 300)}") from None

    # --- the token ---------------------------------------------------------

    def use_token(self, token: str) -> None:
        # The page's first requests done and their events in, so that what
        # follows is what the token changed.
        self.quiet()
        self.page.wait_for_timeout(100)
        self.token_set_at = len(self.requests)
        self.token_field().fill(token, timeout=5000)
        self.page.get_by_role("button", name="Use token").click(timeout=5000)
        self.wait_text(r"Token set for this tab", 5)

    def forget_token(self) -> None:
        self.page.get_by_role("button", name="Forget token").click(timeout=5000)

    def token_form_shown(self) -> bool:
        f = self.token_field()
        return f.count() > 0 and f.is_visible()

    def token_field(self):
        """The password field labelled "Admin token"; if no field has that
        label, the page's password field, and the deviation is noted."""
        f = field(self.page, "Admin token")
        if f.count():
            return f
        why = self.page.evaluate("""() => {
            const l = [...document.querySelectorAll('label')].find(l => l.textContent.trim() === 'Admin token');
            if (!l) return 'no label says "Admin token"';
            const id = l.htmlFor, twins = id ? document.querySelectorAll('#' + CSS.escape(id)) : [];
            return twins.length > 1
                ? `its label[for="${id}"] names the first of ${twins.length} elements with id "${id}", a <${twins[0].tagName.toLowerCase()}>`
                : `its label labels ${l.control ? '<' + l.control.tagName.toLowerCase() + '>' : 'nothing'}`;
        }""")
        self.deviations.add(f'the password field is not labelled "Admin token": {why}')
        return self.page.locator("input[type=password]").first

    def fragment_requests(self, since_token: bool = False) -> list:
        """The page's own requests for content (not its assets), all or
        those since the last token was pasted."""
        out = []
        for r in self.requests[self.token_set_at if since_token else 0:]:
            u = urllib.parse.urlsplit(r.url)
            if u.path.startswith("/console") and not u.path.startswith("/console/assets/") \
                    and r.resource_type in ("xhr", "fetch"):
                out.append(r)
        return out

    # --- the counts and the queue ------------------------------------------

    def counts(self) -> str:
        return self.page.locator("#counts").inner_text(timeout=5000)

    def rows(self) -> list[dict]:
        """The queue's rows with a key, each cell under its column's name
        (none while there is no #queue)."""
        q = self.page.evaluate(QUEUE_JS)
        if q is None:
            return []
        names = q["heads"]
        rows = []
        for r in q["rows"]:
            if not r["link"]:
                continue
            row = {"link": r["link"], "href": r["href"], "text": r["text"]}
            for i, cell in enumerate(r["cells"]):
                name = names[i] if i < len(names) else str(i)
                for col in ("tenant", "state", "attempt", "age"):
                    if col in name:
                        row[col] = cell
            rows.append(row)
        return rows

    def filter(self, tenant: str | None = None, state: str | None = None,
               older_than_minutes: str | None = None) -> None:
        p = self.page
        if tenant is not None:
            field(p, "Tenant").fill(tenant, timeout=5000)
        if state is not None:
            field(p, "State").select_option(value=state, timeout=5000)
        if older_than_minutes is not None:
            field(p, "Older than (minutes)").fill(older_than_minutes, timeout=5000)
        p.get_by_role("button", name="Filter", exact=True).click(timeout=5000)

    def wait_row(self, h: str, timeout: float, press_filter: bool = True) -> dict:
        """Waits until the queue lists the key whose hash is `h`, pressing
        Filter now and then, as a person waiting for it would."""
        last = [0.0]

        def listed():
            if press_filter and time.monotonic() - last[0] > 1.5:
                last[0] = time.monotonic()
                self.page.get_by_role("button", name="Filter", exact=True).click(timeout=5000)
                time.sleep(0.3)
            for r in self.rows():
                if r["link"] == h[:12]:
                    return r
            return None
        try:
            return wait_until(listed, timeout, 0.3, f"the queue to list key {h[:12]}")
        except Failed as e:
            q = self.page.evaluate(QUEUE_JS)
            raise Failed(f"{e}; the queue shows: {short(q['text'] if q else self.text())}") from None

    def quiet(self, settle_s: float = 0.4, timeout: float = 10) -> None:
        """Waits until the tab has had no request in flight for `settle_s`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = self.page.evaluate("() => window.__sends.length")
            busy = self.page.evaluate(
                "() => !!document.querySelector('.htmx-request, [aria-busy=true]')")
            time.sleep(settle_s)
            if not busy and self.page.evaluate("() => window.__sends.length") == n:
                return

    # --- a key's page ------------------------------------------------------

    def settle_form(self):
        return self.page.locator("#settle")

    def fill_settle(self, action: str, reason: str, status: str | None = None,
                    headers: str | None = None, body: str | None = None) -> None:
        form = self.settle_form()
        label = {"release": "Release: nothing happened",
                 "complete": "Complete: this is what happened"}[action]
        field(form, label).check(timeout=5000)
        if status is not None:
            field(form, "Status").fill(status, timeout=5000)
        if headers is not None:
            field(form, "Headers").fill(headers, timeout=5000)
        if body is not None:
            field(form, "Body").fill(body, timeout=5000)
        field(form, "Reason").fill(reason, timeout=5000)

    def settle_button(self):
        return self.settle_form().get_by_role("button", name="Settle", exact=True)

    def sends(self, method: str | None = None) -> list[dict]:
        s = self.page.evaluate("() => window.__sends")
        return [x for x in s if method is None or x["method"] == method]

    def active(self) -> dict:
        return self.page.evaluate(ACTIVE_JS)

    def unlabelled(self) -> list[str]:
        return self.page.evaluate(UNLABELLED_JS)


def short(text: str, n: int = 600) -> str:
    text = re.sub(r"\s+", " ", text or "").strip()
    return text if len(text) <= n else text[:n] + " …"
