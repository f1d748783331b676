"""A tracing session: load the probes, attach them to one process, drain and record events.

Data flow: probes (pos/bpf) -> ring buffer -> `Tracer.poll` (bulk drain; resolves kernel names
and parameter layouts from the lookup and module events) -> `Sink` (another process: decodes the
rest and makes batched inserts into the store). Module images are parsed in the drain when
small, else in worker processes; each parsed layout goes into the probes' `named_layouts` map
(by kernel-name hash), so that the probe gives a handle looked up later its layout in the
kernel, and into the `layouts` map (by handle) for handles looked up before the parse ended, so
that launches copy exactly their parameters. Launches that run before their kernel's layout is
known are recorded as 8-byte slots with layout_known = False, and with a capture while a layout
may still come (the probe marks the handle `awaiting` at its lookup; `poll` unmarks it once
nothing can bring one), from which pos/tracer/late.py completes them when the trace ends;
captures are paid from a credit that each drain refills, so that a storm of such launches cannot
flood the ring.
"""

import json
import mmap
import os
import struct
import threading
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from pos.errors import PosError
from pos.tracer import fatbin, ring
from pos.tracer.events import (ALLOC, FREE, FUNCTION_KIND, LAUNCH_KIND, LAYOUT, MAX_PARAMS,
                               MEMCPY, MEMORY_KINDS, MEMSET, MODULE, SYNC, Row, decode)
from pos.tracer.late import Completion
from pos.tracer.bpfsys import Map
from pos.tracer.probes import DEFAULT_RINGBUF_PAGES, Family, bpf_include_dir, bpf_text
from pos.tracer.program import Loaded, compiled
from pos.tracer.ring import LAUNCH_KNOWN_AT, MAX_RECORDS, Batch, RingReader
from pos.tracer.sink import Sink
from pos.tracer.target import MappedLibrary, mapped_files

MAX_IMAGE_BYTES = 1 << 30
# Images up to this size are parsed in the drain itself (milliseconds): their layouts reach the
# probes in the drain that sees the load, before the job's lookups of its kernels are handled.
INLINE_PARSE_BYTES = 1 << 18
# Images larger than this are parsed by every worker at once, each taking one share of their
# fatbin containers: the layouts of one large library (cuBLAS, libtorch_cuda) come as soon as
# those of many small ones.
SHARED_PARSE_BYTES = 16 << 20
# Bytes of captures the probes may write between two drains (pos/bpf/common.h: capture_credit):
# about 200 launches' captures of the usual size (one window of 4-5 KiB), 60 of the largest
# (17 KiB), at the default 20 ms interval 3,000 to 10,000 a second -- the start of a job, where
# a few kernels wait for their layout, not a storm -- and never more than 1/16 of the ring,
# which stays for the launch events themselves.
CAPTURE_CREDIT = 1 << 20
CAPTURE_RING_SHARE = 16
NAME_LEN = 1024                  # POS_NAME_LEN of pos/bpf/events.h
_U32, _U64, _S64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q")
FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


# pos_hdr.kind -> the store table its rows go to (what the live view counts).
TABLE_OF_KIND = {LAUNCH_KIND: "launches", MEMCPY: "copies", MEMSET: "copies", SYNC: "syncs",
                 MODULE: "modules", FUNCTION_KIND: "functions",
                 **{k: "allocations" for k in MEMORY_KINDS}}


