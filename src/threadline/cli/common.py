"""What the commands share: opening a store (``--db`` or ``--dsn``), choosing a model (the built-in scripted
one, a pydantic-ai model name, or an OpenAI-compatible server), the tools, and building a runtime."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..errors import AgentStoreUnavailableError, ThreadlineError
from ..records import INPUT_POLICIES
from ..store.aggregate import AgentConversationReader, AgentRuntimeStore

if TYPE_CHECKING:  # the runtime side (pydantic-ai) is imported by the commands that run a model
    from ..runtime import AgentRuntime
    from ..tools import AgentTool
    from .scripted import ScriptedModel

DEFAULT_DB = Path("threadline.db")
POLICY_HELP = "Input policy for text typed while the model answers: " + ", ".join(INPUT_POLICIES) + "."


class CliContext(BaseModel):
    """The context every run of the ``threadline`` command carries."""

    user: str = "cli"


class CliUsageError(ThreadlineError):
    """A bad invocation the command reports in one line (an unknown policy, ``--db`` with ``--dsn``…)."""


def check_policy(policy: str) -> str:
    if policy not in INPUT_POLICIES:
        raise CliUsageError(f"unknown policy {policy!r}; choose one of: {', '.join(INPUT_POLICIES)}")
    return policy


# ------------------------------------------------------------------------------------------- stores


@dataclass
class OpenStore:
    store: AgentRuntimeStore
    conversations: AgentConversationReader
    where: str


@asynccontextmanager
async def open_store(
    db: Path | None,
    dsn: str | None,
    *,
    create: bool = True,
    schema: str | None = None,
    read_only: bool = False,
) -> AsyncIterator[OpenStore]:
    """Open the SQLite file ``db`` (default ``./threadline.db``) or the PostgreSQL database ``dsn`` (its
    ``schema``, default ``threadline``). With ``create=False`` a missing SQLite file, or a PostgreSQL schema
    without threadline's tables, is an error instead of a new database (nothing is created). With
    ``read_only=True`` (``inspect``) a SQLite file is opened with SQLite's ``mode=ro``, and a PostgreSQL
    layout that would need migrating is an error instead of being migrated."""
    if db is not None and dsn is not None:
        raise CliUsageError("pass --db or --dsn, not both")
    if schema is not None and dsn is None:
        raise CliUsageError("--schema is for PostgreSQL (--dsn)")
    if dsn is not None:
        try:
            from ..store.postgres import DEFAULT_SCHEMA, create_postgres_agent_runtime_store
        except ImportError:
            raise CliUsageError("PostgreSQL support needs psycopg: pip install 'threadline[postgres]'") from None
        if not create:
            await require_postgres_layout(dsn, schema or DEFAULT_SCHEMA, read_only=read_only)
        options = {"schema": schema} if schema is not None else {}
        async with create_postgres_agent_runtime_store(dsn=dsn, **options) as pg:
            yield OpenStore(pg.store, pg.conversations, f"PostgreSQL {pg.driver.where} schema {pg.schema}")
        return
    from ..store.sqlite import create_sqlite_agent_runtime_store

    path = (db or DEFAULT_DB).expanduser()
    if not create and not path.exists():
        raise AgentStoreUnavailableError(f"no database at {path}")
    async with create_sqlite_agent_runtime_store(filename=path, read_only=read_only) as sqlite:
        yield OpenStore(sqlite.store, sqlite.conversations, str(path.resolve()))


def postgres_where(dsn: str) -> str:
    """``host:port/dbname`` of a connection string: never its user or password."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(dsn)
    except Exception:  # psycopg.ProgrammingError: the store factory reports it, naming the field
        return "PostgreSQL"
    host = info.get("host") or info.get("hostaddr") or "localhost"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or info.get('user') or ''}"


async def require_postgres_layout(dsn: str, schema: str, *, read_only: bool) -> None:
    """Refuse a schema that does not exist or holds no threadline tables (opening the store would create
    them); with ``read_only``, also a layout that opening would migrate. Reads the catalog only."""
    import psycopg

    from ..store.postgres import POSTGRES_SCHEMA_VERSION, validate_schema

    validate_schema(schema)
    where = postgres_where(dsn)
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=10)
    except psycopg.Error as error:
        raise AgentStoreUnavailableError(
            f"PostgreSQL at {where}: cannot connect ({first_sentence(str(error))})"
        ) from None
    try:
        found = await conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,))
        if await found.fetchone() is None:
            raise AgentStoreUnavailableError(
                f"no schema {schema!r} in PostgreSQL {where} (nothing was created); --schema names an existing one"
            )
        meta = await conn.execute("SELECT to_regclass(format('%%I.threadline_meta', %s::text))", (schema,))
        row = await meta.fetchone()
        if row is None or row[0] is None:
            raise AgentStoreUnavailableError(
                f"schema {schema!r} in PostgreSQL {where} holds no threadline tables (nothing was created)"
            )
        if read_only:
            from psycopg import sql

            query = sql.SQL("SELECT value FROM {}.threadline_meta WHERE key = 'schema_version'").format(
                sql.Identifier(schema)
            )
            version = await (await conn.execute(query)).fetchone()
            if version is None or str(version[0]) != str(POSTGRES_SCHEMA_VERSION):
                raise AgentStoreUnavailableError(
                    f"schema {schema!r} in PostgreSQL {where} holds threadline layout version "
                    f"{version[0] if version else '?'}, not {POSTGRES_SCHEMA_VERSION}; inspect only reads, so it "
                    "does not migrate it (any command that writes, e.g. threadline recover, does)"
                )
    finally:
        await conn.close()


