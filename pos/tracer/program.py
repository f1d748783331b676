"""A probe family's BPF program: compiled by bcc once per host, then loaded and attached here.

Where `pos trace` spent its time (a 2-core VM, the fake libcuda's 49 symbols; bench/trace_startup.py
measures it): bcc compiled the CUDA family's C in 1.3-1.9 s on every run (bcc keeps no compiled
program: iovisor/bcc#534, #2564), the verifier took 0.6 s, and detaching the 63 uprobes took
6-7.5 s, each perf-event uprobe waiting for an RCU grace period (~0.1 s on Linux 6.x) under the
kernel's event mutex, one after another.

So:
- What bcc's compilation leaves -- each function's instructions and the specification of each
  map they use -- is kept in CACHE_DIR (POS_CACHE_DIR, default /var/cache/pos), under a key that
  changes with the C text, bcc's version and the kernel. A run that finds it creates the maps,
  writes their descriptors into the instructions (the ld_imm64 that load a map's fd: bcc's
  pseudo-fd relocation, done again) and loads the programs with the bpf() system call: no
  compiler runs.
- The symbols' file offsets are read in one pass over the library's symbol table (bcc reads
  the whole ELF file again for each probe).
- Where the kernel has uprobe_multi links (Linux 6.6+, with the process filter of later kernels),
  each program is attached by a link, and all links are closed at once on detach: closings in
  parallel share their grace periods (0.1-0.2 s for all). Elsewhere the probes are perf events,
  attached through bcc's library, as bcc does.
"""

import base64
import hashlib
import json
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pos.errors import BadInput, PosError
from pos.tracer import bpfsys
from pos.tracer.probes import RETURNS, Family

FORMAT = 1
DEFAULT_CACHE = "/var/cache/pos"


def cache_dir() -> Path:
    return Path(os.environ.get("POS_CACHE_DIR") or DEFAULT_CACHE) / "bpf"


@dataclass
class Compiled:
    """What bcc's compilation of one C text leaves: the maps and each function's instructions,
    with the map's index (into `maps`) where bcc had put its fd."""

    maps: list[dict[str, Any]]        # name, type, key_size, value_size, max_entries, flags
    functions: dict[str, bytes]
    license: str

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "maps": self.maps, "license": self.license,
                           "functions": {n: base64.b64encode(c).decode()
                                         for n, c in self.functions.items()}})

    @classmethod
    def from_json(cls, text: str) -> "Compiled":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"cache format {d.get('format')}")
        return cls(d["maps"], {n: base64.b64decode(c) for n, c in d["functions"].items()},
                   d["license"])


def _map_fds(code: bytes) -> list[tuple[int, int]]:
    """(byte offset of the imm, fd) of each ld_imm64 that loads a map's fd."""
    return [(at + 4, struct.unpack_from("<i", code, at + 4)[0])
            for at in range(0, len(code) - 15, 8)
            if code[at] == bpfsys.LD_IMM64 and code[at + 1] >> 4 == bpfsys.PSEUDO_MAP_FD]


def _relocate(code: bytes, new: Callable[[int], int]) -> bytes:
    out = bytearray(code)
    for at, old in _map_fds(code):
        struct.pack_into("<i", out, at, new(old))
    return bytes(out)


def compile_text(text: str, cflags: list[str]) -> Compiled:
    """Compile with bcc and take what it made apart from bcc (its module is destroyed)."""
    import ctypes

    from bcc import BPF, lib

    for fn, res, args in (("bpf_num_tables", ctypes.c_ulonglong, [ctypes.c_void_p]),
                          ("bpf_table_name", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_ulonglong]),
                          ("bpf_table_fd_id", ctypes.c_int, [ctypes.c_void_p, ctypes.c_ulonglong])):
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, args
    b = BPF(text=text, cflags=cflags)
    try:
        m = b.module
        fds: dict[int, int] = {}
        maps: list[dict[str, Any]] = []
        for i in range(lib.bpf_num_tables(m)):
            fd = lib.bpf_table_fd_id(m, i)
            typ, key, value, entries, flags = bpfsys.map_info(fd)
            fds[fd] = len(maps)
            maps.append({"name": lib.bpf_table_name(m, i).decode(), "type": typ, "key_size": key,
                         "value_size": value, "max_entries": entries, "flags": flags})
        functions = {}
        for i in range(lib.bpf_num_functions(m)):
            name = lib.bpf_function_name(m, i)
            code = ctypes.string_at(lib.bpf_function_start(m, name), lib.bpf_function_size(m, name))
            functions[name.decode()] = _relocate(code, fds.__getitem__)
        return Compiled(maps, functions, lib.bpf_module_license(m).decode())
    finally:
        b.cleanup()
        b.close()


def cache_key(text: str, cflags: list[str]) -> str:
    from bcc.version import __version__ as bcc_version

    u = os.uname()
    h = hashlib.sha256()
    for part in (str(FORMAT), bcc_version, u.release, u.version, u.machine, *cflags, text):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:24]


def compiled(family: Family, text: str, cflags: list[str],
             say: Callable[[str], None] = lambda _: None) -> Compiled:
    """The family's program from the cache, else compiled (saying so) and cached."""
    path = cache_dir() / f"{family.name}-{cache_key(text, cflags)}.json"
    try:
        return Compiled.from_json(path.read_text())
    except (OSError, ValueError, KeyError):
        pass
    say(f"compiling the {family.name} probes for this kernel (once per host and pos version; "
        f"kept in {path.parent})")
    program = compile_text(text, cflags)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(program.to_json())
        tmp.replace(path)
    except OSError:     # a cache that cannot be written: compile again next time
        pass
    return program


