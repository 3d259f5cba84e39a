"""Can this process copy straight out of another process's memory (CMA, process_vm_readv)?

UCX's `cma` transport does exactly that, and it needs ptrace permission over the peer. UCX
decides at start-up (see its cma_md.c): Yama `ptrace_scope` 0 -> yes; 1 -> UCX calls
prctl(PR_SET_PTRACER_ANY) on itself and says yes; 2 -> only with CAP_SYS_PTRACE; 3 -> no; and a
self-test with process_vm_writev must pass (seccomp can forbid it). When CMA is off, UCX quietly
uses TCP for the data, ~5-10x slower. Even when UCX says yes, the real cross-process call can
still be refused (different uid, an LSM, a non-dumpable peer), so `probe_read` tries it against
the peer's pool with the same syscall.
"""

from __future__ import annotations

import ctypes
import errno
import os

_CAP_SYS_PTRACE = 19
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc():
    lib = ctypes.CDLL(None, use_errno=True)
    fn = lib.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


def yama_ptrace_scope() -> int | None:
    """The Yama ptrace scope (0-3), or None when Yama is not present."""
    try:
        with open(_YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False


def probe_read(pid: int, addr: int, nbytes: int = 8) -> str | None:
    """Read `nbytes` at `addr` in process `pid` with process_vm_readv. None = OK, else why not."""
    buf = ctypes.create_string_buffer(nbytes)
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), nbytes)
    remote = _IoVec(addr, nbytes)
    try:
        n = _libc()(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    except (AttributeError, OSError) as e:  # no such libc symbol
        return f"process_vm_readv unavailable: {e}"
    if n == nbytes:
        return None
    err = ctypes.get_errno()
    return f"process_vm_readv(pid {pid}) failed: {errno.errorcode.get(err, err)} {os.strerror(err)}"


def ucx_tls_allows_cma(tls: str | None) -> bool:
    """Does a UCX_TLS value leave the cma transport enabled?"""
    if not tls:
        return True
    items = [t.strip().lower() for t in tls.split(",") if t.strip()]
    if items and items[0].startswith("^"):
        excluded = {items[0][1:], *items[1:]}
        return not excluded & {"cma", "sm", "shm"}
    return bool({"all", "cma", "sm", "shm"} & set(items))


def ucx_cma_status(tls: str | None = None) -> tuple[bool, str]:
    """Will UCX enable its cma transport in this process? (mirrors UCX's own start-up checks)"""
    if not ucx_tls_allows_cma(tls if tls is not None else os.environ.get("UCX_TLS")):
        return False, f"UCX_TLS={os.environ.get('UCX_TLS')!r} excludes cma"
    self_err = probe_read(os.getpid(), ctypes.addressof(ctypes.c_uint64(0)))
    if self_err is not None:
        return False, f"CMA self-test failed ({self_err}); seccomp may forbid process_vm_*"
    scope = yama_ptrace_scope()
    if scope is None:
        return True, "no Yama LSM; same-uid ptrace allowed"
    if scope == 0:
        return True, "Yama ptrace_scope=0"
    if scope == 1:
        return True, "Yama ptrace_scope=1; UCX sets PR_SET_PTRACER_ANY on each process"
    if scope == 2:
        if has_cap_sys_ptrace():
            return True, "Yama ptrace_scope=2 and the process has CAP_SYS_PTRACE"
        return False, "Yama ptrace_scope=2 and no CAP_SYS_PTRACE"
    return False, f"Yama ptrace_scope={scope}: ptrace disabled system-wide"
