"""FP8 quantization: the Triton kernels (on a GPU when there is one, else in
Triton's interpreter on CPU tensors) and the torch CPU path against the
reference, bit for bit; the reference against float64."""

import zlib

import pytest
import torch

from llamarl_core.ops.fp8 import (
    DEFAULT_BLOCK,
    FP8_MAX,
    cast_fp8_ref,
    dequantize_fp8,
    e4m3_nearest_even_ref64,
    expand_scale,
    fp8_amax,
    fp8_amax_ref,
    quantize_fp8,
    quantize_fp8_ref,
    quantize_fp8_with_scale,
    scale_from_amax,
)
from llamarl_core.ops.fp8_launch import SWEEP_TILINGS, Fp8Tiling, launch_quantize_fp8

GRANULARITIES = ["tensor", "channel", "block"]
CUDA = torch.cuda.is_available()
# (backend, device): the Triton kernels on CUDA tensors when there is a GPU, else on
# CPU tensors in the interpreter (conftest sets TRITON_INTERPRET=1 without a GPU).
BACKENDS = [
    pytest.param(("triton", "cuda" if CUDA else "cpu"), id="triton-cuda" if CUDA else "triton-interpreter"),
    pytest.param(("torch", "cpu"), id="torch"),
]
SHAPES = [(1, 1), (127, 129), (300, 200), (4096, 1)]


