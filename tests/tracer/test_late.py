"""Completing launches recorded before their layout was known (pos/tracer/late.py)."""

import struct

from pos.tracer.late import PACKED, rebuild


def capture(base: int, addresses: list[int], memory: bytes) -> bytes:
    """What the probe keeps after its slots: base, count and the parameters' addresses, memory
    from base."""
    return struct.pack(f"<{len(addresses) + 2}Q", base, len(addresses), *addresses) + memory


def test_parameters_are_taken_from_the_captured_memory_at_their_addresses() -> None:
    memory = bytes(range(256)) * 8                    # 2 KiB from 0x7000
    # a 4-byte int at 0x7010, a 24-byte struct at 0x7100, a pointer at 0x7008
    cap = capture(0x7000, [0x7010, 0x7100, 0x7008], memory)
    layout = [[0, 4], [8, 24], [32, 8]]
    out = rebuild(bytes(24), cap, layout)
    assert out == memory[0x10:0x14] + bytes(4) + memory[0x100:0x118] + memory[0x8:0x10]


def test_addresses_beyond_the_layout_are_ignored() -> None:
    # the probe reads 64 addresses: those past the kernel's parameters are not its own
    memory = bytes(range(64))
    cap = capture(0x1000, [0x1000, 0x1008, 0xdead0000], memory)
    assert rebuild(bytes(24), cap, [[0, 8], [8, 8]]) == memory[:16]


def test_a_parameter_outside_the_capture_leaves_the_launch_unknown() -> None:
    memory = bytes(64)
    cap = capture(0x1000, [0x1000, 0x1038], memory)
    assert rebuild(bytes(16), cap, [[0, 8], [8, 16]]) is None
    assert rebuild(bytes(8), capture(0x1000, [0xff0], memory), [[0, 8]]) is None  # below base
    assert rebuild(bytes(8), capture(0x1000, [0x1000], memory), [[0, 8], [8, 8]]) is None
    assert rebuild(bytes(16), b"short", [[0, 8]]) is None
    assert rebuild(bytes(8), capture(0x1000, [0x1000] * 3, b"")[:24], [[0, 8]]) is None  # cut


def test_a_kernel_with_more_parameters_than_slots_is_completed() -> None:
    # 20 parameters, 8 bytes each, back to back: only 16 fit the slots, all 20 the capture
    memory = bytes(range(160))
    cap = capture(0x2000, [0x2000 + 8 * i for i in range(20)] + [0] * 44, memory)
    assert rebuild(bytes(128), cap, [[8 * i, 8] for i in range(20)]) == memory


def test_the_extra_form_needs_only_its_layout() -> None:
    packed = bytes(range(20))              # CU_LAUNCH_PARAM_BUFFER_POINTER: laid out already
    assert rebuild(packed, PACKED, [[0, 8], [8, 4], [16, 4]]) == packed
    assert rebuild(packed, PACKED, [[0, 8], [16, 8]]) is None      # shorter than the layout
