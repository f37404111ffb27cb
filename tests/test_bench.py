"""The benchmark commands run end to end and print their figures as JSON (tiny
sizes; no timing is asserted here: figures live in bench/RESULTS.md)."""

import json
import math
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

from helpers import llama_parameter_count


def _run(*args: str) -> dict:
    # Run outside the repository so the installed package is imported, not the sources.
    out = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "bench", *args, "--json"],
                         capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[c10d]" not in out.stderr, out.stderr[-3000:]  # a successful run logs no store timeouts
    return json.loads(out.stdout)


# A one-layer model and a single timed sync: every bench sync mode runs in seconds.
TINY_SYNC = ["--hidden", "64", "--intermediate", "128", "--layers", "1", "--heads", "4", "--kv-heads", "2",
             "--vocab", "256", "--warmup", "0", "--repeats", "1"]


def _figures_hold_together(result: dict) -> None:
    """Each rate is the model's bytes over its method's median time; each ratio
    "a_vs_b" is the rate of a (engine: the engine over `auto`; p2p: over p2p) over
    the rate of b."""
    seconds = {method: figures["median"] for method, figures in result["seconds"].items()}
    assert set(seconds) == set(result["gbps"])
    for method, median in seconds.items():
        assert math.isclose(result["gbps"][method], result["model_bytes"] / median / 1e9, rel_tol=1e-9), method
    methods = {"engine": "engine_auto", "p2p": "engine_p2p"}
    for name, ratio in result["ratios"].items():
        ours, peer = name.split("_vs_")
        assert math.isclose(ratio, result["gbps"][methods.get(ours, ours)] / result["gbps"][peer], rel_tol=1e-9), name


def test_bench_sync_reports_every_method():
    """Every method beside the engine, their figures holding together, the model's
    bytes its parameters' in the generator's bf16 (counted here by transformers)."""
    result = _run("sync", *TINY_SYNC)
    assert set(result["gbps"]) == {"memcpy", "engine_auto", "engine_p2p", "gloo_broadcast", "mp_shared"}
    assert set(result["ratios"]) == {"engine_vs_memcpy", "engine_vs_gloo_broadcast", "engine_vs_mp_shared",
                                     "p2p_vs_gloo_broadcast"}
    _figures_hold_together(result)
    assert result["model_bytes"] == 2 * llama_parameter_count(result["config"])


def test_bench_sync_into_fp8_destinations_reports_the_engine_beside_its_limit():
    result = _run("sync", "--fp8", "channel", "--src-dtype", "fp32", "--transports", "auto", *TINY_SYNC)
    assert set(result["gbps"]) == {"memcpy", "engine_auto"} and result["fp8"] == "channel"
    assert set(result["ratios"]) == {"engine_vs_memcpy"}
    _figures_hold_together(result)


