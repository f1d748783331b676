"""The bpf() system call for what the tracer does without bcc: maps, program loads and
uprobe_multi links (pos/tracer/program.py says why).

Each attribute block is packed at the offsets of `union bpf_attr` in linux/bpf.h; the kernel
takes a block shorter than its own union and zero-fills the rest. Failures raise OSError with
the kernel's errno.
"""

import ctypes
import os
import platform
import struct
from typing import Any, Optional

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
NR_BPF = {"x86_64": 321, "aarch64": 280}.get(platform.machine(), 321)

# commands (enum bpf_cmd)
MAP_CREATE, MAP_LOOKUP_ELEM, MAP_UPDATE_ELEM, MAP_DELETE_ELEM, MAP_GET_NEXT_KEY, PROG_LOAD = range(6)
OBJ_GET_INFO_BY_FD = 15
LINK_CREATE = 28
PROG_TYPE_KPROBE = 2
TRACE_UPROBE_MULTI = 48          # enum bpf_attach_type (Linux 6.6)
F_UPROBE_MULTI_RETURN = 1
PSEUDO_MAP_FD = 1                # src_reg of the ld_imm64 that loads a map's fd
LD_IMM64 = 0x18
ATTR_SIZE = 128
OBJ_NAME_LEN = 16


def _buffer(data: bytes) -> Any:
    """A C copy of `data` (kept alive by the caller while the kernel reads it)."""
    return ctypes.create_string_buffer(bytes(data), len(data) or 1)


def _addr(buf: Any) -> int:
    return ctypes.addressof(buf)


def bpf(cmd: int, attr: bytearray) -> int:
    """One bpf() call; its result (a new fd for the commands that make one)."""
    buf = (ctypes.c_char * len(attr)).from_buffer(attr)
    r = _libc.syscall(NR_BPF, ctypes.c_int(cmd), buf, ctypes.c_uint(len(attr)))
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(r)


def _name(name: str) -> bytes:
    """An object name as the kernel takes it: up to 15 characters of [A-Za-z0-9_.]."""
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name).encode()[:OBJ_NAME_LEN - 1]


def map_info(fd: int) -> tuple[int, int, int, int, int]:
    """(type, key size, value size, max entries, flags) of a map."""
    info = ctypes.create_string_buffer(80)
    attr = bytearray(16)
    struct.pack_into("<IIQ", attr, 0, fd, len(info), _addr(info))
    bpf(OBJ_GET_INFO_BY_FD, attr)
    typ, _id, key, value, entries, flags = struct.unpack_from("<6I", info.raw)
    return typ, key, value, entries, flags


def possible_cpus() -> int:
    """How many values a per-CPU map holds for each key."""
    text = open("/sys/devices/system/cpu/possible").read().strip()
    return max(int(part.split("-")[-1]) for part in text.split(",")) + 1


