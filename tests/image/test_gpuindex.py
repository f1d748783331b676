"""The GPU index typed (pos/image/gpuindex.py): an index written before the types existed reads
the same, one written now is byte for byte what was written before, the dict forms still used
by the concurrent engine agree with the types, and a damaged index is one sentence."""

import json
from pathlib import Path

import pytest

from pos.errors import BadInput
from pos.image import gpuindex, names
from pos.image.gpuindex import BufferRecord, ChunkRecord, GpuIndex, Saved

# gpu-index.json as pos wrote it before the types (json.dump of its dict, indent=1): a job on
# one GPU, one buffer of two chunks the job used after its release, one of one chunk
OLD = """{
 "format": 1,
 "pid": 4242,
 "parent": null,
 "gpu": "GPU-8e5c1d2a-0000-4000-8000-000000000001",
 "buffers": [
  {
   "base": "0x7f0000000000",
   "size": 3000000,
   "mapped": 4194304,
   "device": 0,
   "hot": true,
   "chunks": [
    {
     "offset": 0,
     "file": "gpu-data-00.bin",
     "at": 0,
     "stored": 2097152,
     "raw": 2097152,
     "hash": "00a1b2c3d4e5f607",
     "zstd": false
    },
    {
     "offset": 2097152,
     "file": "gpu-data-01.bin",
     "at": 4096,
     "stored": 902848,
     "raw": 902848,
     "hash": "ffeeddccbbaa9988",
     "zstd": false
    }
   ]
  },
  {
   "base": "0x7f0000400000",
   "size": 512,
   "mapped": 2097152,
   "device": 0,
   "hot": false,
   "chunks": [
    {
     "offset": 0,
     "file": "gpu-data-00.bin",
     "at": 2097152,
     "stored": 512,
     "raw": 512,
     "hash": "0000000000000001",
     "zstd": false
    }
   ]
  }
 ]
}"""

# an index from before pos recorded the job's GPU and which buffers were hot
OLDER = {"format": 1, "pid": 7, "parent": None,
         "buffers": [{"base": "0x7000", "size": 8, "mapped": 4096, "device": 1,
                      "chunks": [{"offset": 0, "file": "gpu-data-00.bin", "at": 0, "stored": 8,
                                  "raw": 8, "hash": "0123456789abcdef", "zstd": True}]}]}

CHUNK = ChunkRecord(offset=0, file="gpu-data-00.bin", at=0, stored=8, raw=8,
                    hash=0x0123456789ABCDEF, zstd=True)


def test_an_index_written_before_the_types_reads_as_it_was_written(tmp_path: Path) -> None:
    (tmp_path / names.INDEX).write_text(OLD)
    index = gpuindex.read(tmp_path)
    assert (index.pid, index.parent, index.format) == (4242, None, 1)
    assert index.gpu == "GPU-8e5c1d2a-0000-4000-8000-000000000001"
    first, second = index.buffers
    assert (first.base, first.size, first.mapped, first.device, first.hot) == \
        (0x7F00_0000_0000, 3000000, 4 << 20, 0, True)
    assert [(c.offset, c.file, c.at, c.raw, c.hash) for c in first.chunks] == \
        [(0, "gpu-data-00.bin", 0, 2 << 20, 0x00A1B2C3D4E5F607),
         (2 << 20, "gpu-data-01.bin", 4096, 902848, 0xFFEEDDCCBBAA9988)]
    assert not second.hot and index.hot == {0x7F00_0000_0000}


def test_an_index_written_now_is_byte_for_byte_the_old_one(tmp_path: Path) -> None:
    gpuindex.write(tmp_path, GpuIndex.from_json(json.loads(OLD)))
    assert (tmp_path / names.INDEX).read_text() == OLD


def test_an_index_without_the_gpu_or_hot_marks_reads_with_none(tmp_path: Path) -> None:
    (tmp_path / names.INDEX).write_text(json.dumps(OLDER))
    index = gpuindex.read(tmp_path)
    assert index.gpu is None and index.hot == frozenset()
    assert index.buffers == (BufferRecord(0x7000, 8, 4096, 1, False, (CHUNK,)),)


