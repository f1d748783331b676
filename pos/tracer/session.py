"""A tracing session: load the probes, attach them to one process, drain and record events.

Data flow: probes (pos/bpf) -> ring buffer -> `Tracer.poll` (decode, resolve kernel names and
parameter layouts) -> `TraceWriter` (batched inserts into the store). Layouts go back into the
probes' `layouts` map so that later launches of a kernel copy exactly its parameters; launches
that run before their layout arrives (one poll interval after the kernel is looked up) are
recorded as 8-byte slots with layout_known = False.
"""

import ctypes
import json
import os
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from pos.errors import PosError
from pos.store.writer import TraceWriter
from pos.tracer import fatbin
from pos.tracer.events import FUNCTION_KIND, KIND_AT, MODULE, Row, decode
from pos.tracer.probes import RETURNS, Family, bpf_include_dir, bpf_text
from pos.tracer.target import MappedLibrary, mapped_files

MAX_IMAGE_BYTES = 1 << 30


@dataclass
class Stats:
    """What the live view shows; updated as events are decoded."""

    events: Counter = field(default_factory=Counter)      # by table
    kernels: Counter = field(default_factory=Counter)     # launches by kernel name
    live_bytes: int = 0
    copied_bytes: int = 0
    lost: int = 0
    layout_known: int = 0
    _sizes: dict[int, int] = field(default_factory=dict)

    def count(self, table: str, row: Row, name: Optional[str]) -> None:
        self.events[table] += 1
        if table == "launches":
            self.kernels[name or f"<0x{row['function']:x}>"] += 1
            self.layout_known += row["layout_known"]
        elif table == "allocations":
            if row["kind"] == "alloc":
                self._sizes[row["ptr"]] = row["size"] or 0
                self.live_bytes += row["size"] or 0
            elif row["kind"] == "free":
                self.live_bytes -= self._sizes.pop(row["ptr"], 0)
        elif table == "copies" and row["kind"] == "memcpy":
            self.copied_bytes += row["size"]


def _layout_json(layout: fatbin.KernelLayout) -> str:
    return json.dumps([[p.offset, p.size] for p in layout.params])


def _parse_image(data: bytes) -> dict[str, fatbin.KernelLayout]:
    """A module image's layouts (runs in a worker process)."""
    return fatbin.parse_image(data)


def _scan_files(paths: list[str]) -> dict[str, fatbin.KernelLayout]:
    """Layouts from the .nv_fatbin sections of mapped files (runs in a helper process)."""
    found: dict[str, fatbin.KernelLayout] = {}
    for path in paths:
        try:
            for name, layout in fatbin.layouts_from_elf_file(path).items():
                found.setdefault(name, layout)
        except (fatbin.FatbinError, OSError):
            continue
    return found


class _Probes:
    """One family's BPF program attached to one library of the target."""

    def __init__(self, library: MappedLibrary, pid: int, ringbuf_pages: int, sink: list) -> None:
        from bcc import BPF

        self.family: Family = library.family
        self.bpf = BPF(text=bpf_text(self.family, ringbuf_pages), cflags=[f"-I{bpf_include_dir()}"])
        self.attached: list[str] = []
        for sym in self.family.symbols:
            try:
                self.bpf.attach_uprobe(name=library.host_path, sym=sym, fn_name=f"on_{sym}", pid=pid)
                if sym in RETURNS:
                    self.bpf.attach_uretprobe(name=library.host_path, sym=sym,
                                              fn_name=f"ret_{sym}", pid=pid)
            except Exception:  # bcc raises plain Exception for a symbol the library lacks
                continue
            self.attached.append(sym)
        self.layouts = self.bpf["layouts"]

        def on_event(_ctx: Any, data: Any, size: int) -> int:
            sink.append((self, ctypes.string_at(data, size)))
            return 0

        self.bpf["events"].open_ring_buffer(on_event)

    def push_layout(self, handle: int, layout: fatbin.KernelLayout) -> bool:
        if len(layout.params) > len(self.layouts.Leaf().offset):
            return False
        leaf = self.layouts.Leaf()
        leaf.count = len(layout.params)
        leaf.total = min(layout.total_size, 0xFFFF)
        for i, p in enumerate(layout.params):
            leaf.offset[i] = min(p.offset, 0xFFFF)
            leaf.size[i] = min(p.size, 0xFFFF)
        self.layouts[self.layouts.Key(handle)] = leaf
        return True

    def lost(self) -> int:
        return sum(sum(v) for v in self.bpf["lost"].values())

    def close(self) -> None:
        self.bpf.cleanup()


