"""Kernel parameter layouts from the CUDA images a process loads (cubins and fatbins).

Why: a launch hands the driver an array of pointers to its arguments, not the arguments. To copy
the argument values in a probe, and so speculate which buffers a kernel touches, the tracer
must know each parameter's offset and size. The compiler records them in the cubin, in the
`EIATTR_KPARAM_INFO` attributes of the `.nv.info.<kernel>` sections; this module reads them
from an image read out of the process (`image_extent` says how many bytes to read) or from the
`.nv_fatbin` section of a mapped executable or library.

The formats are NVIDIA's and undocumented; what is relied on here was taken from public
reverse-engineering notes and checked against nvcc 13 and `cuobjdump -elf`:

- fatbin container: u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of the entries
  that follow. Containers are concatenated (8-byte aligned) in a `.nv_fatbin` section.
- fatbin entry: u16 kind (1 PTX, 2 cubin), u16 version, u32 header size, u64 payload size
  (padded to 8), u32 compressed size, then at byte 40 u64 flags and at byte 56 u64 uncompressed
  size; the payload follows the entry header. Flag 0x2000 marks an LZ4 block (nvcc
  `--compress-mode=speed`), flag 0x8000 a Zstandard frame (the other modes).
- `.nv.info` records: u8 format, u8 attribute, u16 value; for format 4 (EIFMT_SVAL) the u16 is
  the size of the payload that follows. KPARAM_INFO's payload: u32 index, u16 ordinal, u16
  offset, u32 word whose bits 18..31 hold the size.
- kernels are the cubin's function symbols with the STO_CUDA_ENTRY bit (0x10) in st_other;
  device functions, which can have `.text.<name>` and `.nv.info.<name>` sections too, lack it.
"""

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Optional

import lz4.block
import zstandard
from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

ELF_MAGIC = b"\x7fELF"
FATBIN_MAGIC = 0xBA55ED50
WRAPPER_MAGIC = 0x466243B1      # __fatBinC_Wrapper_t: u32 magic, u32 version, fatbin pointer at 8
ENTRY_CUBIN = 2
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000

_FATBIN_MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)
_FATBIN_HEADER = struct.Struct("<IHHQ")             # magic, version, header size, entries size
_ENTRY_HEADER = struct.Struct("<HHIQI20xQ8xQ")      # kind, version, header size, payload size,
                                                    # compressed size, flags, uncompressed size
_ELF_HEADER = struct.Struct("<16xHHIQQQIHHHHHH")    # Elf64_Ehdr after e_ident
_SECTION = struct.Struct("<IIQQQQIIQQ")             # Elf64_Shdr
_SYMBOL = struct.Struct("<IBBHQQ")                  # Elf64_Sym
_SHT_SYMTAB, _SHT_NOBITS = 2, 8
_STT_FUNC, _STO_CUDA_ENTRY = 2, 0x10
_EIFMT_SVAL = 4
_EIATTR_KPARAM_INFO, _EIATTR_CBANK_PARAM_SIZE = 0x17, 0x19


class FatbinError(Exception):
    """The image is malformed or in a form this module does not read."""


@dataclass(frozen=True)
class Param:
    """One kernel parameter: where it lies in the parameter buffer."""

    offset: int
    size: int


@dataclass(frozen=True)
class KernelLayout:
    """A kernel's parameters in declaration order."""

    params: tuple[Param, ...]

    @property
    def total_size(self) -> int:
        """Bytes of the parameter buffer up to the end of the last parameter."""
        return max((p.offset + p.size for p in self.params), default=0)


class _Section(NamedTuple):
    name: str
    type: int
    data: bytes
    link: int


@dataclass(frozen=True)
class Extent:
    """How much to read at an image's address; `indirect` is the offset of a pointer to the
    real image when the address holds a fatbin wrapper (then `size` is 0)."""

    size: int
    indirect: Optional[int] = None


def image_extent(head: bytes) -> Optional[Extent]:
    """Recognise the image whose first bytes are `head`; None when it is none of ours."""
    if head[:4] == ELF_MAGIC and len(head) >= _ELF_HEADER.size and head[4:6] == b"\x02\x01":
        (_, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
         _) = _ELF_HEADER.unpack_from(head)
        return Extent(max(phoff + phnum * phentsize, shoff + shnum * shentsize))
    if len(head) >= _FATBIN_HEADER.size:
        magic, _, header_size, size = _FATBIN_HEADER.unpack_from(head)
        if magic == FATBIN_MAGIC:
            return Extent(header_size + size)
        if magic == WRAPPER_MAGIC:
            return Extent(0, indirect=8)
    return None