def test_round_trip_of_each_process_of_several(tmp_path: Path) -> None:
    index = GpuIndex(pid=11, gpu=None, buffers=(BufferRecord(0x7000, 8, 4096, 1, True, (CHUNK,)),
                                                BufferRecord(0x9000, 0, 4096, 1)))
    gpuindex.write(tmp_path, index, 11)
    gpuindex.write(tmp_path, GpuIndex(12, "GPU-x", ()), 12)
    assert gpuindex.read(tmp_path, 11) == index
    assert gpuindex.read(tmp_path, 12) == GpuIndex(12, "GPU-x", ())
    assert gpuindex.jobs(tmp_path) == [11, 12]
    with pytest.raises(FileExistsError):      # an image is written once
        gpuindex.write(tmp_path, index, 11)


def test_the_buffers_come_from_this_image_or_its_parent(tmp_path: Path) -> None:
    parent, child = tmp_path / "parent", tmp_path / "child"
    parent.mkdir()
    child.mkdir()
    gpuindex.write(parent, GpuIndex(5, None, (BufferRecord(0x7000, 8, 4096, 0, chunks=(CHUNK,)),)))
    gpuindex.write(child, GpuIndex(5, None, (BufferRecord(0x7000, 8, 4096, 0, in_parent=True),
                                             BufferRecord(0x9000, 8, 4096, 0, chunks=(CHUNK,))),
                                   parent=str(parent)))
    assert gpuindex.saved(child) == {0x7000: Saved(parent, 8, (CHUNK,)),
                                     0x9000: Saved(child, 8, (CHUNK,))}
    assert '"in_parent": true' in (child / names.INDEX).read_text()
    gpuindex.write(tmp_path, GpuIndex(5, None, (BufferRecord(0x7000, 16, 4096, 0,
                                                             in_parent=True),),
                                      parent=str(parent)))
    with pytest.raises(BadInput, match="lacks buffer 0x7000"):    # another size there
        gpuindex.saved(tmp_path)
    orphan = GpuIndex(5, None, (BufferRecord(0x7000, 8, 4096, 0, in_parent=True),))
    with pytest.raises(BadInput, match="names no parent image for buffer 0x7000"):
        gpuindex.saved(tmp_path, orphan)


@pytest.mark.parametrize("text,says", [
    (None, "is not a GPU image (no gpu-index.json)"),
    ("{", "is not valid JSON"),
    ('{"format": 2, "pid": 1}', "is a GPU image of format 2, this pos reads 1"),
    ("[1]", "is a GPU image of format None"),
    ('{"format": 1, "pid": 1, "buffers": [{"base": "0x10"}]}', "is not a valid GPU index"),
    ('{"format": 1, "pid": "1", "buffers": []}', "is not a valid GPU index"),
    ('{"format": 1, "pid": 1, "buffers": [{"base": "zz", "size": 1, "mapped": 1, "device": 0}]}',
     "is not a valid GPU index"),
])
def test_a_missing_or_damaged_index_is_one_sentence(tmp_path: Path, text, says: str) -> None:
    if text is not None:
        (tmp_path / names.INDEX).write_text(text)
    with pytest.raises(BadInput, match=says.replace("(", r"\(").replace(")", r"\)")):
        gpuindex.read(tmp_path)


def test_a_chunk_hashed_on_the_gpu_names_its_kind_and_an_unknown_kind_is_refused(
        tmp_path: Path) -> None:
    """A chunk of kind `blocks` says so (`hash_kind`) and reads back so; one of the first kind
    writes no key (as before); a kind this pos does not know is one sentence."""
    blocks = ChunkRecord(0, "gpu-data-00.bin", 0, 8, 8, 0xABC, False, "blocks")
    index = GpuIndex(pid=11, gpu=None, buffers=(BufferRecord(0x7000, 8, 4096, 1, False,
                                                             (blocks,)),))
    gpuindex.write(tmp_path, index, 11)
    assert gpuindex.read(tmp_path, 11) == index
    assert blocks.to_json()["hash_kind"] == "blocks" and "hash_kind" not in CHUNK.to_json()
    d = json.loads((tmp_path / names.index_name(11)).read_text())
    d["buffers"][0]["chunks"][0]["hash_kind"] = "sha3"
    (tmp_path / names.index_name(11)).write_text(json.dumps(d))
    with pytest.raises(BadInput, match="kind this pos does not know .'sha3'."):
        gpuindex.read(tmp_path, 11)
