// The control-view rules of threadline.delivery, in the browser: a cursor that classifies each delivery
// event (fresh, duplicate, gap) and a pure reducer from a snapshot and events to what the page renders.
// Same rules, same field names (snake_case, as on the wire): a transient gap marks the conversation
// resync_required (the page then asks for a fresh snapshot); a durable event older than the cursor is a
// duplicate. The constants (run states, terminal reasons, durable types) come from the server
// (constants.js), so they cannot drift from the Python ones.
"use strict";

(function (root) {
  const C = root.ThreadlineConstants;
  const DURABLE = new Set(C.durable_event_types);
  const ACTIVE = new Set(C.active_run_states);
  const SEPARATOR = C.reasoning_separator;

  // ------------------------------------------------------------------------------------------ cursor

  function emptyCursor() {
    return { version: null, durable_event_ids: [], runs: {} };
  }

  // [cursor, classification] for one event of one conversation; the cursor is never mutated.
  function advanceCursor(cursor, event) {
    cursor = cursor || emptyCursor();
    if (DURABLE.has(event.type)) {
      const previous = cursor.version;
      const seen = previous === event.version ? cursor.durable_event_ids : [];
      if ((previous !== null && event.version < previous) || seen.includes(event.event_id)) {
        return [cursor, "duplicate"];
      }
      return [{ ...cursor, version: event.version, durable_event_ids: [...seen, event.event_id] }, "fresh"];
    }
    const run = cursor.runs[event.run_id];
    let classification;
    if (run && run.runtime_epoch === null) {
      classification = "fresh"; // baseline after a snapshot: accept where it is
    } else if (run && run.runtime_epoch === event.runtime_epoch) {
      if (event.sequence <= run.sequence) return [cursor, "duplicate"];
      classification = event.sequence === run.sequence + 1 ? "fresh" : "gap";
    } else {
      classification = event.sequence === 1 ? "fresh" : "gap";
    }
    const runs = { ...cursor.runs, [event.run_id]: { runtime_epoch: event.runtime_epoch, sequence: event.sequence } };
    return [{ ...cursor, runs }, classification];
  }

  // --------------------------------------------------------------------------------------- the view

  function emptyConversation() {
    return {
      version: 0,
      resync_required: false,
      messages: [],
      run_states: {},
      operations: {},
      transient_by_run: {},
    };
  }

  function emptyRun() {
    return { text: "", reasoning: "", reasoning_active: false, tools: {}, finished_calls: [] };
  }

  function createView() {
    return { cursors: {}, conversations: {} };
  }

  function texts(parts) {
    const text = parts.filter((p) => p.type === "text").map((p) => p.text).join("");
    const reasoning = parts
      .filter((p) => p.type === "reasoning" && p.text)
      .map((p) => p.text)
      .join(SEPARATOR);
    return [text, reasoning];
  }

  function upsert(messages, message) {
    const index = messages.findIndex((m) => m.id === message.id);
    if (index < 0) return [...messages, message];
    const copy = messages.slice();
    copy[index] = message;
    return copy;
  }

  // Reset one conversation to a canonical snapshot (reduce_agent_control_snapshot).
  function reduceSnapshot(snapshot, state) {
    state = state || createView();
    const active = {};
    for (const run of snapshot.runs) if (ACTIVE.has(run.state)) active[run.id] = run;
    const drafts = {};
    for (const run of Object.values(active)) drafts[run.assistant_message_id] = run.id;
    const transient = {};
    const messages = [];
    for (const message of snapshot.messages) {
      const runId = drafts[message.id];
      if (runId !== undefined && message.status === "streaming") {
        const [text, reasoning] = texts(message.parts);
        transient[runId] = { ...emptyRun(), text, reasoning };
      } else {
        messages.push(message);
      }
    }
    const runStates = {};
    for (const run of snapshot.runs) runStates[run.id] = run.state;
    const operations = {};
    for (const run of Object.values(active)) if (run.last_operation) operations[run.id] = run.last_operation;
    const conversation = {
      version: snapshot.version,
      resync_required: false,
      messages,
      run_states: runStates,
      operations,
      transient_by_run: transient,
    };
    const previous = state.cursors[snapshot.conversation_id] || emptyCursor();
    const runs = { ...previous.runs };
    for (const run of Object.values(active)) {
      if ((run.state === "running" || run.state === "interrupt_requested") && !(run.id in runs)) {
        runs[run.id] = { runtime_epoch: null, sequence: 0 };
      }
    }
    return {
      cursors: { ...state.cursors, [snapshot.conversation_id]: { version: snapshot.version, durable_event_ids: [], runs } },
      conversations: { ...state.conversations, [snapshot.conversation_id]: conversation },
    };
  }

  // Apply one delivery event (reduce_agent_control_event): a new view, the old one untouched.
  function reduceEvent(state, event) {
    state = state || createView();
    const id = event.conversation_id;
    const [cursor, classification] = advanceCursor(state.cursors[id], event);
    if (classification === "duplicate") return state;
    let conversation = state.conversations[id] || emptyConversation();
    if (classification === "gap") conversation = { ...conversation, resync_required: true };
    conversation = apply(conversation, event);
    return {
      cursors: { ...state.cursors, [id]: cursor },
      conversations: { ...state.conversations, [id]: conversation },
    };
  }

  function without(map, key) {
    const copy = { ...map };
    delete copy[key];
    return copy;
  }

  function apply(view, event) {
    const kind = event.type;
    if (DURABLE.has(kind)) view = { ...view, version: Math.max(view.version, event.version) };
    const runId = event.run_id;
    if (kind === "admission") {
      return {
        ...view,
        messages: upsert(view.messages, event.input),
        run_states: { ...view.run_states, [event.run.id]: event.run.state },
      };
    }
    if (kind === "run-state") return { ...view, run_states: { ...view.run_states, [runId]: event.state } };
    if (kind === "run-operation") return { ...view, operations: { ...view.operations, [runId]: event.operation } };
    if (kind === "terminal") {
      const state = C.run_state_for_reason[event.terminal_reason] || view.run_states[runId] || "completed";
      return {
        ...view,
        transient_by_run: without(view.transient_by_run, runId),
        operations: without(view.operations, runId),
        run_states: { ...view.run_states, [runId]: state },
        messages: event.assistant ? upsert(view.messages, event.assistant) : view.messages,
      };
    }
    const known = view.run_states[runId];
    if (known !== undefined && !ACTIVE.has(known)) return view; // a settled run streams nothing more
    const run = applyToRun(view.transient_by_run[runId] || emptyRun(), event);
    return { ...view, transient_by_run: { ...view.transient_by_run, [runId]: run } };
  }

  function applyToRun(run, event) {
    switch (event.type) {
      case "assistant-checkpoint": {
        const [text, reasoning] = texts(event.parts);
        return { ...run, text, reasoning };
      }
      case "assistant-delta":
        return { ...run, text: run.text + event.delta };
      case "reasoning-start":
        return { ...run, reasoning: run.reasoning ? run.reasoning + SEPARATOR : run.reasoning, reasoning_active: true };
      case "reasoning-delta":
        return { ...run, reasoning: run.reasoning + event.delta };
      case "reasoning-end":
        return { ...run, reasoning_active: false };
      case "attempt-reset":
        return { ...run, text: "", reasoning: "", reasoning_active: false, tools: {} };
      case "tool-progress":
        if (run.finished_calls.includes(event.call_id)) return run; // the terminal status had the final word
        return { ...run, tools: { ...run.tools, [event.call_id]: event } };
      case "tool-status":
        if (event.status === "started") return run;
        return {
          ...run,
          tools: without(run.tools, event.call_id),
          finished_calls: [...run.finished_calls, event.call_id],
        };
      default:
        return run;
    }
  }

  root.ThreadlineControlView = { advanceCursor, createView, reduceSnapshot, reduceEvent };
})(typeof window !== "undefined" ? window : globalThis);
