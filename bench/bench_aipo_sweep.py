"""The GPU sweep of the log-prob kernels' launch configs and of
linear_aipo_loss's chunk size (`python -m llamarl_core.bench.bench_aipo
--gpu-sweep`, on a CUDA device): each candidate config (BLOCK_V, rows a
program, warps, and for the backward the programs it splits rows over) timed
on bf16 logits beside the GPU_CONFIGS defaults, and linear_aipo_loss beside its
three GEMMs for each chunk size. What bench_aipo's --gpu-sweep runs and
records.
"""

from __future__ import annotations

import torch

from llamarl_core.bench.harness import table

# The log-prob kernels are timed on bf16 logits of these (tokens, vocab);
# linear_aipo_loss beside its three GEMMs at (tokens, hidden, vocab), bf16, for
# each chunk size (MiB of logits per chunk; 1024 MiB holds the whole batch).
SWEEP_SHAPES = ((4096, 128256), (16384, 32000))
SWEEP_LINEAR = (4096, 4096, 128256)
SWEEP_CHUNK_MIB = (128, 256, 512, 1024)
# (block_v, rows, num_warps) candidates: 4 to 32 values a thread, one row or a few;
# the backward's also with a 2-D grid (vocabulary split until there are this many
# programs). They include the GPU_CONFIGS defaults for large vocabularies.
_SWEEP_LAUNCHES = ((1024, 1, 4), (2048, 1, 4), (2048, 1, 8), (4096, 1, 4), (4096, 1, 8), (4096, 1, 16),
                   (8192, 1, 8), (8192, 1, 16), (1024, 4, 4), (2048, 2, 8), (2048, 4, 8))
_SWEEP_MIN_PROGRAMS = (0, 8192, 32768)


def sweep_configs() -> tuple[list, list]:
    """(forward candidates, backward candidates), LogprobConfigs."""
    from llamarl_core.ops.logprob_launch import LogprobConfig

    return ([LogprobConfig(b, r, w) for b, r, w in _SWEEP_LAUNCHES],
            [LogprobConfig(b, r, w, p) for b, r, w in _SWEEP_LAUNCHES for p in _SWEEP_MIN_PROGRAMS])


def sweep_variants() -> list:
    """Each candidate's forward and backward launch on small CPU bf16 tensors standing
    in for CUDA ones, for llamarl_core.ops.kernel_check (tests/test_aipo.py
    compiles them for sm_90). The backward's grid does not change what compiles."""
    from llamarl_core.ops.logprob_launch import logprob_launches

    logits = torch.empty((4, SWEEP_SHAPES[0][1]), dtype=torch.bfloat16)
    targets = torch.empty(4, dtype=torch.int64)
    lse, logp, coef = (torch.empty(4, dtype=torch.float32) for _ in range(3))
    variants = []
    for config in sweep_configs()[0]:
        fwd, bwd = logprob_launches(logits, targets, lse, logp, None, coef, torch.empty_like(logits), 0.7, config,
                                    config)
        tag = f"BLOCK_V {config.block_v}, {config.rows} rows, {config.num_warps} warps"
        variants += [(f"sweep forward, {tag}", fwd), (f"sweep backward, {tag}", bwd)]
    return variants


def _median_ms(fn) -> float:
    """Median of CUDA-event-timed calls (triton.testing.do_bench: L2 flushed before each)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _config_name(config) -> str:
    grid = "" if config.min_programs == 0 else f", >= {config.min_programs} programs"
    return f"BLOCK_V {config.block_v}, {config.rows} rows, {config.num_warps} warps{grid}"


def _kernel_rows(tokens: int, vocab: int, device: torch.device) -> list[dict]:
    """Each candidate's forward and backward alone, beside a copy of the logits'
    bytes; `max diff` against the default configs' outputs catches a broken one."""
    from llamarl_core.ops.aipo import aipo_loss
    from llamarl_core.ops.logprob_launch import logprob_configs, logprob_launches

    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(tokens, vocab, device=device, generator=gen) * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    coef = torch.randn(tokens, device=device, generator=gen) / tokens
    lse, logp, ent = (torch.empty(tokens, device=device) for _ in range(3))
    dlogits = torch.empty_like(logits)
    nbytes = logits.numel() * logits.element_size()
    copy_ms = _median_ms(lambda: dlogits.copy_(logits))

    def row(what, ms, moved, **extra):
        return {"what": what, "ms": ms, "gbps": moved / ms / 1e6, "vs_copy": moved / ms * copy_ms / (2 * nbytes),
                **extra}

    rows = [row("copy (read + write)", copy_ms, 2 * nbytes)]
    defaults = logprob_configs(vocab, tokens, on_gpu=True)
    forward, backward = logprob_launches(logits, targets, lse, logp, ent, coef, dlogits, 1.0, *defaults)
    rows.append(row(f"forward + entropy, default: {_config_name(defaults[0])}",
                    _median_ms(lambda: forward.launch(logits.device)), nbytes))
    backward.launch(logits.device)
    ref_lse, ref_grad = lse.clone(), dlogits.clone()
    forwards, backwards = sweep_configs()
    for config in forwards:
        launch = logprob_launches(logits, targets, lse, logp, None, coef, dlogits, 1.0, config, config)[0]
        lse.fill_(float("nan"))
        ms = _median_ms(lambda: launch.launch(logits.device))
        rows.append(row(f"forward, {_config_name(config)}", ms, nbytes, kernel="forward",
                        diff=(lse - ref_lse).abs().max().item()))
    lse.copy_(ref_lse)
    for config in backwards:
        launch = logprob_launches(logits, targets, lse, logp, None, coef, dlogits, 1.0, config, config)[1]
        dlogits.fill_(float("nan"))
        ms = _median_ms(lambda: launch.launch(logits.device))
        rows.append(row(f"backward, {_config_name(config)}", ms, 2 * nbytes, kernel="backward",
                        diff=(dlogits.float() - ref_grad.float()).abs().max().item()))
    del dlogits, ref_grad
    behavior, advantages = -torch.rand(tokens, device=device) * 9, torch.randn(tokens, device=device)

    def loss_step():
        x = logits.detach().requires_grad_()
        aipo_loss(x, targets, behavior, advantages)[0].backward()

    rows.append(row("aipo_loss fwd + bwd (6 bytes an element)", _median_ms(loss_step), 3 * nbytes))
    for r in rows:
        r["shape"] = f"{tokens} x {vocab}"
    return rows


