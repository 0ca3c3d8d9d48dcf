#!/usr/bin/env python3
"""Native llama.cpp, the benchmark peer: found in, or built into, ~/.cache/qserve-peer.

    python scripts/peer.py [--check] [--jobs N]

The source is the llama.cpp vendored in llama-cpp-python's sdist (fetched with plain
`pip download`, so no network beyond the package index is needed). It is built once, for this
CPU (GGML_NATIVE), with the targets the benchmarks use; later calls reuse the build. Importable:

    llama_cpp_dir()    the source tree, downloaded and built if needed
    binary(name)       e.g. binary("llama-bench") -> .../build/bin/llama-bench
    convert_script()   its convert_hf_to_gguf.py; run it with convert_env() (vendored gguf-py)

$QSERVE_PEER_HOME moves the cache. QSERVE_PEER_ISA=avx2 (or --isa avx2) builds and uses a second
copy in build-avx2/, compiled for AVX2 + FMA without AVX-512 (an AVX2-only CPU's llama.cpp on
a CPU that has AVX-512, to compare with qserve's QSERVE_CPU_ISA=avx2 kernels). Without --check the CLI builds what is missing, then lists
the binaries; with --check it only lists what is there (exit status 1 if anything is missing).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # pinned: the peer is the same llama.cpp in every run
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize",
           "llama-perplexity", "llama-cli")
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # -march=native turns on AMX where the CPU has it (Sapphire Rapids and later), and this
    # llama.cpp's AMX matmul crashes there (SIGSEGV / SIGILL at its first ldtilecfg; upstream
    # issue ggml-org/llama.cpp#20824). Without AMX, ggml takes its AVX-512 repacked kernels.
    NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_FLAGS += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


# QSERVE_PEER_ISA=avx2: what GGML_NATIVE would pick on an AVX2-only x86 CPU (a Zen 2 / Zen 3, a
# Haswell-to-Alder Lake core), whatever this CPU has
AVX2_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
              "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF",
              "-DCMAKE_BUILD_TYPE=Release"]
# QSERVE_PEER_ISA=avx2-vnni: the same with AVX-VNNI, as GGML_NATIVE picks on an Intel core
# without AVX-512 (Alder Lake and later), whose int8 dot products then use 256-bit vpdpbusd
ISAS = {"native": ("build", CMAKE_FLAGS), "avx2": ("build-avx2", AVX2_FLAGS),
        "avx2-vnni": ("build-avx2-vnni",
                      [f for f in AVX2_FLAGS if f != "-DGGML_AVX_VNNI=OFF"]
                      + ["-DGGML_AVX_VNNI=ON"])}


def isa() -> str:
    """The peer build in use: "native", "avx2" or "avx2-vnni" ($QSERVE_PEER_ISA)."""
    v = os.environ.get("QSERVE_PEER_ISA", "native") or "native"
    if v not in ISAS:
        raise PeerError(f"QSERVE_PEER_ISA={v!r}: choose one of {', '.join(ISAS)}")
    return v


def _flags() -> list[str]:
    return ISAS[isa()][1]


def build_name() -> str:
    """The build directory's name inside the source tree."""
    return ISAS[isa()][0]


class PeerError(RuntimeError):
    """Something the user can fix (a missing tool, a failed build), said in one line."""


def peer_home() -> Path:
    return Path(os.environ.get("QSERVE_PEER_HOME", Path.home() / ".cache" / "qserve-peer"))


def source_dir(download: bool = True) -> Path:
    """The vendored llama.cpp of the pinned sdist, unpacked (and downloaded) if absent."""
    name = SDIST.replace("-", "_").replace("==", "-")  # llama_cpp_python-0.3.36
    src = peer_home() / name / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    if not download:
        raise PeerError(f"no llama.cpp source in {src.parent.parent}; run scripts/peer.py")
    peer_home().mkdir(parents=True, exist_ok=True)
    sdist = peer_home() / f"{name}.tar.gz"
    if not sdist.exists():
        print(f"downloading the {SDIST} sdist into {peer_home()} ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-binary", ":all:", "-d", str(peer_home()), SDIST],
                           capture_output=True, text=True)
        if r.returncode or not sdist.exists():
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerError(f"pip download {SDIST} failed: {last}")
    with tarfile.open(sdist) as tar:
        tar.extractall(peer_home(), filter="data")
    if not (src / "CMakeLists.txt").exists():
        raise PeerError(f"{sdist.name} has no vendor/llama.cpp; is {SDIST} the right sdist?")
    return src


