"""Every documented way to hand a generator model to a WeightReceiver updates the
model's own parameters, on every transport: what the generator computes with
after a receive is checked, never the receiver's view of it."""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist

from helpers import in_threads, store_client
from live_workers import tiny_model
from llamarl_core.sync import (Layout, ParamSpec, SyncError, WeightReceiver, module_layout, module_receiver,
                               module_sender)
from llamarl_core.sync.engine import check_distinct_memory

FORMS = {
    "named_parameters": lambda model: dict(model.named_parameters()),
    "p.data": lambda model: {n: p.data for n, p in model.named_parameters()},
    "p.detach()": lambda model: {n: p.detach() for n, p in model.named_parameters()},
}
TRANSPORTS = ["shm", "p2p", pytest.param("cuda_ipc", marks=pytest.mark.gpu)]


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))


def _receiver(store, form: str, generator: torch.nn.Module, name: str, transport: str):
    if form == "module_receiver":
        return module_receiver(store_client(store), generator, 0, 1, name=name, transport=transport, timeout=30)
    return WeightReceiver(store_client(store), module_layout(generator, 1), 0, FORMS[form](generator), name=name,
                          transport=transport, timeout=30)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("form", [*FORMS, "module_receiver"])
def test_every_receiver_form_updates_the_models_own_parameters(store, form, transport):
    """A Qwen3-MoE trainer (fused experts) into a generator of the same family
    with other weights, three versions, the trainer stepped by its optimizer
    between them: after each receive every Parameter of the generator model
    equals the trainer's bit for bit, and so do its logits."""
    device = "cuda" if transport == "cuda_ipc" else "cpu"
    trainer, generator = tiny_model("qwen3_moe", 1).to(device), tiny_model("qwen3_moe", 2).to(device)
    generator.requires_grad_(False)
    name = f"forms-{form}-{transport}"
    receiver, sender = in_threads(lambda: _receiver(store, form, generator, name, transport),
                                  lambda: module_sender(store_client(store), trainer, 0, 1, name=name,
                                                        transport=transport, timeout=30))
    assert not isinstance(receiver, Exception) and not isinstance(sender, Exception), (receiver, sender)
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    ids = torch.randint(0, 300, (2, 7), device=device)
    for version in (1, 2, 3):
        landed, sent = in_threads(lambda: receiver.receive(timeout=30), lambda v=version: sender.send(v, timeout=30))
        assert landed == version and not isinstance(sent, Exception), (landed, sent)
        stale = [n for n, p in generator.named_parameters() if not torch.equal(p, trainer.get_parameter(n))]
        assert stale == [], f"version {version}: {len(stale)} of the generator model's parameters stale: {stale[:3]}"
        with torch.no_grad():
            assert torch.equal(generator(input_ids=ids).logits, trainer(input_ids=ids).logits)
        trainer(input_ids=ids).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    sender.close()
    receiver.close()


def test_two_names_sharing_memory_are_refused_naming_both(store):
    """A tensor registered under two names (tied weights, an alias): a sync would
    write both into one memory. Refused before anything is published."""
    layout = Layout(1, [ParamSpec("a", (4, 8), torch.float32), ParamSpec("b", (2, 8), torch.float32)])
    a = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"receiver rank 0: 'a' and 'b' share memory"):
        WeightReceiver(store_client(store), layout, 0, {"a": a, "b": a[2:]}, name="aliased", timeout=5)
    assert not dist.PrefixStore("llamarl/sync/aliased/", store_client(store)).check(["dst/0/info"])
    flat = torch.zeros(48)  # side by side in one storage: taken
    check_distinct_memory({"a": flat[:32].view(4, 8), "b": flat[32:].view(2, 8)}, "receiver rank 0")
    with pytest.raises(ValueError, match=r"'a' and 'b' share memory"):  # one byte in common
        check_distinct_memory({"a": flat[:32].view(4, 8), "b": flat[31:47].view(2, 8)}, "receiver rank 0")


def test_module_receiver_refuses_a_parameter_rebound_after_registration(store):
    """load_state_dict(assign=True) on the generator model after registration: the
    next receive raises naming the parameter before a byte moves, and the model's
    new parameters are left as they were."""
    trainer, generator = tiny_model("qwen3", 1), tiny_model("qwen3", 2)
    receiver, sender = in_threads(
        lambda: module_receiver(store_client(store), generator, 0, 1, name="rebound", timeout=30),
        lambda: module_sender(store_client(store), trainer, 0, 1, name="rebound", timeout=30))
    landed, sent = in_threads(lambda: receiver.receive(timeout=30), lambda: sender.send(1, timeout=30))
    assert landed == 1 and not isinstance(sent, Exception), (landed, sent)
    generator.load_state_dict({n: p.detach() + 1 for n, p in generator.named_parameters()}, assign=True)
    before = {n: p.clone() for n, p in generator.named_parameters()}
    with pytest.raises(SyncError, match=re.escape("generator parameter 'model.embed_tokens.weight' was rebound after "
                                                  "the receiver registered it")):
        receiver.receive(timeout=5)
    assert receiver.torn is False and receiver.version == 1
    assert all(torch.equal(p, before[n]) for n, p in generator.named_parameters())
    sender.close()
    receiver.close()


_DESCRIPTORS = """
import json, resource, torch
from llamarl_core.sync.transports import share_in_place
out = {}
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))  # a soft limit the storages overflow, a hard one they fit
tensors = {f"p{i}": torch.randn(4) for i in range(600)}
out["regions"] = len(share_in_place(tensors, "receiver rank 0")["regions"])
out["soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
resource.setrlimit(resource.RLIMIT_NOFILE, (1000, 1000))  # no room even at the hard limit
tensors = {f"q{i}": torch.randn(4) for i in range(1200)}
try:
    share_in_place(tensors, "receiver rank 0")
except RuntimeError as exc:
    out["error"] = str(exc)
out["moved"] = sum(t.is_shared() for t in tensors.values())
print(json.dumps(out))
"""


def test_storages_beyond_the_open_file_limit_raise_it_or_are_refused_before_any_moves():
    """torch keeps a descriptor per shared storage: 600 storages under a soft limit
    of 256 raise it (to no more than needed), 1200 under a hard limit of 1000 are
    refused naming the receiver, none moved."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _DESCRIPTORS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["regions"] == 600 and 600 < out["soft"] <= 4096
    assert out["error"].startswith("receiver rank 0: cannot move its 1200 tensors into shared memory, none moved: "
                                   "their 1200 storages need a descriptor each, and the limit on open files is 1000")
    assert out["moved"] == 0
