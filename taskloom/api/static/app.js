// The taskloom console: plain JavaScript, no build step, no library.
// Every piece of text that comes from a goal, a plan or a model is put into the page with
// textContent (through `h` below), never parsed as HTML.
"use strict";

(function () {
  const TOKEN_KEY = "taskloom.token";
  let me = null; // {name, scopes}
  let routeCleanup = []; // closers of the current view's EventSources and timers

  // -- DOM helpers ------------------------------------------------------------------------------

  // h("td", {class: "x", dataset: {task: id}}, "text", child) -> element; strings become text nodes.
  function h(tag, attrs, ...children) {
    const el = tag.startsWith("svg:")
      ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4))
      : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "dataset") Object.assign(el.dataset, v);
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

  function age(iso) {
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (s < 60) return `${Math.floor(s)}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${Math.floor(s % 60)}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
    return `${Math.floor(s / 86400)}d`;
  }
  function stateBadge(state, extra) {
    return h("span", { class: `state ${state}`, dataset: extra || {} }, state.replace("_", " "));
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

  // An EventSource on `path` (the token goes as a parameter: EventSource cannot send headers).
  // It reconnects by itself, sending Last-Event-ID, so nothing is missed across a drop.
  function stream(path, onEvent, onEnd) {
    const sep = path.includes("?") ? "&" : "?";
    const url = token() ? `${path}${sep}access_token=${encodeURIComponent(token())}` : path;
    const es = new EventSource(url);
    const live = $("#live");
    es.onopen = () => {
      live.textContent = "live";
      live.classList.add("on");
    };
    es.onerror = () => {
      live.textContent = "reconnecting";
      live.classList.remove("on");
    };
    es.onmessage = (m) => onEvent(JSON.parse(m.data));
    es.addEventListener("end", () => {
      es.close();
      live.textContent = "ended";
      live.classList.remove("on");
      if (onEnd) onEnd();
    });
    routeCleanup.push(() => es.close());
    return es;
  }

  function showError(where, err) {
    put(where, h("p", { class: "error", role: "alert" }, err.message || String(err)));
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
      h("table", { id: "goals" },
        h("thead", {}, h("tr", {}, ["goal", "state", "progress", "tokens", "age", "id"].map((c) => h("th", {}, c)))),
        body),
      h("p", {}, more)
    );
    put(view(), panel);
    let rows = [];
    let cursor = null;

    function row(g) {
      const frac = g.tasks_total ? g.tasks_done / g.tasks_total : 0;
      const used = g.budget_tokens ? (g.spent_tokens + g.reserved_tokens) / g.budget_tokens : 0;
      const tr = h(
        "tr",
        { class: "goal-row", dataset: { goal: g.id, state: g.state } },
        h("td", { class: "text", title: g.text }, h("a", { href: `#/goals/${encodeURIComponent(g.id)}` }, g.text)),
        h("td", {}, stateBadge(g.state)),
        h("td", {}, h("div", { class: "cell-bar" }, bar(frac), `${g.tasks_done}/${g.tasks_total}`)),
        h("td", {}, h("div", { class: "cell-bar" }, bar(used, used > 0.8 ? "tokens high" : "tokens"),
          `${fmt(g.spent_tokens)} / ${fmt(g.budget_tokens)}`)),
        h("td", { class: "age", dataset: { since: g.created_at } }, age(g.created_at)),
        h("td", { class: "mono muted" }, g.id.slice(0, 12))
      );
      tr.addEventListener("click", (ev) => {
        if (ev.target.tagName !== "A") location.hash = `#/goals/${encodeURIComponent(g.id)}`;
      });
      return tr;
    }

    async function load(reset) {
      const params = new URLSearchParams({ limit: "50" });
      if (filter.value) params.set("state", filter.value);
      if (!reset && cursor) params.set("cursor", cursor);
      try {
        const page = await api(`/v1/goals?${params}`);
        rows = reset ? page.goals : rows.concat(page.goals);
        cursor = page.next_cursor;
        put(body, ...rows.map(row));
        if (!rows.length) body.append(h("tr", {}, h("td", { colspan: 6, class: "muted" }, "No goals yet.")));
        more.hidden = !cursor;
        put(msg);
      } catch (e) {
        showError(msg, e);
      }
    }
    filter.addEventListener("change", () => load(true));
    more.addEventListener("click", () => load(false));
    await load(true);
    // Live: any goal's event refreshes the loaded rows (debounced); ages tick every second.
    const refresh = debounce(() => load(true), 250);
    stream("/v1/events?after=$", refresh);
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
    const clip = (s, n) => (s.length > n ? `${s.slice(0, n - 1)}…` : s);
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

  // -- goal page --------------------------------------------------------------------------------

  async function renderGoal(id) {
    const head = h("section", { class: "panel", id: "goal-head" });
    const dag = h("div", { class: "dag", id: "dag" }, h("p", { class: "muted" }, "No plan yet."));
    const tasks = h("div", { id: "tasks" });
    const answer = h("div", { id: "answer" });
    const ledger = h("div", { id: "ledger" });
    const events = h("tbody", { id: "event-rows" });
    put(
      view(),
      head,
      h("div", { class: "grid" },
        h("div", {},
          h("section", { class: "panel" }, h("h2", {}, "Plan"), dag),
          h("section", { class: "panel" }, h("h2", {}, "Answer"), answer),
          h("section", { class: "panel" }, h("h2", {}, "Tasks and attempts"), tasks)),
        h("div", {},
          h("section", { class: "panel" }, h("h2", {}, "Ledger"), ledger),
          h("section", { class: "panel" }, h("h2", {}, "Events"),
            h("div", { class: "events" }, h("table", { id: "events" }, events)))))
    );

    async function refresh() {
      let s;
      try {
        s = await api(`/v1/goals/${encodeURIComponent(id)}`);
      } catch (e) {
        showError(head, e);
        return;
      }
      const g = s.goal;
      const cancel = can("submit") && !["succeeded", "failed", "cancelled", "budget_exhausted"].includes(g.state)
        ? h("button", { class: "deny", id: "cancel", onclick: async () => {
          if (!confirm("Cancel this goal?")) return;
          try { await api(`/v1/goals/${encodeURIComponent(id)}/cancel`, { method: "POST", json: {} }); }
          catch (e) { alert(e.message); }
          refresh();
        } }, "Cancel goal")
        : null;
      put(
        head,
        h("div", { class: "toolbar" }, h("h1", {}, "Goal"), stateBadge(g.state, { testid: "goal-state" }), cancel),
        h("p", { class: "goal-text", id: "goal-text" }, g.goal.text),
        g.goal.definition_of_done ? h("p", { class: "muted" }, `Done when: ${g.goal.definition_of_done}`) : null,
        h("div", { class: "meta" },
          h("span", {}, "id ", h("b", { class: "mono" }, g.id)),
          h("span", {}, "plan ", h("b", {}, `v${g.plan_version}`)),
          h("span", {}, "replans ", h("b", {}, String(g.replans))),
          h("span", {}, "age ", h("b", {}, age(g.created_at))),
          g.reason ? h("span", {}, "reason ", h("b", {}, g.reason)) : null)
      );
      put(answer, g.answer ? h("div", { class: "answer", id: "answer-text" }, g.answer)
        : h("p", { class: "muted" }, g.state === "succeeded" ? "(empty)" : "Not yet."));
      const jobs = [];
      if (g.plan_version) {
        jobs.push(api(`/v1/goals/${encodeURIComponent(id)}/plan`).then((p) => put(dag, drawDag(p))));
      }
      jobs.push(api(`/v1/goals/${encodeURIComponent(id)}/attempts`).then(renderAttempts));
      jobs.push(api(`/v1/goals/${encodeURIComponent(id)}/ledger`).then(renderLedger).catch(() => null));
      await Promise.all(jobs).catch((e) => showError(tasks, e));
    }

    function renderAttempts(a) {
      if (!a.tasks.length) {
        put(tasks, h("p", { class: "muted" }, "No tasks yet."));
        return;
      }
      put(tasks, ...a.tasks.map((t) => h("div", { class: "task", dataset: { task: t.task_id } },
        h("div", {}, h("b", {}, `${t.task_id}: ${t.title}`), " ", stateBadge(t.state)),
        t.attempts.length ? null : h("div", { class: "muted" }, "no attempt finished yet"),
        t.attempts.map((x) => h("div", { class: `attempt ${x.verdict ? x.verdict.action : ""}` },
          h("div", { class: "muted" }, `attempt ${x.attempt} · ${x.stop_reason} · ${x.steps} steps · ${x.tool_calls} tool calls · `
            + `${fmt(x.usage.input_tokens + x.usage.output_tokens)} tokens`
            + (x.verdict ? ` · critic: ${x.verdict.action}` : " · awaiting review")),
          h("pre", {}, x.answer || "(no answer)"),
          x.verdict && x.verdict.feedback ? h("div", { class: "feedback" }, `Critic: ${x.verdict.feedback}`) : null)))));
    }

    function renderLedger(l) {
      const rows = [
        ["budget", fmt(l.budget)], ["spent", fmt(l.spent)], ["· input", fmt(l.spent_input)],
        ["· output", fmt(l.spent_output)], ["· cache read", fmt(l.spent_cache_read)],
        ["· cache write", fmt(l.spent_cache_write)], ["· unknown (forfeited)", fmt(l.spent_unknown)],
        ["reserved", `${fmt(l.reserved)} (${l.open} open)`], ["headroom", fmt(l.headroom)],
        ["model calls", fmt(l.calls)], ["refused", fmt(l.refusals)], ["cost", `$${l.cost_usd.toFixed(4)}`],
      ];
      put(ledger, bar(l.budget ? (l.spent + l.reserved) / l.budget : 0, "tokens"),
        h("table", { class: "ledger" }, h("tbody", {}, rows.map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, v))))));
    }

    function addEvent(e) {
      const data = Object.entries(e.data || {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`).join(" ");
      events.append(h("tr", { dataset: { type: e.type } },
        h("td", { class: "mono muted" }, new Date(e.at).toLocaleTimeString("en-GB")),
        h("td", { class: "mono" }, e.type),
        h("td", { class: "mono" }, e.task_id || ""),
        h("td", {}, data.length > 300 ? `${data.slice(0, 299)}…` : data)));
      const box = events.closest(".events");
      box.scrollTop = box.scrollHeight;
    }

    await refresh();
    const soon = debounce(refresh, 150);
    stream(`/v1/goals/${encodeURIComponent(id)}/events`, (e) => { addEvent(e); soon(); }, refresh);
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

    async function decide(a, approved, reason, row) {
      const verb = approved ? "approve" : "deny";
      for (const b of row.querySelectorAll("button")) b.disabled = true;
      try {
        await api(`/v1/approvals/${encodeURIComponent(a.goal_id)}/${encodeURIComponent(a.call_id)}/${verb}`,
          { method: "POST", json: { reason } });
        put(row, h("p", { class: "notice" }, `${approved ? "Approved" : "Denied"}: ${a.tool} for goal ${a.goal_id.slice(0, 12)}`));
      } catch (e) {
        row.append(h("p", { class: "error", role: "alert" }, e.message));
      }
      load();
    }

    async function load() {
      let items;
      try {
        items = (await api("/v1/approvals")).approvals;
      } catch (e) {
        showError(list, e);
        return;
      }
      updateCount(items.length);
      if (!items.length) {
        put(list, h("p", { class: "muted", id: "inbox-empty" }, "Nothing waits for a decision."));
        return;
      }
      put(list, ...items.map((a) => {
        const reason = h("input", { type: "text", placeholder: "reason (optional; shown to the model on deny)",
          "aria-label": "reason" });
        const row = h("div", { class: "approval", dataset: { call: a.call_id, goal: a.goal_id } });
        row.append(
          h("div", {},
            h("div", {}, h("b", {}, a.tool), h("span", { class: "muted" }, ` · requested ${age(a.requested_at)} ago`)),
            h("dl", { class: "kv" },
              h("dt", {}, "goal"), h("dd", {}, h("a", { href: `#/goals/${encodeURIComponent(a.goal_id)}` }, a.goal_text)),
              h("dt", {}, "asked by"), h("dd", {}, `task ${a.task_id}${a.task_title ? `: ${a.task_title}` : ""} (attempt ${a.attempt})`),
              h("dt", {}, "call"), h("dd", { class: "mono" }, a.call_id),
              h("dt", {}, "arguments"), h("dd", {}, h("pre", { class: "args" }, JSON.stringify(a.arguments, null, 2))))),
          can("approve")
            ? h("div", { class: "actions" }, reason, h("div", { class: "row" },
              h("button", { class: "approve", onclick: () => decide(a, true, reason.value, row) }, "Approve"),
              h("button", { class: "deny", onclick: () => decide(a, false, reason.value, row) }, "Deny")))
            : h("div", { class: "actions muted" }, "read only")
        );
        return row;
      }));
    }
    await load();
    const soon = debounce(load, 200);
    stream("/v1/events?after=$", (e) => { if (e.type.startsWith("tool.approval") || e.type === "goal.state") soon(); });
  }

  function updateCount(n) {
    const badge = $("#approval-count");
    badge.hidden = !n;
    badge.textContent = String(n);
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
    $("#live").textContent = "offline";
    $("#live").classList.remove("on");
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
    if (me && can("read")) {
      api("/v1/approvals").then((r) => updateCount(r.approvals.length)).catch(() => null);
    }
    await route();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