class Map:
    """A BPF map created here, read and written by raw keys and values."""

    PER_CPU = {5, 6, 10}   # percpu hash, percpu array, lru percpu hash

    def __init__(self, name: str, typ: int, key_size: int, value_size: int, max_entries: int,
                 flags: int) -> None:
        self.name, self.type = name, typ
        self.key_size, self.value_size, self.max_entries = key_size, value_size, max_entries
        attr = bytearray(ATTR_SIZE)
        struct.pack_into("<5I", attr, 0, typ, key_size, value_size, max_entries, flags)
        n = _name(name)
        attr[28:28 + len(n)] = n
        self.fd = bpf(MAP_CREATE, attr)       # -1 once closed

    def _elem(self, cmd: int, key: bytes, value: Optional[Any] = None, flags: int = 0) -> None:
        k = _buffer(key)
        attr = bytearray(32)
        struct.pack_into("<IIQQQ", attr, 0, self.fd, 0, _addr(k),
                         _addr(value) if value is not None else 0, flags)
        bpf(cmd, attr)

    def update(self, key: bytes, value: bytes) -> None:
        self._elem(MAP_UPDATE_ELEM, key, _buffer(value))

    def delete(self, key: bytes) -> bool:
        """False when the key was not there."""
        try:
            self._elem(MAP_DELETE_ELEM, key)
        except FileNotFoundError:
            return False
        return True

    def lookup(self, key: bytes) -> Optional[bytes]:
        """The value; for a per-CPU map each CPU's value, each padded to 8 bytes."""
        size = self.value_size
        if self.type in self.PER_CPU:
            size = (size + 7) // 8 * 8 * possible_cpus()
        out = ctypes.create_string_buffer(size)
        try:
            self._elem(MAP_LOOKUP_ELEM, key, out)
        except FileNotFoundError:
            return None
        return out.raw

    def keys(self) -> list[bytes]:
        found: list[bytes] = []
        nxt = ctypes.create_string_buffer(self.key_size)
        while True:
            attr = bytearray(32)
            prev = _buffer(found[-1]) if found else None
            struct.pack_into("<IIQQ", attr, 0, self.fd, 0, _addr(prev) if prev else 0, _addr(nxt))
            try:
                bpf(MAP_GET_NEXT_KEY, attr)
            except FileNotFoundError:
                return found
            found.append(nxt.raw)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def prog_load(insns: bytes, name: str, license: str = "GPL", attach_type: int = 0,
              log_size: int = 0) -> int:
    """Load a kprobe-type program; the verifier's log goes into the OSError's message when
    `log_size` is given and the load fails."""
    code, lic = _buffer(insns), _buffer(license.encode() + b"\0")
    log = ctypes.create_string_buffer(log_size) if log_size else None
    attr = bytearray(ATTR_SIZE)
    struct.pack_into("<IIQQIIQ", attr, 0, PROG_TYPE_KPROBE, len(insns) // 8, _addr(code),
                     _addr(lic), 1 if log else 0, log_size, _addr(log) if log else 0)
    n = _name(name)
    attr[48:48 + len(n)] = n
    struct.pack_into("<I", attr, 68, attach_type)
    try:
        return bpf(PROG_LOAD, attr)
    except OSError as e:
        if log is not None:
            tail = log.value.decode(errors="replace").strip().splitlines()[-3:]
            raise OSError(e.errno, f"{e.strerror}: {' / '.join(tail)}") from None
        raise


def link_uprobe_multi(prog_fd: int, path: str, offsets: list[int], pid: int,
                      retprobe: bool = False) -> int:
    """One uprobe_multi link: the program on each offset of the file, for one process."""
    p = _buffer(os.fsencode(path) + b"\0")
    offs = (ctypes.c_uint64 * len(offsets))(*offsets)
    attr = bytearray(ATTR_SIZE)
    struct.pack_into("<IIII", attr, 0, prog_fd, 0, TRACE_UPROBE_MULTI, 0)
    struct.pack_into("<QQQQIIi", attr, 16, _addr(p), ctypes.addressof(offs), 0, 0, len(offsets),
                     F_UPROBE_MULTI_RETURN if retprobe else 0, pid)
    return bpf(LINK_CREATE, attr)


def uprobe_multi_works() -> bool:
    """Whether this kernel has uprobe_multi links that filter by process (Linux 6.6 had them
    filter by thread; later kernels and backports fixed that). Probed as libbpf does: a link on
    the directory "/" fails with EBADF where links exist at all, and one for PID -1 with EINVAL
    (before the path is looked at) where the process filter is fixed."""
    try:
        prog = prog_load(bytes.fromhex("b700000000000000" "9500000000000000"), "pos_probe",
                         attach_type=TRACE_UPROBE_MULTI)
    except OSError:
        return False
    try:
        for pid, expected in ((0, 9), (-1, 22)):     # EBADF, EINVAL
            try:
                os.close(link_uprobe_multi(prog, "/", [0], pid))
                return False
            except OSError as e:
                if e.errno != expected:
                    return False
        return True
    finally:
        os.close(prog)
