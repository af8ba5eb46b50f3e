"""Builds the RoME PyTorch extension (rome._C).

The C++ library is built first with CMake into build/py (static, PIC, no tests or benchmarks),
then bindings/torch/*.cpp are compiled into rome._C and linked against build/py/librome.a.

    pip install --no-build-isolation -e .     # development
    pip install --no-build-isolation .        # regular install

Environment: ROME_CORE_LIBRARY names an already built PIC librome.a to link instead (make
passes the one of its Release build, so the library is compiled once); ROME_CMAKE_ARGS adds
arguments to the CMake configure step; MAX_JOBS bounds the parallel build.
"""

import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CORE_BUILD = os.path.join(ROOT, "build", "py")
PREBUILT_CORE = os.environ.get("ROME_CORE_LIBRARY", "")
CORE_LIBRARY = os.path.abspath(PREBUILT_CORE) if PREBUILT_CORE else os.path.join(CORE_BUILD, "librome.a")


def build_core():
    """Configures and builds the static library with CMake."""
    cmake = shutil.which("cmake")
    if cmake is None:
        sys.exit("rome: cmake is required to build the C++ library (apt-get install cmake)")
    configure = [
        cmake, "-S", ROOT, "-B", CORE_BUILD,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DROME_BUILD_TESTS=OFF",
        "-DROME_BUILD_BENCH=OFF",
        "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
    ]
    if not os.path.exists(os.path.join(CORE_BUILD, "CMakeCache.txt")) and shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    configure += shlex.split(os.environ.get("ROME_CMAKE_ARGS", ""))
    subprocess.check_call(configure)
    build = [cmake, "--build", CORE_BUILD, "--target", "rome"]
    jobs = os.environ.get("MAX_JOBS")
    build += ["--parallel"] + ([jobs] if jobs else [])
    subprocess.check_call(build)


class BuildRome(BuildExtension):
    def run(self):
        if PREBUILT_CORE:
            if not os.path.isfile(CORE_LIBRARY):
                sys.exit(f"rome: ROME_CORE_LIBRARY={PREBUILT_CORE}: no such file")
        else:
            build_core()
        super().run()


extension = CppExtension(
    name="rome._C",
    sources=sorted(glob.glob(os.path.join("bindings", "torch", "*.cpp"))),
    include_dirs=[os.path.join(ROOT, "include")],
    extra_objects=[CORE_LIBRARY],
    # A rebuilt core library or changed public headers relink/recompile the extension.
    depends=[CORE_LIBRARY] + sorted(glob.glob(os.path.join(ROOT, "include", "rome", "*.hpp"))),
    # -fopenmp: at::parallel_for (exec_options in common.cpp) is an inline template over OpenMP in
    # torch's headers; without it the pragma is dropped and RoME runs on one thread. libgomp.so.1
    # resolves to the copy torch has already loaded, so there is one OpenMP pool in the process.
    extra_compile_args={"cxx": ["-O3", "-g0", "-std=c++20", "-fvisibility=hidden", "-fopenmp"]},
    extra_link_args=["-pthread", "-fopenmp"],
)

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildRome},
)
