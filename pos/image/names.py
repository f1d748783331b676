"""Every name of a file in a pos image, in one place: pos's own (the manifest, the GPU index and
its data files), CRIU's that pos reads or looks for (its inventory, its stats, its logs), and
the suffix that marks an unfinished image. Nothing else in pos spells them out: an image read
by one part of pos is found by every other.

A whole-process image of a job of several CUDA processes (DDP's ranks) holds one GPU index per
process, gpu-index-PID.json, and each process's data files are named after it too,
gpu-data-PID-NN.bin; an image of one job holds gpu-index.json and gpu-data-NN.bin.

A whole-process image whose memory CRIU pre-dumped while the job ran (pos/concurrent/predump.py)
holds the pre-dump's files in the folder PARENT, named PARENT/NAME in the manifest: the one
folder an image has.
"""

import re
from pathlib import Path
from typing import Optional

MANIFEST = "pos-manifest.json"       # written last: a folder holding it is a sealed image
MANIFEST_TMP = MANIFEST + ".tmp"   # its rewrite before the rename; a pos killed between
                                   # the two leaves it, which is no part of the image
PARTIAL_SUFFIX = ".partial"          # DIR.partial: an image being written, or an interrupted one

INVENTORY = "inventory.img"          # CRIU's: every dump of a process tree writes one
STATS_DUMP = "stats-dump"            # CRIU's: where its dump's time went (pos/image/criustats.py)
FILES = "files.img"                  # CRIU's: every file the tree had open or mapped (criufiles.py)
REMAP_FPATH = "remap-fpath.img"      # CRIU's: the files it brings back itself (deleted at the dump)
DUMP_LOG = "criu-dump.log"           # CRIU's log of the dump, kept in the image
RESTORE_LOG = "criu-restore.log"     # of a restore, in its work folder
RESTORE_PIDFILE = "pidfile"          # of a restore, in its work folder: its root's PID
LAZY_PAGES_LOG = "criu-lazy-pages.log"   # of a lazy restore's daemon, beside it
PAGE_SERVER_LOG = "criu-page-server.log"   # of `pos migrate --listen`'s page server
PREDUMP_LOG = "criu-predump.log"     # of a pre-dump, in PARENT
PARENT = "parent"                    # CRIU's name for the images an incremental dump's pages
                                     # refer to (a link it makes to --prev-images-dir, unless
                                     # a folder of that name is there: pos's pre-dump's)

INDEX = "gpu-index.json"             # the GPU index of an image of one job
CONTAINER_ARCHIVE = "container.tar"  # a container's image: its runtime's export (pos/container)
PEER_LINKS = "peer-links.json"       # the imports of other processes' memory the checkpoint
                                     # took down, each with its owner (the agent side: peers.py)
_OWN_MEMORY = "own-memory"           # the job's own cuMem memory pos took (pos/concurrent/ownmem.py)
OWN_MEMORY_INDEXES = f"{_OWN_MEMORY}*.json"   # every such index of an image, as a glob
_RANK_INDEX = re.compile(r"gpu-index-(\d+)\.json")
_DATA = "gpu-data-"


def partial(final: Path) -> Path:
    """Where the image `final` is written until it is sealed."""
    return final.with_name(final.name + PARTIAL_SUFFIX)


def is_partial(name: str) -> bool:
    """The folder `name` is an unfinished image (never restored, kept or counted)."""
    return name.endswith(PARTIAL_SUFFIX)


def is_file_name(sent: str) -> bool:
    """`sent` (a name another pos gave) names a file of an image: NAME, or PARENT/NAME for a
    pre-dump's file; nothing else, which could reach outside the image."""
    head, _, name = sent.rpartition("/")
    return head in ("", PARENT) and name not in ("", ".", "..")


def criu_image(kind: str, n: int) -> str:
    """CRIU's image `kind` ("ids", "mm", "fs": of the process `n`; "fdinfo": of the table of
    descriptors `n`)."""
    return f"{kind}-{n}.img"


def index_name(pid: Optional[int] = None) -> str:
    """The GPU index of an image of one job (None), or of the process `pid` of several."""
    return INDEX if pid is None else f"gpu-index-{pid}.json"


def rank_of(name: str) -> Optional[int]:
    """The PID whose GPU index the file `name` is, in an image of several processes (None: the
    file is no such index)."""
    m = _RANK_INDEX.fullmatch(name)
    return int(m.group(1)) if m else None


def own_memory(pid: Optional[int] = None) -> tuple[str, str]:
    """The index and the data (its first part) of the job's own cuMem memory that a checkpoint
    took, of an image of one job (None) or of the process `pid` of several."""
    stem = _OWN_MEMORY if pid is None else f"{_OWN_MEMORY}-{pid}"
    return f"{stem}.json", f"{stem}.bin"


def own_memory_part(pid: Optional[int], k: int) -> str:
    """Part `k` of that data: the parts hold it one after another, each written by a thread of
    its own (a file of a tmpfs or of the page cache takes one write at a time)."""
    first = own_memory(pid)[1]
    return first if k == 0 else f"{first[:-len('.bin')]}.{k}.bin"


def data_prefix(pid: Optional[int] = None) -> str:
    """How the data files of that index begin."""
    return _DATA if pid is None else f"{_DATA}{pid}-"


def data_name(prefix: str, n: int) -> str:
    """The n-th data file of an index whose files begin with `prefix` (one per writer thread)."""
    return f"{prefix}{n:02d}.bin"


def is_gpu_data(name: str) -> bool:
    """The file `name` holds GPU chunks, whose checksums are checked as they are read."""
    return name.startswith(_DATA)


def checked_as_read(name: str) -> bool:
    """The file `name` holds device memory, whose chunks a restore checks as it reads them
    rather than before the job runs: the GPU data, and the data parts of the job's own
    memory."""
    return is_gpu_data(name) or (name.startswith(_OWN_MEMORY) and name.endswith(".bin"))
