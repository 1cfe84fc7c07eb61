"""Graders: run a solution against assert-style tests or stdin/stdout cases, with per-test results.

The verdict never comes from the process that runs the solution. `runner_job` builds one job whose
code is a trusted runner: it reads and deletes its spec, makes itself non-dumpable (so no same-uid
process can open its /proc fds or memory), then starts the solution in a separate "subject"
interpreter (`python -I -S` by posix_spawn: it inherits only its two protocol pipe ends and a log pipe
for stdout/stderr that the runner only logs, in its own session) and evaluates every test itself. The runner's test code sees the solution only through proxies: a call
sends (name, args) over a pipe and gets back a value in a restricted data format (None, bool, int,
float, str, bytes, list, tuple, dict, set, frozenset; never pickle, never an object of the solution's
own class), so an `__eq__` that always says True, a patched `builtins` or `unittest`, an import hook,
`sys.exit`/`os._exit`, frame or gc digging and fake output all stay inside the subject. The subject
dying, exiting, hanging or sending garbage fails the test it served and is restarted for the next one.
The runner writes all results once, in one line tagged with a per-job nonce the subject never holds;
`read_runner_result` takes exactly one such line and only when the job ended OK with exit status 0.

Residual risk: a solution can still return correct values it looked up rather than computed (tests
that are public, like HumanEval's, can be memorised), signal or stop the runner (which fails its own
job, never passes it), and burn its time budget. Values cross by copy: a test that relies on the
solution mutating its arguments in place sees no mutation.

`grade_asserts(sandbox, solution_code, tests, limits=None)` grades assert strings (e.g.
`assert f(2) == 4`) this way; the solution's public names that are not builtins are bound as proxies.
`grade_io(sandbox, code, cases, ...)` runs one job per (stdin, expected) case (any language) and
compares output ignoring trailing whitespace, with optional float tolerance. `GradeResult(passed,
total, fraction, per_test, status, infra_failure, detail)`: when `infra_failure` is True the sandbox
failed and the sample must be excluded, never scored 0. It does not decide rewards.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.sandbox.api import ExecResult, ExecStatus, Job, Limits, Sandbox

SPEC_FILE = ".grading_spec.json"
RESULT_MARKER = "@@POSTTRAIN_RUNNER_RESULTS@@"

# The value format: the runner sends requests as marshal (it alone writes them; the subject only reads
# them), the subject replies with tagged JSON text it builds by hand (so it imports nothing: its start
# is the interpreter's), and the runner decodes replies with `json` plus `_dec`, which builds nothing
# but exact builtin types. Encoding turns subclasses (defaultdict, namedtuple, IntEnum, numpy values)
# into plain builtins.
_DECODE = r"""
_MAX_DEPTH = 100
_MAX_MESSAGE = 32 << 20


def _dec(x, depth=0):
    if depth > _MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is dict and len(x) == 1:
        ((k, v),) = x.items()
        if k == "b" and type(v) is str:
            return bytes.fromhex(v)
        if type(v) is list:
            if k == "l":
                return [_dec(i, depth + 1) for i in v]
            if k == "t":
                return tuple([_dec(i, depth + 1) for i in v])
            if k == "s":
                return set([_dec(i, depth + 1) for i in v])
            if k == "f":
                return frozenset([_dec(i, depth + 1) for i in v])
            if k == "d":
                out = {}
                for pair in v:
                    if type(pair) is not list or len(pair) != 2:
                        raise ValueError("malformed dict entry")
                    out[_dec(pair[0], depth + 1)] = _dec(pair[1], depth + 1)
                return out
    raise ValueError("malformed value")
"""

# The subject: serves import / attr / names / call requests for the untrusted code, nothing else.
SUBJECT_SOURCE = r"""
import marshal, os, sys

_MAX_DEPTH = 100
_ESC = {i: "\\u%04x" % i for i in (*range(32), *range(0xD800, 0xE000))}
_ESC.update({34: '\\"', 92: "\\\\"})


def _js(s):
    return '"' + str.translate(str.__str__(s), _ESC) + '"'