def _stamp(src: Path) -> Path:
    """The configure flags of the build in src/build, written once it succeeded."""
    return src / build_name() / "qserve-cmake-flags.txt"


def _configured(src: Path) -> bool:
    """Whether src/build was last built, successfully, with CMAKE_FLAGS."""
    return _stamp(src).exists() and _stamp(src).read_text().split("\n") == _flags()


def _missing(src: Path) -> list[str]:
    """TARGETS still to build: all of them when the build was configured with other flags."""
    if not _configured(src):
        return list(TARGETS)
    return [t for t in TARGETS if not (src / build_name() / "bin" / t).exists()]


def _check_toolchain() -> None:
    if shutil.which("cmake") is None:
        raise PeerError("cmake is not on PATH; install it (apt-get install cmake, or "
                        "pip install cmake) to build llama.cpp")
    cxx = os.environ.get("CXX") or next(
        (c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cxx is None or shutil.which(cxx) is None:
        raise PeerError(f"no C++ compiler found ({cxx or 'c++, g++, clang++'}); install one "
                        f"(apt-get install build-essential) to build llama.cpp")


def _build(src: Path, jobs: int) -> None:
    """Configure and build TARGETS under src/build (build_name()), logging to its
    qserve-build.log; a build configured before with the same flags is only brought up to
    date."""
    _check_toolchain()
    build = src / build_name()
    build.mkdir(exist_ok=True)
    log = build / "qserve-build.log"
    configured = _configured(src)
    _stamp(src).unlink(missing_ok=True)  # until this build succeeds
    steps = [["cmake", "--build", build.name, f"-j{jobs}", "--target", *TARGETS]]
    if not configured:
        steps.insert(0, ["cmake", "-B", build.name, *_flags()])
    print(f"building llama.cpp in {build} with {jobs} jobs (log: {log}; ~25 min on 2 cores)",
          file=sys.stderr)
    with open(log, "a") as out:
        for cmd in steps:
            rc = subprocess.run(cmd, cwd=src, stdout=out, stderr=subprocess.STDOUT).returncode
            if rc:
                raise PeerError(f"`{' '.join(cmd)}` failed with exit status {rc}; see {log}")
    _stamp(src).write_text("\n".join(_flags()))


def llama_cpp_dir(jobs: int | None = None, build: bool = True) -> Path:
    """The llama.cpp source tree whose build/bin (build_name()) holds every TARGET, building what is missing
    (under a lock, so two scripts never build at once) unless `build` is False."""
    src = source_dir(download=build)
    if not _missing(src) or not build:
        return src
    with open(peer_home() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _missing(src):  # another process may have built it while we waited
            _build(src, jobs or os.cpu_count() or 1)
    if missing := _missing(src):
        raise PeerError(f"the build finished without {', '.join(missing)}; see "
                        f"{src / build_name() / 'qserve-build.log'}")
    return src


def binary(name: str) -> Path:
    """The path of llama.cpp's `name` binary (one of TARGETS), built if missing."""
    if name not in TARGETS:
        raise PeerError(f"{name!r} is not built here; choose one of {', '.join(TARGETS)}")
    return llama_cpp_dir() / build_name() / "bin" / name


def convert_script() -> Path:
    """llama.cpp's convert_hf_to_gguf.py (needs no build); run it with convert_env()."""
    return source_dir() / "convert_hf_to_gguf.py"


def convert_env() -> dict[str, str]:
    """os.environ with the vendored gguf-py first on PYTHONPATH, so the converter uses the gguf
    package of its own version, not whichever one is installed."""
    gguf_py = str(source_dir() / "gguf-py")
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": gguf_py + (os.pathsep + path if path else "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only list what is there; download and build nothing")
    ap.add_argument("--isa", choices=tuple(ISAS),
                    help="which build (sets QSERVE_PEER_ISA)  [default: $QSERVE_PEER_ISA or native]")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="parallel compile jobs  [default: all CPUs]")
    args = ap.parse_args()
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: give at least 1")
    if args.isa:
        os.environ["QSERVE_PEER_ISA"] = args.isa
    try:
        src = llama_cpp_dir(args.jobs, build=not args.check)
    except PeerError as e:
        sys.exit(f"error: {e}")
    missing = _missing(src)
    for name in TARGETS:
        path = src / build_name() / "bin" / name
        state = "stale (other flags)" if path.exists() else "missing"
        print(f"{name:20} {state if name in missing else path}")
    print(f"{'convert_hf_to_gguf':20} {src / 'convert_hf_to_gguf.py'}")
    if missing:
        sys.exit(1)


if __name__ == "__main__":
    main()
