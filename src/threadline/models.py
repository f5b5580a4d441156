"""``define_model_registry``: the models an application allows, their windows and capabilities.

A model is any pydantic-ai model: a name such as ``'openai:gpt-4.1-mini'`` (constructed on first use,
which reads the provider's credentials) or a ``Model`` instance. ``preflight`` runs before admission,
so a missing credential or capability refuses the input before anything is written.

A model may name the upstream that served each response: ``resolve_response_provider`` receives the
pydantic-ai ``ModelResponse`` and returns a provider name or ``None``. The runtime records what it returns
(``provider/response`` in the ledger, ``step-finished.response.provider``) and knows no gateway's metadata
key itself; :func:`openrouter_response_provider` is the resolver for OpenRouter, passed explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from pydantic_ai.exceptions import UserError
from pydantic_ai.models import Model, infer_model

from .errors import AgentRuntimeUsageError

logger = logging.getLogger("threadline.models")

ResolveResponseProvider: TypeAlias = Callable[[Any], "str | None"]
"""Receives a pydantic-ai ``ModelResponse``; returns the name of the provider that served it, or ``None``."""


class AgentModelUnavailableError(AgentRuntimeUsageError):
    """The model is unknown, lacks a required capability, or its provider cannot be constructed (for
    example a missing API key; the message names the environment variable)."""


@dataclass(frozen=True)
class AgentModelDescriptor:
    """One resolved model: its registry name, the pydantic-ai ``Model``, window and capabilities."""

    name: str
    model: Model
    context_window: int | None
    capabilities: frozenset[str] = field(default_factory=frozenset)
    resolve_response_provider: ResolveResponseProvider | None = None
    """Names the upstream that served a response (``response.provider``); ``None``: responses name none."""

    @property
    def provider_name(self) -> str:
        return self.model.system


def openrouter_response_provider(response: Any) -> str | None:
    """OpenRouter's resolver: the upstream provider OpenRouter routed the request to (``"Anthropic"``, ...),
    as pydantic-ai's OpenRouter model reports it in ``provider_details``; ``None`` when it names none.

    Pass it where the model is declared::

        define_model_registry(models={"router": {"model": "openrouter:anthropic/claude-sonnet-4",
                                                 "resolve_response_provider": openrouter_response_provider}})
    """
    details = getattr(response, "provider_details", None)
    upstream = details.get("downstream_provider") if isinstance(details, Mapping) else None
    return upstream if isinstance(upstream, str) and upstream else None


def response_provider(model: Any, response: Any) -> str | None:
    """What ``model``'s ``resolve_response_provider`` says served ``response``; ``None`` without a resolver,
    or when it returns something other than a non-empty string or raises (logged: a resolver never fails a
    run)."""
    resolve = getattr(model, "resolve_response_provider", None)
    if resolve is None or response is None:
        return None
    try:
        name = resolve(response)
    except Exception:
        logger.warning(
            "resolve_response_provider of model %r failed; the response names no provider",
            getattr(model, "name", model),
            exc_info=True,
        )
        return None
    if name is None or (isinstance(name, str) and name):
        return name
    logger.warning(
        "resolve_response_provider of model %r returned %r, not a non-empty str; ignored",
        getattr(model, "name", model),
        name,
    )
    return None


@dataclass
class _Declaration:
    name: str
    model: Model | str
    context_window: int | None
    capabilities: frozenset[str]
    resolve_response_provider: ResolveResponseProvider | None = None
    built: Model | None = None


class AgentModelRegistry:
    """Resolve declared models by name. Build it with :func:`define_model_registry`."""

    def __init__(self, declarations: Mapping[str, _Declaration]) -> None:
        self._declarations = dict(declarations)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._declarations)

    def _declaration(self, name: str, capabilities: Iterable[str]) -> _Declaration:
        declared = self._declarations.get(name)
        if declared is None:
            raise AgentModelUnavailableError(f"unknown model {name!r}; declared: {sorted(self._declarations)}")
        missing = set(capabilities) - declared.capabilities
        if missing:
            raise AgentModelUnavailableError(f"model {name!r} lacks capabilities {sorted(missing)}")
        return declared

    def _build(self, declared: _Declaration) -> Model:
        if declared.built is None:
            if isinstance(declared.model, Model):
                declared.built = declared.model
            else:
                try:
                    declared.built = infer_model(declared.model)
                except (UserError, ImportError, ValueError) as error:
                    raise AgentModelUnavailableError(f"model {declared.name!r} is unavailable: {error}") from error
        return declared.built

    def preflight(self, name: str, capabilities: Iterable[str] = ()) -> AgentModelDescriptor:
        """Check before admission that ``name`` is declared, has ``capabilities`` and can be built."""
        return self.resolve(name, capabilities)

    def resolve(self, name: str, capabilities: Iterable[str] = ()) -> AgentModelDescriptor:
        """The descriptor a run uses. Raises :class:`AgentModelUnavailableError` with the reason."""
        declared = self._declaration(name, capabilities)
        return AgentModelDescriptor(
            name=name,
            model=self._build(declared),
            context_window=declared.context_window,
            capabilities=declared.capabilities,
            resolve_response_provider=declared.resolve_response_provider,
        )


def define_model_registry(*, models: Mapping[str, Mapping[str, Any]]) -> AgentModelRegistry:
    """Declare models: ``{name: {"model": <pydantic-ai Model or name>, "context_window": int,
    "capabilities": [...], "resolve_response_provider": callable}}`` (only ``model`` is required;
    ``resolve_response_provider``: see :func:`openrouter_response_provider`). Unknown keys are refused so
    typos do not pass silently."""
    declarations = {}
    for name, spec in models.items():
        unknown = set(spec) - {"model", "context_window", "capabilities", "resolve_response_provider"}
        if unknown:
            raise AgentRuntimeUsageError(f"models[{name!r}] has unknown keys {sorted(unknown)}")
        model = spec.get("model")
        if not isinstance(model, Model | str) or not model:
            raise AgentRuntimeUsageError(f"models[{name!r}].model is a pydantic-ai Model or a model name")
        window = spec.get("context_window")
        if window is not None and (not isinstance(window, int) or window < 0):
            raise AgentRuntimeUsageError(f"models[{name!r}].context_window is a non-negative integer")
        capabilities = spec.get("capabilities", ())
        if isinstance(capabilities, str):
            raise AgentRuntimeUsageError(f"models[{name!r}].capabilities is a list of names, not a string")
        resolver = spec.get("resolve_response_provider")
        if resolver is not None and not callable(resolver):
            raise AgentRuntimeUsageError(
                f"models[{name!r}].resolve_response_provider is a callable receiving a pydantic-ai ModelResponse "
                "and returning a provider name or None (e.g. threadline.openrouter_response_provider)"
            )
        declarations[name] = _Declaration(name, model, window, frozenset(capabilities), resolver)
    return AgentModelRegistry(declarations)
