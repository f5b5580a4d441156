"""Project canonical :class:`~threadline.records.Message` records onto pydantic-ai ``ModelMessage`` s.

The input is a conversation's messages in causal order (``ConversationSnapshot.messages``). The output
is always valid for pydantic-ai's provider adapters: it alternates request/response, starts with a
``ModelRequest``, answers every ``ToolCallPart`` exactly once in the immediately following request, has
no orphan ``ToolReturnPart`` and no duplicate call id.

What is never sent to a model as a message:

- compacted (inactive) messages; their summary reaches the model through the system channel;
- ``system`` and ``summary`` messages: their text is returned in ``AgentHistoryProjection.system``, to be
  delivered as instructions;
- superseded assistants (none of their text, anywhere), crash drafts (``streaming``) and failed
  assistants unless the evidence policy asks for them, clearly marked;
- source, provider, approval and control parts, files an assistant produced, and reasoning produced by
  a provider other than ``options.provider_name``;
- provider metadata (the ``envelope`` of a text, tool-call or reasoning part: item ids, signatures,
  Gemini thought signatures) to any provider but the one that produced it; that one gets it back on the
  part, as pydantic-ai's own parser had set it;
- a file reference itself: only what ``resolve_file`` returns, or an ``[attachment: name]`` placeholder;
- tool calls nobody answered, results without a call (or naming another tool than their call), and
  repeated call ids; an assistant left with nothing but such calls is omitted (``incomplete-tool-turn``,
  or ``awaiting-approval`` for a call suspended on an approval), whatever ``interrupted_assistant`` says;
- a tool call awaiting approval (the run that carries the approval records it again with its result);
- ``tool`` role messages (approval responses; not projected yet).

Every message gets one :class:`AgentProjectionDecision` saying what happened to it and why, with the
part types it holds that did not reach the provider (``tool-call`` / ``tool-result`` when a pairing was
dropped).
"""

from __future__ import annotations

import json
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart as AiTextPart,
    ThinkingPart,
    ToolCallPart as AiToolCallPart,
    ToolReturnPart,
    UserContent,
    UserPromptPart,
)

from ..errors import AgentRecordValidationError, ThreadlineError
from ..records import FilePart, Message, ProviderEnvelope, ReasoningPart, TextPart, ToolCallPart, ToolResultPart

__all__ = (
    "FAILED_MARKER",
    "INTERRUPTED_MARKER",
    "AgentHistoryEvidencePolicy",
    "AgentHistoryProjection",
    "AgentHistoryProjectionError",
    "AgentHistoryProjectionOptions",
    "AgentProjectionDecision",
    "project_agent_history",
    "project_agent_history_detailed",
)

INTERRUPTED_MARKER = "[interrupted: this turn was cut off before it finished]"
FAILED_MARKER = "[failed: partial evidence from a run that did not complete successfully]"


class AgentHistoryProjectionError(ThreadlineError):
    """The history cannot be projected under the chosen options: a broken tool chronology with
    ``incomplete_tool_turn='error'``, or a file that could not be resolved with ``unresolved_file='error'``."""

    def __init__(self, message: str, *, message_id: str) -> None:
        super().__init__(message)
        self.message_id = message_id


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AgentHistoryEvidencePolicy(_Options):
    failed_assistant: Literal["omit", "assistant-marked"] = "omit"
    """``assistant-marked`` projects a failed run's partial content followed by :data:`FAILED_MARKER`."""


class AgentHistoryProjectionOptions(_Options):
    interrupted_assistant: Literal["assistant-marked", "system-note", "omit"] = "assistant-marked"
    evidence_policy: AgentHistoryEvidencePolicy = AgentHistoryEvidencePolicy()
    incomplete_tool_turn: Literal["drop", "error"] = "drop"
    unresolved_file: Literal["omit", "text", "error"] = "omit"
    resolve_file: Callable[[FilePart], UserContent | None] | None = None
    """Turns a file reference into content a model can read; ``None`` from it means unresolved."""
    provider_name: str | None = None
    """The provider being called: reasoning and the envelopes of text and tool calls go back only to the
    provider that produced them (``ProviderEnvelope.provider``); None sends no provider metadata."""


_NOT_GIVEN: Any = object()