def _e4m3_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def _inputs(kind: str, shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n, k = shape
    w = torch.randn(shape, generator=gen)
    if kind == "outliers":  # a few 1e3 outliers: most values land in fp8's subnormal range
        w[torch.rand(shape, generator=gen) < 0.01] = 1e3
    elif kind == "midpoints":  # with amax 448 the scale is 1: w / s sits exactly on fp8 midpoints
        pos = _e4m3_values()
        pos = pos[pos >= 0].sort().values
        mids = (pos[1:] + pos[:-1]) / 2
        grid = torch.cat([mids, -mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
        w = grid[torch.randint(len(grid), shape, generator=gen)]
        w.view(-1)[0] = FP8_MAX
        if dtype != torch.float32:
            pytest.skip("midpoints are exact only in float32")
    elif kind == "beyond448":  # magnitudes far above fp8's range
        w = w * 1e5
    elif kind == "zero_blocks":  # whole 128 x 128 blocks, rows and the top-left element zero
        w[:128, :128] = 0
        w[n // 2] = 0
    return w.to(dtype)


def _quantize(w, granularity, backend, **kw):
    """quantize_fp8 of w on the backend's device; (q, scale) back on the CPU."""
    name, device = backend
    q, scale = quantize_fp8(w.to(device), granularity, backend=name, **kw)
    return q.cpu(), scale.cpu()


def _assert_same(q, scale, q_ref, scale_ref):
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert len(bad) == 0, f"{len(bad)} codes differ, first at {bad[0].tolist()}"
    assert scale.shape == scale_ref.shape and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["normal", "outliers", "midpoints", "beyond448", "zero_blocks"])
def test_matches_reference_bitwise(backend, granularity, shape, kind):
    w = _inputs(kind, shape, torch.bfloat16 if kind != "midpoints" else torch.float32, zlib.crc32(f"{shape}{kind}".encode()))
    q, scale = _quantize(w, granularity, backend)
    q_ref, scale_ref = quantize_fp8_ref(w, granularity)
    _assert_same(q, scale, q_ref, scale_ref)
    # The scale is amax / 448 exactly (float64 quotient rounded once to float32), or
    # 1 where that is 0 (all-zero groups; float32 amax below 448 x the least subnormal).
    quotient = (fp8_amax_ref(w, granularity).to(torch.float64) / FP8_MAX).to(torch.float32)
    expected = torch.where(quotient == 0, torch.ones_like(quotient), quotient)
    assert torch.equal(scale_ref, expected.reshape(scale_ref.shape))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_other_input_dtypes_and_strides(dtype, granularity):
    w = (torch.randn(200, 300) * 7).to(dtype)
    for backend in BACKENDS:
        name, device = backend.values[0]
        q, scale = quantize_fp8(w.to(device).t(), granularity, backend=name)  # a non-contiguous (300, 200) view
        _assert_same(q.cpu(), scale.cpu(), *quantize_fp8_ref(w.t().contiguous(), granularity))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_reference_rounds_like_float64_nearest_even(granularity):
    w = _inputs("outliers", (300, 200), torch.float32, 5)
    q_ref, scale = quantize_fp8_ref(w, granularity)
    quotient = (w / expand_scale(scale, tuple(w.shape), granularity)).clamp(-FP8_MAX, FP8_MAX)
    assert torch.equal(e4m3_nearest_even_ref64(quotient), q_ref.view(torch.uint8))


def test_float64_rounding_check_is_itself_sound():
    values = _e4m3_values()
    # Every representable value maps to its own code; midpoints go to the even code.
    assert torch.equal(e4m3_nearest_even_ref64(values).view(torch.float8_e4m3fn).float(), values)
    assert e4m3_nearest_even_ref64(torch.tensor([1.0625])).item() == 0x38  # 1.0625: between 1.0 (0x38) and 1.125
    assert e4m3_nearest_even_ref64(torch.tensor([1.1875])).item() == 0x3A  # between 1.125 (0x39) and 1.25 (0x3A)
    assert e4m3_nearest_even_ref64(torch.tensor([2.0 ** -10])).item() == 0x00  # half the smallest subnormal
    assert e4m3_nearest_even_ref64(torch.tensor([3 * 2.0 ** -10])).item() == 0x02


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero_gives_zeros_and_unit_scale(backend, granularity):
    q, scale = _quantize(torch.zeros(130, 260, dtype=torch.bfloat16), granularity, backend)
    assert int(q.view(torch.uint8).sum()) == 0
    assert torch.isfinite(scale).all() and (scale == 1.0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # the interpreter's inf / inf
def test_nan_and_inf_raise_naming_the_tensor(backend, granularity, bad):
    w = torch.randn(130, 260, dtype=torch.bfloat16)
    w[129, 259] = bad
    with pytest.raises(ValueError, match=r"layers\.3\.mlp: contains NaN or inf"):
        _quantize(w, granularity, backend, name="layers.3.mlp")


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_with_scale_checks_before_writing(backend):
    name, device = backend
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    scale = scale_from_amax(fp8_amax_ref(w, "channel")).to(device)
    out = torch.full((64, 64), 1.0).to(torch.float8_e4m3fn).to(device)
    original = w[3, 3].clone()
    w[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_fp8_with_scale(w.to(device), scale, "channel", out=out, backend=name)
    assert (out.float() == 1.0).all()  # untouched
    w[3, 3] = original
    quantize_fp8_with_scale(w.to(device), scale, "channel", out=out, backend=name)
    assert torch.equal(out.cpu().view(torch.uint8), quantize_fp8_ref(w, "channel")[0].view(torch.uint8))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_dequantize_is_q_times_scale_within_fp8_precision(granularity):
    w = torch.randn(300, 200, dtype=torch.float32)
    q, scale = quantize_fp8(w, granularity)
    full = expand_scale(scale, (300, 200), granularity)
    deq = dequantize_fp8(q, scale)
    assert torch.equal(deq, q.float() * full)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4, absolute <= half a subnormal step.
    assert ((deq - w).abs() <= torch.maximum(w.abs() * 2.0 ** -4, full * 2.0 ** -10)).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.zeros(4, 4), "row")
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.zeros(4), "tensor")
    with pytest.raises(ValueError, match="dtype"):
        quantize_fp8(torch.zeros(4, 4, dtype=torch.float64), "tensor")
    with pytest.raises(ValueError, match="backend"):
        quantize_fp8(torch.zeros(4, 4), "tensor", backend="cuda")
    with pytest.raises(ValueError, match="scale must be float32 of shape"):
        quantize_fp8_with_scale(torch.zeros(4, 4), torch.ones(4), "channel")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_input_is_left_untouched(backend, granularity):
    w = (torch.randn(300, 200, dtype=torch.float32) * 9).to(backend[1])
    before = w.clone()
    quantize_fp8(w, granularity, backend=backend[0])
    assert torch.equal(w, before)


def _weight(shape, dtype=torch.bfloat16, layout="contiguous", seed=17) -> torch.Tensor:
    """Random weight with outliers; "transposed": a (K, N) tensor's .t() view (strides (1, N))."""
    if layout == "transposed":
        return _inputs("outliers", shape[::-1], dtype, seed).t()
    return _inputs("outliers", shape, dtype, seed)


def _assert_nonfinite_exactly_where_the_reference_is(w, granularity, block_size, scale, amax):
    """check=False: the groups holding NaN / inf get an inf scale and amax, the others the reference's."""
    ref_amax = fp8_amax_ref(w, granularity, block_size).reshape(scale.shape)
    bad = ~torch.isfinite(ref_amax)
    assert bad.any()
    assert (scale[bad] == float("inf")).all() and (amax[bad] == float("inf")).all()
    assert torch.equal(scale[~bad], scale_from_amax(ref_amax)[~bad]) and torch.equal(amax[~bad], ref_amax[~bad])


# The GPU's tilings as of this test (GPU_TILINGS may move to another SWEEP_TILINGS
# candidate after a GPU sweep; the cases below state which path these ones take).
TEST_TILINGS = {"tensor": Fp8Tiling(tile=8192), "channel": Fp8Tiling(tile=8192), "block": Fp8Tiling(tile=16384)}
# (granularity, shape, block_size, layout, path): what a GPU's tiling makes of it.
GPU_TILING_CASES = [
    ("block", (256, 384), (128, 128), "contiguous", "one tile"),  # a 128 x 128 block a program
    ("block", (256, 160), (100, 60), "contiguous", "one tile"),  # a block size that is no power of two: masked
    ("block", (140, 130), (128, 128), "contiguous", "walk"),  # unaligned: 8 x 128 sub-tiles, ragged edge blocks
    ("block", (150, 130), (100, 60), "transposed", "walk"),  # strided
    ("channel", (5, 4096), (128, 128), "contiguous", "one tile"),  # whole rows, 2 a program
    ("channel", (70, 208), (128, 128), "contiguous", "one tile"),  # 32 short rows a program
    ("channel", (3, 12288), (128, 128), "contiguous", "one tile"),  # one row a program, padded to 16384
    ("channel", (3, 16400), (128, 128), "contiguous", "walk"),  # past max_tile: 4096-wide sub-tiles
    ("channel", (9, 2500), (128, 128), "contiguous", "walk"),  # unaligned: 1024-wide sub-tiles, the last ragged
    ("channel", (70, 200), (128, 128), "transposed", "walk"),
    ("tensor", (96, 1024), (128, 128), "contiguous", "flat"),  # 8192 a program, grid-stride amax, reversed cast
    ("tensor", (17, 1030), (128, 128), "contiguous", "flat"),  # unvectorized: 1024 a program
    ("tensor", (32, 1024), (128, 128), "transposed", "walk"),  # atomic amax over row groups, then sub-tiles
]


@pytest.mark.parametrize("granularity, shape, block_size, layout, path", GPU_TILING_CASES)
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # the interpreter's inf / inf
def test_gpu_tilings_in_the_interpreter(monkeypatch, granularity, shape, block_size, layout, path):
    """The interpreter normally holds whole regions of up to 64K elements (it is
    slow per operation); here it cuts the weight as a GPU does (one tile or a
    walk, flat or strided, by size and alignment), so every path a GPU runs is
    checked bit for bit, and with check=False, for a NaN, too."""
    from llamarl_core.ops import fp8_launch

    if not fp8_launch.use_interpreter():
        pytest.skip("checks the interpreter's run of the GPU tilings")
    monkeypatch.setattr(fp8_launch, "_INTERPRETER_TILINGS", TEST_TILINGS)
    w = _weight(shape, layout=layout)
    tiling = TEST_TILINGS[granularity]
    if granularity == "tensor" and fp8_launch._flat(w):
        assert path == "flat"
    else:
        assert path == ("one tile" if fp8_launch._region_plan(w, granularity, block_size, tiling).one_tile else "walk")
    q, scale = quantize_fp8(w, granularity, block_size, backend="triton")
    _assert_same(q, scale, *quantize_fp8_ref(w, granularity, block_size))
    amax = fp8_amax(w, granularity, block_size, backend="triton")
    assert torch.equal(amax, fp8_amax_ref(w, granularity, block_size).reshape(amax.shape))
    w[shape[0] // 2, shape[1] - 1] = float("nan")
    _q, scale = quantize_fp8(w, granularity, block_size, backend="triton", check=False)
    amax = fp8_amax(w, granularity, block_size, backend="triton", check=False)
    _assert_nonfinite_exactly_where_the_reference_is(w, granularity, block_size, scale, amax)


@pytest.mark.parametrize("granularity, tiling", [(g, t) for g, ts in SWEEP_TILINGS.items() for t in ts],
                         ids=lambda x: x if isinstance(x, str) else x.describe("channel").replace(" ", ""))
def test_sweep_candidates_in_the_interpreter(granularity, tiling):
    """Every tiling the GPU sweep times gives the reference's bits (K 4096 and
    14336: the sweep's weights' rows)."""
    from llamarl_core.ops import fp8_launch

    if not fp8_launch.use_interpreter():
        pytest.skip("the GPU sweep checks them on a GPU")
    for shape in ((4, 4096), (2, 14336)) if granularity == "channel" else ((256, 256),):
        w = _weight(shape, torch.float32 if shape[0] == 2 else torch.bfloat16)
        q, scale = launch_quantize_fp8(w, granularity, tiling=tiling)
        _assert_same(q, scale, *quantize_fp8_ref(w, granularity))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_gpu_tilings_every_dtype(monkeypatch, dtype, granularity):
    """The vectorized one-tile and flat paths of a GPU on each input dtype."""
    from llamarl_core.ops import fp8_launch

    if not fp8_launch.use_interpreter():
        pytest.skip("checks the interpreter's run of the GPU tilings")
    monkeypatch.setattr(fp8_launch, "_INTERPRETER_TILINGS", TEST_TILINGS)
    w = _weight((256, 256), dtype)
    q, scale = quantize_fp8(w, granularity, backend="triton")
    _assert_same(q, scale, *quantize_fp8_ref(w, granularity))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # the interpreter's inf / inf
def test_unchecked_nan_and_inf_give_inf_scales(backend, granularity, layout, bad):
    """check=False: nothing raises, and exactly the groups holding NaN / inf get
    an inf scale and amax, on every path (flat and 2-D per tensor, CPU)."""
    name, device = backend
    w = _weight((130, 260), layout=layout)
    w[129, 3] = bad
    q, scale = quantize_fp8(w.to(device), granularity, backend=name, check=False)
    amax = fp8_amax(w.to(device), granularity, backend=name, check=False)
    _assert_nonfinite_exactly_where_the_reference_is(w, granularity, DEFAULT_BLOCK, scale.cpu(), amax.cpu())
    assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match=r"layers\.0\.up: contains NaN or inf"):
        fp8_amax(w.to(device), granularity, backend=name, name="layers.0.up", check=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_quantize_with_scale_writes_without_looking(backend):
    name, device = backend
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    scale = scale_from_amax(fp8_amax_ref(w, "channel")).to(device)
    w[5, 5] = float("nan")
    out = quantize_fp8_with_scale(w.to(device), scale, "channel", backend=name, check=False)
    rows = torch.arange(64) != 5
    assert torch.equal(out.cpu().view(torch.uint8)[rows], cast_fp8_ref(w, scale.cpu()).view(torch.uint8)[rows])
