"""`posttrain sandbox run|doctor|serve`: run a file in the jail, report isolation layers, serve
the sandbox over HTTP. The sandbox itself lives in `posttrain.sandbox`; this module only parses
arguments and prints."""

from __future__ import annotations

import secrets
import signal
import sys
from pathlib import Path

import typer
from rich.markup import escape

from posttrain.cli.common import EXIT_USAGE, console, err_console, fail, print_json_last
from posttrain.config import SandboxConfig

app = typer.Typer(
    help="Run untrusted code in the isolated sandbox.", no_args_is_help=True, rich_markup_mode=None
)

_DEFAULTS = SandboxConfig()
EXTENSIONS = {
    ".py": "python",
    ".sh": "bash",
    ".bash": "bash",
    ".c": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
}


MIN_MEMORY_MB = 16  # below this a limit cannot tell a job's own allocations from the interpreter's start


def _text_or_base64(out: dict, key: str, data: bytes) -> None:
    """out[key] = the text when `data` is UTF-8, else out[key + "_base64"] = base64 of the bytes."""
    import base64

    try:
        out[key] = data.decode("utf-8")
    except UnicodeDecodeError:
        out[key] = None
        out[key + "_base64"] = base64.b64encode(data).decode("ascii")


@app.command("run")
def run(
    file: Path = typer.Argument(..., help="source file to execute"),
    language: str | None = typer.Option(
        None, "--language", "-l", help="python|bash|c|cpp (default: from extension)"
    ),
    stdin_file: Path | None = typer.Option(None, "--stdin", help="file fed to the job's stdin"),
    wall_time_s: float = typer.Option(5.0, "--wall", min=0.01, help="wall-clock limit in seconds"),
    memory_mb: int = typer.Option(
        512,
        "--memory-mb",
        min=MIN_MEMORY_MB,
        help="memory the job may allocate beyond the interpreter's start, in MiB",
    ),
    profile: str = typer.Option("default", "--profile", help="warm pool profile, e.g. default or numpy"),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="print the result as one JSON object, last (stdout and "
        "stderr as text, or as *_base64 when they are not UTF-8)",
    ),
    allow_unisolated: bool = typer.Option(False, "--allow-unisolated", help="run even without namespaces"),
) -> None:
    """Run FILE in the sandbox and print its stdout/stderr. Exit status: 0 when the job ran and exited 0,
    1 when it failed (its own exit code, signal and status are printed), 2 for a usage error."""
    from posttrain.sandbox import Job, Limits, LocalSandbox, SandboxUnavailable
    from posttrain.sandbox.api import LANGUAGES, result_to_dict

    if not file.is_file():
        fail(f"no such file: {file}", EXIT_USAGE)
    if language is not None and language not in LANGUAGES:
        fail(f"unknown language '{language}'; --language is one of: {', '.join(LANGUAGES)}", EXIT_USAGE)
    lang = language or EXTENSIONS.get(file.suffix)
    if lang not in LANGUAGES:
        fail(
            f"cannot tell the language of '{file.name}' from its extension; pass --language one of: "
            f"{', '.join(LANGUAGES)}",
            EXIT_USAGE,
        )
    raw = file.read_bytes()
    try:
        code = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        fail(
            f"{file} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); save it as UTF-8",
            EXIT_USAGE,
        )
    if stdin_file is not None and not stdin_file.is_file():
        fail(f"no such --stdin file: {stdin_file}", EXIT_USAGE)
    job = Job(
        code=code,
        language=lang,
        stdin=stdin_file.read_bytes() if stdin_file else b"",
        limits=Limits(wall_time_s=wall_time_s, cpu_time_s=wall_time_s, memory_bytes=memory_mb << 20),
        profile=profile,
    )
    try:
        with LocalSandbox(pool_size=1, allow_unisolated=allow_unisolated) as sb:
            res = sb.run_blocking(job)
    except (SandboxUnavailable, ValueError) as err:
        fail(str(err), EXIT_USAGE)
    if json_out:
        out = result_to_dict(res)
        _text_or_base64(out, "stdout", res.stdout)
        _text_or_base64(out, "stderr", res.stderr)
        out["files_base64"] = out.pop("files")
        print_json_last(out)
    else:
        sys.stdout.buffer.write(res.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(res.stderr)
        sys.stderr.flush()
        err_console.print(
            escape(
                f"status={res.status.value} exit={res.exit_code} signal={res.signal} "
                f"wall={res.wall_ms:.1f}ms cpu={res.cpu_ms:.1f}ms rss={res.max_rss_bytes >> 20}MiB"
                f"{' ' + res.error if res.error else ''}"
            ),
            style="dim",
            highlight=False,
        )
    raise typer.Exit(0 if res.status.value == "ok" and res.exit_code == 0 else 1)


@app.command("doctor")
def doctor(json_out: bool = typer.Option(False, "--json", help="print the report as JSON, last")) -> None:
    """Report which isolation layers are active (a worker is really started to confirm seccomp)."""
    from rich.table import Table

    from posttrain.sandbox import Job, LocalSandbox, SandboxUnavailable
    from posttrain.sandbox import isolation as iso_mod

    iso = iso_mod.detect()
    probe: dict = {}
    if iso.isolated:
        try:
            with LocalSandbox(pool_size=1) as sb:
                res = sb.run_blocking(Job(code="import os; print(os.getuid(), len(os.environ))"))
                probe = {
                    "job_status": res.status.value,
                    "job_stdout": res.stdout_text.strip(),
                    "worker": sb.worker_info,
                }
        except SandboxUnavailable as err:
            probe = {"error": str(err)}
    rows = [
        ("namespaces (bwrap)", iso.namespaces, iso.details.get("namespaces", iso.bwrap or "")),
        (
            "seccomp filter",
            iso.seccomp,
            iso.details.get(
                "seccomp",
                "verified by a worker self-test" if probe.get("worker", {}).get("seccomp") == "on" else "",
            ),
        ),
        (
            f"cgroups {iso.cgroups or 'v1/v2'} (memory, pids)",
            bool(iso.cgroups),
            iso.details.get("cgroups", ""),
        ),
        ("uid drop", iso.uid_drop, iso.details.get("uid_drop", "one unprivileged uid per worker slot")),
        ("rlimits", True, "AS, DATA, CPU, FSIZE, NOFILE, NPROC, CORE=0 per job"),
        ("clean environment", True, "jobs see a fixed 9-variable environment"),
    ]
    if json_out:
        print_json_last(
            {
                "layers": iso.layers,
                "missing": iso.missing,
                "isolated": iso.isolated,
                "cgroups": iso.cgroups,
                "cgroups_detail": iso.details.get("cgroups", ""),
                "probe": probe,
            }
        )
        return
    table = Table(title="posttrain sandbox doctor")
    table.add_column("layer")
    table.add_column("active")
    table.add_column("detail")
    for name, active, detail in rows:
        table.add_row(name, "[green]yes[/]" if active else "[bold red]NO[/]", detail)
    console.print(table)
    if probe.get("error"):
        console.print(f"[bold red]probe job failed:[/] {escape(str(probe['error']))}", highlight=False)
    elif probe:
        worker = probe["worker"]
        console.print(
            f"probe job: status {probe['job_status']}; worker pid {worker.get('pid')} uid "
            f"{worker.get('uid')} python {worker.get('python')}, {len(worker.get('preloaded', []))} "
            "modules pre-imported",
            highlight=False,
        )
    if not iso.isolated:
        console.print(
            "[bold red]WARNING: no namespace isolation; untrusted code will be refused unless "
            "sandbox.allow_unisolated=true[/]"
        )


@app.command("serve")
def serve(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8765, "--port"),
    token: str | None = typer.Option(
        None,
        "--token",
        envvar="POSTTRAIN_SANDBOX_TOKEN",
        help="bearer token clients must send (default: a random one, printed)",
    ),
    pool_size: int = typer.Option(0, "--pool-size", help="workers per profile (0 = CPU count)"),
    max_request_mb: int = typer.Option(_DEFAULTS.max_request_mb, "--max-request-mb"),
    max_concurrent: int = typer.Option(
        _DEFAULTS.max_concurrent_jobs,
        "--max-concurrent",
        min=1,
        help="jobs executing at once (a batch of N jobs counts N)",
    ),
    max_wall_s: float = typer.Option(
        _DEFAULTS.service_max_wall_time_s,
        "--max-wall-s",
        min=0.01,
        help="a job asking for more wall or CPU time is refused (400)",
    ),
    max_memory_mb: int = typer.Option(
        _DEFAULTS.service_max_memory_mb,
        "--max-memory-mb",
        min=16,
        help="largest per-job memory limit a client may ask for",
    ),
    max_processes: int = typer.Option(
        _DEFAULTS.service_max_processes,
        "--max-processes",
        min=1,
        help="largest per-job process count a client may ask for",
    ),
    request_timeout_s: float = typer.Option(
        _DEFAULTS.request_timeout_s,
        "--request-timeout-s",
        min=0.1,
        help="bound on reading a request and writing its reply",
    ),
) -> None:
    """Serve the sandbox over HTTP (POST /run, POST /run_batch, GET /health). Jobs whose limits exceed the
    service's maxima are refused with a 400 that names the limit."""
    import dataclasses

    from posttrain.sandbox import LocalSandbox, SandboxUnavailable
    from posttrain.sandbox.remote import DEFAULT_MAX_LIMITS, make_server

    token = token or secrets.token_urlsafe(24)
    maxima = dataclasses.replace(
        DEFAULT_MAX_LIMITS,
        wall_time_s=max_wall_s,
        cpu_time_s=max_wall_s,
        memory_bytes=max_memory_mb << 20,
        max_processes=max_processes,
    )
    try:
        sb = LocalSandbox(pool_size=pool_size)
        sb.warm()
        srv = make_server(
            sb, host, port, token, max_request_mb << 20, max_concurrent, maxima, request_timeout_s
        )
    except (SandboxUnavailable, OSError, ValueError) as err:
        fail(str(err))
    console.print(
        f"sandbox service on {srv.url}  token: {token}  layers: {', '.join(sb.layers)}", highlight=False
    )

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT and SIGTERM stop the service cleanly, even when started with SIGINT ignored (a shell's background job)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
        sb.close_blocking()