@dataclass
class Stats:
    """What the live view shows; taken from each drained batch without decoding it."""

    events: Counter = field(default_factory=Counter)      # by table
    kernels: Counter = field(default_factory=Counter)     # launches by kernel name
    live_bytes: int = 0
    copied_bytes: int = 0
    lost: int = 0
    captures_dropped: int = 0     # launches that lost their capture: the credit was spent
    layout_known: int = 0
    layouts_full: bool = False    # a probes' layout map ran full (later kernels: 8-byte slots)
    # launches completed after the trace, and why the others stay without a layout (late.py)
    completion: Completion = field(default_factory=Completion)
    _sizes: dict[int, int] = field(default_factory=dict)

    def take(self, batch: Batch, names: dict[int, str]) -> None:
        kinds, counts = np.unique(batch.kinds, return_counts=True)
        for kind, n in zip(kinds.tolist(), counts.tolist()):
            self.events[TABLE_OF_KIND.get(kind, "other")] += n
        launch = batch.kinds == LAUNCH_KIND
        if launch.any():
            handles, counts = np.unique(batch.words[launch, 0], return_counts=True)
            for h, n in zip(handles.tolist(), counts.tolist()):
                self.kernels[names.get(h) or f"<0x{h:x}>"] += n
            raw = np.frombuffer(batch.data, np.uint8)
            self.layout_known += int(raw[batch.offsets[launch] + LAUNCH_KNOWN_AT].sum())
        self.copied_bytes += int(batch.words[batch.kinds == MEMCPY, 2].sum())
        for i in np.flatnonzero((batch.kinds == ALLOC) | (batch.kinds == FREE)).tolist():
            ptr, size = int(batch.words[i, 0]), int(batch.words[i, 1])
            if batch.kinds[i] == ALLOC:
                self._sizes[ptr] = size
                self.live_bytes += size
            else:
                self.live_bytes -= self._sizes.pop(ptr, 0)


