"""The extras stay optional: ``import threadline`` and ``import threadline.harness`` import neither Starlette,
uvicorn nor PyYAML, and a missing extra raises an ImportError naming its ``pip install`` line."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_threadline_and_the_harness_imports_no_extra() -> None:
    probe = run(
        "import sys, threadline, threadline.harness\n"
        "print(sorted(m for m in ('starlette', 'uvicorn', 'yaml', 'websockets') if m in sys.modules))"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


def test_a_missing_server_extra_names_the_install_line() -> None:
    probe = run("import sys\nsys.modules['starlette'] = None\nimport threadline.server")
    assert probe.returncode != 0
    assert "pip install 'threadline[server]'" in probe.stderr


def test_a_missing_yaml_names_the_install_line() -> None:
    probe = run(
        "import sys\nsys.modules['yaml'] = None\n"
        "from threadline.harness.file_resources import skill_metadata\n"
        "skill_metadata('---\\nname: x\\ndescription: y\\n---\\n', 'a:SKILL.md')"
    )
    assert probe.returncode != 0
    assert "pip install 'threadline[harness]'" in probe.stderr