class AgentProjectionDecision(_Options):
    message_id: str
    action: Literal["projected", "omitted"]
    reason: str
    omitted_parts: list[str] = Field(default_factory=list)
    """Part types the message holds that were not projected (control markers are never listed)."""
    detail: str | None = None


@dataclass(frozen=True)
class AgentHistoryProjection:
    messages: list[ModelMessage]
    system: list[str]
    """System-channel lines in order (summaries, system messages, interrupted notes): instructions."""
    decisions: list[AgentProjectionDecision]
    """One per input message, in input order."""


def project_agent_history(
    messages: Sequence[Message], options: AgentHistoryProjectionOptions | Mapping[str, Any] | None = None
) -> list[ModelMessage]:
    """The provider-valid ``ModelMessage`` list for ``messages``; see :func:`project_agent_history_detailed`."""
    return project_agent_history_detailed(messages, options).messages


def project_agent_history_detailed(
    messages: Sequence[Message], options: AgentHistoryProjectionOptions | Mapping[str, Any] | None = None
) -> AgentHistoryProjection:
    """Project ``messages`` (causal order) and say, per message, what was sent and what was not."""
    if options is None:
        opts = AgentHistoryProjectionOptions()
    elif isinstance(options, AgentHistoryProjectionOptions):
        opts = options
    else:
        try:
            opts = AgentHistoryProjectionOptions.model_validate(options)
        except ValidationError as exc:
            raise AgentRecordValidationError(f"invalid projection options: {exc}", field="options") from exc
    projector = _Projector(opts)
    projector.extend(messages)
    return projector.result(messages)


# ------------------------------------------------------------------------------------------ internals

_Kind = Literal["request", "response"]
_STATUS_MARKER = {"interrupted": INTERRUPTED_MARKER, "failed": FAILED_MARKER}
# an interrupted turn assistant-marked is projected like any other (its marker says it was cut off)
_PROJECTED_REASON = {"completed": "projected", "interrupted": "projected", "failed": "failed-evidence"}


class _Step:
    """One model step of an assistant run: its response, then the request that answered it."""

    __slots__ = ("closed", "pending", "response", "returns", "users")  # several per projected assistant

    def __init__(self) -> None:
        self.response: list[Any] = []
        self.pending: dict[str, str] = {}
        self.returns: list[ToolReturnPart] = []
        self.users: list[str] = []
        self.closed = False


class _Overlay:
    """A set seen through a fork: reads the base, writes locally (the base is never mutated)."""

    def __init__(self, base: set[str] | _Overlay) -> None:
        self.base = base
        self.local: set[str] = set()

    def __contains__(self, item: object) -> bool:
        return item in self.local or item in self.base

    def add(self, item: str) -> None:
        self.local.add(item)


