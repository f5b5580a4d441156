"""Fail closed where descriptor-anchored containment is impossible: construction raises a typed refusal naming
the platform and what is missing. The platform is simulated by changing what the check reads (the platform
name, the open flags, ``dir_fd`` support, the ``/proc/self/fd`` location); on this Linux host nothing is
missing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from threadline import APP_ERROR_STATUS
from threadline.coding import (
    AgentCodingPlatformError,
    Workspace,
    create_agent_coding_tools,
    workspace as workspace_module,
)
from threadline.tools import error_envelope


def build(root: Path) -> None:
    create_agent_coding_tools(root=root, authorize=lambda payload: True)


def test_this_linux_host_has_everything_the_descriptor_walk_needs(workspace: Path) -> None:
    assert workspace_module.descriptor_platform_gaps() == []
    assert {t.name for t in create_agent_coding_tools(root=workspace, authorize=lambda payload: True)} >= {
        "read_file",
        "search_files",
    }


def test_an_unqualified_platform_refuses_construction_naming_it(monkeypatch, workspace: Path) -> None:
    monkeypatch.setattr(sys, "platform", "freebsd14")
    with pytest.raises(AgentCodingPlatformError) as raised:
        build(workspace)
    error = raised.value
    assert error.platform == "freebsd14" and "freebsd14" in str(error)
    assert error.code == "SERVICE_UNAVAILABLE" and error.status == APP_ERROR_STATUS["SERVICE_UNAVAILABLE"] == 503
    assert error.details["platform"] == "freebsd14" and any("Linux" in m for m in error.details["missing"])
    assert error.hint
    envelope = error_envelope(error)
    assert envelope["error"] == "SERVICE_UNAVAILABLE" and str(workspace) not in str(envelope)


def test_missing_proc_self_fd_refuses(monkeypatch, workspace: Path, tmp_path: Path) -> None:
    monkeypatch.setattr(workspace_module, "PROC_FD", str(tmp_path / "no-proc" / "self" / "fd"))
    with pytest.raises(AgentCodingPlatformError) as raised:
        Workspace(workspace)
    assert raised.value.missing == [str(tmp_path / "no-proc" / "self" / "fd")]
    assert raised.value.platform == sys.platform


def test_a_proc_fd_that_does_not_name_our_descriptors_refuses(monkeypatch, workspace: Path, tmp_path: Path) -> None:
    # a directory that exists but is not this process's descriptor table (numbered entries are absent)
    fake = tmp_path / "fake-fd"
    fake.mkdir()
    monkeypatch.setattr(workspace_module, "PROC_FD", str(fake))
    with pytest.raises(AgentCodingPlatformError):
        build(workspace)


@pytest.mark.parametrize("flag", ["O_DIRECTORY", "O_NOFOLLOW", "O_CLOEXEC", "O_NONBLOCK"])
def test_a_missing_open_flag_refuses(monkeypatch, workspace: Path, flag: str) -> None:
    monkeypatch.delattr(os, flag)
    with pytest.raises(AgentCodingPlatformError) as raised:
        build(workspace)
    assert f"os.{flag}" in raised.value.missing


def test_missing_dir_fd_support_refuses(monkeypatch, workspace: Path) -> None:
    monkeypatch.setattr(os, "supports_dir_fd", os.supports_dir_fd - {os.link})
    monkeypatch.setattr(os, "supports_fd", os.supports_fd - {os.scandir})
    with pytest.raises(AgentCodingPlatformError) as raised:
        build(workspace)
    assert raised.value.missing == ["dir_fd support in os.link", "os.scandir of a descriptor"]
