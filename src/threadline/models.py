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

from .errors import AgentConfigError, AgentRuntimeUsageError

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
    """Resolve declared models by name. Build it with :func:`define_model_registry`. ``default`` is the model
    a runtime given the registry itself (``models=registry``) uses for every run."""

    def __init__(self, declarations: Mapping[str, _Declaration], default: str | None = None) -> None:
        self._declarations = dict(declarations)
        self.default = default if default is not None or len(self._declarations) != 1 else next(iter(declarations))

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


_SPEC_KEYS = ("model", "context_window", "capabilities", "resolve_response_provider")


def define_model_registry(*, models: Mapping[str, Mapping[str, Any]], default: str | None = None) -> AgentModelRegistry:
    """Declare models: ``{name: {"model": <pydantic-ai Model or name>, "context_window": int,
    "capabilities": [...], "resolve_response_provider": callable}}`` (only ``model`` is required;
    ``resolve_response_provider``: see :func:`openrouter_response_provider`); ``default`` names the model a
    runtime given the registry itself uses (a registry of one model defaults to it). Everything is checked
    here, where it is given: a bad value raises :class:`~threadline.errors.AgentConfigError` naming it
    (``models['fast'].context_window``), unknown keys included, so typos do not pass silently. A model name
    is only resolved (its provider built, its credentials read) on first use."""
    if not isinstance(models, Mapping) or not models:
        raise AgentConfigError(
            "models is a non-empty dict of {name: {'model': ..., 'context_window': ..., 'capabilities': [...]}}, "
            f"got {models!r}"[:300],
            field="models",
        )
    declarations = {}
    for name, spec in models.items():
        where = f"models[{name!r}]"
        if not isinstance(name, str) or not name:
            raise AgentConfigError(f"model names are non-empty strings, got {name!r}", field="models")
        if not isinstance(spec, Mapping):
            raise AgentConfigError(
                f"{where} is a dict such as {{'model': 'openai:gpt-4.1-mini', 'context_window': 1047576}}, "
                f"got {type(spec).__name__}",
                field=where,
            )
        unknown = sorted(set(spec) - set(_SPEC_KEYS))
        if unknown:
            raise AgentConfigError(
                f"{where} has unknown keys {unknown}; known: {list(_SPEC_KEYS)}", field=f"{where}.{unknown[0]}"
            )
        model = spec.get("model")
        if not isinstance(model, Model | str) or not model:
            raise AgentConfigError(
                f"{where}.model is a pydantic-ai Model or a model name such as 'openai:gpt-4.1-mini', got {model!r}",
                field=f"{where}.model",
            )
        window = spec.get("context_window")
        if window is not None and (type(window) is not int or window < 1):
            raise AgentConfigError(
                f"{where}.context_window is None or a positive int (tokens), got {window!r}",
                field=f"{where}.context_window",
            )
        capabilities = spec.get("capabilities", ())
        listed = (
            tuple(capabilities)
            if isinstance(capabilities, Iterable) and not isinstance(capabilities, str | bytes | Mapping)
            else None
        )
        if listed is None or not all(isinstance(c, str) and c for c in listed):
            raise AgentConfigError(
                f"{where}.capabilities is a list of names such as ['tools', 'vision'], got {capabilities!r}",
                field=f"{where}.capabilities",
            )
        resolver = spec.get("resolve_response_provider")
        if resolver is not None and not callable(resolver):
            raise AgentConfigError(
                f"{where}.resolve_response_provider is a callable receiving a pydantic-ai ModelResponse and "
                "returning a provider name or None (e.g. threadline.openrouter_response_provider)",
                field=f"{where}.resolve_response_provider",
            )
        declarations[name] = _Declaration(name, model, window, frozenset(listed), resolver)
    if default is not None and default not in declarations:
        raise AgentConfigError(
            f"default is one of the declared models {sorted(declarations)}, got {default!r}", field="default"
        )
    return AgentModelRegistry(declarations, default)
