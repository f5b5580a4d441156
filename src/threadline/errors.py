"""Every error threadline raises.

Failures are classified by exception type, never by message text. The tree::

    ThreadlineError
    ├── AgentRuntimeUsageError            the application called threadline wrongly
    │   ├── AgentRecordValidationError    a record or argument failed validation
    │   ├── AgentConfigError              a configuration value is invalid (refused when it is given)
    │   └── AgentRuntimeClosedError       the runtime is closing: it starts and writes nothing new
    ├── AgentRecordSchemaVersionError     a stored record carries an unknown schema_version
    ├── AgentStoreError                   the store could not do what was asked
    │   ├── AgentStoreConflictError       a compare-and-swap lost: nothing was written
    │   │   ├── AgentRunRevisionConflictError     expected run revision is stale
    │   │   ├── AgentRunOwnershipConflictError    owner or fencing token is stale
    │   │   ├── AgentRunStateConflictError        the run is not in a state that allows this
    │   │   ├── AgentRunOrderConflictError        another run must go first
    │   │   └── AgentIdempotencyConflictError     a key or input id reused for different input
    │   ├── AgentRecordNotFoundError      an unknown conversation, run or message id
    │   ├── AgentConversationPurgedError  the conversation was purged; it accepts no mutation
    │   ├── AgentStoreBusyError           another connection holds the write lock; retry
    │   ├── AgentStoreUnavailableError    the database cannot be reached or was closed
    │   ├── AgentStoreSchemaError         the database schema is unknown, partial or unsupported
    │   ├── AgentStoreCorruptRecordError  a stored row is malformed or foreign
    │   ├── AgentStoreCapabilityError     the store's driver does not offer this optional capability
    │   ├── AgentArchiveRejectedError     an archive cannot be imported or branched from (``code`` says why)
    │   └── AgentBranchRefusedError       a branch request cannot be carried out (``code`` says why)
    ├── AgentRunUnsettledError            a run could not be settled; the store may be ahead
    ├── AgentToolFenceLostError           a tool fence check said this executor no longer owns the run
    ├── AppError                          a typed application error a model may see (code, message, hint)
    └── AgentContextOverflowError         a prepared step cannot fit the model window

Every store error guarantees that nothing was written by the failing call — with one exception a
database cannot rule out: a connection lost during COMMIT (``AgentStoreUnavailableError`` says so), after
which the caller reads back (or retries with the same identity) to learn the outcome.
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "AgentArchiveRejectedError",
    "AgentBranchRefusedError",
    "AgentConfigError",
    "AgentContextOverflowError",
    "AgentConversationPurgedError",
    "AgentIdempotencyConflictError",
    "AgentRecordNotFoundError",
    "AgentRecordSchemaVersionError",
    "AgentRecordValidationError",
    "AgentRunOrderConflictError",
    "AgentRunOwnershipConflictError",
    "AgentRunRevisionConflictError",
    "AgentRunStateConflictError",
    "AgentRunUnsettledError",
    "AgentRuntimeClosedError",
    "AgentRuntimeUsageError",
    "AgentStoreBusyError",
    "AgentStoreCapabilityError",
    "AgentStoreConflictError",
    "AgentStoreCorruptRecordError",
    "AgentStoreError",
    "AgentStoreSchemaError",
    "AgentStoreUnavailableError",
    "AgentToolFenceLostError",
    "AppError",
    "ThreadlineError",
)


class ThreadlineError(Exception):
    """Base class of every error threadline raises on purpose."""


class AgentRuntimeUsageError(ThreadlineError):
    """The application called threadline in a way it does not support; the message names the fix."""


class AgentRecordValidationError(AgentRuntimeUsageError):
    """A record or argument is invalid. ``field`` names where, when known."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class AgentConfigError(AgentRuntimeUsageError):
    """A configuration value is invalid. Raised where the value is given (constructing a policy, building a
    runtime), never at the first run; ``field`` names it, the message says what it accepts."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class AgentRuntimeClosedError(AgentRuntimeUsageError):
    """The runtime is closing or closed: it admits nothing new, and ``resume()``/``recover()`` start nothing.
    Work that had not written yet wrote nothing; durably queued work stays recoverable by ``recover()`` in a
    later runtime."""


class AgentRecordSchemaVersionError(ThreadlineError):
    """A stored record was written by a newer (or unknown) schema; it is refused, not guessed at."""

    def __init__(self, record: str, version: object, supported: int) -> None:
        super().__init__(
            f"{record} has schema_version {version!r}; this threadline reads schema_version {supported}. "
            "Upgrade threadline to read this database."
        )
        self.record = record
        self.version = version
        self.supported = supported


class AgentStoreError(ThreadlineError):
    """The store could not complete an operation. Nothing from that call was written."""


class AgentStoreConflictError(AgentStoreError):
    """A compare-and-swap lost. Nothing was written; reload and decide again.

    Attributes carry what the store saw: ``conversation_id``, ``run_id`` (when a run was involved),
    ``actual_revision``/``actual_version`` and the current ``run`` record when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        conversation_id: str,
        run_id: str | None = None,
        actual_revision: int | None = None,
        actual_version: int | None = None,
        run: Any = None,
    ) -> None:
        super().__init__(message)
        self.conversation_id = conversation_id
        self.run_id = run_id
        self.actual_revision = actual_revision
        self.actual_version = actual_version
        self.run = run


class AgentRunRevisionConflictError(AgentStoreConflictError):
    """The run moved since the caller read it (its revision differs from the expected one)."""