def _enc(x, depth=0):
    if depth > _MAX_DEPTH:
        raise ValueError("value nested more than %d levels" % _MAX_DEPTH)
    if x is None:
        return "null"
    if x is True or x is False:
        return "true" if x else "false"
    if isinstance(x, int):
        return int.__repr__(int.__index__(x))
    if isinstance(x, float):
        f = float.__float__(x)
        if f != f:
            return "NaN"
        if f in (float("inf"), float("-inf")):
            return "Infinity" if f > 0 else "-Infinity"
        return float.__repr__(f)
    if isinstance(x, str):
        return _js(x)
    if isinstance(x, (bytes, bytearray)):
        return '{"b":"' + bytes(x).hex() + '"}'
    d = depth + 1
    if isinstance(x, list):
        return '{"l":[' + ",".join([_enc(v, d) for v in list.__iter__(x)]) + "]}"
    if isinstance(x, tuple):
        return '{"t":[' + ",".join([_enc(v, d) for v in tuple.__iter__(x)]) + "]}"
    if isinstance(x, dict):
        return '{"d":[' + ",".join(["[" + _enc(k, d) + "," + _enc(v, d) + "]" for k, v in dict.items(x)]) + "]}"
    if isinstance(x, frozenset):
        return '{"f":[' + ",".join([_enc(v, d) for v in frozenset.__iter__(x)]) + "]}"
    if isinstance(x, set):
        return '{"s":[' + ",".join([_enc(v, d) for v in set.__iter__(x)]) + "]}"
    if type(x).__module__ == "numpy" and callable(getattr(x, "tolist", None)):
        return _enc(x.tolist(), d)
    raise TypeError("a value of type %s cannot be returned (only None, bool, int, float, str, bytes, list, "
                    "tuple, dict, set, frozenset)" % type(x).__name__)


def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _exc(err):
    try:
        import traceback
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))[-4000:]
        msg = str(err)[:2000]
    except BaseException:
        tb, msg = "", "(unprintable)"
    return '"exc":[' + _js(type(err).__name__) + "," + _js(msg) + "," + _js(tb) + "]"


def _resolve(module, name):
    obj = sys.modules.get(module)
    if obj is None:
        __import__(module)
        obj = sys.modules[module]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _describe(obj):
    if isinstance(obj, type(sys)):
        return '{"kind":"module","module":' + _js(obj.__name__) + "}"
    if callable(obj):
        return '{"kind":"callable"}'
    try:
        return '{"kind":"value","value":' + _enc(obj) + "}"
    except (TypeError, ValueError):
        return '{"kind":"opaque"}'


def _serve(req):
    op = req["op"]
    if op == "init":
        sys.path[:] = req["sys_path"]
        if req.get("program") is not None:
            mod = type(sys)("__solution__")
            mod.__file__ = req.get("program_name", "submission.py")
            sys.modules["__solution__"] = mod
            exec(compile(req["program"], mod.__file__, "exec"), mod.__dict__)
        return '"ok":null'
    if op == "import":
        __import__(req["module"])
        return '"ok":null'
    if op == "attr":
        try:
            obj = _resolve(req["module"], req["name"])
        except AttributeError:
            return '"kind":"missing"'
        return _describe(obj)[1:-1]
    if op == "names":
        ns = vars(sys.modules[req["module"]])
        items = ["[" + _js(k) + "," + _describe(v) + "]" for k, v in list(ns.items())
                 if isinstance(k, str) and not k.startswith("__")]
        return '"names":[' + ",".join(items) + "]"
    if op == "call":
        fn = _resolve(req["module"], req["name"])
        return '"ok":' + _enc(fn(*req["args"], **req["kwargs"]))
    raise ValueError("unknown op %r" % op)


def _main():
    rfd, wfd = int(sys.argv[1]), int(sys.argv[2])
    while True:
        try:
            req = marshal.loads(_read_exact(rfd, int.from_bytes(_read_exact(rfd, 4), "big")))
        except EOFError:
            os._exit(0)
        try:
            body = _serve(req)
        except BaseException as err:  # SystemExit and KeyboardInterrupt too: they fail this call only
            body = _exc(err)
        data = ('{"seq":%d,' % req["seq"] + body + "}").encode("utf-8")
        view = memoryview(len(data).to_bytes(4, "big") + data)
        while view:
            view = view[os.write(wfd, view):]