def symbol_offsets(path: str, symbols: tuple[str, ...]) -> dict[str, int]:
    """The file offset (what a uprobe takes) of each of `symbols` the ELF file defines, from
    one pass over its dynamic (else full) symbol table. BadInput for a file that is not ELF."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    wanted = set(symbols)
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
            table = elf.get_section_by_name(".dynsym") or elf.get_section_by_name(".symtab")
            found: dict[str, int] = {}
            for sym in table.iter_symbols() if isinstance(table, SymbolTableSection) else ():
                if sym.name in wanted and sym.name not in found and sym["st_value"] and \
                        sym["st_shndx"] != "SHN_UNDEF":
                    v = sym["st_value"]
                    seg = next((s for s in loads
                                if s["p_vaddr"] <= v < s["p_vaddr"] + s["p_memsz"]), None)
                    if seg is not None:
                        found[sym.name] = v - seg["p_vaddr"] + seg["p_offset"]
            return found
    except (ELFError, struct.error, ValueError) as e:
        raise BadInput(f"{path} is not an ELF library ({e})",
                       "give --lib the GPU driver library (libcuda.so.1 or libamdhip64.so)") \
            from None


_multi: Optional[bool] = None


def uprobe_multi() -> bool:
    """Whether to attach by uprobe_multi links (probed once; POS_UPROBE_MULTI=0 turns it off)."""
    global _multi
    if _multi is None:
        _multi = os.environ.get("POS_UPROBE_MULTI", "1") != "0" and bpfsys.uprobe_multi_works()
    return _multi


class Loaded:
    """A family's maps and programs in the kernel, attached to one library of one process."""

    def __init__(self, program: Compiled, family: Family, path: str, pid: int,
                 ringbuf_bytes: Optional[int] = None) -> None:
        self.multi = uprobe_multi()
        self.maps: dict[str, bpfsys.Map] = {}
        self._progs: list[int] = []
        self._links: list[int] = []
        self._events: list[bytes] = []    # perf-event uprobes' names (for bcc's detach)
        self.attached: list[str] = []
        try:
            self._load(program, family, path, pid, ringbuf_bytes)
        except BaseException:
            self.close()
            raise

    def _load(self, program: Compiled, family: Family, path: str, pid: int,
              ringbuf_bytes: Optional[int]) -> None:
        fds: list[int] = []
        for spec in program.maps:
            entries = spec["max_entries"]
            if ringbuf_bytes and spec["type"] == 27:      # BPF_MAP_TYPE_RINGBUF
                entries = ringbuf_bytes
            m = bpfsys.Map(spec["name"], spec["type"], spec["key_size"], spec["value_size"],
                           entries, spec["flags"])
            self.maps[spec["name"]] = m
            fds.append(m.fd)
        offsets = symbol_offsets(path, family.symbols)
        # older drivers lack newer entry points: not fatal, those are not probed
        wanted = [(sym, fn, ret) for sym in family.symbols if sym in offsets
                  for fn, ret in ((f"on_{sym}", False), (f"ret_{sym}", True))
                  if not ret or sym in RETURNS]
        # The verifier takes most of the load (0.15 s for each launch probe on a 2-core VM) and
        # runs in parallel for root, outside the GIL: one thread per CPU, the largest first.
        names = sorted({fn for _, fn, _ in wanted}, key=lambda fn: -len(program.functions[fn]))
        with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
            progs = dict(zip(names, pool.map(lambda fn: self._prog(program, fn, fds), names)))
        for sym, fn, ret in wanted:
            self._attach(progs[fn], path, offsets[sym], pid, ret)
            if sym not in self.attached:
                self.attached.append(sym)

    def _prog(self, program: Compiled, fn: str, fds: list[int]) -> int:
        code = _relocate(program.functions[fn], fds.__getitem__)
        attach = bpfsys.TRACE_UPROBE_MULTI if self.multi else 0
        try:
            fd = bpfsys.prog_load(code, fn, program.license, attach)
        except OSError:
            try:    # again, for the verifier's words
                fd = bpfsys.prog_load(code, fn, program.license, attach, log_size=1 << 22)
            except OSError as e:
                raise PosError(f"the kernel's BPF verifier refused pos's probe {fn} ({e})",
                               "report this with `uname -r` and `pos doctor`'s output") from None
        self._progs.append(fd)
        return fd

    def _attach(self, prog: int, path: str, offset: int, pid: int, ret: bool) -> None:
        if self.multi:
            try:
                self._links.append(bpfsys.link_uprobe_multi(prog, path, [offset], pid, ret))
                return
            except OSError as e:
                raise PosError(f"attaching a probe to {path} failed ({e.strerror})",
                               "check that the process is still running and see `pos doctor`") \
                    from None
        from bcc import lib

        name = f"{'r' if ret else 'p'}_pos_{pid}_{offset:x}_{os.getpid()}".encode()
        fd = lib.bpf_attach_uprobe(prog, 1 if ret else 0, name, path.encode(), offset, pid)
        if fd < 0:
            raise PosError(f"attaching a probe to {path} at offset {offset:#x} failed",
                           "check that the process is still running and see `pos doctor`")
        self._links.append(fd)
        self._events.append(name)

    def detach(self) -> None:
        """Detach every probe, all at once (see the module docstring); the maps stay."""
        links, self._links = self._links, []
        threads = [threading.Thread(target=os.close, args=(fd,)) for fd in links]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._events:
            from bcc import lib

            for name in self._events:     # tracefs-made uprobes only; a no-op for the others
                lib.bpf_detach_uprobe(name)
            self._events = []

    def close(self) -> None:
        self.detach()
        for fd in self._progs:
            os.close(fd)
        self._progs = []
        for m in self.maps.values():
            m.close()
