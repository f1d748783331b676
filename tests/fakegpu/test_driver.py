"""pos.driver's declarations against cuda.h and against the fake libcuda.so.1.

cuda.h (found beside nvcc) is compiled with every symbol under the name libcuda exports
(__CUDA_API_VERSION_INTERNAL, as NVIDIA builds the driver), and C++ says, for each declared
function, each argument's kind and size (pointers with what they point to), for each struct its
fields' offsets and sizes, and each constant's value: they must be what pos declares. The fake is
driven through the same declarations by the scheduler's tests; here, what it lacks on purpose."""

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from pos import driver as cu

CHECK = r"""
#include <cuda.h>
#include <cstddef>
#include <cstdio>
#include <string>
#include <type_traits>

template <class T, class = void> struct complete : std::false_type {};
template <class T> struct complete<T, std::void_t<decltype(sizeof(T))>> : std::true_type {};

// i4 (signed, 4 bytes), u8, e4 (an enum), s64 (a struct by value), p>... (a pointer to ...),
// v (void, or a struct cuda.h keeps opaque)
template <class T> std::string kind() {
    using U = std::remove_cv_t<T>;
    if constexpr (std::is_pointer_v<U>) return "p>" + kind<std::remove_pointer_t<U>>();
    else if constexpr (std::is_void_v<U> || (std::is_class_v<U> && !complete<U>::value)) return "v";
    else if constexpr (std::is_class_v<U>) return "s" + std::to_string(sizeof(U));
    else if constexpr (std::is_enum_v<U>) return "e" + std::to_string(sizeof(U));
    else return (std::is_signed_v<U> ? "i" : "u") + std::to_string(sizeof(U));
}

template <class F> struct signature;    // only the function's type: nothing to link
template <class... A> struct signature<CUresult (*)(A...)> {
    static void say(const char *name) {
        std::string line = std::string("fn ") + name;
        ((line += " " + kind<A>()), ...);
        std::puts(line.c_str());
    }
};

#define FN(f) signature<decltype(&f)>::say(#f)
#define FIELD(s, f) std::printf("field %s.%s %zu %zu\n", #s, #f, offsetof(s, f), sizeof(s::f))
#define SIZE(s) std::printf("size %s %zu\n", #s, sizeof(s))
#define CONST(c) std::printf("const %s %lld\n", #c, (long long)(c))

int main() {
%BODY%
    return 0;
}
"""


def _kind(t: Any) -> str:
    """The kind of a ctypes type, in the C++ side's words."""
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return f"s{ctypes.sizeof(t)}"
    if t is ctypes.c_void_p:
        return "p>v"
    if t is ctypes.c_char_p:
        return "p>i1"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return "p>" + _kind(t._type_)
    return ("i" if t._type_.islower() else "u") + str(ctypes.sizeof(t))


def _same(c: str, ours: str) -> bool:
    """An enum is passed as the int of its size, whichever sign pos gives it."""
    if c.startswith("e"):
        return ours in ("i" + c[1:], "u" + c[1:])
    if c.startswith("p>") and ours.startswith("p>"):
        return _same(c[2:], ours[2:])
    return c == ours


def _structs() -> list[type]:
    return [v for k, v in vars(cu).items() if isinstance(v, type) and
            issubclass(v, ctypes.Structure) and v.__module__ == cu.__name__ and
            k != "CUmemAllocationPropFlags"]        # unnamed in cuda.h: checked as a field


def _constants() -> dict[str, int]:
    return {k: v for k, v in vars(cu).items() if k.startswith(("CU_", "CUDA_")) and
            isinstance(v, int)}


@pytest.fixture(scope="module")
def cuda_h(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """What cuda.h says of every declared name: {"fn NAME": kinds, "field S.F": [offset, size],
    "size S": [size], "const C": [value]}."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc (and the cuda.h beside it) is needed to check the declarations")
    body = [f"    FN({f.name});" for f in cu.declared()]
    for s in _structs():
        body.append(f"    SIZE({s.__name__});")
        body += [f"    FIELD({s.__name__}, {f[0]});" for f in s._fields_]
    body += [f"    CONST({c});" for c in _constants()]
    out = tmp_path_factory.mktemp("cuda_h")
    src = out / "check.cpp"
    src.write_text(CHECK.replace("%BODY%", "\n".join(body)))
    subprocess.run([nvcc, "-std=c++17", "-cudart", "none", "-D__CUDA_API_VERSION_INTERNAL",
                    "-o", str(out / "check"), str(src)], check=True, capture_output=True)
    said = subprocess.run([str(out / "check")], check=True, capture_output=True, text=True)
    return {" ".join(w[:2]): w[2:] for w in (line.split() for line in said.stdout.splitlines())}


def test_every_function_takes_what_cuda_h_declares(cuda_h: dict[str, list[str]]) -> None:
    for f in cu.declared():
        c = cuda_h[f"fn {f.name}"]
        ours = [_kind(t) for t in f.argtypes]
        assert len(c) == len(ours) and all(map(_same, c, ours)), (f.name, c, ours)


def test_every_struct_is_laid_out_as_in_cuda_h(cuda_h: dict[str, list[str]]) -> None:
    for s in _structs():
        assert cuda_h[f"size {s.__name__}"] == [str(ctypes.sizeof(s))], s.__name__
        for name, _t in s._fields_:
            field = getattr(s, name)
            assert cuda_h[f"field {s.__name__}.{name}"] == [str(field.offset), str(field.size)], \
                (s.__name__, name)


def test_every_constant_has_cuda_h_value(cuda_h: dict[str, list[str]]) -> None:
    for name, value in _constants().items():
        assert cuda_h[f"const {name}"] == [str(value)], name


def test_the_fake_lacks_only_what_pos_does_without(fakegpu: dict[str, Path]) -> None:
    """The fake has no page-locked allocation (the validator then hashes from pageable memory);
    it has the rest."""
    d = cu.Driver(str(fakegpu["libcuda"]))
    missing = {f.name for f in cu.declared()} - d.present
    assert missing == {"cuMemAllocHost_v2"}
    with pytest.raises(cu.PosError, match="has no cuMemAllocHost_v2: update the NVIDIA driver"):
        d.cuMemAllocHost_v2(ctypes.byref(ctypes.c_void_p()), 4096)


def test_a_failure_names_the_function_the_driver_error_and_the_hint(
        fakegpu: dict[str, Path]) -> None:
    d = cu.Driver(str(fakegpu["libcuda"]))
    d.primary_context(0)
    p = cu.CUdeviceptr()
    with pytest.raises(cu.DriverError) as e, cu.hint("give it a size"):
        d.cuMemAlloc_v2(ctypes.byref(p), 0)
    assert (e.value.function, e.value.code, e.value.name) == (
        "cuMemAlloc_v2", cu.CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE")
    assert e.value.message == ("cuMemAlloc_v2 failed with CUDA_ERROR_INVALID_VALUE (1): "
                               "give it a size.")
    assert d.raw.cuMemAlloc_v2(ctypes.byref(p), 0) == cu.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(ctypes.ArgumentError):           # the declared types hold
        d.cuMemAlloc_v2(ctypes.byref(ctypes.c_int()), 4096)
    with pytest.raises(AttributeError):
        d.has("cuNoSuchFunction")
