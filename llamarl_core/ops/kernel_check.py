"""Compile every Triton kernel variant the launchers use for real GPU targets,
without a GPU, and report registers and spills.

Triton's interpreter (TRITON_INTERPRET=1, how the kernels run on CPU tensors)
checks almost nothing a GPU compiler checks: a kernel reading a plain module
global ran there and failed its first launch on every GPU. `triton.compile`
needs no GPU: it lowers the kernel down to a cubin with the ptxas shipped in the
Triton wheel. The launchers describe each launch as a KernelLaunch; this module
specializes its arguments the way Triton's JIT does at launch time (an int equal
to 1 becomes a constant, pointers and ints divisible by 16 get the divisibility
hint), compiles it, and reads registers and spills from `ptxas -v`.

    python -m llamarl_core.ops.kernel_check [--arch 90 100] [--json]

The compile must run in a process where TRITON_INTERPRET is unset before
triton is imported (the decorators read it): `compile_all()` starts one.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

# sm_90 (H100 / H200) and sm_100 (B200) run the hardware e4m3 cast; sm_80 (A100,
# and A10 / sm_86 with the same code) the software cast: see fp8_launch.software_fp8_cast.
DEFAULT_ARCHS = (80, 90, 100)


@dataclass
class CompiledVariant:
    name: str
    kernel: str
    arch: int
    num_warps: int
    registers: int | None = None  # per thread
    spill_bytes: int | None = None  # spill stores + loads, per thread
    stack_bytes: int | None = None
    error: str | None = None


def _variants():
    from . import fp8_launch, logprob_launch, objective_launch

    return [*fp8_launch.kernel_variants(), *fp8_launch.tile_variants(), *logprob_launch.kernel_variants(),
            *objective_launch.kernel_variants()]


def _uses_software_fp8(launch) -> bool:
    return bool(launch.constexprs.get("SOFTWARE_FP8", False))


def _arch_runs(launch, arch: int) -> bool:
    """Whether a launcher would pick this variant on `arch`: the FP8 cast variants
    split by arch (software before sm_89); everything else runs everywhere."""
    from .fp8_launch import HARDWARE_E4M3_CAPABILITY

    if "SOFTWARE_FP8" not in launch.constexprs:
        return True
    return _uses_software_fp8(launch) == (divmod(arch, 10) < HARDWARE_E4M3_CAPABILITY)


_TORCH_TO_TRITON = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "uint8": "u8", "int8": "i8", "int64": "i64",
                    "int32": "i32", "float8_e4m3fn": "fp8e4nv"}


def specialize(launch):
    """(signature, constexprs, attrs) for triton.compiler.ASTSource, as Triton's
    JIT would build them for these arguments."""
    import torch

    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(launch.kernel.arg_names):
        if name in launch.constexprs:
            signature[name], constexprs[name] = "constexpr", launch.constexprs[name]
            continue
        value = launch.args[name]
        aligned = False
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[str(value.dtype).removeprefix("torch.")]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:  # the JIT turns an int equal to 1 into a constant (unit strides)
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.kernel.__name__}: cannot specialize argument {name}={value!r}")
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _usage_cache() -> str:
    """Where ptxas's answers are kept, beside Triton's own cache (which keeps the
    compiled kernels, not these figures): a second check skips ptxas entirely."""
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return os.path.join(root, "llamarl-ptxas-usage")


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill bytes, stack bytes) of a kernel's PTX, from `ptxas -v`
    with the ptxas Triton itself uses for `arch`; remembered per (ptxas name and
    version, arch, PTX) in _usage_cache(), one file an entry, written whole. The
    key holds the PTX up to its first `.file` line (what follows is debug info:
    the source files' paths, the compile directory), which the figures do not
    depend on, and the ptxas by name and version, not path: a checkout elsewhere,
    or another environment with the same Triton, finds the answers."""
    from triton.backends.nvidia import compiler

    try:  # Triton 3.9 picks a ptxas per arch; earlier 3.x releases have one, get_ptxas()
        ptxas = compiler.get_ptxas(arch)
    except TypeError:
        ptxas = compiler.get_ptxas()
    version = getattr(ptxas, "version", "")
    ptxas = getattr(ptxas, "path", ptxas)
    code = "\n".join(itertools.takewhile(lambda line: not line.lstrip().startswith(".file"), ptx.splitlines()))
    # the ptxas by its name and version where Triton gives one (the same ptxas in another environment), else its path
    ident = f"{os.path.basename(ptxas)} {version}" if version else ptxas
    key = hashlib.sha256(f"{ident}\0{arch}\0{code}".encode()).hexdigest()
    entry = os.path.join(_usage_cache(), f"{key}.json")
    try:
        with open(entry) as f:
            return tuple(json.load(f))
    except (OSError, ValueError):
        pass
    usage = _run_ptxas(ptxas, ptx, arch)
    try:
        os.makedirs(_usage_cache(), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=_usage_cache(), delete=False, suffix=".tmp") as f:
            json.dump(usage, f)
        os.replace(f.name, entry)  # whole or not at all: the shards of compile_all() write side by side
    except OSError:
        pass  # a read-only home: ptxas answers again next time
    return usage


