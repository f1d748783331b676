"""One trace's operations as the flat numpy arrays the numba passes replay (`Ops`: load.py
builds them, access.py and dag.py read them), and the codes they hold."""

from dataclasses import dataclass
from typing import Optional

import numpy as np

# Operation kinds of a replayed trace.
OP_ALLOC, OP_FREE, OP_LAUNCH, OP_MEMCPY, OP_MEMSET = 1, 2, 3, 4, 5
# Memcpy flags: which sides are device addresses (from the direction).
DST_DEVICE, SRC_DEVICE = 1, 2


@dataclass
class Ops:
    """One trace's operations; arrays indexed by op, by signature, or by allocation."""

    kind: np.ndarray          # int8, OP_*
    a: np.ndarray             # uint64: base (alloc/free), dst (copy/set)
    b: np.ndarray             # uint64: size (alloc), src (memcpy)
    c: np.ndarray             # uint64: allocation id (alloc), bytes (copy/set)
    sig: np.ndarray           # int64: signature (launch), side flags (memcpy)
    pstart: np.ndarray        # int64: launch bytes in pbytes
    plen: np.ndarray          # int64
    ts: np.ndarray            # int64 ns
    api: list[str]
    pbytes: np.ndarray        # uint8
    sig_start: np.ndarray     # int64, CSR over the signatures' parameters
    sig_off: np.ndarray
    sig_size: np.ndarray
    sig_kind: np.ndarray      # int8
    sig_name: list[Optional[str]]
    sig_layout_known: list[bool]
    sig_types_known: list[bool]
    alloc_base: np.ndarray    # uint64, by allocation id
    alloc_size: np.ndarray    # uint64
    alloc_op: np.ndarray      # int64: the op that allocated it
    free_op: np.ndarray       # int64: the op that freed it, -1 if never

    @property
    def n_launches(self) -> int:
        return int(np.count_nonzero(self.kind == OP_LAUNCH))