class AgentRunOwnershipConflictError(AgentStoreConflictError):
    """The caller no longer owns the run: another owner or a higher fencing token holds it."""


class AgentRunStateConflictError(AgentStoreConflictError):
    """The run's state does not allow the operation (for example acquiring a run that is not queued)."""


class AgentRunOrderConflictError(AgentStoreConflictError):
    """Another run of the conversation must be acquired or settle first."""


class AgentIdempotencyConflictError(AgentStoreConflictError):
    """An idempotency key, input message id or seed key was reused with different content."""


class AgentRecordNotFoundError(AgentStoreError):
    """An id names no record: unknown conversation, run or message."""


class AgentConversationPurgedError(AgentStoreError):
    """The conversation was purged. Every mutation is refused for ever; new chats need a new id."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id!r} was purged; use a new conversation id")
        self.conversation_id = conversation_id


class AgentStoreBusyError(AgentStoreError):
    """Another connection holds the database write lock. Nothing was written; the call may be retried."""


class AgentStoreUnavailableError(AgentStoreError):
    """The database cannot be reached, or the store handle was closed."""


class AgentStoreSchemaError(AgentStoreError):
    """The database schema is from an unknown version, partial, or the engine lacks a required feature."""


class AgentStoreCorruptRecordError(AgentStoreError):
    """A stored row cannot be read as a threadline record; ``where`` names the table and key."""

    def __init__(self, message: str, *, where: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


class AgentStoreCapabilityError(AgentStoreError):
    """The store's driver does not offer an optional capability (the event ledger, say): it is reported
    absent, never faked. ``capability`` names it."""

    def __init__(self, capability: str, message: str) -> None:
        super().__init__(message)
        self.capability = capability


class AgentArchiveRejectedError(AgentStoreError):
    """An archive was refused before anything was written. ``code`` names the offence
    (``ARCHIVE_MALFORMED``, ``ARCHIVE_TOO_LARGE``, ``ARCHIVE_FORMAT``, ``ARCHIVE_FOREIGN``,
    ``ARCHIVE_SEQUENCE``, ``ARCHIVE_DUPLICATE_ID``, ``ARCHIVE_UNKNOWN_KIND``, ``ARCHIVE_PAYLOAD``,
    ``ARCHIVE_DIGEST``, ``ARCHIVE_SNAPSHOT``, ``IMPORT_TARGET_EXISTS``); ``where`` the part of the archive."""

    def __init__(self, code: str, message: str, *, where: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.where = where


class AgentBranchRefusedError(AgentStoreError):
    """A branch was refused before anything was written. ``code``: ``BRANCH_SOURCE_UNKNOWN``,
    ``BRANCH_RUN_UNKNOWN``, ``BRANCH_RUN_ACTIVE`` (the selected prefix still has a queued or acquired run),
    ``BRANCH_DESTINATION_EXISTS``, ``BRANCH_REQUEST_CONFLICT`` (the key was used for another request),
    ``BRANCH_SOURCE_INVALID``, ``BRANCH_ARTIFACTS`` (spills need ``artifact_authorization``),
    ``BRANCH_METADATA_REFERENCE`` (message metadata names an engine identity, which a copy would carry)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class AgentRunUnsettledError(ThreadlineError):
    """A run could not be settled in this process. ``run`` is the record as last read (the store may be
    ahead of it) and ``owner_id`` the owner this runtime used."""

    def __init__(self, message: str, *, run: Any, owner_id: str | None) -> None:
        super().__init__(message)
        self.run = run
        self.owner_id = owner_id


class AgentToolFenceLostError(ThreadlineError):
    """A fence check (``create_agent_tool_fence_lifecycle``) found that this executor no longer owns the run,
    or could not confirm that it does. It is a control signal, never a tool error: the run's loop stops
    without applying the call's result or committing a terminal, and the model never sees it."""


class AgentContextOverflowError(ThreadlineError):
    """A prepared step cannot fit the selected model's context window; the run ends ``context_overflow``."""


APP_ERROR_STATUS: dict[str, int] = {
    "BAD_REQUEST": 400,
    "INVALID_ARGUMENTS": 400,
    "INVALID_CONTEXT": 400,
    "UNAUTHORIZED": 401,
    "FORBIDDEN": 403,
    "NOT_FOUND": 404,
    "UNKNOWN_TOOL": 404,
    "SPILL_REFERENCE_UNKNOWN": 404,
    "CONFLICT": 409,
    "PAYLOAD_TOO_LARGE": 413,
    "UNPROCESSABLE_ENTITY": 422,
    "TOO_MANY_REQUESTS": 429,
    "INTERNAL_SERVER_ERROR": 500,
    "SERVICE_UNAVAILABLE": 503,
    "SANDBOX_UNAVAILABLE": 503,
    "TIMEOUT": 504,
    "TOOL_VALUE_REFUSED": 422,
    "STEP_VALUE_REFUSED": 422,
}
"""The one map from an error code to its HTTP status (stitchkit's ``STITCH_ERROR_STATUS``); a code it does not
name is 500."""


class AppError(ThreadlineError):
    """A typed application error whose ``code``, message, ``details`` and ``hint`` may reach the model.
    ``status`` is the code's HTTP status from :data:`APP_ERROR_STATUS` (500 for a code it does not name)."""

    def __init__(
        self, code: str, message: str, details: Any = None, hint: str | None = None, *, retryable: bool = False
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details
        self.hint = hint
        self.retryable = retryable
        self.status = APP_ERROR_STATUS.get(code, 500)
