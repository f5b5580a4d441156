"""Structured output: ``define_agent_protocol(output=City)`` makes a run's answer a validated value.

The output is declared the way pydantic-ai's ``Agent(output_type=...)`` declares it, and pydantic-ai's own
machinery does the work: its ``OutputSchema`` turns the declaration into ``ModelRequestParameters``
(``output_mode``, ``output_tools``, ``output_object``, ``allow_text_output``, the prompted template) sent with
every request through ``Model.request_stream``, and its processors validate what comes back. The modes are
pydantic-ai's:

- a type (``City``, ``list[City]``, a ``TypedDict``, a union ``[City, Country]``) — the model's default mode
  (``tool`` for most providers), chosen by pydantic-ai per model;
- ``ToolOutput(City)`` — an output tool (``final_result``) the model calls with the value as arguments;
- ``NativeOutput(City)`` — the provider's own JSON-schema output (the answer text is the JSON);
- ``PromptedOutput(City)`` — the schema in the instructions, the answer text is the JSON.

An output tool call is recorded like any tool round (the call and a ``success`` result), so history stays
provider-valid and the stored answer still holds the value. A value that does not validate is retried: an
invalid output tool call gets an ``INVALID_OUTPUT`` tool result naming the errors (the call and its result
stay in the draft, like any tool round); invalid answer text is withdrawn (``attempt-reset``) and the next
request carries it back with pydantic-ai's retry feedback (``RetryFeedbackPart``). After ``output_retries``
such retries (1 by default, as pydantic-ai's), the run ends ``output_rejected``. Every retry is a step:
``loop.max_steps`` bounds them too.

Not supported (refused where declared): output functions, ``TextOutput``, ``DeferredToolRequests``,
``BinaryImage`` and ``PendingModelResponse`` — they need pydantic-ai's agent graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import PydanticSchemaGenerationError, ValidationError
from pydantic_ai import _output as pai_output
from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import ModelRequest, ModelResponse, RetryFeedbackPart, RetryInfo, TextPart as PaiTextPart
from pydantic_ai.models import ModelRequestParameters

from .errors import AgentConfigError
from .records import Part, ToolCallPart, ToolResultPart

__all__ = ("OUTPUT_RETRIES", "AgentOutput", "OutputJudgement", "agent_output")

OUTPUT_RETRIES = 1
"""Invalid outputs retried before a run ends ``output_rejected`` (pydantic-ai's default too)."""
FINAL_RESULT_PROCESSED = "Final result processed."
"""The tool result recorded for an accepted output tool call (pydantic-ai's wording)."""
_MAX_ERRORS = 5  # validation errors shown to the model per retry


def _not_executed(call: ToolCallPart) -> ToolResultPart:
    return ToolResultPart(
        call_id=call.call_id,
        tool_name=call.tool_name,
        outcome="error",
        output={"error": "NOT_EXECUTED", "retryable": False, "message": "a final result was given in the same turn"},
    )


def _errors(error: ValidationError) -> list[Any]:
    return error.errors(include_url=False, include_context=False)[:_MAX_ERRORS]


def _summary(error: ValidationError) -> str:
    parts = []
    for item in _errors(error):
        where = ".".join(str(p) for p in item["loc"]) or "value"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


@dataclass(frozen=True)
class OutputJudgement:
    """What a step's response means for the declared output.

    ``kind``: ``tools`` (function tools only: an ordinary tool round), ``valid`` (the final answer, ``value``),
    ``invalid-call`` (an output tool call that did not validate: ``results`` answer it and the round goes on),
    ``invalid-text`` (answer text that did not validate, or text where only a tool may answer: ``feedback`` is
    what the next request carries). ``results`` are the tool results to record for output calls."""

    kind: Literal["tools", "valid", "invalid-call", "invalid-text"]
    value: Any = None
    results: tuple[ToolResultPart, ...] = ()
    feedback: tuple[Any, ...] = ()
    error: ValidationError | None = None
    summary: str = ""


@dataclass(frozen=True)
class AgentOutput:
    """A declared structured output (build it with :func:`agent_output`, or through ``define_agent_protocol``
    and ``submit``): pydantic-ai's ``OutputSchema`` of ``spec``, built once."""

    spec: Any
    schema: Any
    retries: int = OUTPUT_RETRIES

    @property
    def name(self) -> str:
        spec = self.spec
        inner = getattr(spec, "output", None) or getattr(spec, "outputs", None) or spec
        return getattr(inner, "__name__", None) or repr(inner)

    @property
    def mode(self) -> str:
        """pydantic-ai's output mode: ``auto`` (the model's default), ``tool``, ``native`` or ``prompted``."""
        return str(self.schema.mode)

    @property
    def tool_names(self) -> frozenset[str]:
        toolset = self.schema.toolset
        return frozenset(toolset.processors) if toolset is not None else frozenset()

    def parameters(self, params: ModelRequestParameters) -> ModelRequestParameters:
        """``params`` with this output's request fields; the model's ``prepare_request`` resolves ``auto``
        and drops what its mode does not use."""
        schema = self.schema
        toolset = schema.toolset
        return replace(
            params,
            output_mode=schema.mode,
            output_tools=list(toolset._tool_defs) if toolset is not None else [],
            output_object=schema.object_def,
            allow_text_output=schema.allows_text,
            prompted_output_template=(
                schema.template if isinstance(schema, pai_output.StructuredTextOutputSchema) else None
            ),
        )

    def _validate(self, processor: Any, data: Any) -> Any:
        value = processor.validate(data)
        if isinstance(value, pai_output._UnionValidatedOutput):
            return value.data
        key = getattr(processor, "outer_typed_dict_key", None)
        return value[key] if key else value

    def judge(self, produced: Sequence[Part]) -> OutputJudgement:
        """Judge one step's response parts."""
        names = self.tool_names
        calls = [p for p in produced if isinstance(p, ToolCallPart)]
        output_calls = [c for c in calls if c.tool_name in names]
        if output_calls:
            first, others = output_calls[0], [c for c in calls if c is not output_calls[0]]
            processor = self.schema.toolset.processors[first.tool_name]
            try:
                value = self._validate(processor, first.input if first.input is not None else {})
            except ValidationError as error:
                summary = _summary(error)
                answer = ToolResultPart(
                    call_id=first.call_id,
                    tool_name=first.tool_name,
                    outcome="error",
                    output={
                        "error": "INVALID_OUTPUT",
                        "retryable": True,
                        "message": summary,
                        "_hint": f"call {first.tool_name} again with arguments that fit its schema",
                    },
                )
                extra = tuple(_not_executed(c) for c in output_calls[1:])
                return OutputJudgement("invalid-call", results=(answer, *extra), error=error, summary=summary)
            done = ToolResultPart(
                call_id=first.call_id, tool_name=first.tool_name, outcome="success", output=FINAL_RESULT_PROCESSED
            )
            return OutputJudgement("valid", value=value, results=(done, *(_not_executed(c) for c in others)))
        if calls:
            return OutputJudgement("tools")
        text = "".join(p.text for p in produced if p.type == "text")
        response = ModelResponse(parts=[PaiTextPart(content=text)])
        processor = self.schema.text_processor
        if processor is None:  # only a tool may answer
            listed = ", ".join(sorted(names))
            said = f"Give your final answer by calling {listed}, not as text."
            retry = ModelRequest(parts=[RetryFeedbackPart(content=said, retry=RetryInfo(cause="no_output"))])
            return OutputJudgement("invalid-text", feedback=(response, retry), summary=said)
        try:
            value = self._validate(processor, text)
        except ValidationError as error:
            feedback = RetryFeedbackPart(content=_errors(error), retry=RetryInfo(cause="validation_error"))  # type: ignore[arg-type]
            retry = ModelRequest(parts=[feedback])
            return OutputJudgement("invalid-text", feedback=(response, retry), error=error, summary=_summary(error))
        return OutputJudgement("valid", value=value)

    def value_of(self, parts: Sequence[Part]) -> Any:
        """The output a stored answer holds: the arguments of its accepted output tool call, else the text
        after its last tool round; None when it holds none that validates (an answer of another run, a
        protocol that changed)."""
        accepted = {p.call_id for p in parts if p.type == "tool-result" and p.outcome == "success"}
        names = self.tool_names
        for part in reversed(parts):
            if isinstance(part, ToolCallPart) and part.tool_name in names and part.call_id in accepted:
                try:
                    return self._validate(self.schema.toolset.processors[part.tool_name], part.input or {})
                except ValidationError:
                    return None
        processor = self.schema.text_processor
        if processor is None:
            return None
        last_round = max((i for i, p in enumerate(parts) if p.type == "tool-result"), default=-1)
        text = "".join(p.text for p in parts[last_round + 1 :] if p.type == "text")
        try:
            return self._validate(processor, text)
        except ValidationError:
            return None


def _unsupported(schema: Any) -> str | None:
    if isinstance(schema, pai_output.TextOutputSchema | pai_output.ImageOutputSchema):
        return "plain text or image output is what a run gives without output="
    if schema.allows_deferred_tools or schema.allows_image or schema.allows_pending_model_response:
        return "DeferredToolRequests, BinaryImage and PendingModelResponse need pydantic-ai's agent graph"
    processors = list(schema.toolset.processors.values()) if schema.toolset is not None else []
    if schema.text_processor is not None:
        processors.append(schema.text_processor)
        processors.extend(getattr(schema.text_processor, "_processors", {}).values())
    for processor in processors:
        if getattr(processor, "_function_schema", None) is not None:
            return "output functions run application code: call it on result.output instead"
        if isinstance(processor, pai_output.TextFunctionOutputProcessor):
            return "TextOutput(function) runs application code: call it on result.text instead"
        choices = getattr(processor, "_choice_values", None)
        if choices and any(callable(v) for v in choices.values()):
            return "Choices with callable values run application code"
    return None


def agent_output(spec: Any, *, retries: int = OUTPUT_RETRIES, field: str = "output") -> AgentOutput:
    """Check and build a declared output (``City``, ``ToolOutput(City)``, ``NativeOutput(City)``,
    ``PromptedOutput(City)``, a list or union of types). Raises :class:`~threadline.errors.AgentConfigError`
    naming ``field`` for what pydantic-ai refuses and what threadline does not support."""
    if isinstance(spec, AgentOutput):
        return spec
    if spec is None or spec is str or inspect.isfunction(spec) or inspect.ismethod(spec):
        raise AgentConfigError(
            f"{field} is a type such as a pydantic model (output=City), or ToolOutput(City), NativeOutput(City), "
            f"PromptedOutput(City) from pydantic_ai; got {spec!r}",
            field=field,
        )
    if type(retries) is not int or retries < 0:
        raise AgentConfigError(f"output_retries is an int of at least 0, got {retries!r}", field="output_retries")
    try:
        schema = pai_output.OutputSchema.build(spec)
    except (UserError, TypeError, ValueError, PydanticSchemaGenerationError) as error:  # refused by pydantic(-ai)
        raise AgentConfigError(f"{field}: {error}", field=field) from error
    problem = _unsupported(schema)
    if problem is not None:
        raise AgentConfigError(f"{field}: not supported here: {problem}", field=field)
    return AgentOutput(spec, schema, retries)
