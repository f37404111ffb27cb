"""Every Triton kernel variant the launchers use compiles for real GPUs (sm_80,
sm_90, sm_100) down to a cubin, without a GPU, with registers and spills within
bounds. The interpreter the other tests run in checks almost nothing the GPU
compiler does (it ran an FP8 kernel that no GPU compiler accepts)."""

import ast
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamarl_core.ops.kernel_check import compile_all

KERNEL_DIR = Path(__import__("llamarl_core.kernels", fromlist=["x"]).__file__).parent


@pytest.fixture(scope="module")
def compiled():
    return compile_all()


def test_every_variant_compiles_for_every_arch(compiled):
    failures = [f"{r.name} (sm_{r.arch}): {r.error}" for r in compiled if r.error is not None]
    assert not failures, "\n".join(failures)
    for arch in (90, 100):
        assert any(r.arch == arch and "quantize" in r.name and "software" not in r.name for r in compiled)
    # sm_80 (A100) has no e4m3 conversion instruction: it runs the software cast.
    assert {r.arch for r in compiled if "software cast" in r.name} == {80}


def test_no_spills_and_the_fp8_block_tile_within_128_registers(compiled):
    spilling = [f"{r.name} (sm_{r.arch}): {r.spill_bytes} bytes" for r in compiled if r.spill_bytes]
    assert not spilling, spilling
    block = [r for r in compiled if r.name.startswith("quantize block")]
    assert block and max(r.registers for r in block) <= 128, [(r.name, r.arch, r.registers) for r in block]
    # Two CTAs of 256 threads per SM need <= 128 registers a thread (65536 per SM).
    assert max(r.registers for r in compiled) <= 128


def test_every_kernel_in_the_kernels_package_is_compiled(compiled):
    """A kernel added to kernels/ without a variant in a launcher's kernel_variants() fails here."""
    kernels = set()
    for path in KERNEL_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                kernels.add(node.name)
    assert kernels and kernels == {r.kernel for r in compiled}


def test_the_check_catches_what_the_interpreter_lets_through(tmp_path):
    """A kernel reading a plain module global runs in the interpreter and fails
    to compile for a GPU; the same check, given it, reports the error."""
    module = tmp_path / "global_kernel.py"
    module.write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        LIMIT = 448.0

        @triton.jit
        def clamp_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offsets, mask=offsets < n)
            tl.store(x_ptr + offsets, tl.minimum(x, LIMIT), mask=offsets < n)
    """))
    probe = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        import global_kernel
        from llamarl_core.ops import kernel_check
        from llamarl_core.ops._launch import KernelLaunch

        x = torch.zeros(100)
        launch = KernelLaunch(global_kernel.clamp_kernel, (1,), dict(x_ptr=x, n=100), dict(BLOCK=128), 4)
        if sys.argv[2] == "interpret":
            launch.launch(x.device)
            print("interpreted fine")
        else:
            kernel_check._variants = lambda: [("clamp", launch)]
            rows = kernel_check.compile_here((90,))
            print(rows[0].error)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    interpreted = subprocess.run([sys.executable, "-c", probe, str(tmp_path), "interpret"], capture_output=True,
                                 text=True, timeout=120, env={**env, "TRITON_INTERPRET": "1"})
    assert interpreted.stdout.strip() == "interpreted fine", interpreted.stderr
    compiled = subprocess.run([sys.executable, "-c", probe, str(tmp_path), "compile"], capture_output=True, text=True,
                              timeout=120, env=env)
    assert "Cannot access global variable LIMIT" in compiled.stdout, compiled.stdout + compiled.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with a GPU, llamarl check gpu runs the GPU tests")
def test_check_gpu_without_a_gpu_says_so_and_runs_the_compile_check(tmp_path):
    out = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "check", "gpu", "--log", str(tmp_path / "check.log")],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "No CUDA device is visible" in out.stdout
    compiled = re.search(r"Compile check: (\d+) of (\d+) compiled \(passed\)", out.stdout)
    assert compiled and compiled.group(1) == compiled.group(2) and int(compiled.group(1)) > 100, out.stdout[-2000:]
    assert re.search(r"\| fp8_quantize_kernel \| \d+ of \d+ \| \d+ \| 0 \|", out.stdout)


def test_ptxas_answers_are_remembered_per_ptx(tmp_path, monkeypatch):
    """compile_all() runs ptxas -v once per (ptxas, arch, PTX): a second check reads
    the remembered answer (here planted, to prove it is read), also for the same
    kernel at another path (its `.file` lines), and an entry that does not parse
    is asked again."""
    from llamarl_core.ops import kernel_check

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    # as Triton writes it: the code, then the debug info naming the source files and the compile directory
    ptx = ('.version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry empty_kernel()\n{\n\tret;\n}\n'
           '\t.file\t1 "/here/kernels/k.py"\n\t.section\t.debug_str\n\t{\n.b8 47,104,101,114,101,0\n\t}\n')
    usage = kernel_check._ptxas_usage(ptx, 90)
    assert len(usage) == 3 and all(isinstance(x, int) for x in usage)
    (entry,) = Path(kernel_check._usage_cache()).glob("*.json")
    entry.write_text("[7, 8, 9]")
    assert kernel_check._ptxas_usage(ptx, 90) == (7, 8, 9)
    elsewhere = ptx.replace("/here/", "/elsewhere/").replace("47,104,101,114,101", "47,116,104,101,114,101")
    assert kernel_check._ptxas_usage(elsewhere, 90) == (7, 8, 9)
    assert kernel_check._ptxas_usage(ptx.replace("empty_kernel", "other_kernel"), 90) == usage
    entry.write_text("not json")
    assert kernel_check._ptxas_usage(ptx, 90) == usage