_main()
"""

# The trusted runner: the job's own code. Nothing untrusted ever runs in this process.
RUNNER_SOURCE = (
    r"""
import sys
import posix
sys.path[:] = [p for p in sys.path if p not in ("", ".", posix.getcwd())]  # first: no job file shadows stdlib
"""
    + _DECODE
    + r'''
def _posttrain_runner():
    cwd = posix.getcwd()
    import builtins, ctypes, importlib, importlib.machinery, json, marshal, os, select, signal
    import linecache, time, traceback, types

    def trusted_compile(source, filename):
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
        return compile(source, filename, "exec")

    def test_traceback(err):
        """The traceback from the tests' own frames on (the runner's frames are noise to a reader)."""
        own = trusted_compile.__code__.co_filename
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != own]
        return "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                        *traceback.format_exception_only(type(err), err)])

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        sys.stderr.write("runner: prctl(PR_SET_DUMPABLE) failed\n")
        os._exit(3)
    with open(".grading_spec.json", "rb") as fh:
        spec = json.loads(fh.read())
    os.unlink(".grading_spec.json")
    nonce = spec.pop("nonce")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGPIPE, signal.SIGALRM):
        signal.signal(sig, signal.SIG_IGN)
    timeout_s = float(spec.get("timeout_s") or 1e6)
    proxy_roots = tuple(spec.get("proxy_packages", ()))
    trusted_sources = dict(spec.get("modules", {}))
    subject_path = [os.path.join(cwd, p) for p in spec.get("subject_path", [])] + list(sys.path)
    log_tail = bytearray()
    CAP = 4000

    class SubjectFailed(BaseException):
        """The subject died, hung or broke the protocol: the test it served fails."""

    class TestTimeout(BaseException):
        pass

    class RemoteError(Exception):
        pass

    class Subject:
        def __init__(self):
            req_r, self.req_w = os.pipe()
            self.rep_r, rep_w = os.pipe()
            self.log_r, log_w = os.pipe()
            # posix_spawn (not subprocess: a 5 ms import): every runner fd is close-on-exec except 0-2,
            # which are replaced, and the subject's two protocol ends, made inheritable for this call only.
            null = os.open("/dev/null", os.O_RDONLY)
            os.set_inheritable(req_r, True)
            os.set_inheritable(rep_w, True)
            try:
                self.pid = os.posix_spawn(
                    sys.executable, [sys.executable, "-I", "-S", "-c", spec["subject_source"], str(req_r), str(rep_w)],
                    dict(os.environ), setsid=True,
                    file_actions=[(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, log_w, 1),
                                  (os.POSIX_SPAWN_DUP2, log_w, 2)])
            finally:
                for fd in (req_r, rep_w, log_w, null):
                    os.close(fd)
            self.status = None
            os.set_blocking(self.req_w, False)
            self.seq = 0
            self.log_open = True

        def exit_code(self, block):
            if self.status is None:
                pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
                if pid:
                    self.status = os.waitstatus_to_exitcode(status)
            return self.status

        def close(self):
            for target in (lambda: os.killpg(self.pid, signal.SIGKILL), lambda: os.kill(self.pid, signal.SIGKILL)):
                try:
                    target()
                except OSError:
                    pass
            self.exit_code(True)
            self.drain(0)
            for fd in (self.req_w, self.rep_r, self.log_r):
                try:
                    os.close(fd)
                except OSError:
                    pass

        def drain(self, wait_s):
            while self.log_open:
                ready, _, _ = select.select([self.log_r], [], [], wait_s)
                if not ready:
                    return
                chunk = os.read(self.log_r, 65536)
                if not chunk:
                    self.log_open = False
                    return
                log_tail.extend(chunk)
                del log_tail[:-CAP]

        def request(self, msg, deadline):
            self.seq += 1
            msg["seq"] = self.seq
            try:
                data = marshal.dumps(msg)
            except ValueError as err:
                raise RemoteError("cannot pass these values to the solution: %s" % err) from None
            out = memoryview(len(data).to_bytes(4, "big") + data)
            buf = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    state["timed_out"] = True
                    raise SubjectFailed("timeout after %.1fs" % timeout_s)
                rl = [self.rep_r] + ([self.log_r] if self.log_open else [])
                ready_r, ready_w, _ = select.select(rl, [self.req_w] if out else [], [], left)
                if ready_w:
                    try:
                        out = out[os.write(self.req_w, out):]
                    except OSError:
                        raise SubjectFailed("the solution process exited (exit %s)" % self.exit_code(False)) from None
                if self.log_r in ready_r:
                    self.drain(0)
                if self.rep_r in ready_r:
                    chunk = os.read(self.rep_r, 1 << 20)
                    if not chunk:
                        raise SubjectFailed("the solution process exited (exit %s)" % self.exit_code(True))
                    buf += chunk
                    if len(buf) >= 4:
                        size = int.from_bytes(buf[:4], "big")
                        if size > _MAX_MESSAGE or len(buf) > size + 4:
                            raise SubjectFailed("the solution process broke the protocol")
                        if len(buf) == size + 4:
                            break
            try:
                reply = json.loads(bytes(buf[4:]))
                if type(reply) is not dict or reply.get("seq") != self.seq:
                    raise ValueError("reply out of sequence")
            except Exception:
                raise SubjectFailed("the solution process sent a malformed reply") from None
            exc = reply.get("exc")
            if exc is not None:
                if type(exc) is not list or len(exc) != 3 or not all(type(e) is str for e in exc):
                    raise SubjectFailed("the solution process sent a malformed error")
                cls = getattr(builtins, exc[0], None)
                if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
                    try:
                        err = cls(exc[1])
                    except Exception:
                        err = RemoteError("%s: %s" % (exc[0], exc[1]))
                else:
                    err = RemoteError("%s: %s" % (exc[0], exc[1]))
                err.remote_traceback = exc[2]
                raise err
            return reply

    state = {"subject": None, "failures": 0, "deadline": 0.0, "timed_out": False, "load_error": None}

    def start_subject():
        if state["load_error"] is not None:
            raise RemoteError(state["load_error"])
        signal.setitimer(signal.ITIMER_REAL, timeout_s + 2.5)
        subject = state["subject"] = Subject()
        try:  # the interpreter's start and the program's load get their own budget, once per subject
            subject.request({"op": "init", "sys_path": subject_path, "program": spec.get("program"),
                             "program_name": spec.get("program_name", "submission.py")},
                            time.monotonic() + timeout_s + 2.0)
        except (RemoteError, SubjectFailed) as err:
            if spec.get("program") is not None:  # a program that fails to load fails every test
                state["load_error"] = "the solution failed to load: %s" % err
            raise
        state["deadline"] = time.monotonic() + timeout_s
        signal.setitimer(signal.ITIMER_REAL, timeout_s + 0.25)
        return subject

    def call_subject(msg):
        subject = state["subject"]
        try:
            if subject is None:
                subject = start_subject()
            reply = subject.request(msg, state["deadline"])
        except SubjectFailed:
            state["failures"] += 1
            drop_subject()
            raise
        except RemoteError:
            if state["load_error"] is not None:
                drop_subject()
            raise
        return reply

    def drop_subject():
        if state["subject"] is not None:
            state["subject"].close()
            state["subject"] = None

    def decode(reply, key):
        try:
            return _dec(reply[key])
        except Exception:
            raise RemoteError("the solution returned a malformed value") from None

    class Remote:
        """A function of the solution; calling it sends plain values and receives plain values."""

        def __init__(self, module, name):
            self.module, self.name = module, name
            self.__name__ = name.rsplit(".", 1)[-1]

        def __call__(self, *args, **kwargs):
            payload = {"op": "call", "module": self.module, "name": self.name, "args": args, "kwargs": kwargs}
            return decode(call_subject(payload), "ok")

        def __repr__(self):
            return "<solution function %s>" % self.name

    def bind(described, module, name):
        kind = described.get("kind") if type(described) is dict else None
        if kind == "callable":
            return Remote(module, name)
        if kind == "value":
            return decode(described, "value")
        if kind == "module":
            target = described.get("module")
            if type(target) is str and target.split(".")[0] in proxy_roots:
                return importlib.import_module(target)
            if type(target) is str and target.split(".")[0] in sys.stdlib_module_names:
                return importlib.import_module(target)
        raise AttributeError(name)

    class ProxyModule(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = bind(call_subject({"op": "attr", "module": self.__name__, "name": name}), self.__name__, name)
            setattr(self, name, value)
            return value

    class Finder:  # a meta path finder and loader (the ABCs cost an import: 3 ms a job)
        """`proxy_packages` come from the subject as proxies; `modules` are trusted sources from the spec."""

        def find_spec(self, fullname, path=None, target=None):
            if fullname in trusted_sources:
                is_pkg = any(m.startswith(fullname + ".") for m in trusted_sources)
                return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)
            if fullname.split(".")[0] in proxy_roots:
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, mod_spec):
            return None if mod_spec.name in trusted_sources else ProxyModule(mod_spec.name)

        def exec_module(self, module):
            if module.__name__ in trusted_sources:
                module.__file__ = module.__name__.replace(".", "/") + ".py"
                exec(trusted_compile(trusted_sources[module.__name__], module.__file__), module.__dict__)
            else:
                try:
                    call_subject({"op": "import", "module": module.__name__})
                except RemoteError as err:
                    raise ImportError("the solution's module %s failed to import: %s"
                                      % (module.__name__, err)) from None

    sys.meta_path.insert(0, Finder())

    def fresh_modules():
        for name in list(sys.modules):
            if name in trusted_sources or name.split(".")[0] in proxy_roots:
                del sys.modules[name]

    namespace = {"__name__": "__tests__", "__builtins__": builtins}
    bound = {"done": False}

    def bind_solution():
        names = spec.get("bind", [])
        if bound["done"]:
            return
        if names == "*":
            reply = call_subject({"op": "names", "module": "__solution__"})
            entries = reply.get("names")
            if type(entries) is not list:
                raise SubjectFailed("malformed names reply")
            for entry in entries:
                if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not str:
                    continue
                name = entry[0]
                if hasattr(builtins, name) or name in namespace:
                    continue  # a solution never replaces a builtin (or a test's own name) in the tests' view
                try:
                    namespace[name] = bind(entry[1], "__solution__", name)
                except (AttributeError, ImportError, RemoteError):
                    pass
        else:
            for name in names:
                namespace[name] = Remote("__solution__", name)
        bound["done"] = True

    def run_test(test):
        kind = test.get("kind")
        if kind == "call":
            value = Remote("__solution__", test["fn"])(*test["args"])
            text = json.dumps(value, default=repr)
            if len(text) > (256 << 10):
                raise RemoteError("the returned value is larger than 256 KiB")
            return {"ok": True, "value": json.loads(text)}
        if kind == "code":
            bind_solution()
            exec(trusted_compile(test["code"], test.get("name", "<test>")), namespace)
            return {"ok": True}
        if kind == "module":
            fresh_modules()
            getattr(importlib.import_module(test["module"]), test["fn"])()
            return {"ok": True}
        raise ValueError("unknown test kind %r" % kind)

    def alarm(*_):
        raise TestTimeout("timeout after %.1fs" % timeout_s)

    if spec.get("prelude"):
        exec(trusted_compile(spec["prelude"], spec.get("prelude_name", "<tests>")), namespace)
    results, timeouts = [], 0
    for test in spec["tests"]:
        if timeouts >= int(spec.get("max_timeouts") or 2):
            results.append({"ok": False, "error": "skipped after %d timeouts" % timeouts, "timeout": True})
            continue
        failures_before = state["failures"]
        state["deadline"] = time.monotonic() + timeout_s
        state["timed_out"] = False
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s + 0.25)  # the trusted side's own backstop
        try:
            res = run_test(test)
        except BaseException as err:
            tb = test_traceback(err)
            remote = getattr(err, "remote_traceback", "")
            text = (tb + ("\nIn the solution:\n" + remote if remote else "")).replace(cwd + os.sep, "")
            res = {"ok": False, "error": text[-CAP:]}
            if isinstance(err, TestTimeout) or state["timed_out"]:
                res["timeout"] = True
                drop_subject()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
        if state["failures"] != failures_before:
            res["ok"] = False
            res.setdefault("error", "the solution process failed during this test")
        timeouts += bool(res.get("timeout"))
        results.append(res)
    drop_subject()
    if log_tail:
        sys.stderr.write("solution output (tail):\n" + log_tail.decode("utf-8", "replace") + "\n")
    try:
        payload = json.dumps({"done": True, "results": results})
    except (TypeError, ValueError):
        payload = json.dumps({"done": True, "results": [{"ok": False, "error": "result not serialisable"}
                                                        for _ in results]})
    sys.stdout.flush()
    line = memoryview(("\n%s %s %s\n" % ("@@POSTTRAIN_RUNNER_RESULTS@@", nonce, payload)).encode())
    while line:
        line = line[os.write(1, line):]


_posttrain_runner()
'''
)


def runner_job(
    spec: dict[str, Any],
    files: dict[str, bytes] | None = None,
    limits: Limits | None = None,
    profile: str = "default",
) -> tuple[Job, str]:
    """The job that runs the trusted runner on `spec`, and its nonce.

    spec keys: `tests` (list of {"kind": "call", "fn", "args"} | {"kind": "code", "code"} |
    {"kind": "module", "module", "fn"}), `program` (the untrusted source the subject executes as module
    `__solution__`), `bind` (names of `__solution__` bound into the tests' namespace, or "*"), `prelude`
    (trusted code run first in that namespace), `modules` (trusted module sources by dotted name),
    `proxy_packages` (top-level packages served by the subject), `subject_path` (job-relative dirs put
    first on the subject's sys.path), `timeout_s` (per test) and `max_timeouts`."""
    nonce = secrets.token_hex(16)
    full = dict(spec, nonce=nonce, subject_source=SUBJECT_SOURCE)
    all_files = dict(files or {})
    all_files[SPEC_FILE] = json.dumps(full).encode()
    return Job(
        code=RUNNER_SOURCE, language="python", files=all_files, limits=limits or Limits(), profile=profile
    ), nonce


def read_runner_result(res: ExecResult, nonce: str, total: int) -> tuple[list[dict[str, Any]] | None, str]:
    """(per-test result dicts, "") from exactly one nonce-tagged result line of a job that ended OK with
    exit status 0, else (None, why). Lines with another nonce are ignored: only the runner knows it."""
    if res.status != ExecStatus.OK or res.exit_code != 0:
        return None, f"runner did not complete (status {res.status.value}, exit {res.exit_code})"
    prefix = f"{RESULT_MARKER} {nonce} "
    lines = [
        line for line in res.stdout.decode("utf-8", errors="replace").split("\n") if line.startswith(prefix)
    ]
    if len(lines) != 1:
        return None, f"runner wrote {len(lines)} result lines, expected exactly 1"
    try:
        data = json.loads(lines[0][len(prefix) :])
    except json.JSONDecodeError:
        return None, "runner result line is not valid JSON"
    results = data.get("results") if isinstance(data, dict) and data.get("done") is True else None
    if (
        not isinstance(results, list)
        or len(results) != total
        or not all(isinstance(r, dict) for r in results)
    ):
        return None, "runner result line is incomplete"
    return results, ""


@dataclass
class GradeResult:
    passed: int
    total: int
    fraction: float
    per_test: list[bool]
    status: ExecStatus
    infra_failure: bool
    detail: str = ""
    results: list[ExecResult] = field(default_factory=list, repr=False)


def _infra(total: int, results: list[ExecResult], detail: str) -> GradeResult:
    status = ExecStatus.SANDBOX_ERROR
    return GradeResult(0, total, 0.0, [False] * total, status, True, detail, results)


def assert_job(
    solution_code: str,
    tests: Sequence[str],
    limits: Limits | None = None,
    profile: str = "default",
    per_test_timeout_s: float | None = None,
) -> tuple[Job, str]:
    """The single job that grades `solution_code` against `tests`, and its nonce."""
    spec = {
        "program": solution_code,
        "program_name": "solution.py",
        "bind": "*",
        "timeout_s": per_test_timeout_s,
        "max_timeouts": len(tests) + 1,
        "tests": [{"kind": "code", "code": t, "name": f"test_{i}"} for i, t in enumerate(tests)],
    }
    return runner_job(spec, limits=limits, profile=profile)


def parse_assert_result(res: ExecResult, nonce: str, total: int) -> GradeResult:
    """Per-test outcomes from the runner's result line; none pass when the job did not complete."""
    if res.status == ExecStatus.SANDBOX_ERROR:
        return _infra(total, [res], res.error or "sandbox error")
    results, why = read_runner_result(res, nonce, total)
    if results is None:
        return GradeResult(0, total, 0.0, [False] * total, res.status, False, why, [res])
    flags = [r.get("ok") is True for r in results]
    passed = sum(flags)
    errors = [str(r.get("error", "")).strip().splitlines()[-1:] for r in results if r.get("error")]
    detail = "; ".join(e[0] for e in errors if e)[:500]
    return GradeResult(
        passed, total, passed / total if total else 0.0, flags, res.status, False, detail, [res]
    )


async def grade_asserts(
    sandbox: Sandbox,
    solution_code: str,
    tests: Sequence[str],
    limits: Limits | None = None,
    profile: str = "default",
    per_test_timeout_s: float | None = None,
) -> GradeResult:
    """Run every test string (e.g. `assert f(2) == 4`) against the solution in one job."""
    if not tests:
        raise ValueError("grade_asserts needs at least one test")
    job, nonce = assert_job(solution_code, tests, limits, profile, per_test_timeout_s)
    res = await sandbox.run(job)
    return parse_assert_result(res, nonce, len(tests))


def outputs_match(actual: str, expected: str, float_tol: float | None = None) -> bool:
    """Equal up to trailing whitespace per line and trailing blank lines; numbers within `float_tol`
    (absolute or relative) when given."""
    a_lines = [line.rstrip() for line in actual.rstrip().splitlines()]
    e_lines = [line.rstrip() for line in expected.rstrip().splitlines()]
    if a_lines == e_lines:
        return True
    if float_tol is None or len(a_lines) != len(e_lines):
        return False
    for a_line, e_line in zip(a_lines, e_lines, strict=True):
        a_tok, e_tok = a_line.split(), e_line.split()
        if len(a_tok) != len(e_tok):
            return False
        for a, e in zip(a_tok, e_tok, strict=True):
            if a == e:
                continue
            try:
                fa, fe = float(a), float(e)
            except ValueError:
                return False
            if (
                math.isnan(fa)
                or math.isnan(fe)
                or not math.isclose(fa, fe, rel_tol=float_tol, abs_tol=float_tol)
            ):
                return False
    return True


async def grade_io(
    sandbox: Sandbox,
    code: str,
    cases: Sequence[tuple[str | bytes, str]],
    language: str = "python",
    limits: Limits | None = None,
    float_tol: float | None = None,
    profile: str = "default",
) -> GradeResult:
    """One job per (stdin, expected_stdout) case; a case passes when the job is OK and output matches."""
    if not cases:
        raise ValueError("grade_io needs at least one case")
    jobs = [
        Job(
            code=code,
            language=language,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            limits=limits or Limits(),
            profile=profile,
        )
        for stdin, _ in cases
    ]
    results = await sandbox.run_batch(jobs)
    total = len(cases)
    infra = [r for r in results if r.status == ExecStatus.SANDBOX_ERROR]
    if infra:
        return _infra(total, results, infra[0].error or "sandbox error")
    if any(r.status == ExecStatus.COMPILE_ERROR for r in results):
        return GradeResult(
            0,
            total,
            0.0,
            [False] * total,
            ExecStatus.COMPILE_ERROR,
            False,
            results[0].stderr_text[-500:],
            results,
        )
    per_test = [
        r.status == ExecStatus.OK and outputs_match(r.stdout_text, expected, float_tol)
        for r, (_, expected) in zip(results, cases, strict=True)
    ]
    worst = next((r.status for r in results if r.status != ExecStatus.OK), ExecStatus.OK)
    failing = [i for i, ok in enumerate(per_test) if not ok]
    detail = f"failed cases: {failing[:10]}" if failing else ""
    passed = sum(per_test)
    return GradeResult(passed, total, passed / total, per_test, worst, False, detail, results)