def name_hash(name: str) -> int:
    """FNV-1a of a kernel name as the probes see it (pos/bpf/common.h: name_hash): its first
    POS_NAME_LEN - 1 bytes."""
    h = FNV_OFFSET
    for c in name.encode()[:NAME_LEN - 1]:
        h = ((h ^ c) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def _layout_json(layout: fatbin.KernelLayout) -> str:
    return json.dumps([[p.offset, p.size] for p in layout.params])


@dataclass
class _Module:
    """A module image being parsed in workers: first the first cubin of each fatbin container
    (most kernels, quickly), then the rest (fatbin.parse_image says why); a large image in as
    many shares as there are workers, each part's shares at once."""

    row: Row
    addr: int      # the image in the process's memory
    size: int
    shares: int
    part: str = "first"
    left: int = 0                  # shares of the part not yet taken in
    note: Optional[str] = None     # why (a share of) the image could not be parsed
    wanted: bool = False           # a kernel of it was looked up and waits for its layout


@dataclass
class _Parse:
    """One share of a part of a module image, in a worker."""

    future: Future
    module: _Module


def next_share(queue: list[tuple[_Module, int]]) -> int:
    """Which queued share a free worker parses next: the first of a module that a looked-up
    kernel waits for (the parse follows the job's lookups), else the oldest."""
    return next((i for i, (m, _) in enumerate(queue) if m.wanted), 0)


def _parse_at(pid: int, addr: int, size: int, part: str, share: int, shares: int
              ) -> dict[str, fatbin.KernelLayout]:
    """fatbin.parse_share of the image at `addr` in `pid`'s memory (runs in a worker, which
    reads the image itself, and only its share: PyTorch's are hundreds of MB, which the drain
    must neither read nor send through a pipe). FatbinError for an image cut short (the process
    unmapped it)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return fatbin.parse_share(lambda at, n: os.pread(fd, max(0, min(n, size - at)), addr + at),
                                  size, part, share, shares)
    finally:
        os.close(fd)


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
    """One family's BPF program attached to one library of the target (pos/tracer/program.py)."""

    def __init__(self, library: MappedLibrary, pid: int, ringbuf_pages: int,
                 say: Callable[[str], None]) -> None:
        self.family: Family = library.family
        # compiled with the default ring size (the size is only the map's, set at load): one
        # cached program for every --ringbuf-mb
        program = compiled(self.family, bpf_text(self.family, DEFAULT_RINGBUF_PAGES),
                           [f"-I{bpf_include_dir()}"], say)
        self.loaded = Loaded(program, self.family, library.host_path, pid,
                             ringbuf_pages * mmap.PAGESIZE)
        self.attached: list[str] = self.loaded.attached
        maps = self.loaded.maps
        self.layouts, self.named, self.awaiting = maps["layouts"], maps["named_layouts"], \
            maps["awaiting"]
        self.awaited: set[int] = set()   # handles the probes mark `awaiting`, read, not resolved
        self.full = False        # a layouts map ran full: later kernels go without layouts
        self.ring = RingReader(maps["events"].fd, ringbuf_pages * mmap.PAGESIZE)
        self._credit = maps["capture_credit"]
        self._budget = min(CAPTURE_CREDIT, self.ring.size // CAPTURE_RING_SHARE)
        self.refill()

    def refill(self) -> None:
        """Give the probes the next drain's capture credit (what is left of the last is
        forgotten: the credit bounds the bytes between two drains)."""
        self._credit.update(_U32.pack(0), _S64.pack(self._budget))

    def release(self) -> None:
        """Unmark the awaited handles: no layout can come for them any more, so their launches
        stop keeping a capture (pos/tracer/late.py)."""
        for handle in self.awaited:
            self.awaiting.delete(_U64.pack(handle))   # False: evicted already (an LRU map)
        self.awaited.clear()

    @staticmethod
    def _leaf(layout: fatbin.KernelLayout) -> Optional[bytes]:
        n = len(layout.params)
        if n > MAX_PARAMS:
            return None
        pad = [0] * (MAX_PARAMS - n)
        return LAYOUT.pack(n, min(layout.total_size, 0xFFFF),
                           *[min(p.offset, 0xFFFF) for p in layout.params], *pad,
                           *[min(p.size, 0xFFFF) for p in layout.params], *pad)

    def push_layout(self, handle: int, layout: fatbin.KernelLayout) -> bool:
        """False when the layout cannot be given (too many parameters, map full): that
        kernel's launches are then recorded as 8-byte slots, with layout_known false."""
        leaf = self._leaf(layout)
        return leaf is not None and self._update(self.layouts, handle, leaf)

    def push_named(self, layouts: dict[str, fatbin.KernelLayout]) -> None:
        """Layouts by name hash, for the probes to give to handles at their lookup."""
        for name, layout in layouts.items():
            leaf = self._leaf(layout)
            if leaf is not None and not self._update(self.named, name_hash(name), leaf):
                return

    def _update(self, table: Map, key: int, leaf: bytes) -> bool:
        try:
            table.update(_U64.pack(key), leaf)
        except OSError:   # E2BIG when the map is full
            self.full = True
            return False
        return True

    def _count(self, name: str) -> int:
        """The sum over CPUs of a one-entry per-CPU counter map."""
        raw = self.loaded.maps[name].lookup(_U32.pack(0)) or b""
        return sum(v for (v,) in _U64.iter_unpack(raw))

    def lost(self) -> int:
        return self._count("lost")

    def captures_dropped(self) -> int:
        return self._count("captures_dropped")

    def detach(self) -> None:
        self.loaded.detach()

    def close(self) -> None:
        self.ring.close()
        self.loaded.close()


class Tracer:
    """Probes attached to one process; `poll` moves what they saw into the sink."""

    def __init__(self, pid: int, libraries: list[MappedLibrary], sink: Sink,
                 ringbuf_pages: int = DEFAULT_RINGBUF_PAGES, scan_libraries: bool = True,
                 say: Callable[[str], None] = lambda _: None) -> None:
        """`say`: where a line goes that tells what the start waits for (a compilation)."""
        self.pid = pid
        self.sink = sink
        self.stats = Stats()
        # Started now, before the probes exist (forked workers would hold their file descriptors)
        # and before the first module load, which must not wait for the workers to start.
        self._workers = min(8, len(os.sched_getaffinity(0)))
        self._pool = ProcessPoolExecutor(max_workers=self._workers)
        self._pool.submit(os.getpid).result()
        warm = threading.Thread(target=ring.warm_up, name="pos-ring-warm-up")
        warm.start()
        try:
            self._probes: list[_Probes] = []
            for lib in libraries:
                self._probes.append(_Probes(lib, pid, ringbuf_pages, say))
        except BaseException:
            self.close()
            raise
        finally:
            warm.join()
        self.attached_at = time.monotonic()
        self.detached_at: Optional[float] = None
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
        self._parses: list[_Parse] = []                       # shares in the workers
        self._queue: list[tuple[_Module, int]] = []           # shares waiting for a worker
        self._modules: dict[int, _Module] = {}                # module handle -> being parsed
        self._scan: Optional[Future] = None
        self._scan_enabled = scan_libraries
        try:
            self._mem: Optional[int] = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError:
            self._mem = None

    # ---- draining ------------------------------------------------------------------------
    def poll(self) -> int:
        """Drain every ring buffer; returns how many events were taken.

        Kernel lookups and module loads are handled here, before the batch goes to the sink:
        their layouts reach the probes at once, so that the kernel's next launches are captured
        with their layout as early as possible. Everything else is decoded by the sink."""
        taken = 0
        for probes in self._probes:
            while True:
                batch = probes.ring.read()
                taken += len(batch)
                if len(batch):
                    self._take(probes, batch)
                if len(batch) < MAX_RECORDS:
                    break
        for probes in self._probes:
            probes.refill()
        self._settle()
        if not self.layouts_pending():
            for probes in self._probes:
                probes.release()
        self.stats.lost = sum(p.lost() for p in self._probes)
        self.stats.captures_dropped = sum(p.captures_dropped() for p in self._probes)
        self.stats.layouts_full = any(p.full for p in self._probes)
        self.sink.check()
        return taken

    def _take(self, probes: _Probes, batch: Batch) -> None:
        meta = (batch.kinds == MODULE) | (batch.kinds == FUNCTION_KIND)
        for at in batch.offsets[meta].tolist():
            table, row = decode(batch.data, at)
            if table == "functions":
                self._on_function(probes, row)
            elif not self._on_module(row):
                continue                     # `_settle` sends it once its image is parsed
            self.sink.add(table, row)
        self.stats.take(batch, self.names)
        self.sink.raw(batch.data, batch.offsets[~meta])

    def _read(self, addr: int, size: int) -> bytes:
        if self._mem is None:
            return b""
        try:
            return os.pread(self._mem, size, addr)
        except OSError:
            return b""

    def _on_module(self, row: Row) -> bool:
        """Read the loaded image out of the process and parse its kernels' layouts: a small one
        at once, a large one in a worker process (PyTorch loads hundreds of MB of fatbins at
        start: parsed here, they would hold up the drain and every layout behind them). True
        when the row is complete now; otherwise `_settle` writes it once the parse is done."""
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
            row["image_size"] = extent.size
            if extent.size > INLINE_PARSE_BYTES:
                shares = self._workers if extent.size > SHARED_PARSE_BYTES else 1
                self._parse(_Module(row, addr, extent.size, shares))
                return False
            try:
                layouts, row["note"] = fatbin.parse_image(self._read(addr, extent.size)), None
            except fatbin.FatbinError as e:
                layouts, row["note"] = {}, str(e)
            row["kernels"] = self._merge(row, layouts)
            self._resolve("pos-layout")
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
        else:
            probes.awaited.add(row["handle"])
            if name:
                self._unresolved[row["handle"]] = (probes, name)
            if row["module"] in self._modules:
                self._modules[row["module"]].wanted = True

    # ---- layouts that arrive later: parsed modules, then the mapped files' fatbins -------
    def _settle(self, wait: bool = False) -> None:
        """Take in finished parses and scans, and push the layouts that kernels waited for
        (`wait`: every parse and the scan, as the tracer closes: launches recorded before their
        layout came are completed from them). The mapped files are scanned, once, only for
        kernels that no loaded module explains: modules loaded before pos attached."""
        while True:
            self._pump()
            done = [p for p in self._parses if wait or p.future.done()]
            if not done:
                break
            for p in done:
                self._parses.remove(p)
                self._take_parse(p)
            self._resolve("pos-layout")
        if self._unresolved and not (self._parses or self._queue or self._scan) and \
                self._scan_enabled:
            try:
                paths = [f"/proc/{self.pid}/root{p}" for p in mapped_files(self.pid)]
                self._scan = self._pool.submit(_scan_files, paths)
            except PosError:    # the process is gone: its files with it
                self._scan_enabled = False
        if self._scan is not None and (wait or self._scan.done()):
            try:
                found = self._scan.result()
            except Exception:   # the scan is best effort: those launches keep 8-byte slots
                found = {}
            self._scan = None
            self._scan_enabled = False
            self._learn(found)
            self._resolve("pos-layout-scan")

    def _learn(self, layouts: dict[str, fatbin.KernelLayout]) -> None:
        """Layouts by name, for user space and the probes; only names not known yet are
        pushed (the rest of a fatbin mostly repeats its first cubins' kernels for other
        architectures, and every push is a map update in the drain's thread)."""
        new = {name: layout for name, layout in layouts.items() if name not in self.by_name}
        self.by_name.update(new)
        for probes in self._probes:
            probes.push_named(new)

    def _take_parse(self, p: _Parse) -> None:
        """Merge a finished share; once every share of the first part is in, parse the rest;
        once the rest is in, store the module's row."""
        m = p.module
        try:
            layouts = p.future.result()
        except (fatbin.FatbinError, OSError) as e:
            layouts, m.note = {}, m.note or str(e)
        kernels = self._merge(m.row, layouts)
        m.left -= 1
        if m.left:
            return
        if m.part == "first" and m.note is None:
            m.part = "rest"
            self._parse(m)
            return
        m.row["kernels"], m.row["note"] = kernels, m.note
        self.sink.add("modules", m.row)
        del self._modules[m.row["handle"]]

    def _parse(self, m: _Module) -> None:
        """Queue the shares of the module's current part."""
        self._modules[m.row["handle"]] = m
        m.left = m.shares
        self._queue.extend((m, share) for share in range(m.shares))

    def _pump(self) -> None:
        """Give each free worker a queued share (next_share says which). Shares wait here, not
        in the pool's queue, so that one whose kernels the job has looked up goes first."""
        while self._queue and len(self._parses) < self._workers:
            m, share = self._queue.pop(next_share(self._queue))
            future = self._pool.submit(_parse_at, self.pid, m.addr, m.size, m.part, share,
                                       m.shares)
            self._parses.append(_Parse(future, m))

    def _merge(self, row: Row, layouts: dict[str, fatbin.KernelLayout]) -> int:
        """Add parsed layouts of the module of `row` (the first definition of a name wins) and
        give them to the probes; how many kernels the module has so far."""
        merged = self.by_module.setdefault(row["handle"], {})
        for name, layout in layouts.items():
            merged.setdefault(name, layout)
        self._learn(layouts)
        return len(merged)

    def _resolve(self, source: str) -> None:
        """Push the layouts now known for kernels looked up earlier; a function row (ts 0, so
        that exports meet it before any launch) records each."""
        for handle, (probes, name) in list(self._unresolved.items()):
            layout = self.by_name.get(name)
            if layout is not None and probes.push_layout(handle, layout):
                self._pushed[handle] = (name, _layout_json(layout))
                self.sink.add("functions", {
                    "ts_ns": 0, "pid": self.pid, "tid": 0, "api": source, "handle": handle,
                    "module": None, "name": name, "layout": self._pushed[handle][1]})
                del self._unresolved[handle]
                probes.awaited.discard(handle)

    def layouts_pending(self) -> bool:
        """Whether `close` will wait for module parses or the mapped-file scan."""
        return bool(self._parses or self._queue or self._scan or
                    (self._unresolved and self._scan_enabled))

    def detach(self) -> None:
        """Detach every probe: nothing is recorded after this; what the probes wrote before
        stays in the ring for the last `poll`."""
        if hasattr(self, "attached_at") and self.detached_at is None:
            self.detached_at = time.monotonic()    # the first probe goes now
        for p in getattr(self, "_probes", []):
            p.detach()

    def seconds(self) -> float:
        """How long the probes were (or have been) attached."""
        return (self.detached_at or time.monotonic()) - self.attached_at

    def close(self) -> None:
        """Detach the probes if `detach` did not, and free what the session holds (after a
        last drain by the caller)."""
        self.detach()
        if hasattr(self, "_parses") and self.layouts_pending():
            self._settle(wait=True)   # module rows still being parsed, layouts still missing
        for p in getattr(self, "_probes", []):
            p.close()
        if hasattr(self, "_pool"):
            self._pool.shutdown(wait=False, cancel_futures=True)
        mem = getattr(self, "_mem", None)
        if mem is not None:
            os.close(mem)
            self._mem = None
