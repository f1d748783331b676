"""Build the fake GPU driver and its workloads at test time (tests/conftest.py's `fakegpu`).

nvcc compiles kernels.cu three ways (a cubin, a fatbin for sm_90 + sm_80 + PTX, and the same
fatbin compressed); gcc builds the fake libcuda.so.1 and libamdhip64.so, libkernels.so (the
fatbin in a .nv_fatbin section, as a CUDA library carries it) and the workloads, linked
with an rpath to the build directory so that /proc/PID/maps shows the fakes. nvcc needs no GPU.
"""

import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
CFLAGS = ["-std=gnu11", "-O2", "-g", "-Wall", "-Werror"]
# Only API entry points are exported, each a function of its own: identical-code folding
# would let two symbols share one address (one uprobe firing for two APIs).
LIBFLAGS = ["-fPIC", "-shared", "-fvisibility=hidden", "-fno-ipa-icf"]
GENCODE = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_80,code=sm_80",
           "-gencode", "arch=compute_90,code=compute_90"]


class BuildError(RuntimeError):
    """A compiler failed; the message holds its command line and output."""


def _run(argv: list[str], cwd: Path) -> None:
    try:
        p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError as e:
        raise BuildError(f"{argv[0]} not found: {e}") from None
    if p.returncode != 0:
        raise BuildError(f"command failed (exit {p.returncode}): {' '.join(argv)}\n"
                         f"{p.stdout}{p.stderr}")


def build(out: Path) -> dict[str, Path]:
    """Compile everything into `out`; returns the named paths of what was built."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    nvcc = shutil.which("nvcc") or "nvcc"
    cu = str(HERE / "kernels.cu")
    paths = {
        "dir": out,
        "cubin": out / "kernels.cubin",
        "fatbin": out / "kernels.fatbin",
        "zfatbin": out / "kernels.zfatbin",
        "libkernels": out / "libkernels.so",
        "libcuda": out / "libcuda.so.1",
        "libamdhip64": out / "libamdhip64.so",
        "cuda_app": out / "cuda_app",
        "hip_app": out / "hip_app",
        "fill_job": out / "fill_job",
        "peer_job": out / "peer_job",
        "future_copy": out / "libfuturecopy.so",
    }
    _run([nvcc, "-cubin", "-arch=sm_90", "-o", str(paths["cubin"]), cu], out)
    _run([nvcc, "-fatbin", *GENCODE, "-o", str(paths["fatbin"]), cu], out)
    _run([nvcc, "-fatbin", "-Xfatbin", "-compress-all", *GENCODE, "-o", str(paths["zfatbin"]), cu],
         out)

    gcc = ["gcc", *CFLAGS, f"-I{HERE}"]
    _run([*gcc, *LIBFLAGS, "-Wl,-soname,libcuda.so.1", "-o", str(paths["libcuda"]),
          str(HERE / "libcuda.c"), "-lpthread"], out)
    # the tracer matches the basename prefix libamdhip64.so; ROCm's soname carries the major
    _run([*gcc, *LIBFLAGS, "-Wl,-soname,libamdhip64.so.6", "-o", str(paths["libamdhip64"]),
          str(HERE / "libamdhip64.c"), "-lpthread"], out)
    (out / "libamdhip64.so.6").unlink(missing_ok=True)
    (out / "libamdhip64.so.6").symlink_to("libamdhip64.so")
    _run([*gcc, "-fPIC", "-shared", f"-Wa,-I{out}", "-o", str(paths["libkernels"]),
          str(HERE / "libkernels.c")], out)
    # link against the fakes by their sonames, found at run time through the rpath
    (out / "libcuda.so").unlink(missing_ok=True)
    (out / "libcuda.so").symlink_to("libcuda.so.1")
    rpath = [f"-L{out}", f"-Wl,-rpath,{out}"]
    _run([*gcc, "-o", str(paths["cuda_app"]), str(HERE / "cuda_app.c"), *rpath, "-lcuda", "-ldl"],
         out)
    _run([*gcc, "-o", str(paths["hip_app"]), str(HERE / "hip_app.c"), *rpath, "-lamdhip64"], out)
    _run([*gcc, "-o", str(paths["fill_job"]), str(HERE / "fill_job.c"), *rpath, "-lcuda", "-ldl"],
         out)
    _run([*gcc, "-o", str(paths["peer_job"]), str(HERE / "peer_job.c"), *rpath, "-lcuda"], out)
    _run([*gcc, *LIBFLAGS, "-o", str(paths["future_copy"]), str(HERE / "future_copy.c"), *rpath,
          "-lcuda"], out)
    return paths
