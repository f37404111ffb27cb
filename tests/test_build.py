"""The native build without CUDA: with LLAMARL_SKIP_CUDA and with no nvcc on PATH,
CMake configures the host backend alone and says so; built (without nvcc) the
module imports, and with libstdc++ linked statically it still raises its errors
intact beside torch. With nvcc, the default GPU architectures are the ones that
nvcc can build."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _configure(tmp_path: Path, extra_args: list[str], env: dict) -> str:
    """CMake's configure step in tmp_path; returns what it printed."""
    pybind11 = pytest.importorskip("pybind11")
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake is not installed")
    configure = subprocess.run(
        [cmake, str(ROOT), f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DPython_EXECUTABLE={sys.executable}",
         f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={tmp_path / 'out'}", *extra_args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert configure.returncode == 0, configure.stderr
    return configure.stdout


def _build(tmp_path: Path, extra_args: list[str], env: dict) -> tuple[str, Path]:
    stdout = _configure(tmp_path, extra_args, env)
    build = subprocess.run([shutil.which("cmake"), "--build", ".", "--parallel", "2"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    return stdout, tmp_path / "out"


def _import_summary(out_dir: Path) -> str:
    probe = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('_C', sys.argv[1]); "
             "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             "print(m.built_with_cuda, m.build_summary)")
    module = next(out_dir.glob("_C*.so"))
    return subprocess.run([sys.executable, "-c", probe, str(module)], capture_output=True, text=True,
                          timeout=60, check=True).stdout.strip()


def test_cuda_skipped_on_request():
    """LLAMARL_SKIP_CUDA: CMake configures the host backend alone, and says so (the
    build of that configuration: the test below, where nvcc is not found)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        stdout = _configure(Path(folder), ["-DLLAMARL_SKIP_CUDA=ON"], dict(os.environ))
    assert "llamarl_core._C: host backend only (CUDA skipped: LLAMARL_SKIP_CUDA=1)" in stdout


def test_build_without_nvcc_on_path_and_libstdcxx_static(tmp_path):
    """No nvcc on PATH: the host backend alone is built, says so, and imports.
    -static-libstdc++ stands in for toolchains that link it statically by default
    (a CUDA image's GCC 13 did): unless the module keeps that copy's symbols to
    itself, the loader binds part of them to the libstdc++.so that torch loaded and
    an error message formatting a number comes out garbled ("segment  (") or
    segfaults (it did on an H100 machine). One build for both: the suite's only one."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "CUDA_PATH", "CUDA_HOME")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (Path(p) / "nvcc").exists())
    stdout, out = _build(tmp_path, ["-DCMAKE_MODULE_LINKER_FLAGS=-static-libstdc++"], env)
    assert "host backend only (CUDA skipped: nvcc not found)" in stdout
    assert _import_summary(out) == "False host backend only (CUDA skipped: nvcc not found)"
    probe = ("import importlib.util, sys; import numpy as np; import torch; "
             "spec = importlib.util.spec_from_file_location('_C', sys.argv[1]); "
             "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
             "t = np.zeros((2, 7), np.int64); t[:, 4] = 16; t[:, 5] = 1; t[0, 0] = t[0, 2] = 4096\n"
             "try: m.execute_segments_host(t, 1)\nexcept m.EngineError as exc: print(exc)")
    module = next(out.glob("_C*.so"))
    proc = subprocess.run([sys.executable, "-c", probe, str(module)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("segment 1: null address ("), proc.stdout


def test_default_gpu_architectures_follow_the_nvcc_found(tmp_path):
    """An nvcc that cannot build sm_100 (before CUDA 12.8) is not asked to: stood
    in for by a wrapper of the real nvcc whose --list-gpu-code leaves sm_100 out."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f"""#!/bin/sh
if [ "$1" = "--list-gpu-code" ]; then "{nvcc}" "$@" | grep -v '^sm_1[0-9][0-9]'; exit 0; fi
exec "{nvcc}" "$@"
""")
    wrapper.chmod(0o755)
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    stdout = _configure(build_dir, [f"-DCMAKE_CUDA_COMPILER={wrapper}"], {**os.environ})
    # (with the real nvcc, sm_100 is built: test_engine checks the module's cubins)
    assert "sm 80-real;86-real;89-real;90-real;90-virtual," in stdout, stdout


def test_kernels_install_as_a_subpackage_only():
    import importlib
    import importlib.metadata

    kernels = importlib.import_module("llamarl_core.kernels")
    assert Path(kernels.__file__).parent.name == "kernels"
    # The one top-level package: no generic `kernels` or `bench` module is installed.
    top_level = importlib.metadata.distribution("llamarl-core").read_text("top_level.txt")
    assert top_level.split() == ["llamarl_core"]
    bench = importlib.import_module("llamarl_core.bench.bench_sync")
    assert callable(bench.main)