# ------------------------------------------------------------------------------------------- models


@dataclass
class ModelChoice:
    """The model a command runs with: ``model`` is a pydantic-ai ``Model`` or model name; ``label`` is what
    the screen says about it."""

    model: Any
    label: str
    scripted: ScriptedModel | None = None


def choose_model(name: str | None, base_url: str | None, *, pace: float = 0.0) -> ModelChoice:
    """The built-in scripted model (no ``--model``), a pydantic-ai model name such as
    ``openai:gpt-4.1-mini``, or ``name`` served by the OpenAI-compatible server at ``base_url``."""
    if base_url is not None:
        if not name:
            raise CliUsageError("--base-url needs --model NAME (the model's name on that server)")
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        bare = name.removeprefix("openai:")
        provider = OpenAIProvider(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "not-needed"))
        return ModelChoice(OpenAIChatModel(bare, provider=provider), f"{bare} at {base_url}")
    if name:
        return ModelChoice(name, name)
    from .scripted import ScriptedModel

    scripted = ScriptedModel(pace=pace)
    return ModelChoice(scripted.model, "threadline's built-in scripted model (offline)", scripted)


def check_reachable(base_url: str, timeout: float = 5.0) -> None:
    """Refuse an OpenAI-compatible server that does not accept a connection, naming its URL (before
    anything is written). Only connects: the server's answers are the model's business."""
    import socket
    from urllib.parse import urlsplit

    from ..models import AgentModelUnavailableError

    try:
        parts = urlsplit(base_url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as error:
        raise CliUsageError(f"--base-url {base_url!r} is not a URL: {error}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise CliUsageError(f"--base-url {base_url!r} is not an http:// or https:// URL")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise AgentModelUnavailableError(f"cannot reach the model server at {base_url}: {reason}") from None


def first_sentence(message: str) -> str:
    """The first sentence of an error message, on one line (pydantic-ai's credential errors go on with
    advice that does not apply here)."""
    one_line = " ".join(message.split())
    head = re.split(r"(?<=[.!?])\s+(?=[A-Z])", one_line, maxsplit=1)[0]
    return head or one_line


def check_model(choice: ModelChoice, name: str) -> None:
    """Build the model now (reads the provider's credentials), so a missing key is reported before
    anything is written. Raises :class:`AgentModelUnavailableError` naming the environment variable."""
    from ..models import AgentModelUnavailableError, define_model_registry

    registry = define_model_registry(models={name: {"model": choice.model, "context_window": None}})
    try:
        registry.preflight(name)
    except AgentModelUnavailableError as error:
        raise AgentModelUnavailableError(first_sentence(str(error))) from None


# -------------------------------------------------------------------------------------------- tools


def lookup_tool() -> AgentTool:
    from ..tools import define_agent_tool
    from .scripted import NOTES

    @define_agent_tool
    async def lookup(topic: str) -> str:
        """Look up notes about a city (offline notes: Lisbon, Porto)."""
        facts = NOTES.get(topic.strip().lower())
        return f"{topic}: {facts}" if facts else f"{topic}: no notes"

    return lookup


def clock_tool() -> AgentTool:
    from ..tools import define_agent_tool

    @define_agent_tool
    async def current_time() -> str:
        """The current date and time (UTC)."""
        return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")

    return current_time


# ------------------------------------------------------------------------------------------ runtime


def build_runtime(
    store: AgentRuntimeStore,
    model: Any,
    *,
    model_name: str = "model",
    policy: str | Callable[[Any], str] = "queue",
    tools: Sequence[AgentTool] = (),
    publish: Callable[[Any], Any] | None = None,
    operator_publish: Callable[[Any], Any] | None = None,
    owner_id: str | None = None,
    checkpoint_every_events: int = 20,
    coalesce_pending: bool = False,
    lease_duration: float | None = None,
    instructions: str = "You are a concise assistant. Answer in a few sentences.",
) -> AgentRuntime:
    """A runtime over ``store`` with one model (a pydantic-ai ``Model`` or name) and ``tools``."""
    from ..models import define_model_registry
    from ..protocol import define_agent_protocol
    from ..runtime import create_agent_runtime

    registry = define_model_registry(models={model_name: {"model": model, "context_window": None}})
    # every CLI input carries the same context, so a run another process admitted (a second chat window
    # on the conversation, a `threadline worker`) can be executed here when it queues behind our run
    runs: dict[str, Any] = {
        "input_policy": policy,
        "coalesce_pending": coalesce_pending,
        "resolve_context": lambda _run: CliContext(),
    }
    if owner_id is not None:
        runs["owner_id"] = owner_id
    if lease_duration is not None:
        runs["lease_duration"] = lease_duration
    return create_agent_runtime(
        protocol=define_agent_protocol(context=CliContext),
        store=store,
        models={"preflight": lambda: registry.preflight(model_name), "resolve": lambda: registry.resolve(model_name)},
        prompt=lambda _ctx: instructions,
        tools=list(tools),
        runs=runs,
        loop={"checkpoint_every_events": checkpoint_every_events},
        publish=publish,
        operator_publish=operator_publish,
    )
