"""Shared pytest fixtures for the threadline test suite.

PostgreSQL tests use the ``postgres_dsn`` fixture, and ``schema`` for a fresh schema name (the schema is
dropped after the test). It reads ``THREADLINE_TEST_POSTGRES_DSN``
(default ``postgresql://postgres@127.0.0.1:5432/test``) and skips with the reason when no server
answers there — unless ``THREADLINE_REQUIRE_POSTGRES=1`` (set by ``.ci/run``), in which case the
skip becomes a failure.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import pytest

DEFAULT_POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """The DSN of a reachable PostgreSQL test database."""
    dsn = os.environ.get("THREADLINE_TEST_POSTGRES_DSN") or DEFAULT_POSTGRES_DSN
    try:
        import psycopg

        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        reason = f"PostgreSQL not reachable at {dsn}: {exc}"
        if os.environ.get("THREADLINE_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return dsn


@pytest.fixture
async def schema(postgres_dsn: str) -> AsyncIterator[str]:
    """A fresh schema name; the schema (if created) is dropped after the test."""
    import psycopg

    name = f"threadline_test_{uuid.uuid4().hex}"
    yield name
    async with await psycopg.AsyncConnection.connect(postgres_dsn, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