def test_bench_sync_replicas_reports_each_count_beside_naive_and_limit():
    # --replicas 2 also measures R = 1 (the naive send is R x its time); FSDP 1 -> TP 1 keeps it to 7 processes.
    result = _run("sync", "--replicas", "2", "--fsdp", "1", "--tp", "1", *TINY_SYNC)
    assert [row["replicas"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row) == {"replicas", "seconds", "gbps", "naive_seconds", "speedup_vs_naive", "memcpy_seconds",
                            "memcpy_gbps", "fraction_of_memcpy"}
        assert row["seconds"]["median"] > 0 and row["memcpy_seconds"]["median"] > 0
    assert result["rows"][1]["naive_seconds"] == 2 * result["rows"][0]["seconds"]["median"]
    sent = result["bytes_sent_by_src_rank"]
    assert set(sent) == {"1", "2"} and sent["1"] == sent["2"] and sum(sent["1"].values()) == result["model_bytes"]


def test_bench_sync_hosts_reports_each_count_beside_line_rate_and_broadcast():
    if os.geteuid() != 0:
        pytest.skip("network namespace hosts need root")
    result = _run("sync", "--hosts", "--replicas", "2", "--fsdp", "1", "--tp", "1", "--link-rate", "1gbit",
                  "--delta", "0", "0.5", *TINY_SYNC, "--warmup", "1")
    assert [row["replicas"] for row in result["rows"]] == [1, 2]
    line_rate_s = result["model_bytes"] * 8 / 1e9
    for row in result["rows"]:
        assert row["line_rate_seconds"] == pytest.approx(line_rate_s)
        assert row["seconds"]["median"] > 0 and row["broadcast_seconds"]["median"] > 0
    assert result["rows"][1]["naive_seconds"] == 2 * result["rows"][0]["seconds"]["median"]
    sent = result["bytes_sent_by_src_rank"]
    assert sent["1"] == sent["2"] and sum(sent["1"].values()) == result["model_bytes"]
    # Deltas: nothing changed puts next to nothing on the wire; half the elements drawn change half of them.
    unchanged, half = result["deltas"]
    assert [unchanged["fraction"], half["fraction"]] == [0, 0.5]
    assert unchanged["changed"] == 0 and unchanged["wire_vs_full"] < 0.01 and unchanged["full_bytes"] == result["model_bytes"]
    assert 0.49 < half["changed_fraction"] < 0.51 and half["wire_vs_full"] > 0.45, half
    assert all(row["time_vs_full"] == row["seconds"]["median"] / result["rows"][0]["seconds"]["median"]
               for row in result["deltas"])


def _files(folder: Path) -> dict[str, int]:
    """Every file under `folder` (Python's byte-code caches aside) and its modification time."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_bench_fp8_reports_cpu_path_and_peers(tmp_path):
    """Also: the installed package's folder is never written to; --record DIR writes there alone."""
    import llamarl_core.bench

    # The package and its bench module (one folder installed; two in an editable install: bench/ is mapped).
    before = {Path(m.__file__).parent: None for m in (llamarl_core, llamarl_core.bench)}
    before = {folder: _files(folder) for folder in before}
    result = _run("fp8", "--shapes", "64x96", "--repeats", "1", "--record", str(tmp_path / "rec"))
    assert {folder: _files(folder) for folder in before} == before
    assert sorted(_files(tmp_path / "rec")) == ["RESULTS.md", "results.csv"]
    assert "## FP8 weight quantization (`llamarl bench fp8`)" in (tmp_path / "rec" / "RESULTS.md").read_text()
    rows = (tmp_path / "rec" / "results.csv").read_text().splitlines()
    assert rows[0].startswith("timestamp,machine,version,git_sha,bench") and len(rows) == 1 + len(result["rows"])
    methods = {(r["granularity"], r["method"]) for r in result["rows"]}
    assert methods == {(g, m) for g in ("tensor", "channel", "block") for m in ("torch copy", "CPU path", "torch reference")}
    assert set(result["ratios"]) == {"64x96 tensor", "64x96 channel", "64x96 block"}


def test_bench_aipo_reports_every_loss_type_beside_its_peers():
    """Every objective, from logits and from hidden states, beside the naive loss (and Liger's, where installed,
    else said to be not measured, and why); ours and the naive loss compute the same objective."""
    from llamarl_core.bench import bench_aipo
    from llamarl_core.ops.objectives import LOSS_TYPES

    result = _run("aipo", "--batch", "2", "--seq-len", "16", "--vocabs", "1001", "--hidden", "32")
    ran = [v for v in bench_aipo.VARIANTS if not bench_aipo.unavailable(v)]
    assert set(ran) >= {"aipo_loss", "naive_logits", "linear_aipo_loss", "naive_linear"}
    assert sorted((r["variant"], r["loss_type"]) for r in result["rows"]) == sorted(
        (v, t) for v in ran for t in LOSS_TYPES)
    assert all(r["seconds"]["median"] > 0 and r["peak_bytes"] >= 0 and r["vocab"] == 1001 for r in result["rows"])
    assert set(result["skipped"]) == set(bench_aipo.VARIANTS) - set(ran)
    assert result["ops_path"] == ["CPU torch path"] and result["dtype"] == "float32"
    peers = [p for p in bench_aipo.PEERS if set(p) <= set(ran)]
    assert set(result["ratios"]) == {f"{t}: {ours} vs {peer} @ 1001" for t in LOSS_TYPES for ours, peer in peers}
    for key, ratio in result["ratios"].items():
        if "naive" in key:
            assert ratio["loss_diff"] < 1e-4, key
    text = bench_aipo.report(result)
    for loss_type in LOSS_TYPES:
        assert text.count(f"\n| {loss_type} ") == 2, loss_type  # a row in the logits table and the linear one
    if "liger_grpo" in result["skipped"]:
        assert "Liger-Kernel not measured: " in text


@pytest.mark.parametrize("loss_type", ["aipo", "ppo", "ppo_tis", "icepop", "seq_tis", "seq_mis", "geo_mask", "gspo",
                                       "cispo"])
def test_bench_aipo_liger_peer_has_our_gradients(loss_type):
    """Liger's GRPO loss as the bench sets it up for each objective gives linear_aipo_loss's gradients (the
    corrections Liger takes precomputed, TRL's way, from old log-probs equal to the learner's); skipped without
    liger-kernel."""
    pytest.importorskip("liger_kernel.chunked_loss")
    import types

    from llamarl_core.bench import bench_aipo
    from llamarl_core.ops.aipo import linear_aipo_loss
    from llamarl_core.ops.objectives import OLD_POLICY_TYPES

    spec = types.SimpleNamespace(batch=4, seq_len=12, hidden=16, device="cpu", dtype="float32")
    d = bench_aipo._inputs(spec, 301, linear=True)
    with torch.no_grad():
        learner = (d["hidden"] @ d["weight"].t()).log_softmax(-1).gather(-1, d["targets"].unsqueeze(-1)).squeeze(-1)
    noise = torch.randn((2, *learner.shape), generator=torch.Generator().manual_seed(1))
    # Rows from near the learner to far, so that every truncation, mask and clip acts: behaviour log-probs
    # (row 2 shifted: its sequence ratio is large), and old ones for the objectives that read them (the
    # others' corrections are computed from them: there they are the learner's).
    behavior = learner - torch.tensor([[0.0], [0.0], [0.3], [0.0]]) + torch.tensor([[2e-4], [0.02], [0.1], [1.5]]) * \
        noise[0]
    d["behavior"] = behavior.clamp(max=0.0)
    old = loss_type in OLD_POLICY_TYPES
    d["old"] = learner + torch.tensor([[0.0], [1e-3], [0.3], [2.0]]) * noise[1] if old else learner
    grads = []
    for liger in (False, True):
        h, w = d["hidden"].detach().requires_grad_(), d["weight"].detach().requires_grad_()
        if liger:
            loss = bench_aipo._liger_loss(loss_type, h, w, d, compiled=False)
        else:
            loss, stats = linear_aipo_loss(h, w, d["targets"], d["behavior"], d["advantages"], d["mask"],
                                           loss_type=loss_type, old_logprobs=d["old"] if old else None)
        loss.backward()
        grads.append((h.grad, w.grad))
    acted = [f for f in (stats.truncated_fraction, stats.masked_fraction, stats.clip_fraction) if f is not None]
    assert max(acted) > 0 and grads[0][1].abs().max() > 0
    for ours, theirs in zip(*grads):
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-6)


