"""A classic-BPF seccomp filter built in pure Python and installed with prctl via ctypes.

Runs inside the jail (stdlib only, never imports posttrain). Owns the deny list and its encoding for
x86_64; on other architectures `build_filter` raises `SeccompUnsupported` and the caller reports the
layer as missing. It does not decide when to install the filter: the worker installs it on itself
once, before serving jobs, so every forked job child inherits it (it cannot be removed).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_KILL_PROCESS = 0x80000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

# x86_64 syscall numbers denied outright (EPERM).
X86_64_DENY = {
    "ptrace": 101,
    "syslog": 103,
    "personality": 135,
    "vhangup": 153,
    "pivot_root": 155,
    "chroot": 161,
    "acct": 163,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "process_mrelease": 448,
}
# SysV IPC and POSIX message queues: their objects belong to the jail's IPC namespace, which lives as
# long as the worker (hundreds of jobs), so a job could leave memory charged to the worker's cgroup
# and data for the next job. Denied with ENOSYS, as on a kernel built without them. (POSIX shm is a
# file in the jail's private /dev/shm, emptied after each job.)
X86_64_IPC_DENY = {
    "shmget": 29,
    "shmat": 30,
    "shmctl": 31,
    "semget": 64,
    "semop": 65,
    "semctl": 66,
    "shmdt": 67,
    "msgget": 68,
    "msgsnd": 69,
    "msgrcv": 70,
    "msgctl": 71,
    "semtimedop": 220,
    "mq_open": 240,
    "mq_unlink": 241,
    "mq_timedsend": 242,
    "mq_timedreceive": 243,
    "mq_notify": 244,
    "mq_getsetattr": 245,
}
X86_64_NET_DENY = {"connect": 42, "accept": 43, "bind": 49, "listen": 50, "accept4": 288}
NR_SOCKET, NR_SOCKETPAIR, NR_CLONE, NR_CLONE3 = 41, 53, 56, 435
NR_KILL, NR_TKILL, NR_TGKILL, NR_RT_SIGQUEUEINFO, NR_RT_TGSIGQUEUEINFO = 62, 200, 234, 129, 297
AF_UNIX = 1
CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000


class SeccompUnsupported(RuntimeError):
    """The filter cannot be built or installed here (architecture or kernel)."""


class _Asm:
    """A tiny assembler: conditional jumps name labels; `resolve` turns them into relative offsets."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: object = 0, jf: object = 0) -> None:
        self.code.append((code, jt, jf, k & 0xFFFFFFFF))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def resolve(self) -> bytes:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.code):
            offsets = []
            for target in (jt, jf):
                off = target if isinstance(target, int) else self.labels[target] - (i + 1)
                if not 0 <= off <= 255:
                    raise SeccompUnsupported(f"BPF jump out of range at {i}")
                offsets.append(off)
            out += struct.pack("<HBBI", code, offsets[0], offsets[1], k)
        return bytes(out)


def _arg_lo(i: int) -> int:
    return 16 + 8 * i  # seccomp_data.args[i], low 32 bits on little-endian


def build_filter(protected_pids: tuple[int, ...] = (), allow_network: bool = False) -> bytes:
    """The filter program as bytes (sock_filter array). `protected_pids` may not be signalled."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SeccompUnsupported(f"seccomp filter is only built for x86_64, not {platform.machine()}")
    a = _Asm()
    eperm = SECCOMP_RET_ERRNO | errno.EPERM
    a.op(_LD_W_ABS, 4)
    a.op(_JEQ_K, AUDIT_ARCH_X86_64, 1, 0)
    a.op(_RET_K, SECCOMP_RET_KILL_PROCESS)
    a.op(_LD_W_ABS, 0)
    a.op(_JGE_K, 0x40000000, "deny", 0)  # x32 ABI
    deny = dict(X86_64_DENY)
    if not allow_network:
        deny.update(X86_64_NET_DENY)
    for nr in sorted(deny.values()):
        a.op(_JEQ_K, nr, "deny", 0)
    for nr in sorted(X86_64_IPC_DENY.values()):
        a.op(_JEQ_K, nr, "enosys", 0)
    a.op(_JEQ_K, NR_CLONE3, "enosys", 0)  # args live in memory; glibc falls back to clone
    a.op(_JEQ_K, NR_CLONE, "clone", 0)
    if not allow_network:
        a.op(_JEQ_K, NR_SOCKET, "socket", 0)
        a.op(_JEQ_K, NR_SOCKETPAIR, "socket", 0)
    a.op(_JEQ_K, NR_KILL, "kill", 0)
    a.op(_JEQ_K, NR_RT_SIGQUEUEINFO, "kill", 0)
    a.op(_JEQ_K, NR_TKILL, "tkill", 0)
    a.op(_JEQ_K, NR_TGKILL, "tkill", 0)
    a.op(_JEQ_K, NR_RT_TGSIGQUEUEINFO, "tkill", 0)
    a.op(_RET_K, SECCOMP_RET_ALLOW)

    a.label("clone")
    a.op(_LD_W_ABS, _arg_lo(0))
    a.op(_JSET_K, CLONE_NS_FLAGS, "deny", "allow")
    if not allow_network:
        a.label("socket")
        a.op(_LD_W_ABS, _arg_lo(0))
        a.op(_JEQ_K, AF_UNIX, "allow", "deny")
    # kill(pid) / rt_sigqueueinfo(pid): no -1 (everyone), no pid 1, no protected pid or its group.
    a.label("kill")
    a.op(_LD_W_ABS, _arg_lo(0))
    for pid in (-1, 1, *protected_pids, *(-p for p in protected_pids)):
        a.op(_JEQ_K, pid, "deny", 0)
    a.op(_RET_K, SECCOMP_RET_ALLOW)
    # tkill(tid) / tgkill(tgid, ...) / rt_tgsigqueueinfo(tgid, ...): first argument is the target.
    a.label("tkill")
    a.op(_LD_W_ABS, _arg_lo(0))
    for pid in (1, *protected_pids):
        a.op(_JEQ_K, pid, "deny", 0)
    a.op(_RET_K, SECCOMP_RET_ALLOW)

    a.label("allow")
    a.op(_RET_K, SECCOMP_RET_ALLOW)
    a.label("deny")
    a.op(_RET_K, eperm)
    a.label("enosys")
    a.op(_RET_K, SECCOMP_RET_ERRNO | errno.ENOSYS)
    return a.resolve()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Installer:
    """Holds libc and the filter buffer, prepared once in the worker so each forked job child only
    makes the two prctl calls."""

    def __init__(self, program: bytes) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.buf = ctypes.create_string_buffer(program, len(program))
        self.prog = _SockFprog(len(program) // 8, ctypes.cast(self.buf, ctypes.c_void_p))

    def install(self) -> None:
        """Install on the calling thread (no_new_privs first). Irreversible for this process."""
        if self.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SeccompUnsupported(f"prctl(NO_NEW_PRIVS) failed: errno {ctypes.get_errno()}")
        if self.libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(self.prog), 0, 0) != 0:
            raise SeccompUnsupported(f"prctl(SECCOMP) failed: errno {ctypes.get_errno()}")
