// The operators' console's own script, beside htmx: the admin token kept
// for this tab (sessionStorage, never a cookie) and sent as
// `Authorization: Bearer` on every request the page makes; answers that are
// refusals or failures shown where their fragment goes; the queue reloaded
// when the counts move; the settle form's response fields enabled only for
// "complete".
(function () {
  "use strict";
  var KEY = "idemgate.console.token";

  function token() {
    try { return sessionStorage.getItem(KEY); } catch (e) { return null; }
  }

  function showTokenState() {
    var set = !!token();
    var form = document.getElementById("token-form");
    var note = document.getElementById("token-set");
    if (form) form.hidden = set;
    if (note) note.hidden = !set;
  }

  function tokenChanged() {
    showTokenState();
    htmx.trigger(document.body, "token-changed");
  }

  document.addEventListener("htmx:configRequest", function (e) {
    var t = token();
    if (t) e.detail.headers["Authorization"] = "Bearer " + t;
  });

  // Refusals (401, 403), conflicts (409) and failures (503) are fragments
  // of their own: shown, not dropped. A 401 brings the token form back.
  document.addEventListener("htmx:beforeSwap", function (e) {
    var status = e.detail.xhr.status;
    if (status >= 400) {
      e.detail.shouldSwap = true;
      e.detail.isError = false;
    }
    if (status === 401) {
      var form = document.getElementById("token-form");
      if (form) form.hidden = false;
    }
  });

  // idemgate itself did not answer (stopped, or the network is away).
  document.addEventListener("htmx:sendError", function (e) {
    var target = e.detail.target;
    if (!target) return;
    var p = document.createElement("p");
    p.className = "problem";
    p.setAttribute("role", "alert");
    p.textContent = "idemgate did not answer (" + new Date().toLocaleTimeString() +
      "); the page tries again by itself.";
    if (target.id === "counts") {
      target.replaceChildren(p);
      target.dataset.up = "0";
    } else {
      target.replaceChildren(p);
    }
  });

  // The queue follows the counts: when the number of keys that wait, or
  // the store's health, changes, the queue is read again.
  var last = null;
  document.addEventListener("htmx:afterSwap", function (e) {
    var el = e.detail.target;
    if (!el || el.id !== "counts") return;
    var inner = el.querySelector("[data-stuck]");
    var now = inner ? inner.dataset.stuck + "/" + inner.dataset.up : "none";
    if (last !== null && now !== last) {
      var queue = document.getElementById("queue-section");
      if (queue) htmx.trigger(queue, "refresh");
    }
    last = now;
  });

  // The settle form: status, headers and body belong to "complete" only.
  function syncSettle(form) {
    var chosen = form.querySelector("input[name=action]:checked");
    var response = form.querySelector("#settle-response");
    if (response) response.disabled = !chosen || chosen.value !== "complete";
  }
  document.addEventListener("change", function (e) {
    var form = e.target.closest && e.target.closest("#settle");
    if (form) syncSettle(form);
  });
  document.addEventListener("htmx:load", function (e) {
    var form = e.detail.elt.querySelector ? e.detail.elt.querySelector("#settle") : null;
    if (form) syncSettle(form);
  });

  document.addEventListener("DOMContentLoaded", function () {
    var form = document.getElementById("token-form");
    if (form) {
      form.addEventListener("submit", function (e) {
        e.preventDefault();
        var input = document.getElementById("token");
        var value = input.value.trim();
        if (!value) { input.focus(); return; }
        try { sessionStorage.setItem(KEY, value); } catch (err) { /* storage off: nothing kept */ }
        input.value = "";
        tokenChanged();
        var forget = document.getElementById("forget-token");
        if (forget) forget.focus();
      });
    }
    var forget = document.getElementById("forget-token");
    if (forget) {
      forget.addEventListener("click", function () {
        try { sessionStorage.removeItem(KEY); } catch (err) { /* nothing kept */ }
        tokenChanged();
        var input = document.getElementById("token");
        if (input) input.focus();
      });
    }
    showTokenState();
  });
})();
