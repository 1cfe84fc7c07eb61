"""Running the failing check: a shell command (e.g. `pytest -q`) on a copy of the repository inside the
sandbox jail (no network, the repository's files only, the config's limits), with `python`, `python3`
and `pytest` on PATH and the repository's pure-Python dependencies from the host's installed packages
(bound read-only) or a folder of wheels (imported from the zip files). Owns the job script, the
pytest summary parser and the result; not the agent (`agent`) or the repository on disk (`repo`).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.envs.tools import InfraError
from posttrain.sandbox import ExecStatus, Job, Limits
from posttrain.sandbox.isolation import PROFILES, STDLIB_PRELOAD, Profile, python_install, register_profile

REPO_DIR = "repo"  # the copy's folder inside the job dir
DEPS_DIR = ".ptdeps"  # wheels, inside the job dir
PYTEST_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "py")
MAX_LOG_BYTES = 1 << 20
MAX_RETURNED_BYTES = 4 << 20
SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


@dataclass
class CheckResult:
    """One run of the check. `passed` is strict: the command exited 0 within every limit."""

    passed: bool
    status: str  # the sandbox's ExecStatus value
    exit_code: int | None
    log: str  # stdout and stderr, interleaved as written
    counts: dict[str, int] = field(default_factory=dict)  # pytest's summary, when it printed one
    wall_s: float = 0.0
    outputs: dict[str, bytes] = field(default_factory=dict)  # files the command created or changed

    def summary(self) -> dict[str, Any]:
        """`ok`: the check passed (strict); then the exit code, the sandbox status and pytest's counts."""
        return {"ok": self.passed, "exit_code": self.exit_code, "status": self.status, **self.counts}

    def headline(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items()) or "no pytest summary"
        state = "PASSED" if self.passed else "FAILED"
        return f"check {state} (status {self.status}, exit code {self.exit_code}; {counts})"


def pytest_counts(log: str) -> dict[str, int]:
    """The counts of pytest's last summary line ("1 failed, 3 passed in 0.05s"), or {} without one."""
    for line in reversed(log.splitlines()):
        if re.search(r"\bin \d+(\.\d+)?s\b", line) and SUMMARY.search(line):
            out: dict[str, int] = {}
            for n, what in SUMMARY.findall(line):
                out["errors" if what.startswith("error") else what] = int(n)
            return out
    return {}


def deps_profile(packages: tuple[str, ...] = ()) -> str:
    """The sandbox profile (registered on first use) that exposes pytest and `packages` read-only."""
    wanted = tuple(dict.fromkeys((*PYTEST_PACKAGES, *packages)))
    name = "ci-fix-" + hashlib.sha256(",".join(wanted).encode()).hexdigest()[:10]
    if name not in PROFILES:
        register_profile(Profile(name, tuple(STDLIB_PRELOAD), wanted))
    return name


def job_script(command: str, wheels: list[str]) -> str:
    """The bash job: shims for python/python3/pytest, dependency paths, then the command in the copy."""
    py = python_install().jail_executable
    path = ":".join(["/opt/ptsb/site", *(f"$JOB/{DEPS_DIR}/{w}" for w in wheels)])
    return (
        "set -u\nexec 2>&1\nJOB=$(pwd)\nmkdir -p .ptbin\n"
        f"printf '#!/bin/sh\\nexec {py} \"$@\"\\n' > .ptbin/python\n"
        f"printf '#!/bin/sh\\nexec {py} -m pytest \"$@\"\\n' > .ptbin/pytest\n"
        "cp .ptbin/python .ptbin/python3\nchmod +x .ptbin/*\n"
        f'export PATH="$JOB/.ptbin:$PATH" PYTHONPATH="{path}" PYTHONDONTWRITEBYTECODE=1\n'
        f"cd {REPO_DIR}\n{command}\n"
    )


class CheckRunner:
    """Runs `command` on a copy of given repository files in `sandbox`.

    `extra_files` (binary files of the repository) travel with every run; `wheels` maps a wheel's file
    name to its bytes; `packages` names host packages made visible read-only."""

    def __init__(
        self,
        sandbox: Any,
        command: str,
        extra_files: dict[str, bytes] | None = None,
        wheels: dict[str, bytes] | None = None,
        packages: tuple[str, ...] = (),
        wall_time_s: float = 600.0,
        max_processes: int = 32,
    ) -> None:
        if not command.strip():
            raise ValueError("the check command is empty")
        self.sandbox = sandbox
        self.command = command
        self.extra_files = dict(extra_files or {})
        self.wheels = dict(wheels or {})
        self.profile = deps_profile(packages)
        self.limits = Limits(
            wall_time_s=wall_time_s,
            cpu_time_s=wall_time_s,
            max_processes=max_processes,
            max_output_bytes=MAX_LOG_BYTES,
            max_returned_files_bytes=MAX_RETURNED_BYTES,
        )

    def job(self, files: dict[str, str], select: list[str] | None = None) -> Job:
        command = self.command + "".join(" " + shlex.quote(s) for s in select or [])
        payload = {f"{REPO_DIR}/{p}": b for p, b in self.extra_files.items()}
        payload.update({f"{REPO_DIR}/{p}": t.encode() for p, t in files.items()})
        payload.update({f"{DEPS_DIR}/{w}": b for w, b in self.wheels.items()})
        return Job(
            code=job_script(command, sorted(self.wheels)),
            language="bash",
            files=payload,
            limits=self.limits,
            profile=self.profile,
        )

    async def run(self, files: dict[str, str], select: list[str] | None = None) -> CheckResult:
        """Run the check on `files`; InfraError when the sandbox itself failed."""
        t0 = time.perf_counter()
        job = self.job(files, select)
        try:
            res = await self.sandbox.run(job)
        except Exception as err:  # noqa: BLE001 - a sandbox that raises is an infrastructure failure
            raise InfraError(f"{type(err).__name__}: {err}") from err
        if res.is_infra_failure:
            raise InfraError(res.error or "sandbox error")
        log = res.stdout_text
        if res.status == ExecStatus.TIMEOUT:
            log += f"\n[posttrain: the check ran past its time limit ({job.limits.wall_time_s:g} s) and was killed]"
        elif res.status == ExecStatus.OUTPUT_TRUNCATED:
            log += f"\n[posttrain: the check wrote more than {MAX_LOG_BYTES} bytes and was killed]"
        elif res.status == ExecStatus.MEMORY_EXCEEDED:
            log += "\n[posttrain: the check ran out of memory]"
        prefix = REPO_DIR + "/"
        outputs = {
            p[len(prefix) :]: b
            for p, b in res.files.items()
            if p.startswith(prefix) and "__pycache__/" not in p and not p.endswith(".pyc")
        }
        return CheckResult(
            passed=res.status == ExecStatus.OK and res.exit_code == 0,
            status=res.status.value,
            exit_code=res.exit_code,
            log=log,
            counts=pytest_counts(log),
            wall_s=time.perf_counter() - t0,
            outputs=outputs,
        )


def read_wheels(folder: str | Path) -> dict[str, bytes]:
    """The `*.whl` files of `folder` (ValueError when it is not a folder or holds none)."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"--wheels {folder}: not a folder")
    wheels = {p.name: p.read_bytes() for p in sorted(path.glob("*.whl"))}
    if not wheels:
        raise ValueError(f"--wheels {folder}: no .whl files in it")
    return wheels