def test_bench_pipeline_reports_both_modes():
    # TRL is an optional bench dependency, not installed for the tests: our two modes only.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "bench", "pipeline", "--steps", "3", "--skip-trl", "--repeats", "1",
                          "--warmup-steps", "0", "--json"], capture_output=True, text=True, timeout=300,
                         cwd=tempfile.gettempdir(), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert set(result) == {"llamarl_async", "llamarl_sync"}
    for name, r in result.items():  # one run each: its figures, not medians of several
        assert r["completion_tokens"] > 0 and r["tokens_per_s_runs"] == [round(r["tokens_per_s"])], name
        assert math.isclose(r["tokens_per_s"], r["completion_tokens"] / r["rl_time_s"], rel_tol=1e-9), name
        assert r["rl_time_s"] <= r["wall_time_s"] and r["tokens_per_s_with_startup"] <= r["tokens_per_s"], name
        # samples a second x tokens a sample: tokens a second
        assert math.isclose(r["samples_per_s"] * r["mean_completion_tokens"], r["tokens_per_s"], rel_tol=1e-9), name


def _synthetic_run(folder: Path) -> list[dict]:
    """A run folder whose trace has 9 steps of 100 ms (integer ms): train 0-40, a
    receive 35-50 that overlaps it and the generation 45-80, score 82-90, an
    evaluation 91-95 (not step work: a gap)."""
    spans = [("trainer", "train step", 0, 40), ("generator", "receive weights", 35, 50),
             ("generator", "generate", 45, 80), ("reward", "score", 82, 90), ("generator", "evaluate", 91, 95)]
    roles = {"trainer": 1, "generator": 2, "reward": 3}
    events = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": role}} for role, pid in roles.items()]
    events += [{"name": name, "ph": "X", "pid": roles[role], "tid": 0, "ts": (100 * k + start) * 1e3,
                "dur": (end - start) * 1e3, "args": {}} for k in range(9) for role, name, start, end in spans]
    folder.mkdir()
    (folder / "trace.json").write_text(json.dumps({"traceEvents": events}))
    (folder / "summary.json").write_text(json.dumps({"mode": "sync", "overlap_efficiency": 0.5, "reward_last": 0.1}))
    return events