class Tracer:
    """Probes attached to one process; `poll` moves what they saw into the writer."""

    def __init__(self, pid: int, libraries: list[MappedLibrary], writer: TraceWriter,
                 ringbuf_pages: int = 16384, scan_libraries: bool = True) -> None:
        self.pid = pid
        self.writer = writer
        self.stats = Stats()
        self._raw: list[tuple[_Probes, bytes]] = []
        self._probes = [_Probes(lib, pid, ringbuf_pages, self._raw) for lib in libraries]
        self.attached = sum(len(p.attached) for p in self._probes)
        if not self.attached:
            self.close()
            raise PosError(f"none of pos's probes attached to {libraries[0].path}",
                           "check that the file is the GPU driver library (see `pos doctor`)")
        self.names: dict[int, str] = {}                       # function/kernel handle -> name
        self.by_module: dict[int, dict[str, fatbin.KernelLayout]] = {}
        self.by_name: dict[str, fatbin.KernelLayout] = {}
        self._unresolved: dict[int, tuple[_Probes, str]] = {}  # handle -> (probes, name)
        self._pushed: dict[int, tuple[str, str]] = {}         # handle -> (name, layout JSON)
        self._parses: list[tuple[Future, Row]] = []           # module images being parsed
        self._scan: Optional[Future] = None
        self._scan_enabled = scan_libraries
        self._pool: Optional[ProcessPoolExecutor] = None
        try:
            self._mem: Optional[int] = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:
            self._mem = None

    # ---- draining ------------------------------------------------------------------------
    def poll(self) -> int:
        """Drain every ring buffer once; returns how many events were recorded.

        Kernel lookups and module loads are handled first: their layouts reach the probes
        before the (many) launches of the same batch are decoded and queued, so that the
        kernel's next launches are captured with their layout as early as possible."""
        for p in self._probes:
            p.bpf.ring_buffer_consume()
        raw, self._raw[:] = list(self._raw), []
        early: dict[int, tuple[str, Row]] = {}
        pending: set[int] = set()   # module rows that _settle writes once parsed
        for i, (probes, data) in enumerate(raw):
            if data[KIND_AT] in (MODULE, FUNCTION_KIND):
                table, row = decode(data)
                if table == "functions":
                    self._on_function(probes, row)
                elif not self._on_module(row):
                    pending.add(i)
                early[i] = (table, row)
        for i, (probes, data) in enumerate(raw):
            table, row = early.get(i) or decode(data)
            name = self.names.get(row["function"]) if table == "launches" else None
            self.stats.count(table, row, name)
            if i not in pending:
                self.writer.add(table, row)
        self._settle()
        self.stats.lost = sum(p.lost() for p in self._probes)
        return len(raw)

    def _read(self, addr: int, size: int) -> bytes:
        if self._mem is None:
            return b""
        try:
            return os.pread(self._mem, size, addr)
        except OSError:
            return b""

    def _on_module(self, row: Row) -> bool:
        """Read the loaded image out of the process and start parsing its kernels' layouts in a
        worker process (PyTorch loads hundreds of MB of fatbins at start: parsed here, they would
        hold up the drain and every layout behind them). True when the row is complete now;
        otherwise `_settle` writes it once the parse is done."""
        addr = row["image"]
        for _ in range(2):  # a fatbin wrapper points at the fatbin: follow it once
            extent = fatbin.image_extent(self._read(addr, 4096))
            if extent is None or extent.indirect is None:
                break
            addr = int.from_bytes(self._read(addr + extent.indirect, 8), "little")
        row["kernels"] = 0
        self.by_module[row["handle"]] = {}
        if extent is None or not extent.size:
            row["note"] = f"image format not recognised (starts {self._read(addr, 8).hex()})"
        elif extent.size > MAX_IMAGE_BYTES:
            row["note"] = f"image of {extent.size} bytes not read"
        else:
            data = self._read(addr, extent.size)
            row["image_size"] = len(data)
            self._parses.append((self._workers().submit(_parse_image, data), row))
            return False
        return True

    def _on_function(self, probes: _Probes, row: Row) -> None:
        if row["api"] == "cuKernelGetFunction":   # `module` holds the CUkernel
            row["name"] = self.names.get(row["module"], "")
        name = row["name"]
        self.names[row["handle"]] = name
        pushed = self._pushed.get(row["handle"])
        if pushed and pushed[0] == name:   # a repeated lookup (cuBLAS makes one per launch)
            row["layout"] = pushed[1]
            return
        layout = self.by_module.get(row["module"], {}).get(name) or self.by_name.get(name)
        if layout is not None and probes.push_layout(row["handle"], layout):
            row["layout"] = _layout_json(layout)
            self._pushed[row["handle"]] = (name, row["layout"])
        elif name:
            self._unresolved[row["handle"]] = (probes, name)

    # ---- layouts that arrive later: parsed modules, then the mapped files' fatbins -------
    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1))
        return self._pool

    def _settle(self, wait: bool = False) -> None:
        """Take in finished parses and scans, and push the layouts that kernels waited for
        (`wait`: every parse, as the tracer closes). The mapped files are scanned, once, only
        for kernels that no loaded module explains: modules loaded before pos attached."""
        for future, row in [p for p in self._parses if wait or p[0].done()]:
            self._parses.remove((future, row))
            try:
                layouts, row["note"] = future.result(), None
            except (fatbin.FatbinError, OSError) as e:
                layouts, row["note"] = {}, str(e)
            row["kernels"] = len(layouts)
            self.by_module[row["handle"]] = layouts
            for name, layout in layouts.items():
                self.by_name.setdefault(name, layout)
            self.writer.add("modules", row)
            self._resolve("pos-layout")
        if self._scan is not None and self._scan.done():
            try:
                found = self._scan.result()
            except Exception:   # the scan is best effort: those launches keep 8-byte slots
                found = {}
            self._scan = None
            self._scan_enabled = False
            for name, layout in found.items():
                self.by_name.setdefault(name, layout)
            self._resolve("pos-layout-scan")
        if self._unresolved and not (wait or self._parses or self._scan) and self._scan_enabled:
            try:
                paths = [f"/proc/{self.pid}/root{p}" for p in mapped_files(self.pid)]
            except PosError:
                return
            self._scan = self._workers().submit(_scan_files, paths)

    def _resolve(self, source: str) -> None:
        """Push the layouts now known for kernels looked up earlier; a function row (ts 0, so
        that exports meet it before any launch) records each."""
        for handle, (probes, name) in list(self._unresolved.items()):
            layout = self.by_name.get(name)
            if layout is not None and probes.push_layout(handle, layout):
                self._pushed[handle] = (name, _layout_json(layout))
                self.writer.add("functions", {
                    "ts_ns": 0, "pid": self.pid, "tid": 0, "api": source, "handle": handle,
                    "module": None, "name": name, "layout": self._pushed[handle][1]})
                del self._unresolved[handle]

    def close(self) -> None:
        """Detach the probes (after a last drain by the caller) and free what the session holds."""
        for p in getattr(self, "_probes", []):
            p.close()
        if getattr(self, "_parses", None):
            self._settle(wait=True)   # the module rows still being parsed
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if getattr(self, "_mem", None) is not None:
            os.close(self._mem)
            self._mem = None
