// The inspector page: conversations over REST, one conversation live over the control WebSocket.
// What it shows comes from the control view (reducer.js) — a snapshot, then events; a gap asks for a
// fresh snapshot; a connection dropped for falling behind (close 4008) reconnects and attaches again.
"use strict";

(function () {
  const C = window.ThreadlineConstants;
  const V = window.ThreadlineControlView;
  const token = new URLSearchParams(location.search).get("access_token") || "";
  const $ = (id) => document.getElementById(id);

  const page = {
    view: V.createView(),
    current: null, // the conversation shown
    runs: {}, // run records of the current conversation, by id
    approvals: [],
    access: null,
    socket: null,
    nextRequest: 1,
    pending: new Map(),
    resyncs: 0,
    cursor: null, // conversations list paging
    resyncing: false,
    ledger: [],
    ledgerNext: 1,
    ledgerMissing: null,
    ledgerLoading: false,
    ledgerTimer: null,
  };

  // ------------------------------------------------------------------------------------------- REST

  async function api(path, options = {}) {
    const headers = { "content-type": "application/json" };
    if (token) headers.authorization = `Bearer ${token}`;
    const response = await fetch(path, { ...options, headers });
    const body = await response.json().catch(() => null);
    if (!response.ok) throw new Error((body && body.error && body.error.message) || `HTTP ${response.status}`);
    return body;
  }

  async function loadConversations(more = false) {
    const query = new URLSearchParams({ limit: "50" });
    if (more && page.cursor) query.set("cursor", page.cursor);
    const listing = await api(`/conversations?${query}`);
    page.cursor = listing.next_cursor;
    const list = $("conversations");
    if (!more) list.replaceChildren();
    for (const head of listing.items) {
      const item = document.createElement("li");
      const link = document.createElement("a");
      link.href = `#${encodeURIComponent(head.conversation_id)}`;
      link.textContent = head.conversation_id;
      link.dataset.id = head.conversation_id;
      link.title = `version ${head.version}`;
      item.append(link);
      list.append(item);
    }
    $("more-conversations").hidden = !page.cursor;
    markCurrent();
  }

  function markCurrent() {
    for (const link of $("conversations").querySelectorAll("a")) {
      link.setAttribute("aria-current", String(link.dataset.id === page.current));
    }
  }

  // The ledger's timeline: read forward from the last seq seen, a few pages at a time; the newest
  // LEDGER_KEEP events are kept.
  const LEDGER_KEEP = 500;

  async function loadLedger() {
    if (!page.current || page.ledgerLoading) return;
    const id = page.current;
    page.ledgerLoading = true;
    try {
      for (let pages = 0; pages < 5; pages += 1) {
        const query = new URLSearchParams({ from_seq: String(page.ledgerNext), limit: "200" });
        const listing = await api(`/conversations/${encodeURIComponent(id)}/ledger?${query}`);
        if (id !== page.current) return;
        page.ledger = [...page.ledger, ...listing.items].slice(-LEDGER_KEEP);
        if (listing.items.length) page.ledgerNext = listing.items[listing.items.length - 1].seq + 1;
        if (!listing.next_seq) break;
      }
      page.ledgerMissing = null;
    } catch (error) {
      page.ledgerMissing = error.message;
    } finally {
      page.ledgerLoading = false;
    }
    renderLedger();
  }

  function renderLedger() {
    const box = $("ledger");
    box.replaceChildren();
    if (page.ledgerMissing) {
      box.append(el("div", "muted", page.ledgerMissing));
      return;
    }
    const table = el("table", "ledger");
    for (const event of page.ledger) {
      const row = el("tr");
      row.dataset.kind = event.kind;
      row.append(
        el("td", null, String(event.seq)),
        el("td", null, event.occurred_at.replace("T", " ").slice(0, 23)),
        el("td", null, event.kind),
        el("td", "summary", event.summary),
      );
      table.append(row);
    }
    box.append(table);
  }

  async function loadApprovals() {
    if (!page.current) return;
    const id = page.current;
    try {
      const listing = await api(`/conversations/${encodeURIComponent(id)}/approvals`);
      if (id === page.current) {
        page.approvals = listing.approvals;
        render();
      }
    } catch (error) {
      showError(error);
    }
  }

  // -------------------------------------------------------------------------------------- WebSocket

  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const query = token ? `?access_token=${encodeURIComponent(token)}` : "";
    const socket = new WebSocket(`${scheme}//${location.host}/control${query}`);
    page.socket = socket;
    setConnection("connecting");
    socket.onopen = () => {
      setConnection("open");
      if (page.current) attach(page.current);
    };
    socket.onmessage = (message) => {
      const data = JSON.parse(message.data);
      // one frame, or an array of event deliveries that were waiting for this socket together, in order
      for (const frame of Array.isArray(data) ? data : [data]) receive(frame);
    };
    socket.onclose = (closed) => {
      if (page.socket !== socket) return;
      for (const { reject } of page.pending.values()) reject(new Error("the connection closed"));
      page.pending.clear();
      setConnection("closed");
      if (closed.code === 4008) page.resyncs += 1; // detached for falling behind: attach again at once
      setTimeout(connect, closed.code === 4008 ? 0 : 1000);
    };
  }

  function setConnection(state) {
    const badge = $("connection");
    badge.dataset.state = state;
    badge.textContent = state;
  }

  function request(operation, fields) {
    const request_id = `r${page.nextRequest++}`;
    return new Promise((resolve, reject) => {
      if (!page.socket || page.socket.readyState !== WebSocket.OPEN) {
        reject(new Error("not connected"));
        return;
      }
      page.pending.set(request_id, { resolve, reject });
      page.socket.send(JSON.stringify({ schema_version: 1, request_id, operation, ...fields }));
    });
  }

  function receive(frame) {
    if (frame.type === "response") {
      const waiter = page.pending.get(frame.request_id);
      if (!waiter) return;
      page.pending.delete(frame.request_id);
      if (frame.outcome === "ok") waiter.resolve(frame);
      else waiter.reject(Object.assign(new Error(frame.error.message), { code: frame.error.code }));
    } else if (frame.type === "event") {
      onEvent(frame.event);
    } else if (frame.type === "resync-required") {
      resync();
    }
  }

  async function attach(id) {
    let response;
    try {
      response = await request("attach", { conversation_id: id, access: "control" });
      page.access = "control";
    } catch (error) {
      if (error.code !== "LEASE_CONFLICT") return showError(error);
      response = await request("attach", { conversation_id: id, access: "observe" });
      page.access = "observe";
      setTimeout(() => page.current === id && page.access === "observe" && attach(id), 2000);
    }
    if (id !== page.current) return;
    applySnapshot(response.snapshot);
    loadApprovals();
    loadLedger();
  }

  async function resync() {
    if (!page.current || page.resyncing) return;
    page.resyncing = true;
    page.resyncs += 1;
    try {
      const response = await request("snapshot", { conversation_id: page.current });
      applySnapshot(response.snapshot);
    } catch (error) {
      showError(error);
    } finally {
      page.resyncing = false;
    }
  }

  function applySnapshot(snapshot) {
    page.view = V.reduceSnapshot(snapshot, page.view);
    page.runs = {};
    for (const run of snapshot.runs) page.runs[run.id] = run;
    render();
  }

  function onEvent(event) {
    if (event.conversation_id !== page.current) return;
    page.view = V.reduceEvent(page.view, event);
    const run = page.runs[event.run_id] || {};
    if (event.type === "admission") page.runs[event.run.id] = event.run;
    else if (event.type === "run-state") {
      page.runs[event.run_id] = { ...run, id: event.run_id, state: event.state, terminal_reason: event.terminal_reason };
    } else if (event.type === "terminal") {
      page.runs[event.run_id] = {
        ...run,
        id: event.run_id,
        state: C.run_state_for_reason[event.terminal_reason] || run.state,
        terminal_reason: event.terminal_reason,
        policy_name: event.policy_name,
        usage: event.usage,
      };
      loadApprovals();
      loadConversations().catch(showError);
    }
    if (DURABLE_TYPES.has(event.type)) scheduleLedger();
    if (conversation().resync_required) resync();
    render();
  }

  const DURABLE_TYPES = new Set(C.durable_event_types);

  function scheduleLedger() {
    if (page.ledgerTimer) return;
    page.ledgerTimer = setTimeout(() => {
      page.ledgerTimer = null;
      loadLedger();
    }, 250);
  }

  // ------------------------------------------------------------------------------------------ actions

  async function open(id) {
    if (page.current && page.current !== id && page.socket && page.socket.readyState === WebSocket.OPEN) {
      request("detach", { conversation_id: page.current }).catch(() => {});
    }
    page.current = id;
    page.runs = {};
    page.approvals = [];
    page.ledger = [];
    page.ledgerNext = 1;
    page.ledgerMissing = null;
    $("conversation").hidden = false;
    $("empty").hidden = true;
    $("title").textContent = id;
    markCurrent();
    render();
    if (page.socket && page.socket.readyState === WebSocket.OPEN) await attach(id);
  }

  async function send(event) {
    event.preventDefault();
    const text = $("composer-text").value.trim();
    if (!text || !page.current) return;
    $("composer-error").textContent = "";
    try {
      await request("submit", {
        conversation_id: page.current,
        idempotency_key: `inspector-${Date.now()}-${Math.random().toString(36).slice(2)}`,
        parts: [{ type: "text", text }],
        input_metadata: { policy: $("policy").value },
      });
      $("composer-text").value = "";
      loadConversations().catch(showError);
    } catch (error) {
      showError(error);
    }
  }

  async function interrupt() {
    const running = activeRuns().find((run) => run.state === "running") || activeRuns()[0];
    if (!running) return;
    try {
      await request("interrupt", { conversation_id: page.current, run_id: running.id });
    } catch (error) {
      showError(error);
    }
  }

  async function answerApproval(approval, approved) {
    try {
      await request("respond-approval", {
        conversation_id: page.current,
        approval_id: approval.approval_id,
        approved,
        reason: approved ? null : "denied in the inspector",
      });
      page.approvals = page.approvals.filter((a) => a.approval_id !== approval.approval_id);
      render();
    } catch (error) {
      showError(error);
    }
  }

  function showError(error) {
    $("composer-error").textContent = error.code ? `${error.code}: ${error.message}` : String(error.message || error);
  }

  // ------------------------------------------------------------------------------------------- render

  function conversation() {
    return page.view.conversations[page.current] || {
      version: 0, resync_required: false, messages: [], run_states: {}, operations: {}, transient_by_run: {},
    };
  }

  function activeRuns() {
    const view = conversation();
    return Object.entries(view.run_states)
      .filter(([, state]) => C.active_run_states.includes(state))
      .map(([id, state]) => ({ ...(page.runs[id] || {}), id, state }));
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }

  function renderPart(part) {
    switch (part.type) {
      case "text":
        return el("div", "text", part.text);
      case "reasoning":
        return el("div", "reasoning", part.text);
      case "tool-call":
        return el("div", "part-tool", `→ ${part.tool_name}(${JSON.stringify(part.input)})`);
      case "tool-result":
        return el("div", "part-tool", `← ${part.tool_name}: ${JSON.stringify(part.error || part.output)}`);
      case "approval-request":
        return el("div", "part-approval", `approval requested: ${part.tool_name || part.approval_id}`);
      case "approval-response":
        return el("div", "part-approval", `approval ${part.approved ? "granted" : "denied"}`);
      default:
        return el("div", "muted", `[${part.type}]`);
    }
  }

  function renderMessages(view) {
    const box = $("messages");
    box.replaceChildren();
    for (const message of view.messages) {
      const node = el("div", "message");
      node.dataset.role = message.role;
      node.dataset.status = message.status;
      node.dataset.id = message.id;
      const who = el("div", "who", message.role);
      if (message.role === "assistant" && message.status !== "completed") {
        who.append(el("span", "mark", message.status)); // interrupted, superseded, failed
      }
      node.append(who, ...message.parts.map(renderPart));
      box.append(node);
    }
  }

  function renderStreaming(view) {
    const box = $("streaming");
    box.replaceChildren();
    for (const [runId, run] of Object.entries(view.transient_by_run)) {
      const node = el("div", "message stream");
      node.dataset.run = runId;
      const state = view.run_states[runId] || "running";
      const operation = view.operations[runId];
      const who = el("div", "who", `assistant · ${state}${operation ? ` · ${operation.kind} ${operation.phase}` : ""}`);
      node.append(who);
      if (run.reasoning) node.append(el("div", "reasoning", run.reasoning));
      for (const progress of Object.values(run.tools)) {
        const figures = progress.progress !== null && progress.progress !== undefined
          ? ` ${progress.progress}${progress.total ? `/${progress.total}` : ""}` : "";
        node.append(el("div", "part-tool tool-progress", `${progress.tool_name}: ${progress.message || ""}${figures}`));
      }
      node.append(el("div", "text streaming-text", run.text));
      box.append(node);
    }
  }

  function renderApprovals() {
    const box = $("approvals");
    box.replaceChildren();
    for (const approval of page.approvals) {
      const node = el("div", "approval");
      node.dataset.approval = approval.approval_id;
      node.append(el("div", null, `${approval.tool_name}(${JSON.stringify(approval.input)}) needs approval`));
      const approve = el("button", null, "Approve");
      approve.onclick = () => answerApproval(approval, true);
      const deny = el("button", null, "Deny");
      deny.onclick = () => answerApproval(approval, false);
      node.append(approve, deny);
      box.append(node);
    }
  }

  function figure(name, value) {
    if (!value) return null;
    const span = el("span", null, `${name} ${value.value ?? value.amount ?? "—"}`);
    span.append(el("em", null, ` ${value.provenance}${value.floor ? " (at least)" : ""}`));
    return span;
  }

  function failureText(run) {
    const failure = run.failure; // present once the runtime records failures (else the reason says it)
    if (!failure) return "";
    if (typeof failure === "string") return failure;
    return [failure.code || failure.kind, failure.message || failure.summary].filter(Boolean).join(": ");
  }

  function renderRuns(view) {
    const body = $("runs").querySelector("tbody");
    body.replaceChildren();
    const ids = Object.keys(view.run_states);
    for (const id of ids) {
      const run = { ...(page.runs[id] || {}), state: view.run_states[id] };
      const row = el("tr");
      row.dataset.run = id;
      const usage = el("td", "usage");
      if (run.usage) {
        for (const [name, key] of [["in", "input_tokens"], ["out", "output_tokens"], ["reasoning", "reasoning_tokens"]]) {
          const span = figure(name, run.usage[key]);
          if (span) usage.append(span);
        }
        const cost = run.usage.cost;
        if (cost && cost.amount !== null && cost.amount !== undefined) usage.append(figure(`cost ${cost.currency || ""}`, cost));
      }
      row.append(
        el("td", null, id.slice(0, 12)),
        el("td", "state", run.state),
        el("td", "reason", run.terminal_reason || ""),
        el("td", null, run.policy_name || run.input_policy || ""),
        usage,
        el("td", "failure", failureText(run)),
      );
      body.append(row);
    }
  }

  function render() {
    $("access").textContent = page.access || "";
    $("resyncs").textContent = page.resyncs ? `resyncs: ${page.resyncs}` : "";
    if (!page.current) return;
    const view = conversation();
    $("title").textContent = `${page.current} · version ${view.version}`;
    renderMessages(view);
    renderStreaming(view);
    renderApprovals();
    renderRuns(view);
    const controlling = page.access === "control";
    $("send").disabled = !controlling;
    $("interrupt").disabled = !controlling || activeRuns().length === 0;
  }

  // -------------------------------------------------------------------------------------------- start

  for (const policy of C.input_policies) {
    const option = el("option", null, policy);
    option.value = policy;
    $("policy").append(option);
  }
  $("open-form").onsubmit = (event) => {
    event.preventDefault();
    location.hash = encodeURIComponent($("open-id").value.trim());
  };
  $("composer").onsubmit = send;
  $("interrupt").onclick = interrupt;
  $("more-conversations").onclick = () => loadConversations(true).catch(showError);
  window.addEventListener("hashchange", () => {
    const id = decodeURIComponent(location.hash.slice(1));
    if (id) open(id);
  });
  const initial = decodeURIComponent(location.hash.slice(1));
  if (initial) open(initial);
  loadConversations().catch(showError);
  connect();
})();