def test_bench_control_reads_the_gaps_of_a_trace(tmp_path):
    """The middle half of the 9 steps (210-630 ms: 4 trainer steps start in it): the
    union of the spans, checked cell by cell on a 1 ms grid, and the gaps between
    them named by their neighbours; the evaluation is a gap, the overlapping
    receive closes the one between training and generating."""
    from llamarl_core.bench.bench_control import trace_gaps

    events = _synthetic_run(tmp_path / "run")
    read = trace_gaps(events)
    cells = [t for t in range(210, 630) if any(100 * k + a <= t < 100 * k + b for k in range(9)
                                               for a, b in ((0, 40), (35, 50), (45, 80), (82, 90)))]
    assert read["steps"] == 4 and read["step_ms"] == pytest.approx(420 / 4)
    assert read["covered_ms"] == pytest.approx(len(cells) / 4) and read["ratio"] == pytest.approx(420 / len(cells))
    assert read["gaps_ms"] == pytest.approx({"generator:generate -> reward:score": 2 * 4 / 4,
                                             "reward:score -> trainer:train step": (420 - len(cells) - 8) / 4})


def test_bench_control_measures_the_hop_beside_a_round_trip(tmp_path):
    """End to end on a synthetic run folder: a message through one queue, or through
    a forwarding process, costs more than one Store round trip (a put and a pop are
    two)."""
    _synthetic_run(tmp_path / "run")
    result = _run("control", "--messages", "20", "--trace", str(tmp_path / "run"))
    assert result["round_trip"]["median_ms"] < min(result["one_queue"]["median_ms"], result["hop"]["median_ms"])
    assert result["runs"][0]["sync"]["steps"] == 4 and result["runs"][0]["sync"]["overlap_efficiency"] == 0.5


def test_transformers_char_tokenizer_has_our_ids():
    """The tokenizer TRL gets in the bench, and exported models carry."""
    from llamarl_core.pipeline import reverse_task

    task = reverse_task()
    ours = task.tokenizer()
    theirs = ours.to_transformers()
    for i in range(50):
        prompt = task.prompt(i)
        assert theirs(prompt)["input_ids"] == ours.encode(prompt)
        ids = ours.encode(task.reference(prompt))[1:] + [ours.eos_token_id, ours.pad_token_id]
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids) == task.reference(prompt)