def parse_image(data: bytes, part: str = "all") -> dict[str, KernelLayout]:
    """Layouts by mangled kernel name from a cubin or from concatenated fatbins.

    `part` lets a caller get most layouts early: a fatbin container holds one translation
    unit compiled for several architectures, and a kernel's parameter layout is the same in
    each, so "first" (the first cubin of every container) already names nearly every kernel
    for a fraction of the decompression; "rest" gives the other cubins (kernels built for some
    architectures only); "all" both."""
    return parse_share(lambda at, n: data[at:at + n], len(data), part)


def parse_share(read: Callable[[int, int], bytes], size: int, part: str = "all", share: int = 0,
                shares: int = 1) -> dict[str, KernelLayout]:
    """parse_image of an image of `size` bytes that `read(offset, n)` gives parts of, limited to
    the containers whose index is `share` modulo `shares`: parsers working in parallel take one
    share each of a large image and read only its containers. A cubin is share 0's."""
    head = read(0, 4)
    if head == ELF_MAGIC:
        return _cubin_layouts(read(0, size)) if part != "rest" and share == 0 else {}
    if head != _FATBIN_MAGIC_BYTES:
        raise FatbinError("the data is neither a cubin nor a fatbin.")
    layouts: dict[str, KernelLayout] = {}
    for index, (start, end) in enumerate(_containers(read, size)):
        if index % shares != share:
            continue
        for cubin in _container_cubins(read(start, end - start), part):
            for name, layout in _cubin_layouts(cubin).items():
                layouts.setdefault(name, layout)
    return layouts


def layouts_from_elf_file(path: str) -> dict[str, KernelLayout]:
    """Layouts from the `.nv_fatbin` section of a host executable, library or object.

    Reads only the ELF headers and that section; {} for a file without one or not ELF.
    OSError passes through (also for offsets so corrupt that seeking to them fails).
    """
    with open(path, "rb") as f:
        if f.read(4) != ELF_MAGIC:
            return {}
        f.seek(0)
        try:
            section = ELFFile(f).get_section_by_name(".nv_fatbin")
        except (ELFError, ValueError) as e:
            raise FatbinError(f"{path} has unreadable ELF headers ({e}).") from e
        if section is None or section["sh_type"] == "SHT_NOBITS":
            return {}
        offset, size = section["sh_offset"], section["sh_size"]
        if offset + size > os.fstat(f.fileno()).st_size:
            raise FatbinError(f"the .nv_fatbin section of {path} runs past the end of the file.")
        f.seek(offset)
        data = f.read(size)
    if data[:4] != _FATBIN_MAGIC_BYTES:
        raise FatbinError(f"the .nv_fatbin section of {path} does not start with a fatbin.")
    return parse_image(data)


# ---- fatbins ------------------------------------------------------------------------------