class _Projector:
    """A left-to-right pass that can be extended and forked: the runtime keeps one per conversation for
    the settled history and forks it for each request's live tail, so a step costs the tail, not the
    whole conversation."""

    def __init__(self, options: AgentHistoryProjectionOptions) -> None:
        self.opts = options
        self.live: dict[str, Message] | ChainMap[str, Message] = {}
        self.taken: set[str] | _Overlay = set()
        self.joined: dict[str, set[str]] = {}
        self.built: list[ModelMessage] = []
        self.last_kind: _Kind | None = None
        self.has_request = False
        self.system: list[str] = []
        self.decisions: dict[str, tuple[str, str, tuple[str, ...] | None, Any]] = {}
        """Per message: (action, reason, omitted parts, extra fields); built into records only by ``result``
        (a step's prompt never reads them)."""
        self.call_ids: set[str] | _Overlay = set()

    def fork(self) -> _Projector:
        other = _Projector(self.opts)
        other.live = ChainMap({}, self.live)
        other.taken = _Overlay(self.taken)
        other.built = list(self.built)
        other.last_kind = self.last_kind
        other.has_request = self.has_request
        other.system = list(self.system)
        other.call_ids = _Overlay(self.call_ids)
        return other

    def _claim_joined_inputs(self, messages: Sequence[Message]) -> None:
        """User inputs each completed assistant absorbed at a step boundary (the first claim wins).

        Only a completed run's terminal commit absorbs joined input (DESIGN §4); the marker on any other
        assistant is ignored and the input stays where it is, an ordinary input."""
        for m in messages:
            f = m.__dict__  # (pydantic's attribute hook per read: a message's fields are read as a dict)
            if f["role"] != "assistant" or f["status"] != "completed" or not f["active"]:
                continue
            for part in f["parts"]:
                if part.type != "input-joined":
                    continue
                for uid in part.message_ids:
                    user = self.live.get(uid)
                    if user is not None and user.role == "user" and uid not in self.taken:
                        self.taken.add(uid)
                        self.joined.setdefault(m.id, set()).add(uid)

    def extend(self, messages: Sequence[Message]) -> None:
        """Project ``messages`` (causal order) after everything projected so far."""
        live = self.live
        for m in messages:
            if m.__dict__["active"]:
                live[m.__dict__["id"]] = m
        self._claim_joined_inputs(messages)
        for m in messages:
            f = m.__dict__
            role = f["role"]
            if not f["active"]:
                self._decide(m, "omitted", "compacted")
            elif role == "user":
                if f["id"] not in self.taken:  # else placed at its step boundary by the assistant that absorbed it
                    self._user(m)
            elif role in ("system", "summary"):
                text = "\n".join(p.text for p in m.parts if p.type == "text" and p.text)
                if text:
                    self.system.append(text)
                    self._decide(m, "projected", "system-channel")
                else:
                    self._decide(m, "omitted", "empty")
            elif role == "tool":
                self._decide(m, "omitted", "tool-message", detail="approval responses are not projected yet")
            else:
                self._assistant(m)

    def result(self, order: Sequence[Message]) -> AgentHistoryProjection:
        decisions = []
        for m in order:
            decided = self.decisions.get(m.id)
            if decided is not None:
                action, reason, omitted, detail = decided
                kw = {} if detail is _NOT_GIVEN else {"detail": detail}
                decisions.append(
                    AgentProjectionDecision(
                        message_id=m.id, action=action, reason=reason, omitted_parts=list(omitted or ()), **kw
                    )
                )
        return AgentHistoryProjection(messages=list(self.built), system=list(self.system), decisions=decisions)

    def _decide(
        self, m: Message, action: str, reason: str, omitted: list[str] | None = None, detail: Any = _NOT_GIVEN
    ) -> None:
        # a plain tuple of immutable values, kept for every message of a cached history: no dict, and no
        # empty list, so the garbage collector can stop tracking it
        self.decisions[m.id] = (action, reason, tuple(omitted) if omitted else None, detail)

    def _emit(self, kind: _Kind, parts: list[Any]) -> None:
        """Adjacent requests merge; adjacent responses merge (neither holds an unanswered call, since every
        kept call is followed by its returns). Merging builds a new message: forks share the old one."""
        self.has_request = self.has_request or kind == "request"
        if self.built and self.last_kind == kind:
            previous = self.built[-1]
            merged = [*previous.parts, *parts]
            self.built[-1] = ModelRequest(parts=merged) if kind == "request" else ModelResponse(parts=merged)
        else:
            self.built.append(
                ModelRequest(parts=list(parts)) if kind == "request" else ModelResponse(parts=list(parts))
            )
            self.last_kind = kind

    # ------------------------------------------------------------------------------------- users

    def _user(self, m: Message, detail: str | None = None) -> None:
        items: list[UserContent] = []
        omitted: list[str] = []
        for part in m.parts:
            if part.type == "text":
                if part.text:
                    items.append(part.text)
            elif part.type == "file":
                resolved = self.opts.resolve_file(part) if self.opts.resolve_file else None
                if resolved is not None:
                    items.append(resolved)
                elif self.opts.unresolved_file == "text":
                    items.append(f"[attachment: {part.filename or part.media_type}]")
                elif self.opts.unresolved_file == "error":
                    raise AgentHistoryProjectionError(
                        f"user message {m.id!r}: file {part.reference!r} could not be resolved", message_id=m.id
                    )
                else:
                    _note(omitted, "file")
            elif part.type != "control":
                _note(omitted, part.type)
        if not items:
            self._decide(m, "omitted", "empty", omitted, detail=detail)
            return
        content = "\n".join(items) if all(isinstance(i, str) for i in items) else items
        self._emit("request", [UserPromptPart(content)])
        self._decide(m, "projected", "projected", omitted, detail=detail)

    # -------------------------------------------------------------------------------- assistants

    def _assistant(self, m: Message) -> None:
        status, opts = m.status, self.opts
        joined = self.joined.get(m.id, set())
        if status == "superseded":
            return self._decide(m, "omitted", "superseded")
        if status == "streaming":
            return self._decide(m, "omitted", "crash-draft")
        if status == "failed" and opts.evidence_policy.failed_assistant == "omit":
            return self._decide(m, "omitted", "failed")
        if status == "interrupted" and opts.interrupted_assistant == "omit":
            return self._decide(m, "omitted", "interrupted")
        if status == "interrupted" and opts.interrupted_assistant == "system-note":
            return self._system_note(m)
        if not self.has_request:
            self._decide(m, "omitted", "leading-assistant")
            for uid in sorted(joined, key=lambda i: self.live[i].seq):
                self._user(self.live[uid], detail=f"joined the omitted leading assistant {m.id}")
            return None

        steps, omitted, problems, dangling = self._steps(m, joined)
        if problems and opts.incomplete_tool_turn == "error":
            raise AgentHistoryProjectionError(
                f"assistant {m.id!r}: incomplete tool chronology: {'; '.join(problems)}", message_id=m.id
            )
        detail = "; ".join(problems) or None
        if "tool-call" in omitted and not any(s.response or s.returns or s.users for s in steps):
            # nothing but calls that cannot be sent: the model would read it as an answer to nothing; a
            # failed run opted in as evidence fails closed too (its effects are uncertain, not evidence)
            reason = "incomplete-tool-turn" if dangling else "awaiting-approval"
            return self._decide(m, "omitted", reason, omitted, detail=detail)
        marker = _STATUS_MARKER.get(status)
        if marker:
            last = steps[-1]
            if last.returns or last.users:
                steps.append(last := _Step())
            last.response.append(AiTextPart(marker))

        projected_any = False
        for step in steps:
            if step.response:
                projected_any = True
                self._emit("response", step.response)
            if step.returns:
                self._emit("request", step.returns)
            for uid in step.users:
                self._user(self.live[uid], detail=f"joined {m.id} at a step boundary")
        if not projected_any:
            # nothing left once unpairable results were dropped: a broken tool turn, not an empty one
            return self._decide(m, "omitted", "incomplete-tool-turn" if problems else "empty", omitted, detail=detail)
        reason = "unmatched-tool-chronology" if problems else _PROJECTED_REASON[status]
        return self._decide(m, "projected", reason, omitted, detail=detail)

    def _system_note(self, m: Message) -> None:
        """An interrupted turn as a system line: its text only (every other part is listed as omitted)."""
        text = "\n".join(p.text for p in m.parts if p.type == "text" and p.text)
        omitted: list[str] = []
        for part in m.parts:
            if part.type not in ("text", "control", "input-joined"):
                _note(omitted, part.type)
        if not text and "tool-call" in omitted:
            return self._decide(m, "omitted", "incomplete-tool-turn", omitted, detail="no text, only tool calls")
        self.system.append(f"[interrupted] partial response: {text}")
        return self._decide(m, "projected", "interrupted-system-note", omitted)

    def _steps(self, m: Message, joined: set[str]) -> tuple[list[_Step], list[str], list[str], bool]:
        """Split a run's parts into steps, pairing calls with results; drop what cannot be paired, listing
        ``tool-call`` / ``tool-result`` as omitted. The flag: a call was dropped for want of its result (a
        call awaiting approval is suspended, not dangling)."""
        steps = [_Step()]
        omitted: list[str] = []
        problems: list[str] = []
        dangling = False
        # a call that asked for approval is suspended, not dangling: it is not sent here; the run that
        # carries the approval response records the call again with its result (or the denial)
        parts = m.parts
        kinds = [p.type for p in parts]  # read once: a record's attribute costs a pydantic hook each time
        awaiting: set[str] = set()
        if "approval-request" in kinds:
            answered = {p.call_id for p, kind in zip(parts, kinds, strict=True) if kind == "tool-result"}
            awaiting = {
                p.call_id for p, kind in zip(parts, kinds, strict=True) if kind == "approval-request"
            } - answered
        for part, kind in zip(parts, kinds, strict=True):
            step = steps[-1]
            if kind == "tool-call" and awaiting and part.call_id in awaiting:
                _note(omitted, "tool-call")
                continue
            if kind in ("text", "reasoning", "tool-call") and step.closed:
                steps.append(step := _Step())
            if kind == "text":
                text = self._text(part)
                if text is not None:
                    step.response.append(text)
            elif kind == "reasoning":
                thinking = self._thinking(part)
                if thinking is None:
                    _note(omitted, "reasoning")
                else:
                    step.response.append(thinking)
            elif kind == "tool-call":
                if part.call_id in self.call_ids:
                    problems.append(f"dropped duplicate call id {part.call_id!r}")
                    _note(omitted, "tool-call")
                    dangling = True
                    continue
                self.call_ids.add(part.call_id)
                step.pending[part.call_id] = part.tool_name
                step.response.append(self._call(part))
            elif kind == "tool-result":
                step.closed = True
                problem = _unmatched(step.pending, part)
                if problem is not None:
                    problems.append(problem)
                    _note(omitted, "tool-result")
                    continue
                del step.pending[part.call_id]
                step.returns.append(_return(part))
            elif kind == "input-joined":
                ids = [i for i in part.message_ids if i in joined and not any(i in s.users for s in steps)]
                if ids:
                    step.closed = True
                    step.users.extend(ids)
            elif kind != "control":
                _note(omitted, kind)
        for step in steps:
            if not step.pending:
                continue
            if m.status == "completed":  # interrupted / failed evidence was cut off: dangling calls are expected
                problems.append(f"dropped unanswered call(s) {sorted(step.pending)}")
            _note(omitted, "tool-call")
            dangling = True
            step.response = [
                p for p in step.response if not (isinstance(p, AiToolCallPart) and p.tool_call_id in step.pending)
            ]
        return steps, omitted, problems, dangling

    def _own(self, envelope: ProviderEnvelope | None) -> dict[str, Any] | None:
        """The envelope's data when the provider being called produced it; None for any other provider."""
        if envelope is None or self.opts.provider_name is None or envelope.provider != self.opts.provider_name:
            return None
        return envelope.data if isinstance(envelope.data, dict) else {}

    def _text(self, part: TextPart) -> AiTextPart | None:
        data = self._own(part.envelope)
        if data is None:
            return AiTextPart(part.text) if part.text else None
        # an empty text part exists only for its metadata (a Gemini thought signature): its provider gets it
        return AiTextPart(part.text, **_metadata_fields(data, self.opts.provider_name))

    def _thinking(self, part: ReasoningPart) -> ThinkingPart | None:
        data = self._own(part.envelope)
        if data is None:
            return None
        signature = data.get("signature")
        return ThinkingPart(
            part.text,
            signature=signature if isinstance(signature, str) else None,
            **_metadata_fields(data, self.opts.provider_name),
        )

    def _call(self, part: ToolCallPart) -> AiToolCallPart:
        args = part.input if part.input is None or isinstance(part.input, dict) else json.dumps(part.input)
        data = self._own(part.envelope)
        fields = _metadata_fields(data, self.opts.provider_name) if data is not None else {}
        return AiToolCallPart(part.tool_name, args, tool_call_id=part.call_id, **fields)


