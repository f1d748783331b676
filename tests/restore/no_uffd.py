"""Run a command with userfaultfd(2) refused (EPERM), as a container's seccomp profile (Docker's
default) refuses it: the kernel's refusal of a lazy restore, on a kernel that has it.

  no_uffd.py COMMAND [ARG...]
"""

import ctypes
import os
import struct
import sys

AUDIT_ARCH_X86_64 = 0xC000003E
NR_USERFAULTFD = 323              # x86_64
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ERRNO, RET_ALLOW, EPERM = 0x00050000, 0x7FFF0000, 1
LD_ABS, JEQ, RET = 0x20, 0x15, 0x06   # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K


def op(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


program = b"".join([
    op(LD_ABS, 0, 0, 4),                        # seccomp_data.arch
    op(JEQ, 0, 3, AUDIT_ARCH_X86_64),           # another architecture: allowed
    op(LD_ABS, 0, 0, 0),                        # seccomp_data.nr
    op(JEQ, 0, 1, NR_USERFAULTFD),
    op(RET, 0, 0, RET_ERRNO | EPERM),
    op(RET, 0, 0, RET_ALLOW)])
code = ctypes.create_string_buffer(program)
fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(program) // 8,
                                                ctypes.addressof(code)))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or \
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fprog, 0, 0):
    sys.exit(f"no_uffd.py: seccomp refused: {os.strerror(ctypes.get_errno())}")
os.execvp(sys.argv[1], sys.argv[1:])
