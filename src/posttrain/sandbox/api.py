"""The sandbox contract: what a job is, what comes back, and the `Sandbox` interface.

Every backend (local warm pool, remote HTTP client) implements `Sandbox`. Callers treat
`ExecStatus.SANDBOX_ERROR` as an infrastructure failure: excluded from training and counted,
never scored 0. No torch here.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class ExecStatus(enum.StrEnum):
    """How a job ended. TIMEOUT: wall or CPU limit. MEMORY_EXCEEDED: MemoryError, std::bad_alloc, a
    segfault at >= 80% of the memory limit, or the worker cgroup's OOM killer. OUTPUT_TRUNCATED: stdout
    or stderr passed max_output_bytes (the job is killed then). KILLED: SIGKILL not caused by a limit.
    RUNTIME_ERROR: non-zero exit or any other signal. SANDBOX_ERROR: the infrastructure failed."""

    OK = "ok"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MEMORY_EXCEEDED = "memory_exceeded"
    OUTPUT_TRUNCATED = "output_truncated"
    KILLED = "killed"
    COMPILE_ERROR = "compile_error"
    SANDBOX_ERROR = "sandbox_error"


# the Limits fields that must be positive (max_returned_files_bytes may be 0)
POSITIVE_LIMITS = (
    "wall_time_s",
    "cpu_time_s",
    "memory_bytes",
    "max_processes",
    "max_output_bytes",
    "max_file_bytes",
)


@dataclass
class Limits:
    """Per-job limits. max_processes counts the job's own process; max_output_bytes applies to stdout
    and stderr each; max_file_bytes is per file (RLIMIT_FSIZE); memory_bytes is per process (address
    space) with a per-worker cgroup backstop; network=True needs sandbox.allow_network."""

    wall_time_s: float = 5.0
    cpu_time_s: float = 5.0
    memory_bytes: int = 512 * 1024 * 1024
    max_processes: int = 16
    max_output_bytes: int = 64 * 1024
    max_file_bytes: int = 8 * 1024 * 1024
    network: bool = False
    max_returned_files_bytes: int = 1024 * 1024  # files the job wrote, returned in ExecResult.files


@dataclass
class Job:
    code: str
    language: str = "python"  # "python" | "bash" | "c" | "cpp"
    stdin: bytes = b""
    files: dict[str, bytes] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    profile: str = "default"  # which warm pool: e.g. "default", "numpy"


@dataclass
class ExecResult:
    status: ExecStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    max_rss_bytes: int = 0
    compile_ms: float = 0.0
    files: dict[str, bytes] = field(default_factory=dict)
    error: str = ""  # infrastructure detail when status is SANDBOX_ERROR

    @property
    def is_infra_failure(self) -> bool:
        return self.status == ExecStatus.SANDBOX_ERROR

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")


@runtime_checkable
class Sandbox(Protocol):
    async def run(self, job: Job) -> ExecResult: ...

    async def run_batch(self, jobs: Sequence[Job]) -> list[ExecResult]: ...

    async def close(self) -> None: ...


LANGUAGES = ("python", "bash", "c", "cpp")


def validate_job(job: Job, profiles: Any = None, gcc: bool = True) -> None:
    """Raise ValueError naming the bad field of `job` (checked before it is queued)."""
    if not isinstance(job.code, str):
        raise ValueError(f"Job.code must be str, got {type(job.code).__name__}")
    if job.language not in LANGUAGES:
        raise ValueError(f"unknown language '{job.language}'; choose one of: {', '.join(LANGUAGES)}")
    if job.language in ("c", "cpp") and not gcc:
        raise ValueError(f"language '{job.language}' needs gcc/g++, which is not installed")
    if profiles is not None and job.profile not in profiles:
        raise ValueError(f"unknown sandbox profile '{job.profile}'; known: {', '.join(profiles)}")
    if not isinstance(job.stdin, bytes | bytearray):
        raise ValueError(f"Job.stdin must be bytes, got {type(job.stdin).__name__}")
    for name, data in job.files.items():
        parts = name.split("/")
        if not name or name.startswith("/") or ".." in parts or "" in parts or name.startswith(".tmp"):
            raise ValueError(f"Job.files name {name!r} must be a relative path inside the job dir")
        if not isinstance(data, bytes | bytearray):
            raise ValueError(f"Job.files[{name!r}] must be bytes, got {type(data).__name__}")
    lim = job.limits
    for key in POSITIVE_LIMITS:
        value = getattr(lim, key)
        if not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"Limits.{key} must be a positive number, got {value!r}")
    if lim.max_returned_files_bytes < 0:
        raise ValueError(f"Limits.max_returned_files_bytes must be >= 0, got {lim.max_returned_files_bytes}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a base64 string")
    return base64.b64decode(text.encode("ascii"), validate=True)


def job_to_dict(job: Job) -> dict:
    """JSON-ready form (bytes as base64) used by the remote service."""
    return {
        "code": job.code,
        "language": job.language,
        "stdin": _b64(job.stdin),
        "files": {k: _b64(v) for k, v in job.files.items()},
        "argv": list(job.argv),
        "limits": dataclasses.asdict(job.limits),
        "profile": job.profile,
    }


def job_from_dict(data: Any) -> Job:
    """Inverse of `job_to_dict`, for untrusted input: ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError("a job must be a JSON object")
    unknown = set(data) - {"code", "language", "stdin", "files", "argv", "limits", "profile"}
    if unknown:
        raise ValueError(f"unknown job fields: {sorted(unknown)}")
    limits_in = data.get("limits") or {}
    known = {f.name for f in dataclasses.fields(Limits)}
    if not isinstance(limits_in, dict) or set(limits_in) - known:
        raise ValueError(f"limits must be an object with keys among {sorted(known)}")
    files = data.get("files") or {}
    argv = data.get("argv") or []
    if not isinstance(files, dict) or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("files must be an object of base64 strings and argv a list of strings")
    job = Job(
        code=data.get("code"),
        language=data.get("language", "python"),
        stdin=_unb64(data.get("stdin", ""), "stdin"),
        files={str(k): _unb64(v, f"files[{k!r}]") for k, v in files.items()},
        argv=argv,
        limits=Limits(**limits_in),
        profile=data.get("profile", "default"),
    )
    validate_job(job)
    return job


def result_to_dict(res: ExecResult) -> dict:
    out = dataclasses.asdict(res)
    out["status"] = res.status.value
    out["stdout"], out["stderr"] = _b64(res.stdout), _b64(res.stderr)
    out["files"] = {k: _b64(v) for k, v in res.files.items()}
    return out


def result_from_dict(data: dict) -> ExecResult:
    data = dict(data)
    data["status"] = ExecStatus(data["status"])
    data["stdout"], data["stderr"] = _unb64(data["stdout"], "stdout"), _unb64(data["stderr"], "stderr")
    data["files"] = {k: _unb64(v, k) for k, v in data.get("files", {}).items()}
    return ExecResult(**data)


def run_sync(sandbox: Sandbox, job: Job) -> ExecResult:
    """Blocking wrapper for callers outside an event loop."""
    return asyncio.run(sandbox.run(job))