def _run_ptxas(ptxas: str, ptx: str, arch: int) -> tuple[int, int, int]:
    gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={gpu_name}", path, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    registers = _PTXAS_REGISTERS.search(text)
    spills = _PTXAS_SPILLS.search(text)
    if registers is None or spills is None:
        raise RuntimeError(f"cannot read ptxas -v output:\n{text}")
    stack, stores, loads = (int(x) for x in spills.groups())
    return int(registers.group(1)), stores + loads, stack


def compile_here(archs=DEFAULT_ARCHS, shard: int = 0, num_shards: int = 1) -> list[CompiledVariant]:
    """Compile every variant for each arch that would run it (with num_shards,
    every num_shards-th from `shard` on), in this process (TRITON_INTERPRET must
    not be set). Failures are reported, not raised."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_here needs a process without TRITON_INTERPRET; use compile_all()")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    unique, seen = [], set()
    for name, launch in _variants():
        specialized = specialize(launch)
        key = (launch.kernel.__name__, str(specialized), launch.num_warps)
        if key in seen:  # e.g. a block's sub-tile does not depend on K: one compile serves both names
            continue
        seen.add(key)
        unique += [(name, launch, specialized, arch) for arch in archs if _arch_runs(launch, arch)]
    results = []
    for name, launch, (signature, constexprs, attrs), arch in unique[shard::num_shards]:
        row = CompiledVariant(name, launch.kernel.__name__, arch, launch.num_warps)
        try:
            compiled = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": launch.num_warps})
            row.registers, row.spill_bytes, row.stack_bytes = _ptxas_usage(compiled.asm["ptx"], arch)
        except Exception as exc:  # noqa: BLE001 - every failing variant is reported with its error
            row.error = f"{type(exc).__name__}: {exc}"
        results.append(row)
    return results


def compile_all(archs=DEFAULT_ARCHS, timeout_s: float = 900.0) -> list[CompiledVariant]:
    """compile_here() in fresh Python processes without TRITON_INTERPRET, one per
    core (a cold compile of every variant takes about 45 s of CPU here)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set to silence its warning
    num_shards = max(1, min(len(os.sched_getaffinity(0)), 8))
    procs = [subprocess.Popen([sys.executable, "-m", "llamarl_core.ops.kernel_check", "--json", "--shard",
                               f"{i}/{num_shards}", "--arch", *map(str, archs)], env=env, cwd="/",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(num_shards)]
    rows = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            if proc.returncode not in (0, 1):  # 1: some variant failed, reported in its rows
                raise RuntimeError(f"the compile check process failed (exit {proc.returncode}):\n{stderr[-4000:]}")
            rows += [CompiledVariant(**row) for row in json.loads(stdout)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return rows


def format_table(rows: list[CompiledVariant]) -> str:
    lines = ["| variant | sm | warps | registers / thread | spill bytes | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        result = "ok" if r.error is None else r.error.splitlines()[0][:120]
        lines.append(f"| {r.name} | {r.arch} | {r.num_warps} | {r.registers} | {r.spill_bytes} | {result} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llamarl_core.ops.kernel_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(DEFAULT_ARCHS), help="SM versions (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--shard", default="0/1", help="I/N: compile every N-th variant from the I-th (default: all)")
    args = parser.parse_args(argv)
    shard, num_shards = (int(x) for x in args.shard.split("/"))
    rows = compile_here(args.arch, shard, num_shards)
    print(json.dumps([asdict(r) for r in rows]) if args.json else format_table(rows))
    return 0 if all(r.error is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