def _peak_mib(fn, device: torch.device) -> float | None:
    """MiB allocated at the peak of fn() beyond what was before, on CUDA; None elsewhere."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def linear_rows(tokens: int, hidden: int, vocab: int, chunks_mib, device: torch.device, median_ms=None) -> list[dict]:
    """linear_aipo_loss forward + backward for each chunk size beside its three
    GEMMs alone on the same shapes (bf16 outputs, as autograd would give), each
    timed by `median_ms(fn)` (default: CUDA events, do_bench)."""
    from llamarl_core.ops.aipo import linear_aipo_loss

    median_ms = median_ms or _median_ms

    gen = torch.Generator(device=device).manual_seed(1)
    h = (torch.randn(tokens, hidden, device=device, generator=gen) / hidden**0.25).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden**0.25).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    behavior, advantages = -torch.rand(tokens, device=device) * 9, torch.randn(tokens, device=device)
    logits = torch.empty(tokens, vocab, device=device, dtype=torch.bfloat16)

    def gemms():
        torch.matmul(h, w.t(), out=logits)  # logits = h @ W^T
        return logits @ w, logits.t() @ h  # grad_h = dlogits @ W, grad_W = dlogits^T @ h

    gemm_ms = median_ms(gemms)
    del logits
    name = f"{tokens} tokens, hidden {hidden}, vocab {vocab}, bf16"
    rows = [{"what": f"three GEMMs alone, {name}", "ms": gemm_ms, "vs_gemms": 1.0,
             "tflops": 6 * tokens * hidden * vocab / gemm_ms / 1e9}]
    for mib in chunks_mib:  # None: linear_aipo_loss's own default
        chunk = None if mib is None else max(1, (mib << 20) // (vocab * 2))

        def step():
            hx, wx = h.detach().requires_grad_(), w.detach().requires_grad_()
            linear_aipo_loss(hx, wx, targets, behavior, advantages, chunk_size=chunk)[0].backward()

        peak_mib = _peak_mib(step, device)  # also the warm-up
        ms = median_ms(step)
        size = "the default chunk" if chunk is None else f"chunk {mib} MiB ({min(chunk, tokens)} tokens)"
        rows.append({"what": f"linear_aipo_loss, {size}", "ms": ms,
                     "vs_gemms": ms / gemm_ms, "tflops": 6 * tokens * hidden * vocab / ms / 1e9,
                     "peak_mib": peak_mib})
    return rows


def gpu_sweep(spec, device=torch.device("cuda"), shapes=SWEEP_SHAPES, linear=SWEEP_LINEAR) -> dict:
    """Every candidate config of the log-prob kernels on each of `shapes`, and
    linear_aipo_loss by chunk size beside its GEMMs at `linear`: see
    sweep_report(). (tests/test_aipo.py runs it on tiny CPU tensors in the
    interpreter.)"""
    import triton

    kernels = [row for tokens, vocab in shapes for row in _kernel_rows(tokens, vocab, device)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"device": name, "triton": triton.__version__, "torch": torch.__version__, "kernels": kernels,
            "linear": linear_rows(*linear, spec.sweep_chunks_mib, device)}


def sweep_report(result: dict) -> str:
    lines = [["shape", "what", "ms", "GB/s", "x copy", "max diff"]]
    for r in result["kernels"]:
        lines.append([r["shape"], r["what"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}", f"{r['vs_copy']:.2f}",
                      f"{r['diff']:.1e}" if "diff" in r else ""])
    best = []
    for shape in dict.fromkeys(r["shape"] for r in result["kernels"]):
        for kernel in ("forward", "backward"):
            candidates = [r for r in result["kernels"] if r["shape"] == shape and r.get("kernel") == kernel]
            top = min(candidates, key=lambda r: r["ms"])
            best.append(f"- best {kernel} at {shape}: {top['what'].split(', ', 1)[1]} ({top['vs_copy']:.2f}x copy)")
    linear = [["what", "ms", "x GEMMs", "TFLOP/s", "peak MiB"]]
    for r in result["linear"]:
        linear.append([r["what"], f"{r['ms']:.2f}", f"{r['vs_gemms']:.2f}", f"{r['tflops']:.0f}",
                       "" if r.get("peak_mib") is None else f"{r['peak_mib']:.0f}"])
    return (f"{result['device']}, Triton {result['triton']}, torch {result['torch']}. GB/s: bytes read + written "
            f"(forward: logits once; backward: logits and dlogits).\n\n{table(lines)}\n\n" + "\n".join(best)
            + f"\n\n{table(linear)}\n")
