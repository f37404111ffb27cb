"""Build driver: CMakeLists.txt describes the native module; this runs it.

`pip install .` / `pip install -e .` configure and build `llamarl_core._C` with
CMake (host backend always; CUDA backend when nvcc is found, unless
LLAMARL_SKIP_CUDA=1) and print the one-line build summary CMake wrote.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        skip_cuda = os.environ.get("LLAMARL_SKIP_CUDA", "0") not in ("", "0")
        configure = [
            "cmake", str(ROOT),
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DLLAMARL_SKIP_CUDA={'ON' if skip_cuda else 'OFF'}",
        ]
        if "CUDAARCHS" in os.environ:
            configure.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['CUDAARCHS']}")
        subprocess.run(configure, cwd=build_dir, check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)
        summary = (build_dir / "llamarl_build_summary.txt").read_text().strip()
        print(f"llamarl_core._C built: {summary}", flush=True)


setup(
    ext_modules=[CMakeExtension("llamarl_core._C")],
    cmdclass={"build_ext": CMakeBuild},
)
