// The taskloom console: plain JavaScript, no build step, no library.
// Every piece of text that comes from a goal, a plan or a model is put into the page with
// textContent (through `h` below), never parsed as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "taskloom.token";
  const POLL_MS = 10000; // the fleet's health and the pending calls, besides what the event stream says
  const FLASH_MS = 10000; // how long a confirmation stays unless dismissed
  const TERMINAL = ["succeeded", "failed", "cancelled", "budget_exhausted"];
  const ROLES = ["planner", "executor", "critic"];
  let me = null; // {name, scopes}
  let routeCleanup = []; // closers of the current view's EventSources, listeners and timers

  // -- DOM helpers ------------------------------------------------------------------------------

  // h("td", {class: "x", dataset: {task: id}}, "text", child) -> element; strings become text nodes.
  function h(tag, attrs, ...children) {
    const el = tag.startsWith("svg:")
      ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
      : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "dataset") {
        for (const [dk, dv] of Object.entries(v)) if (dv !== null && dv !== undefined) el.dataset[dk] = dv;
      }
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  // replaceChildren, minus the null/false placeholders of optional parts (the DOM would print "null").
  function put(el, ...kids) {
    el.replaceChildren(...kids.flat().filter((k) => k !== null && k !== undefined && k !== false));
  }
  const $ = (sel, root) => (root || document).querySelector(sel);
  const view = () => $("#view");
  const can = (scope) => !!me && (me.scopes.includes(scope) || me.scopes.includes("admin"));
  const fmt = (n) => Number(n || 0).toLocaleString("en-US");
  const shortId = (id) => id.slice(0, 12);
  const clip = (s, n) => (s.length > n ? `${s.slice(0, n - 1)}…` : s);
  const callKey = (a) => `${a.goal_id}/${a.call_id}`;
  const goalHref = (id) => `#/goals/${encodeURIComponent(id)}`;

  function age(iso) {
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    return ageOf(s);
  }
  function ageOf(s) {
    if (s < 60) return `${Math.floor(s)}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${Math.floor(s % 60)}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
    return `${Math.floor(s / 86400)}d`;
  }
  function stateBadge(state, extra) {
    return h("span", { class: `state ${state}`, dataset: extra || {} }, state.replace("_", " "));
  }
  // A running goal one of whose tool calls waits for a person: what matters is that it waits.
  function waitingBadge(n, extra) {
    return h("span", { class: "state waiting_approval", title: `${n} tool call${n > 1 ? "s" : ""} wait for a decision`,
      dataset: extra || {} }, "waiting for approval");
  }
  function bar(fraction, cls) {
    const inner = h("span");
    inner.style.width = `${Math.min(100, Math.max(0, fraction * 100)).toFixed(1)}%`;
    return h("div", { class: `bar ${cls || ""}` }, inner);
  }
  function debounce(fn, ms) {
    let t = null;
    return () => {
      clearTimeout(t);
      t = setTimeout(fn, ms);
    };
  }

  // -- API --------------------------------------------------------------------------------------

  const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

  class ApiError extends Error {
    constructor(status, body) {
      const e = (body && body.error) || {};
      super(e.message || `HTTP ${status}`);
      this.status = status;
      this.field = e.field || null;
    }
  }

  async function api(path, options) {
    const opts = Object.assign({ headers: {} }, options || {});
    if (token()) opts.headers.Authorization = `Bearer ${token()}`;
    if (opts.json !== undefined) {
      opts.body = JSON.stringify(opts.json);
      opts.headers["Content-Type"] = "application/json";
      delete opts.json;
    }
    const r = await fetch(path, opts);
    let body = null;
    try {
      body = await r.json();
    } catch (_) {
      body = null;
    }
    if (!r.ok) throw new ApiError(r.status, body);
    return body;
  }

  function showError(where, err) {
    put(where, h("p", { class: "error", role: "alert" }, err.message || String(err)));
  }

  // A confirmation that stays until dismissed or FLASH_MS have passed, whatever the view redraws.
  function flash(text, kind) {
    const item = h("div", { class: `flash ${kind || ""}`, role: "status" }, h("span", {}, text),
      h("button", { class: "dismiss", type: "button", "aria-label": "dismiss", onclick: () => item.remove() }, "×"));
    $("#flash").append(item);
    setTimeout(() => item.remove(), FLASH_MS);
  }

  // -- live updates -----------------------------------------------------------------------------

  // The header's indicator speaks for one stream: the goal's on a goal page, else every goal's.
  const streamStatus = new WeakMap();
  let liveOwner = null;

  function paintLive() {
    const [text, on] = (liveOwner && streamStatus.get(liveOwner)) || ["offline", false];
    const live = $("#live");
    live.textContent = text;
    live.classList.toggle("on", on);
  }
  function setStatus(es, text, on) {
    streamStatus.set(es, [text, on]);
    if (es === liveOwner) paintLive();
  }

  // An EventSource on `path` (the token goes as a parameter: EventSource cannot send headers).
  // It reconnects by itself, sending Last-Event-ID, so nothing is missed across a drop; when the
  // browser gives up (a 4xx answer), it says so instead of "reconnecting".
  // `onLive` (a goal's /stream): its `text` and `restart` frames, the models' words as they are written.
  function openStream(path, onEvent, onEnd, onOpen, onLive) {
    const sep = path.includes("?") ? "&" : "?";
    const url = token() ? `${path}${sep}access_token=${encodeURIComponent(token())}` : path;
    const es = new EventSource(url);
    setStatus(es, "connecting", false);
    es.onopen = () => {
      setStatus(es, "live", true);
      if (onOpen) onOpen();
    };
    es.onerror = () => setStatus(es, es.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting", false);
    es.onmessage = (m) => onEvent(JSON.parse(m.data), m.lastEventId);
    if (onLive) {
      for (const kind of ["text", "restart"]) es.addEventListener(kind, (m) => onLive(JSON.parse(m.data)));
    }
    es.addEventListener("end", () => {
      es.close();
      setStatus(es, "ended", false);
      if (onEnd) onEnd();
    });
    return es;
  }

  // A stream of the current view: closed when the view goes; the indicator follows it meanwhile.
  function viewStream(path, onEvent, onEnd, onLive) {
    const es = openStream(path, onEvent, onEnd, undefined, onLive);
    liveOwner = es;
    paintLive();
    routeCleanup.push(() => es.close());
    return es;
  }

  // One stream of every goal's events per tab, for as long as someone is signed in: the views,
  // the Approvals badge and the goals table all listen to it.
  const hub = { es: null, listeners: new Set() };

  function startHub() {
    if (hub.es && hub.es.readyState !== EventSource.CLOSED) return;
    const old = hub.es;
    const tell = (e) => hub.listeners.forEach((fn) => fn(e));
    // `$` means "from when the stream opens": what happened before (while a view read its data,
    // or while the stream was closed) is not in it, so every (re)opening lets everyone re-read.
    // It never ends by itself: an `end` (a server shutting down) means reconnect.
    hub.es = openStream("/v1/events?after=$", tell, () => setTimeout(() => { if (me) startHub(); }, 1000),
      () => tell({ type: "console.connected" }));
    if (!liveOwner || liveOwner === old) liveOwner = hub.es;
    paintLive();
  }
  function stopHub() {
    if (hub.es) hub.es.close();
    hub.es = null;
    liveOwner = null;
    paintLive();
  }
  function onAnyEvent(fn) {
    hub.listeners.add(fn);
    routeCleanup.push(() => hub.listeners.delete(fn));
  }

  // -- pending approvals: one list for the badge, the goals table and the inbox -----------------

  const pending = { items: [], byGoal: new Map(), listeners: new Set(), seen: "", asked: 0 };

  // Re-reads the pending calls; tells the listeners only when the set changed. Returns the error, if any.
  async function refreshPending() {
    if (!can("read")) return null;
    const asked = ++pending.asked;
    let items;
    try {
      items = (await api("/v1/approvals?limit=500")).approvals;
    } catch (e) {
      return e; // the next event or poll tries again
    }
    if (asked !== pending.asked) return null; // a later read is under way: its answer is newer
    const badge = $("#approval-count");
    badge.hidden = !items.length;
    badge.textContent = items.length >= 500 ? "500+" : String(items.length);
    const seen = items.map(callKey).join(" ");
    if (seen === pending.seen) return null;
    pending.items = items;
    pending.seen = seen;
    pending.byGoal = new Map();
    for (const a of items) pending.byGoal.set(a.goal_id, (pending.byGoal.get(a.goal_id) || 0) + 1);
    pending.listeners.forEach((fn) => fn());
    return null;
  }
  const refreshPendingSoon = debounce(refreshPending, 200);
  function onPending(fn) {
    pending.listeners.add(fn);
    routeCleanup.push(() => pending.listeners.delete(fn));
  }
  const touchesApprovals = (e) => e.type.startsWith("tool.approval") || e.type === "goal.state"
    || e.type === "console.connected";
  hub.listeners.add((e) => { if (touchesApprovals(e)) refreshPendingSoon(); });

  // -- the fleet: a banner when a role has no live worker ---------------------------------------

  // "planner", "planner or executor", "planner, executor or critic"
  function either(names) {
    return names.length > 1 ? `${names.slice(0, -1).join(", ")} or ${names[names.length - 1]}` : names[0];
  }

  async function refreshFleet() {
    const banner = $("#fleet-banner");
    let fleet;
    try {
      fleet = await api("/v1/fleet");
    } catch (_) {
      banner.hidden = true; // 404 (an API without the endpoint) or unreachable: unknown, say nothing
      return;
    }
    const idle = (fleet.roles || []).filter((r) => r.live_workers === 0)
      .sort((a, b) => ROLES.indexOf(a.role) - ROLES.indexOf(b.role));
    const redis = fleet.redis;
    if (redis && (redis.memory_full || redis.role !== "master")) {
      put(banner, h("b", {}, redis.memory_full
        ? "Redis memory is full: every write is refused, goals wait until memory is freed."
        : `Redis at ${redis.address} is a replica: nothing can be written, goals wait.`));
      banner.dataset.roles = "";
      banner.hidden = false;
      return;
    }
    if (fleet.ok || !idle.length) {
      banner.hidden = true;
      return;
    }
    const queued = idle.filter((r) => r.queue_depth > 0).map((r) => `${fmt(r.queue_depth)} ${r.role} job`
      + `${r.queue_depth > 1 ? "s" : ""} queued${r.oldest_queued_age_s !== null ? `, oldest ${ageOf(r.oldest_queued_age_s)}` : ""}`);
    put(banner,
      h("b", {}, `No ${either(idle.map((r) => r.role))} worker is running: goals will not move.`),
      queued.length ? h("span", {}, ` ${queued.join("; ")}.`) : null,
      h("span", { class: "hint" }, " Start one with `taskloom worker <role>`."));
    banner.dataset.roles = idle.map((r) => r.role).join(" ");
    banner.hidden = false;
  }

  let pollTimer = null;
  function startPolling() {
    stopPolling();
    const tick = () => {
      refreshFleet();
      refreshPending();
      startHub(); // reopens it if the browser gave up on it
    };
    tick();
    pollTimer = setInterval(tick, POLL_MS);
  }
  function stopPolling() {
    clearInterval(pollTimer);
    pollTimer = null;
    pending.items = [];
    pending.byGoal = new Map();
    pending.seen = "";
    $("#fleet-banner").hidden = true;
    $("#approval-count").hidden = true;
  }

  // -- sign-in ----------------------------------------------------------------------------------

  async function whoami() {
    try {
      me = await api("/v1/me");
    } catch (e) {
      if (e.status === 401) me = null;
      else throw e;
    }
    $("#whoami").textContent = me ? `${me.name} · ${me.scopes.join(", ")}` : "";
    $("#signout").hidden = !me || !token();
    if (me && can("read")) startPolling();
    return me;
  }

  function renderLogin(message) {
    const input = h("input", { type: "password", id: "token-input", autocomplete: "off", placeholder: "tl_..." });
    const form = h(
      "form",
      { class: "stack panel login", id: "login-form" },
      h("h1", {}, "Sign in"),
      h("p", { class: "muted" }, "Paste an API token (from `taskloom api-token` or `taskloom api --open`)."),
      message ? h("p", { class: "error" }, message) : null,
      h("label", { for: "token-input" }, "Token"),
      input,
      h("p", {}, h("button", { class: "primary", type: "submit" }, "Sign in"))
    );
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      if (await whoami()) route();
      else renderLogin("That token was not accepted.");
    });
    put(view(), form);
  }

  // -- goals table ------------------------------------------------------------------------------

  const PAGE = 50;
  const MAX_PAGE = 200; // the API's largest page
  const TOP_UP = 10; // rows per extra request when goals arrived above those shown

  async function renderGoals() {
    const filter = h(
      "select",
      { id: "state-filter", "aria-label": "state" },
      h("option", { value: "" }, "all states"),
      ["submitted", "planning", "running", "replanning", "reviewing", "succeeded", "failed", "cancelled",
        "budget_exhausted"].map((s) => h("option", { value: s }, s.replace("_", " ")))
    );
    const body = h("tbody", { id: "goals-body" });
    const more = h("button", { id: "more", hidden: true }, "Load more");
    const msg = h("div");
    const panel = h(
      "section",
      { class: "panel" },
      h("div", { class: "toolbar" }, h("h1", {}, "Goals"), h("span", { class: "muted" }, "newest first"), filter,
        can("submit") ? h("a", { href: "#/submit" }, "+ submit a goal") : null),
      msg,
      h("div", { class: "table-wrap" }, h("table", { id: "goals" },
        h("thead", {}, h("tr", {}, ["goal", "state", "progress", "tokens", "age", "id"].map((c) => h("th", {}, c)))),
        body)),
      h("p", {}, more)
    );
    put(view(), panel);
    let rows = [];
    let cursor = null;
    let loadedMore = false; // then a refresh keeps every row shown, else it shows the newest page

    function row(g) {
      const frac = g.tasks_total ? g.tasks_done / g.tasks_total : 0;
      const used = g.budget_tokens ? (g.spent_tokens + g.reserved_tokens) / g.budget_tokens : 0;
      const waiting = TERMINAL.includes(g.state) ? 0 : pending.byGoal.get(g.id) || 0;
      const tr = h(
        "tr",
        { class: "goal-row", dataset: { goal: g.id, state: g.state, waiting: waiting ? String(waiting) : null } },
        h("td", { class: "text", title: g.text }, h("a", { href: goalHref(g.id) }, g.text)),
        h("td", { class: "state-cell" }, waiting ? waitingBadge(waiting) : stateBadge(g.state)),
        h("td", { class: "progress" }, h("div", { class: "cell-bar" }, bar(frac), `${g.tasks_done}/${g.tasks_total}`)),
        h("td", { class: "tokens" }, h("div", { class: "cell-bar" }, bar(used, used > 0.8 ? "tokens high" : "tokens"),
          `${fmt(g.spent_tokens)} / ${fmt(g.budget_tokens)}`)),
        h("td", { class: "age", dataset: { since: g.created_at } }, age(g.created_at)),
        h("td", { class: "id mono muted" }, shortId(g.id))
      );
      tr.addEventListener("click", (ev) => {
        if (ev.target.tagName !== "A") location.hash = goalHref(g.id);
      });
      return tr;
    }

    // A goal's row is kept across redraws (a live update redraws every 250 ms or so) and its cells
    // other than the link are renewed in place: replaced rows made a click that spanned a redraw
    // press one link and release another, and a click so split is lost.
    let shown = new Map();
    // While a button is held down on the table, redraws wait for its release: a goal arriving on top
    // moved the rows under the pointer, so the release landed on another row and the click was lost.
    let pressed = false;
    let owed = false;
    body.addEventListener("pointerdown", () => { pressed = true; });
    function released() {
      if (!body.isConnected) {
        document.removeEventListener("pointerup", released, true);
        document.removeEventListener("pointercancel", released, true);
        return;
      }
      if (!pressed) return;
      pressed = false;
      if (owed) setTimeout(draw); // after the click this release makes
    }
    document.addEventListener("pointerup", released, true);
    document.addEventListener("pointercancel", released, true);
    function draw() {
      owed = pressed;
      if (pressed) return;
      const next = new Map();
      for (const g of rows) {
        const fresh = row(g);
        const old = shown.get(g.id);
        if (!old) {
          next.set(g.id, fresh);
          continue;
        }
        const cells = [...fresh.children];
        for (let i = 1; i < cells.length; i++) old.children[i].replaceWith(cells[i]);
        old.dataset.state = fresh.dataset.state;
        if (fresh.dataset.waiting) old.dataset.waiting = fresh.dataset.waiting;
        else delete old.dataset.waiting;
        next.set(g.id, old);
      }
      shown = next;
      const order = [...next.values()];
      if (!rows.length) put(body, h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No goals yet.")));
      else reconcile(body, order); // rows already shown stay in the page, even when a goal arrives on top
      more.hidden = !cursor;
    }

    // The newest `n` goals, or, given `last` (the oldest row shown after "Load more"), the newest
    // goals down to it: goals that arrived since make the list longer, never shorter. Gives up
    // on `last` a page past `n` (it may have left a filtered list).
    async function fetchNewest(n, last) {
      const out = [];
      let next = null;
      do {
        const want = out.length ? TOP_UP : Math.min(MAX_PAGE, n);
        const params = new URLSearchParams({ limit: String(want) });
        if (filter.value) params.set("state", filter.value);
        if (next) params.set("cursor", next);
        const page = await api(`/v1/goals?${params}`);
        out.push(...page.goals);
        next = page.next_cursor;
      } while (next && (last ? !out.some((g) => g.id === last) && out.length < n + PAGE : out.length < n));
      return { goals: out, next };
    }

    // `more`: the next page after those shown; otherwise re-read as many rows as are shown, so a
    // live update keeps what "Load more" loaded.
    let busy = Promise.resolve();
    function load(how) {
      busy = busy.then(async () => {
        try {
          if (how === "more" && cursor) {
            const params = new URLSearchParams({ limit: String(PAGE), cursor });
            if (filter.value) params.set("state", filter.value);
            const page = await api(`/v1/goals?${params}`);
            rows = rows.concat(page.goals);
            cursor = page.next_cursor;
            loadedMore = true;
          } else {
            if (how === "reset") loadedMore = false;
            const got = loadedMore && rows.length ? await fetchNewest(rows.length, rows[rows.length - 1].id) : await fetchNewest(PAGE);
            rows = got.goals;
            cursor = got.next;
          }
          draw();
          put(msg);
        } catch (e) {
          showError(msg, e);
        }
      });
      return busy;
    }
    filter.addEventListener("change", () => load("reset"));
    more.addEventListener("click", () => load("more"));
    // Live: any goal's event re-reads the shown rows (debounced); the badges follow the pending
    // calls; ages tick every second. Listening starts before the first read, so nothing that
    // happens during it is missed.
    const refresh = debounce(() => load("refresh"), 250);
    onAnyEvent(refresh);
    onPending(draw);
    await load("reset");
    const ticker = setInterval(() => {
      for (const td of document.querySelectorAll("td.age")) td.textContent = age(td.dataset.since);
    }, 1000);
    routeCleanup.push(() => clearInterval(ticker));
  }

  // -- DAG --------------------------------------------------------------------------------------

  // Columns by depth (longest chain of dependencies), rows in plan order; edges as curves.
  function drawDag(plan) {
    const W = 200, H = 50, GX = 60, GY = 18, PAD = 10;
    const byId = new Map(plan.tasks.map((t) => [t.id, t]));
    const depth = new Map();
    const depthOf = (id, seen) => {
      if (depth.has(id)) return depth.get(id);
      if (seen.has(id)) return 0; // a cycle (the planner rejects those; draw anyway)
      seen.add(id);
      const deps = byId.get(id).depends_on.filter((d) => byId.has(d) && d !== id);
      const d = deps.length ? 1 + Math.max(...deps.map((x) => depthOf(x, seen))) : 0;
      depth.set(id, d);
      return d;
    };
    plan.tasks.forEach((t) => depthOf(t.id, new Set()));
    const cols = [];
    for (const t of plan.tasks) (cols[depth.get(t.id)] = cols[depth.get(t.id)] || []).push(t);
    const pos = new Map();
    cols.forEach((col, c) => col.forEach((t, r) => pos.set(t.id, { x: PAD + c * (W + GX), y: PAD + r * (H + GY) })));
    const width = PAD * 2 + cols.length * (W + GX) - GX;
    const height = PAD * 2 + Math.max(...cols.map((c) => c.length)) * (H + GY) - GY;
    const svg = h("svg:svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": "plan" });
    for (const e of plan.edges) {
      const a = pos.get(e.from), b = pos.get(e.to);
      if (!a || !b) continue;
      const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2, mx = (x1 + x2) / 2;
      svg.append(h("svg:path", { class: "edge", d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`,
        "marker-end": "url(#arrow)" }));
    }
    const defs = h("svg:defs", {}, h("svg:marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
      markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, h("svg:path", { d: "M0,0 L10,5 L0,10 z", fill: "#9aa3b8" })));
    svg.prepend(defs);
    for (const t of plan.tasks) {
      const p = pos.get(t.id);
      svg.append(h("svg:g", { class: `node ${t.state}`, transform: `translate(${p.x},${p.y})`,
        dataset: { task: t.id, state: t.state } },
        h("svg:title", {}, `${t.id}: ${t.title} (${t.state})`),
        h("svg:rect", { width: W, height: H, rx: 6 }),
        h("svg:text", { x: 10, y: 20 }, clip(`${t.id}: ${t.title}`, 28)),
        h("svg:text", { x: 10, y: 38, class: "sub" }, t.state.replace("_", " "))));
    }
    return svg;
  }

  // -- a tool call waiting for a person (the inbox and the goal page) ---------------------------

  async function decide(a, approved, reason, card) {
    const verb = approved ? "approve" : "deny";
    for (const b of card.querySelectorAll("button, input")) b.disabled = true;
    try {
      await api(`/v1/approvals/${encodeURIComponent(a.goal_id)}/${encodeURIComponent(a.call_id)}/${verb}`,
        { method: "POST", json: { reason } });
      flash(`${approved ? "Approved" : "Denied"}: ${a.tool} for goal “${clip(a.goal_text, 60)}” (${shortId(a.goal_id)})`,
        approved ? "ok" : "bad");
    } catch (e) {
      for (const b of card.querySelectorAll("button, input")) b.disabled = false;
      card.append(h("p", { class: "error", role: "alert" }, e.message));
    }
    refreshPending();
  }

  // One call: the tool, its arguments, who asked; Approve and Deny for a token that may decide.
  function approvalCard(a, { showGoal }) {
    const reason = h("input", { type: "text", placeholder: "reason (optional)", "aria-label": "reason",
      maxlength: 2000 });
    const card = h("div", { class: "approval", dataset: { call: a.call_id, goal: a.goal_id } });
    card.append(
      h("div", { class: "call" },
        h("div", {}, h("b", { class: "tool" }, a.tool), h("span", { class: "muted" }, ` · requested ${age(a.requested_at)} ago`)),
        h("dl", { class: "kv" },
          showGoal ? [h("dt", {}, "goal"), h("dd", {},
            h("a", { href: goalHref(a.goal_id) }, a.goal_text), " ",
            h("span", { class: "mono muted goal-id", title: a.goal_id }, shortId(a.goal_id)))] : null,
          h("dt", {}, "asked by"), h("dd", {}, `task ${a.task_id}${a.task_title ? `: ${a.task_title}` : ""} (attempt ${a.attempt})`),
          h("dt", {}, "call"), h("dd", { class: "mono" }, a.call_id),
          h("dt", {}, "arguments"), h("dd", {}, h("pre", { class: "args" }, JSON.stringify(a.arguments, null, 2))),
          // What already happened: the task's earlier calls of this tool (a retry may repeat a done one).
          (a.earlier || []).length ? [h("dt", {}, "earlier calls"), h("dd", { class: "earlier" },
            h("ul", {}, a.earlier.map((x) => h("li", {},
              h("b", {}, x.outcome), ` · attempt ${x.attempt} · `,
              h("span", { class: "mono" }, JSON.stringify(x.input)),
              x.result ? h("div", { class: "muted" }, x.result) : null))))] : null)),
      can("approve")
        ? h("div", { class: "actions" }, reason,
          h("span", { class: "hint muted" }, "A denial's reason is shown to the model."),
          h("div", { class: "row" },
            h("button", { class: "approve", onclick: () => decide(a, true, reason.value, card) }, "Approve"),
            h("button", { class: "deny", onclick: () => decide(a, false, reason.value, card) }, "Deny")))
        : h("div", { class: "actions muted" }, "read only")
    );
    return card;
  }

  // Keep the cards of calls still waiting where they are, add new ones in their place, remove the
  // rest. A kept card is never taken out of the page: one taken out and put back (as replacing the
  // list's children did on every sync) loses the focus of the reason being typed in it, and a
  // press on its button that spans the sync is lost with it. It moves only if the order changes.
  function syncCards(list, items, opts) {
    const have = new Map([...list.querySelectorAll(".approval")].map((c) => [`${c.dataset.goal}/${c.dataset.call}`, c]));
    reconcile(list, items.map((a) => have.get(callKey(a)) || approvalCard(a, opts)));
  }

  // Make `want` the children of `list`, in order, without taking out and putting back the ones
  // already there (that would drop their focus, a selection in them, or a press on them).
  function reconcile(list, want) {
    const keep = new Set(want);
    for (const el of [...list.children]) if (!keep.has(el)) el.remove();
    want.forEach((el, i) => { if (list.children[i] !== el) list.insertBefore(el, list.children[i] || null); });
  }

  // -- goal page --------------------------------------------------------------------------------

  async function renderGoal(id) {
    let first;
    try {
      first = await api(`/v1/goals/${encodeURIComponent(id)}`);
    } catch (e) {
      if (e.status === 404) renderNoSuchGoal(id);
      else showError(view(), e);
      return; // nothing to follow
    }
    const head = h("section", { class: "panel", id: "goal-head" });
    const calls = h("div", { id: "goal-approvals" });
    const callsPanel = h("section", { class: "panel waiting", id: "goal-approvals-panel", hidden: true },
      h("h2", {}, "Waiting for approval"),
      h("p", { class: "muted" }, "The agent wants to call a tool that needs a person's decision; the task waits."),
      calls);
    const dag = h("div", { class: "dag", id: "dag" }, h("p", { class: "muted" }, "No plan yet."));
    const tasks = h("div", { id: "tasks" });
    const answer = h("div", { id: "answer" });
    const writing = h("div", { id: "writing" });
    const writingPanel = h("section", { class: "panel", id: "writing-panel", hidden: true },
      h("h2", {}, "Being written"), writing);
    const ledger = h("div", { id: "ledger" });
    const events = h("tbody", { id: "event-rows" });
    put(
      view(),
      head,
      callsPanel,
      h("div", { class: "grid" },
        h("div", {},
          h("section", { class: "panel" }, h("h2", {}, "Plan"), dag),
          h("section", { class: "panel" }, h("h2", { id: "answer-title" }, "Answer"), answer),
          writingPanel,
          h("section", { class: "panel" }, h("h2", {}, "Tasks and attempts"), tasks)),
        h("div", {},
          h("section", { class: "panel" }, h("h2", {}, "Ledger"), ledger),
          h("section", { class: "panel" }, h("h2", {}, "Events"),
            h("div", { class: "events" }, h("table", { id: "events" }, events)))))
    );

    // The head is built once and each refresh renews its parts in place. Replaced whole on every
    // refresh (each event of a running goal makes one), it dropped a press on Cancel that spanned a
    // refresh, and any selection of the goal's text.
    const cancel = h("button", { class: "deny", id: "cancel", hidden: true, onclick: async () => {
      if (!confirm("Cancel this goal?")) return;
      try { await api(`/v1/goals/${encodeURIComponent(id)}/cancel`, { method: "POST", json: {} }); }
      catch (e) { alert(e.message); }
      refresh();
    } }, "Cancel goal");
    const headParts = {
      state: h("span"),
      waiting: h("span", { hidden: true }),
      text: h("p", { class: "goal-text", id: "goal-text" }),
      done: h("p", { class: "muted", hidden: true }),
      meta: h("div", { class: "meta" }),
    };
    const toolbar = h("div", { class: "toolbar" }, h("h1", {}, "Goal"), headParts.state, headParts.waiting, cancel);

    function swap(name, el) {
      headParts[name].replaceWith(el);
      headParts[name] = el;
    }

    function paintHead(g, waiting) {
      if (!head.contains(toolbar)) put(head, toolbar, headParts.text, headParts.done, headParts.meta); // first, or after an error
      swap("state", stateBadge(g.state, { testid: "goal-state" }));
      swap("waiting", waiting.length ? waitingBadge(waiting.length, { testid: "goal-waiting" }) : h("span", { hidden: true }));
      cancel.hidden = !(can("submit") && !TERMINAL.includes(g.state));
      if (headParts.text.textContent !== g.goal.text) headParts.text.textContent = g.goal.text;
      const done = g.goal.definition_of_done ? `Done when: ${g.goal.definition_of_done}` : "";
      if (headParts.done.textContent !== done) headParts.done.textContent = done;
      headParts.done.hidden = !done;
      put(headParts.meta,
        h("span", {}, "id ", h("b", { class: "mono" }, g.id)),
        h("span", {}, "plan ", h("b", {}, `v${g.plan_version}`)),
        h("span", {}, "replans ", h("b", {}, String(g.replans))),
        h("span", {}, "age ", h("b", {}, age(g.created_at))),
        g.reason ? h("span", {}, "reason ", h("b", {}, g.reason)) : null);
    }

    async function refresh(known) {
      let s = known;
      let waiting = [];
      try {
        if (!s) s = await api(`/v1/goals/${encodeURIComponent(id)}`);
        if (!TERMINAL.includes(s.goal.state)) {
          waiting = (await api(`/v1/approvals?goal_id=${encodeURIComponent(id)}`)).approvals;
        }
      } catch (e) {
        showError(head, e);
        return;
      }
      const g = s.goal;
      paintHead(g, waiting);
      syncCards(calls, waiting, { showGoal: false });
      callsPanel.hidden = !waiting.length;
      const jobs = [];
      if (g.plan_version) {
        jobs.push(api(`/v1/goals/${encodeURIComponent(id)}/plan`).then((p) => put(dag, drawDag(p))));
      }
      jobs.push(api(`/v1/goals/${encodeURIComponent(id)}/attempts`).then((a) => {
        renderAttempts(a);
        renderAnswer(g, a);
      }));
      jobs.push(api(`/v1/goals/${encodeURIComponent(id)}/ledger`).then(renderLedger).catch(() => null));
      await Promise.all(jobs).catch((e) => showError(tasks, e));
    }

    const ENDED = { failed: "Failed", cancelled: "Cancelled", budget_exhausted: "Out of budget" };

    // The models' words as they are written (/stream's `text` and `restart` frames, never stored):
    // per task, the text of its latest call. A frame's text lands at its offset (held[:offset] +
    // text), so a call written again from 0 replaces it; `restart` clears it and says so. A task
    // that leaves running drops its text: its stored attempt (Tasks) and the answer take over.
    const live = new Map(); // task id -> { attempt, step, text, gap, restarted, el }
    let planTasks = 0; // tasks of the current plan (0: no plan yet)

    function onLive(f) {
      let held = live.get(f.task);
      if (f.type === "restart") {
        const restarted = held ? held.restarted + 1 : 1;
        if (held) held.el.remove();
        held = { attempt: f.attempt, step: f.step, text: "", gap: false, restarted, el: null };
        live.set(f.task, held);
      } else {
        if (!held || held.attempt !== f.attempt || held.step !== f.step) {
          if (held) held.el.remove();
          held = { attempt: f.attempt, step: f.step, text: "", gap: false, restarted: held ? held.restarted : 0, el: null };
          live.set(f.task, held);
        }
        if (f.offset > held.text.length) { held.text += f.text; held.gap = true; }
        else held.text = held.text.slice(0, f.offset) + f.text;
      }
      paintLiveTask(f.task, held);
    }

    function paintLiveTask(task, held) {
      const note = `attempt ${held.attempt} · step ${held.step}` + (held.restarted ? " · restarted: written again" : "");
      const el = h("div", { class: "writing", dataset: { task, length: String(held.text.length), restarted: String(held.restarted) } },
        h("div", {}, h("b", {}, task), " ", h("span", { class: "muted" }, note)),
        h("pre", { class: "live-text" }, (held.gap ? "…" : "") + held.text));
      if (held.el) held.el.replaceWith(el); else writing.append(el);
      held.el = el;
      writingPanel.hidden = false;
      paintAnswerLive();
    }

    function dropLive(task) {
      const held = live.get(task);
      if (!held) return;
      held.el.remove();
      live.delete(task);
      writingPanel.hidden = live.size === 0;
      paintAnswerLive();
    }

    // A goal of one task (or not planned yet: a goal answered in text is answered while it is
    // planned) has that task's words as its answer: shown in the Answer panel as they come.
    function paintAnswerLive() {
      const slot = $("#answer-live");
      if (!slot) return;
      const only = planTasks <= 1 && live.size === 1 ? [...live.values()][0] : null;
      slot.hidden = !only || !only.text;
      slot.textContent = only ? (only.gap ? "…" : "") + only.text : "";
      const none = $("#answer-none");
      if (none) none.textContent = slot.hidden ? "Not yet." : "Being written…";
    }

    // A goal that ended without an answer says why, and what its tasks had achieved by then.
    function renderAnswer(g, a) {
      const ended = TERMINAL.includes(g.state) && g.state !== "succeeded";
      $("#answer-title").textContent = ended ? "Outcome" : "Answer";
      planTasks = a.tasks.length;
      if (!ended) {
        put(answer, g.answer ? h("div", { class: "answer", id: "answer-text" }, g.answer)
          : h("div", {}, h("div", { class: "answer live-text", id: "answer-live", hidden: true }),
            h("p", { class: "muted", id: "answer-none" }, g.state === "succeeded" ? "(empty)" : "Not yet.")));
        paintAnswerLive();
        return;
      }
      const accepted = [];
      for (const t of a.tasks) {
        for (const x of t.attempts) if (x.verdict && x.verdict.action === "accept") accepted.push([t, x]);
      }
      put(answer,
        h("div", { class: `ended ${g.state}`, id: "ended" },
          h("p", {}, h("b", {}, ENDED[g.state]), ": ",
            h("span", { id: "end-reason" }, g.reason || "no reason was recorded"))),
        g.answer ? h("div", { class: "answer", id: "answer-text" }, g.answer) : null,
        h("h3", {}, `Accepted before it ended (${accepted.length} task result${accepted.length === 1 ? "" : "s"})`),
        accepted.length
          ? h("div", { id: "accepted" }, accepted.map(([t, x]) => h("div", { class: "accepted", dataset: { task: t.task_id } },
            h("div", {}, h("b", {}, `${t.task_id}: ${t.title}`), h("span", { class: "muted" }, ` · attempt ${x.attempt}`)),
            h("pre", {}, x.answer || "(no answer)"))))
          : h("p", { class: "muted", id: "accepted-none" }, "No task result was accepted."));
    }

    function renderAttempts(a) {
      if (!a.tasks.length) {
        put(tasks, h("p", { class: "muted" }, "No tasks yet."));
        return;
      }
      // A task whose record did not change keeps its element where it is (and any text selected in
      // it): each refresh rebuilt them all, and a reader copying an answer lost the selection at
      // every event of the goal.
      const kept = new Map([...tasks.querySelectorAll(".task")].map((el) => [el.dataset.task, el]));
      reconcile(tasks, a.tasks.map((t) => {
        const sig = JSON.stringify(t);
        const el = kept.get(t.task_id);
        if (el && taskSigs.get(el) === sig) return el;
        const card = taskCard(t);
        taskSigs.set(card, sig);
        return card;
      }));
    }

    const taskSigs = new WeakMap(); // task element -> the record it shows (JSON)

    function taskCard(t) {
      return h("div", { class: "task", dataset: { task: t.task_id } },
        h("div", {}, h("b", {}, `${t.task_id}: ${t.title}`), " ", stateBadge(t.state)),
        t.attempts.length ? null : h("div", { class: "muted" }, "no attempt finished yet"),
        t.attempts.map((x) => h("div", { class: `attempt ${x.verdict ? x.verdict.action : ""}` },
          h("div", { class: "muted" }, `attempt ${x.attempt} · ${x.stop_reason} · ${x.steps} steps · ${x.tool_calls} tool calls · `
            + `${fmt(x.usage.input_tokens + x.usage.output_tokens)} tokens`
            + (x.verdict ? ` · critic: ${x.verdict.action}` : " · awaiting review")),
          h("pre", {}, x.answer || "(no answer)"),
          x.verdict && x.verdict.feedback ? h("div", { class: "feedback" }, `Critic: ${x.verdict.feedback}`) : null)));
    }

    function renderLedger(l) {
      const rows = [
        ["budget", fmt(l.budget)], ["spent", fmt(l.spent)], ["· input", fmt(l.spent_input)],
        ["· output", fmt(l.spent_output)], ["· cache read", fmt(l.spent_cache_read)],
        ["· cache write", fmt(l.spent_cache_write)], ["· unknown (forfeited)", fmt(l.spent_unknown)],
        ["reserved", `${fmt(l.reserved)} (${l.open} open)`], ["headroom", fmt(l.headroom)],
        ["model calls", fmt(l.calls)], ["refused", fmt(l.refusals)], ["cost", `$${l.cost_usd.toFixed(4)}`],
        // The model each role's calls went to (an alias of the models file, or a model id).
        ...["planner", "executor", "critic"].filter((r) => (l.served_by || {})[r]).map((r) => [`model · ${r}`, l.served_by[r]]),
      ];
      if (l.usage_unknown) rows.push(["calls without usage (charged in full)", fmt(l.usage_unknown)]);
      put(ledger, bar(l.budget ? (l.spent + l.reserved) / l.budget : 0, "tokens"),
        h("table", { class: "ledger" }, h("tbody", {}, rows.map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, v))))));
    }

    function addEvent(e) {
      const data = Object.entries(e.data || {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(" ");
      // Follow the newest event only while the reader is at the bottom: one who scrolled up to read
      // an earlier event stays there (each event pulled them back down).
      const box = events.closest(".events");
      const following = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
      events.append(h("tr", { dataset: { type: e.type } },
        h("td", { class: "mono muted" }, new Date(e.at).toLocaleTimeString("en-GB")),
        h("td", { class: "mono" }, e.type),
        h("td", { class: "mono" }, e.task_id || ""),
        h("td", {}, data.length > 300 ? `${data.slice(0, 299)}…` : data)));
      if (following) box.scrollTop = box.scrollHeight;
    }

    await refresh(first);
    const soon = debounce(refresh, 150);
    let after = null; // the last event shown
    const follow = () => viewStream(`/v1/goals/${encodeURIComponent(id)}/stream${after ? `?after=${after}` : ""}`,
      (e, position) => {
        after = position || after;
        addEvent(e);
        if (e.type === "task.state" && e.task_id && !["ready", "running"].includes(e.data.state)) dropLive(e.task_id);
        soon();
      },
      async () => {
        // `end` means the goal ended; should a server say it while the goal runs, follow on.
        const s = await api(`/v1/goals/${encodeURIComponent(id)}`).catch(() => null);
        if (s && !TERMINAL.includes(s.goal.state) && !closed) follow();
        refresh(s || undefined);
      },
      onLive);
    let closed = false;
    routeCleanup.push(() => { closed = true; });
    follow();
    // A decision taken here or elsewhere shows in the goal's own stream; this catches a poll's news.
    onPending(soon);
  }

  function renderNoSuchGoal(id) {
    put(view(), h("section", { class: "panel", id: "no-such-goal" },
      h("h1", {}, "No such goal"),
      h("p", {}, "There is no goal with the id ", h("b", { class: "mono wrap" }, id),
        ". Check the link; a goal that was deleted is gone for good."),
      h("p", {}, h("a", { href: "#/" }, "← all goals"))));
  }

  // -- approvals inbox --------------------------------------------------------------------------

  async function renderApprovals() {
    const list = h("div", { id: "approvals" });
    put(view(), h("section", { class: "panel" },
      h("div", { class: "toolbar" }, h("h1", {}, "Approvals"),
        h("span", { class: "muted" }, "tool calls waiting for a person, oldest first")),
      can("approve") ? null : h("p", { class: "notice", id: "no-approve" },
        "Your token has no `approve` scope: you can see the calls but not decide them."),
      list));

    function draw() {
      if (!pending.items.length) {
        put(list, h("p", { class: "muted", id: "inbox-empty" }, "Nothing waits for a decision."));
        return;
      }
      syncCards(list, pending.items, { showGoal: true });
    }
    onPending(draw);
    const err = await refreshPending();
    if (err) showError(list, err);
    else draw();
  }

  // -- submit -----------------------------------------------------------------------------------

  function renderSubmit() {
    if (!can("submit")) {
      put(view(), h("section", { class: "panel" }, h("h1", {}, "Submit a goal"),
        h("p", { class: "notice" }, "Your token has no `submit` scope.")));
      return;
    }
    const text = h("textarea", { id: "goal-input", required: true, maxlength: 20000 });
    const dod = h("input", { type: "text", id: "dod-input", maxlength: 5000 });
    const budget = h("input", { type: "number", id: "budget-input", min: 1, placeholder: "server default" });
    const key = h("input", { type: "text", id: "key-input", maxlength: 64, placeholder: "optional: makes re-sending safe" });
    const msg = h("div");
    const form = h("form", { class: "stack panel", id: "submit-form" },
      h("h1", {}, "Submit a goal"),
      h("label", { for: "goal-input" }, "Goal"), text,
      h("label", { for: "dod-input" }, "Definition of done"), dod,
      h("label", { for: "budget-input" }, "Token budget"), budget,
      h("label", { for: "key-input" }, "Idempotency key"), key,
      msg,
      h("p", {}, h("button", { class: "primary", type: "submit", id: "submit-button" }, "Submit")));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const goal = { text: text.value, definition_of_done: dod.value };
      if (budget.value) goal.budget_tokens = Number(budget.value);
      const headers = key.value ? { "Idempotency-Key": key.value } : {};
      try {
        const r = await api("/v1/goals", { method: "POST", json: goal, headers });
        location.hash = `#/goals/${encodeURIComponent(r.goal_id)}`;
      } catch (e) {
        showError(msg, e.field ? new Error(e.message) : e);
      }
    });
    put(view(), form);
    text.focus();
  }

  // -- routing ----------------------------------------------------------------------------------

  async function route() {
    for (const close of routeCleanup) close();
    routeCleanup = [];
    liveOwner = hub.es;
    paintLive();
    const hash = location.hash || "#/";
    for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", hash.startsWith(a.getAttribute("href")) && (a.getAttribute("href") !== "#/" || hash === "#/"));
    if (!me) {
      renderLogin();
      return;
    }
    const m = hash.match(/^#\/goals\/([^/]+)$/);
    try {
      if (m) await renderGoal(decodeURIComponent(m[1]));
      else if (hash === "#/approvals") await renderApprovals();
      else if (hash === "#/submit") renderSubmit();
      else await renderGoals();
    } catch (e) {
      showError(view(), e);
    }
  }

  async function start() {
    // `taskloom api --open` prints a URL ending in #token=...: keep it for this tab, then drop it
    // from the address bar (the fragment never reaches the server or its logs).
    const t = location.hash.match(/^#token=(.+)$/);
    if (t) {
      sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(t[1]));
      history.replaceState(null, "", location.pathname + "#/");
    }
    $("#signout").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      me = null;
      stopPolling();
      stopHub();
      $("#whoami").textContent = "";
      $("#signout").hidden = true;
      route();
    });
    window.addEventListener("hashchange", route);
    try {
      await whoami();
    } catch (e) {
      showError(view(), e);
      return;
    }
    await route();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