def _containers(read: Callable[[int, int], bytes], size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each container: the first at 0, each next one at the first magic after
    the end of the last (padding may lie between them)."""
    start = 0
    while start >= 0:
        head = read(start, _FATBIN_HEADER.size)
        if len(head) < _FATBIN_HEADER.size:
            raise FatbinError(f"the fatbin header at offset {start} is cut off.")
        _, _, header_size, body = _FATBIN_HEADER.unpack(head)
        end = start + header_size + body
        if header_size < _FATBIN_HEADER.size or end > size:
            raise FatbinError(f"the fatbin at offset {start} claims {header_size + body} bytes "
                              f"but only {size - start} are there.")
        yield start, end
        start = _next_magic(read, end, size)


def _next_magic(read: Callable[[int, int], bytes], at: int, size: int) -> int:
    """The offset of the first container magic at or after `at`; -1 when there is none."""
    window = 4096
    while at < size:
        found = read(at, window + len(_FATBIN_MAGIC_BYTES) - 1).find(_FATBIN_MAGIC_BYTES)
        if found >= 0:
            return at + found
        at += window
    return -1


def _container_cubins(container: bytes, part: str = "all") -> list[bytes]:
    """The cubins (`part`: all, the first, or the rest) of one container, decompressed."""
    _, _, header_size, size = _FATBIN_HEADER.unpack_from(container)
    end = header_size + size
    cubins = []
    seen = 0
    pos = header_size
    while pos < end:
        if pos + _ENTRY_HEADER.size > end:
            raise FatbinError(f"the fatbin entry at offset {pos} is cut off.")
        kind, _, entry_size, padded, packed, flags, full = _ENTRY_HEADER.unpack_from(container,
                                                                                     pos)
        payload = pos + entry_size
        pos = payload + padded
        if entry_size < _ENTRY_HEADER.size or pos > end:
            raise FatbinError(f"the fatbin entry at offset {payload - entry_size} runs past "
                              "the end of its container.")
        if kind == ENTRY_CUBIN:
            seen += 1
            if part == "all" or (part == "first") == (seen == 1):
                cubins.append(_decompress(container[payload:pos], flags, packed, full))
    return cubins


def _decompress(payload: bytes, flags: int, packed: int, full: int) -> bytes:
    """An entry's payload as stored, or decompressed when its flags say so."""
    try:
        if flags & FLAG_LZ4:
            out = lz4.block.decompress(payload[:packed], uncompressed_size=full)
        elif flags & FLAG_ZSTD:
            # streamed, so that a corrupt frame header cannot make it allocate a huge buffer
            out = zstandard.ZstdDecompressor().decompressobj().decompress(payload[:packed])
        else:
            return payload
    except (lz4.block.LZ4BlockError, zstandard.ZstdError, OverflowError) as e:
        raise FatbinError(f"a compressed fatbin entry does not decompress ({e}).") from e
    if len(out) != full:
        raise FatbinError(f"a compressed fatbin entry gave {len(out)} bytes, not {full}.")
    return out


# ---- cubins -------------------------------------------------------------------------------

def _cubin_layouts(elf: bytes) -> dict[str, KernelLayout]:
    """Every kernel of a cubin with the layout of its `.nv.info.<kernel>` section."""
    sections = _sections(elf)
    contents = {s.name: s.data for s in sections}
    layouts: dict[str, KernelLayout] = {}
    for symtab in sections:
        if symtab.type != _SHT_SYMTAB:
            continue
        if len(symtab.data) % _SYMBOL.size or symtab.link >= len(sections):
            raise FatbinError("the cubin's symbol table is malformed.")
        names = sections[symtab.link].data
        for st_name, info, other, shndx, _, _ in _SYMBOL.iter_unpack(symtab.data):
            if info & 0xF != _STT_FUNC or not other & _STO_CUDA_ENTRY or shndx == 0:
                continue
            name = _string(names, st_name)
            layout = _layout(name, contents.get(".nv.info." + name, b""))
            if layout is not None:
                layouts[name] = layout
    return layouts


def _sections(elf: bytes) -> list[_Section]:
    """The sections of a 64-bit little-endian ELF image."""
    if len(elf) < _ELF_HEADER.size or elf[4:6] != b"\x02\x01":
        raise FatbinError("the cubin is not a 64-bit little-endian ELF image.")
    *_, shoff, _, _, _, _, shentsize, shnum, shstrndx = _ELF_HEADER.unpack_from(elf)
    if shentsize != _SECTION.size or shoff + shnum * shentsize > len(elf) or shstrndx >= shnum:
        raise FatbinError("the cubin's section headers lie outside the image.")
    headers = [_SECTION.unpack_from(elf, shoff + i * shentsize) for i in range(shnum)]
    contents = []
    for _, kind, _, _, offset, size, *_ in headers:
        if kind != _SHT_NOBITS and offset + size > len(elf):
            raise FatbinError("a cubin section lies outside the image.")
        contents.append(b"" if kind == _SHT_NOBITS else elf[offset:offset + size])
    names = contents[shstrndx]
    return [_Section(_string(names, h[0]), h[1], data, h[6])
            for h, data in zip(headers, contents, strict=True)]


def _string(table: bytes, at: int) -> str:
    """The NUL-terminated name at `at` of an ELF string table."""
    end = table.find(b"\0", at)
    if end < 0:
        raise FatbinError("a cubin name is not inside its string table.")
    return table[at:end].decode("utf-8", "replace")


def _layout(name: str, attributes: bytes) -> Optional[KernelLayout]:
    """The layout described by a kernel's `.nv.info` records; None when the kernel takes
    parameters (a non-zero parameter bank) that no KPARAM_INFO describes."""
    params: list[tuple[int, Param]] = []
    bank_size = 0
    pos = 0
    while pos + 4 <= len(attributes):
        fmt, attribute, value = struct.unpack_from("<BBH", attributes, pos)
        if not 1 <= fmt <= _EIFMT_SVAL:
            raise FatbinError(f"the .nv.info record at offset {pos} of {name} has unknown "
                              f"format {fmt}.")
        payload = attributes[pos + 4:pos + 4 + value] if fmt == _EIFMT_SVAL else b""
        if fmt == _EIFMT_SVAL and len(payload) != value:
            raise FatbinError(f"the .nv.info record at offset {pos} of {name} is cut off.")
        pos += 4 + len(payload)
        if attribute == _EIATTR_KPARAM_INFO:
            if len(payload) < 12:
                raise FatbinError(f"a KPARAM_INFO record of {name} is too short.")
            _, ordinal, offset, word = struct.unpack_from("<IHHI", payload)
            params.append((ordinal, Param(offset, (word >> 18) & 0x3FFF)))
        elif attribute == _EIATTR_CBANK_PARAM_SIZE and fmt != _EIFMT_SVAL:
            bank_size = value
    if bank_size and not params:
        return None
    return KernelLayout(tuple(p for _, p in sorted(params, key=lambda op: op[0])))