def test_bench_arguments_that_measure_nothing_are_refused_naming_the_flag(capsys):
    """A rank count, size or repeat count below what measures anything (0 ranks, an
    empty model, no timed repeat), a shape that is no model or does not split over
    the tensor-parallel ranks: argparse's error naming the flag, before a rank starts."""
    from llamarl_core.bench.bench_aipo import parse_args as aipo_args
    from llamarl_core.bench.bench_sync import parse_args as sync_args

    small = ["--hidden", "64", "--intermediate", "128", "--vocab", "1000", "--layers", "1"]
    cases = [(sync_args, ["--fsdp", "0"], "argument --fsdp: an integer >= 1, got 0"),
             (sync_args, ["--hidden", "0"], "argument --hidden: an integer >= 1, got 0"),
             (sync_args, ["--repeats", "0"], "argument --repeats: an integer >= 1, got 0"),
             (sync_args, ["--threads", "-2"], "argument --threads: an integer >= 0, got -2"),
             (sync_args, ["--tp", "3"], "--tp 3 over this model: num_attention_heads 16 is not divisible by tp_size 3"),
             (sync_args, ["--heads", "12", "--kv-heads", "3", "--hidden", "96", "--tp", "4"],
              "tp_size 4 > num_key_value_heads 3 must be a multiple of it"),
             (sync_args, ["--heads", "5"], "--heads 5 must divide --hidden 64"),
             (aipo_args, ["--vocabs", "-5"], "argument --vocabs: an integer >= 1, got -5"),
             (aipo_args, ["--repeats", "x"], "argument --repeats: an integer >= 1, got 'x'")]
    for parse, args, message in cases:
        with pytest.raises(SystemExit):
            parse(small + args if parse is sync_args else args)
        assert message in capsys.readouterr().err, (args, message)
    assert sync_args(small).fsdp == 2  # the defaults pass


def test_bench_sync_delta_versions_refuses_bad_folders_before_any_host(tmp_path):
    """--delta-versions: named in one line each, before a host is made: without
    --hosts, a folder save_versions did not write, one with fewer versions than the
    rounds."""
    from safetensors.torch import save_file

    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(2)}, str(short / "version-0000.safetensors"))
    cases = [([str(short)], [], "needs --hosts"),
             ([str(tmp_path)], ["--hosts"], "no config.json and version-"),
             ([str(short)], ["--hosts", "--warmup", "1", "--repeats", "2"], "holds 1 versions, fewer than the 3 rounds")]
    for folders, flags, message in cases:
        out = subprocess.run([sys.executable, "-m", "llamarl_core.cli", "bench", "sync", "--delta-versions", *folders,
                              *flags], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir())
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_save_versions_hook_writes_each_version_as_the_generator_holds_it(tmp_path, monkeypatch):
    """The step hook of llamarl_core.bench.versions, around two real AdamW steps of a
    tiny Llama: version 0 before the first step, one after each, bf16, under the
    model's parameter names, with the model's config; load_versions reads them back."""
    import transformers

    from llamarl_core.bench.versions import ENV, load_versions, read_version, save_versions

    monkeypatch.setenv(ENV, str(tmp_path / "versions"))
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step():
        ids = torch.randint(0, 64, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for i in range(2):
        save_versions(types.SimpleNamespace(step=i, rank=0, model=model), step)
    saved, files = load_versions(tmp_path / "versions")
    assert saved["hidden_size"] == 32 and [f.name for f in files] == [f"version-000{i}.safetensors" for i in range(3)]
    last = read_version(files[-1])
    assert set(last) == {n for n, _ in model.named_parameters()}
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, p.detach().to(torch.bfloat16))
               for (n, p), t in zip(model.named_parameters(), (last[n] for n, _ in model.named_parameters())))
    first = read_version(files[0])
    assert any(not torch.equal(first[n], last[n]) for n in last)