def _metadata_fields(data: dict[str, Any], provider: str | None) -> dict[str, Any]:
    """The pydantic-ai part fields an envelope restores (``threadline.loop.canonical_parts`` wrote them):
    the provider's item ``id`` and ``provider_details``; anything malformed is left out, never guessed."""
    item_id, details = data.get("id"), data.get("provider_details")
    return {
        "id": item_id if isinstance(item_id, str) else None,
        "provider_name": provider,
        "provider_details": details if isinstance(details, dict) and details else None,
    }


def _unmatched(pending: dict[str, str], result: ToolResultPart) -> str | None:
    """Why ``result`` cannot answer a call of its step, or None when it can."""
    called = pending.get(result.call_id)
    if called is None:
        return f"dropped result {result.call_id!r} that answers no call of its step"
    if called != result.tool_name:
        return f"dropped result {result.call_id!r}: it names tool {result.tool_name!r}, its call {called!r}"
    return None


def _return(part: ToolResultPart) -> ToolReturnPart:
    outcome = "failed" if part.outcome == "error" else "success"
    return ToolReturnPart(part.tool_name, part.output, tool_call_id=part.call_id, outcome=outcome)


def _note(omitted: list[str], part_type: str) -> None:
    if part_type not in omitted:
        omitted.append(part_type)
