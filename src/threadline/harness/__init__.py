"""The headless harness: a runtime composed with resources, per-run models and observers; file resources and
skills; a transport-neutral control server; and a JSON-lines runner for supervisors.

A leaf (DESIGN §8): it uses the runtime's public seams only, and the core never imports it. The HTTP
transports built on it live in :mod:`threadline.server` (``pip install 'threadline[server]'``).
"""

from __future__ import annotations

from .contract import (
    AgentHarnessAppliedResource as AgentHarnessAppliedResource,
    AgentHarnessLimits as AgentHarnessLimits,
    AgentHarnessModelSummary as AgentHarnessModelSummary,
    AgentHarnessProfileEvent as AgentHarnessProfileEvent,
    AgentHarnessResource as AgentHarnessResource,
    AgentHarnessResourceDiagnostic as AgentHarnessResourceDiagnostic,
    AgentHarnessResourceError as AgentHarnessResourceError,
    AgentHarnessResourceKind as AgentHarnessResourceKind,
    AgentHarnessResourceRequest as AgentHarnessResourceRequest,
    AgentHarnessResourceResult as AgentHarnessResourceResult,
)
from .control import (
    AgentHarnessControlConnection as AgentHarnessControlConnection,
    AgentHarnessControlServer as AgentHarnessControlServer,
    create_agent_harness_control_server as create_agent_harness_control_server,
)
from .control_schema import (
    AGENT_CONTROL_DELIVERY_ADAPTER as AGENT_CONTROL_DELIVERY_ADAPTER,
    AGENT_CONTROL_ERROR_CODES as AGENT_CONTROL_ERROR_CODES,
    AGENT_CONTROL_REQUEST_ADAPTER as AGENT_CONTROL_REQUEST_ADAPTER,
    AGENT_CONTROL_RESPONSE_ADAPTER as AGENT_CONTROL_RESPONSE_ADAPTER,
    AgentControlDelivery as AgentControlDelivery,
    AgentControlError as AgentControlError,
    AgentControlErrorCode as AgentControlErrorCode,
    AgentControlErrorResponse as AgentControlErrorResponse,
    AgentControlEventDelivery as AgentControlEventDelivery,
    AgentControlOkResponse as AgentControlOkResponse,
    AgentControlRequest as AgentControlRequest,
    AgentControlResponse as AgentControlResponse,
    AgentControlResyncDelivery as AgentControlResyncDelivery,
)
from .fanout import AgentControlDeliveryBatch as AgentControlDeliveryBatch
from .file_resources import (
    AgentHarnessFileLimits as AgentHarnessFileLimits,
    AgentHarnessFileResources as AgentHarnessFileResources,
    AgentHarnessFileRoot as AgentHarnessFileRoot,
    create_agent_harness_file_resources as create_agent_harness_file_resources,
)
from .harness import (
    AgentHarnessDiagnostics as AgentHarnessDiagnostics,
    HeadlessAgentHarness as HeadlessAgentHarness,
    create_headless_agent_harness as create_headless_agent_harness,
)
from .hub import AgentEventHub as AgentEventHub
from .runner import (
    HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES as HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES,
    run_headless_agent_runner as run_headless_agent_runner,
)

__all__ = (
    "AGENT_CONTROL_DELIVERY_ADAPTER",
    "AGENT_CONTROL_ERROR_CODES",
    "AGENT_CONTROL_REQUEST_ADAPTER",
    "AGENT_CONTROL_RESPONSE_ADAPTER",
    "HEADLESS_AGENT_RUNNER_MAX_LINE_BYTES",
    "AgentControlDelivery",
    "AgentControlDeliveryBatch",
    "AgentControlError",
    "AgentControlErrorCode",
    "AgentControlErrorResponse",
    "AgentControlEventDelivery",
    "AgentControlOkResponse",
    "AgentControlRequest",
    "AgentControlResponse",
    "AgentControlResyncDelivery",
    "AgentEventHub",
    "AgentHarnessAppliedResource",
    "AgentHarnessControlConnection",
    "AgentHarnessControlServer",
    "AgentHarnessDiagnostics",
    "AgentHarnessFileLimits",
    "AgentHarnessFileResources",
    "AgentHarnessFileRoot",
    "AgentHarnessLimits",
    "AgentHarnessModelSummary",
    "AgentHarnessProfileEvent",
    "AgentHarnessResource",
    "AgentHarnessResourceDiagnostic",
    "AgentHarnessResourceError",
    "AgentHarnessResourceKind",
    "AgentHarnessResourceRequest",
    "AgentHarnessResourceResult",
    "HeadlessAgentHarness",
    "create_agent_harness_control_server",
    "create_agent_harness_file_resources",
    "create_headless_agent_harness",
    "run_headless_agent_runner",
)
