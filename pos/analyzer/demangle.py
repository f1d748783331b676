"""What the demangled kernel name says about each parameter: pointer to const (a read), other
pointer (a read-write), by-value aggregate (scanned word by word) or arithmetic scalar (ignored).

Demangling itself is libstdc++'s `__cxa_demangle` through the `cxxfilt` package, with the
binutils `c++filt` program as the fallback where that package is missing (the GPU host has no
network). Only the *demangled text* is parsed here: the top-level parameter list and, in each
parameter type, the outermost pointer's pointee qualifiers.
"""

import functools
import shutil
import subprocess
from typing import Optional

# Parameter kinds, as the numba core (access.py) takes them in an int8 array.
SCALAR, CONST_PTR, PTR, SCAN = 0, 1, 2, 3
KIND_NAMES = {SCALAR: "scalar", CONST_PTR: "const-pointer", PTR: "pointer", SCAN: "scanned"}

# Arithmetic types as the demangler spells them: they can hold a pointer only by accident.
_ARITHMETIC = {
    "bool", "char", "signed char", "unsigned char", "wchar_t", "char8_t", "char16_t", "char32_t",
    "short", "unsigned short", "int", "unsigned int", "long", "unsigned long", "long long",
    "unsigned long long", "__int128", "unsigned __int128", "float", "double", "long double",
    "__float128", "decltype(nullptr)", "std::nullptr_t",
}
_QUALIFIERS = ("const", "volatile", "restrict", "__restrict", "__restrict__")


def _demangle_with_cxxfilt(name: str) -> Optional[str]:
    import cxxfilt

    try:
        return cxxfilt.demangle(name, external_only=False)
    except cxxfilt.InvalidName:
        return None


def _demangle_with_program(name: str) -> Optional[str]:
    prog = shutil.which("c++filt")
    if prog is None:
        return None
    out = subprocess.run([prog, name], capture_output=True, text=True, check=False).stdout.strip()
    return out if out and out != name else None


@functools.lru_cache(maxsize=None)
def demangle(name: str) -> Optional[str]:
    """The demangled form of a mangled C++ name; None for C names and unreadable manglings."""
    if not name.startswith("_Z"):
        return None
    try:
        return _demangle_with_cxxfilt(name)
    except ImportError:
        return _demangle_with_program(name)


def parameter_types(demangled: str) -> Optional[list[str]]:
    """The types of the top-level parameter list of a demangled function name, or None."""
    text = demangled.rstrip()
    if not text.endswith(")"):
        return None
    depth, start = 0, -1
    for i in range(len(text) - 1, -1, -1):      # the '(' matching the final ')'
        c = text[i]
        if c in ")>]":
            depth += 1
        elif c in "(<[":
            depth -= 1
            if depth == 0:
                start = i
                break
    if start < 0 or text[start] != "(":
        return None
    inner = text[start + 1:-1].strip()
    if inner in ("", "void"):
        return []
    types, depth, begin = [], 0, 0
    for i, c in enumerate(inner):
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        elif c == "," and depth == 0:
            types.append(inner[begin:i].strip())
            begin = i + 1
    types.append(inner[begin:].strip())
    return types


def _strip_qualifiers(t: str) -> str:
    t = t.strip()
    changed = True
    while changed:
        changed = False
        for q in _QUALIFIERS:
            if t.endswith(" " + q) or t == q:
                t = t[: -len(q)].rstrip()
                changed = True
    return t


def classify(param_type: str) -> int:
    """The kind of one parameter from its demangled type (see the module docstring)."""
    t = _strip_qualifiers(param_type)            # the pointer's own qualifiers do not matter
    if t.endswith("*"):
        pointee = t[:-1].rstrip()
        words = pointee.replace("*", " * ").split()
        # `float const*`, and `const float*` where the const is not behind another '*'
        const = (words[-1] == "const") or (words[0] == "const" and "*" not in words)
        return CONST_PTR if const else PTR
    if t.endswith(")") or t.endswith("]"):       # function pointers, arrays: scan to be safe
        return SCAN
    core = " ".join(w for w in t.split() if w not in _QUALIFIERS)
    return SCALAR if core in _ARITHMETIC else SCAN


def parameter_kinds(name: Optional[str], n_params: int) -> tuple[list[int], bool]:
    """(kind of each of the n_params parameters, whether the types came from the name).

    Without usable types (a C name, a demangling whose parameter count differs from the
    layout's) every parameter is scanned and taken as read-write: never fewer writes than the
    truth allows to see."""
    types = parameter_types(demangle(name) or "") if name else None
    if types is None or len(types) != n_params:
        return [SCAN] * n_params, False
    return [classify(t) for t in types], True
