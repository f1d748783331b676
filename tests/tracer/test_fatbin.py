"""Parameter layouts read from real nvcc output: a cubin, fatbins (plain, zstd and LZ4
compressed), an object file and a linked executable.

The expected layouts follow the C ABI (each parameter at its natural alignment, a by-value
struct at its own size and alignment) and were checked once against `cuobjdump -elf`.
"""

import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from pos.tracer import fatbin
from tests.conftest import need

KERNELS = Path(__file__).resolve().parent.parent / "fakegpu" / "kernels.cu"
TWO_ARCHS = ["-gencode", "arch=compute_90,code=sm_90",
             "-gencode", "arch=compute_80,code=[sm_80,compute_80]"]
EXTRA = """
__global__ void extra(double d, int *p) { *p = (int)d; }
int main() { return 0; }
"""

EXPECTED = {
    "_Z4axpyfPKfPfi": [(0, 4), (8, 8), (16, 8), (24, 4)],     # float, const float*, float*, int
    "_Z9pair_copy4Pairf": [(0, 24), (24, 4)],                  # Pair {float*, float*, int}, float
    "_Z5mixed5MixedPKd": [(0, 24), (24, 8)],                   # Mixed {char, double*, u32}, ptr
    "_Z7scalarscsixdPf": [(0, 1), (2, 2), (4, 4), (8, 8), (16, 8), (24, 8)],
    "_Z4fillIfEvPT_S0_i": [(0, 8), (8, 4), (12, 4)],           # fill<float>(float*, float, int)
    "_Z4fillIiEvPT_S0_i": [(0, 8), (8, 4), (12, 4)],           # fill<int>(int*, int, int)
    "no_params": [],
    "_Z11tensor_list10TensorListf": [(0, 3368), (3368, 4)],   # a 3 KiB struct, float
    "_Z4manyPf" + "i" * 19: [(0, 8)] + [(8 + 4 * i, 4) for i in range(19)],   # 20 parameters
}
WITH_EXTRA = {**EXPECTED, "_Z5extradPi": [(0, 8), (8, 8)]}     # the app also links cudart's
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _nvcc(*args: str) -> None:
    subprocess.run(["nvcc", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test kernels compiled once into every form the parser reads."""
    need(shutil.which("nvcc") is not None, "nvcc is needed to compile the test kernels")
    out = tmp_path_factory.mktemp("fatbin")
    files = {name: out / name for name in
             ("kernels.cubin", "two.fatbin", "zstd.fatbin", "lz4.fatbin", "kernels.o", "app")}
    src = str(KERNELS)
    _nvcc("-cubin", "-arch=sm_90", "-o", str(files["kernels.cubin"]), src)
    _nvcc("-fatbin", *TWO_ARCHS, "-o", str(files["two.fatbin"]), src)
    _nvcc("-fatbin", *TWO_ARCHS, "-Xfatbin", "-compress-all", "-o", str(files["zstd.fatbin"]), src)
    _nvcc("-fatbin", *TWO_ARCHS, "-Xfatbin", "-compress-all", "--compress-mode=speed",
          "-o", str(files["lz4.fatbin"]), src)
    _nvcc("-c", "-o", str(files["kernels.o"]), src)
    extra = out / "extra.cu"
    extra.write_text(EXTRA)
    _nvcc("-c", "-Xfatbin", "-compress-all", "-o", str(out / "extra.o"), str(extra))
    _nvcc("-o", str(files["app"]), str(files["kernels.o"]), str(out / "extra.o"))
    return files


def _plain(layouts: dict[str, fatbin.KernelLayout]) -> dict[str, list[tuple[int, int]]]:
    return {name: [(p.offset, p.size) for p in layout.params] for name, layout in layouts.items()}


def _entries(data: bytes) -> list[tuple[int, int, bytes]]:
    """(kind, flags, first payload bytes) of each entry of a single fatbin container."""
    entries = []
    pos = 16
    while pos < len(data):
        kind, _, header_size, padded = struct.unpack_from("<HHIQ", data, pos)
        flags, = struct.unpack_from("<Q", data, pos + 40)
        entries.append((kind, flags, data[pos + header_size:pos + header_size + 4]))
        pos += header_size + padded
    return entries


def _section(path: Path, name: str) -> tuple[int, int, int]:
    """(file offset, size, address) of a section of a host ELF file."""
    with open(path, "rb") as f:
        s = ELFFile(f).get_section_by_name(name)
        return s["sh_offset"], s["sh_size"], s["sh_addr"]


# ---- layouts --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kernels.cubin", "two.fatbin", "zstd.fatbin", "lz4.fatbin"])
def test_every_kernel_has_its_exact_layout(built: dict[str, Path], name: str) -> None:
    assert _plain(fatbin.parse_image(built[name].read_bytes())) == EXPECTED


def test_total_size_ends_at_the_last_parameter(built: dict[str, Path]) -> None:
    layouts = fatbin.parse_image(built["kernels.cubin"].read_bytes())
    assert layouts["_Z4axpyfPKfPfi"].total_size == 28
    assert layouts["_Z7scalarscsixdPf"].total_size == 32
    assert layouts["no_params"].total_size == 0
    assert layouts["no_params"].params == ()


def test_fatbins_hold_both_archs_and_both_compressions(built: dict[str, Path]) -> None:
    """The fixtures really exercise what they claim: two cubins, zstd and LZ4 payloads."""
    plain = _entries(built["two.fatbin"].read_bytes())
    assert [k for k, _, _ in plain].count(fatbin.ENTRY_CUBIN) == 2
    assert all(head == fatbin.ELF_MAGIC for k, _, head in plain if k == fatbin.ENTRY_CUBIN)
    zstd = [e for e in _entries(built["zstd.fatbin"].read_bytes()) if e[0] == fatbin.ENTRY_CUBIN]
    assert zstd and all(f & fatbin.FLAG_ZSTD and head == ZSTD_MAGIC for _, f, head in zstd)
    lz4 = [e for e in _entries(built["lz4.fatbin"].read_bytes()) if e[0] == fatbin.ENTRY_CUBIN]
    assert lz4 and all(f & fatbin.FLAG_LZ4 and not f & fatbin.FLAG_ZSTD for _, f, _ in lz4)


def test_concatenated_fatbins_are_merged(built: dict[str, Path]) -> None:
    first = built["zstd.fatbin"].read_bytes()
    padding = b"\0" * (-len(first) % 8)
    data = first + padding + built["lz4.fatbin"].read_bytes()
    assert _plain(fatbin.parse_image(data)) == EXPECTED


def test_shares_split_the_containers_and_read_only_their_own(built: dict[str, Path]) -> None:
    """Parsers in parallel take one share each of a large image (pos/tracer/session.py): the
    shares together are the whole image, and a share reads only headers of the others."""
    first = built["zstd.fatbin"].read_bytes()
    second = built["lz4.fatbin"].read_bytes()
    data = first + b"\0" * (-len(first) % 8) + second
    taken: list[tuple[int, int]] = []

    def read(at: int, n: int) -> bytes:
        taken.append((at, n))
        return data[at:at + n]

    shares = [fatbin.parse_share(read, len(data), "all", i, 2) for i in range(2)]
    assert shares[0] == fatbin.parse_image(first) and shares[1] == fatbin.parse_image(second)
    assert _plain({**shares[0], **shares[1]}) == EXPECTED
    taken.clear()
    fatbin.parse_share(read, len(data), "all", 1, 2)
    assert all(at + n <= 16 for at, n in taken if at < len(first))   # its header alone


# ---- image_extent ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kernels.cubin", "two.fatbin", "zstd.fatbin", "lz4.fatbin"])
def test_extent_is_the_whole_image(built: dict[str, Path], name: str) -> None:
    data = built[name].read_bytes()
    assert fatbin.image_extent(data[:4096]) == fatbin.Extent(len(data))


def test_wrapper_points_at_a_fatbin(built: dict[str, Path]) -> None:
    """Follow the executable's __fatBinC_Wrapper_t records as the tracer does in memory."""
    app = built["app"].read_bytes()
    seg_offset, seg_size, _ = _section(built["app"], ".nvFatBinSegment")
    fat_offset, _, fat_addr = _section(built["app"], ".nv_fatbin")
    found: dict[str, list[tuple[int, int]]] = {}
    for wrapper in range(seg_offset, seg_offset + seg_size, 24):
        extent = fatbin.image_extent(app[wrapper:wrapper + 24])
        assert extent == fatbin.Extent(0, indirect=8)
        addr, = struct.unpack_from("<Q", app, wrapper + 8)
        start = addr - fat_addr + fat_offset
        image = fatbin.image_extent(app[start:start + 4096])
        assert image is not None and image.indirect is None
        found.update(_plain(fatbin.parse_image(app[start:start + image.size])))
    assert {name: found.get(name) for name in WITH_EXTRA} == WITH_EXTRA


def test_extent_of_a_built_wrapper() -> None:
    wrapper = struct.pack("<IIQQ", fatbin.WRAPPER_MAGIC, 1, 0x7F0000001000, 0)
    assert fatbin.image_extent(wrapper) == fatbin.Extent(0, indirect=8)


@pytest.mark.parametrize("head", [b"", b"\x7fEL", b"\0" * 64, b"PK\x03\x04" + b"\0" * 60,
                                  b"\x7fELF\x01\x01" + b"\0" * 58])   # a 32-bit ELF
def test_unknown_bytes_have_no_extent(head: bytes) -> None:
    assert fatbin.image_extent(head) is None


# ---- malformed images -----------------------------------------------------------------------

def test_truncated_fatbin_is_an_error(built: dict[str, Path]) -> None:
    data = built["two.fatbin"].read_bytes()
    with pytest.raises(fatbin.FatbinError, match="claims"):
        fatbin.parse_image(data[:len(data) // 2])


@pytest.mark.parametrize("name", ["zstd.fatbin", "lz4.fatbin"])
def test_corrupt_compressed_entry_is_an_error(built: dict[str, Path], name: str) -> None:
    data = bytearray(built[name].read_bytes())
    header_size, = struct.unpack_from("<I", data, 16 + 4)
    payload = 16 + header_size
    data[payload + 8:payload + 200] = b"\xff" * 192
    with pytest.raises(fatbin.FatbinError, match="compressed fatbin entry"):
        fatbin.parse_image(bytes(data))


def test_truncated_cubin_is_an_error(built: dict[str, Path]) -> None:
    with pytest.raises(fatbin.FatbinError, match="section"):
        fatbin.parse_image(built["kernels.cubin"].read_bytes()[:4096])


def test_garbage_is_an_error() -> None:
    with pytest.raises(fatbin.FatbinError, match="neither a cubin nor a fatbin"):
        fatbin.parse_image(b"not an image at all")


# ---- host ELF files -------------------------------------------------------------------------

def test_object_file(built: dict[str, Path]) -> None:
    assert _plain(fatbin.layouts_from_elf_file(str(built["kernels.o"]))) == EXPECTED


def test_executable_with_several_fatbins(built: dict[str, Path]) -> None:
    layouts = _plain(fatbin.layouts_from_elf_file(str(built["app"])))
    assert {name: layouts.get(name) for name in WITH_EXTRA} == WITH_EXTRA


def test_files_without_fatbins(built: dict[str, Path]) -> None:
    assert fatbin.layouts_from_elf_file(str(built["kernels.cubin"])) == {}   # ELF, no section
    assert fatbin.layouts_from_elf_file(str(KERNELS)) == {}                  # not ELF
    with pytest.raises(OSError):
        fatbin.layouts_from_elf_file(str(built["app"]) + ".missing")


def test_corrupt_section_is_an_error(built: dict[str, Path], tmp_path: Path) -> None:
    data = bytearray(built["kernels.o"].read_bytes())
    offset, _, _ = _section(built["kernels.o"], ".nv_fatbin")
    data[offset + 8:offset + 16] = struct.pack("<Q", 1 << 40)   # container size far too large
    broken = tmp_path / "broken.o"
    broken.write_bytes(bytes(data))
    with pytest.raises(fatbin.FatbinError):
        fatbin.layouts_from_elf_file(str(broken))


def test_parts_first_cubin_then_the_rest(tmp_path: Path) -> None:
    """The tracer parses the first cubin of each container first (quickly: most kernels), then
    the rest: a kernel built for one architecture only comes with the rest, and the two parts
    together are the whole image."""
    src = tmp_path / "arch.cu"
    src.write_text("__global__ void everywhere(float *x, int n) { x[n] = 1; }\n"
                   "#if __CUDA_ARCH__ < 900\n"
                   "__global__ void only_sm80(double *y) { y[0] = 2; }\n"
                   "#endif\n")
    out = tmp_path / "arch.fatbin"
    _nvcc("-fatbin", *TWO_ARCHS, "-o", str(out), str(src))   # sm_90 first, then sm_80
    data = out.read_bytes()
    first, rest = fatbin.parse_image(data, "first"), fatbin.parse_image(data, "rest")
    assert set(first) == {"_Z10everywherePfi"}
    assert set(rest) == {"_Z10everywherePfi", "_Z9only_sm80Pd"}
    assert fatbin.parse_image(data) == {**first, **rest}
    assert first["_Z10everywherePfi"] == rest["_Z10everywherePfi"]
