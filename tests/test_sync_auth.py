"""The weight sync's Store values are authenticated (auth.AuthenticatedStore under
sync/protocol.Channel): anyone who reaches the Store can write its keys, but a value
without the sync's tag is never acted on. Forged values planted at every key a sync
will read (layouts, device infos, a memory handle pointing at a decoy region, ticket
answers, offers, the point-to-point group's rendezvous) change nothing: the versions
land bit-exact and the decoy is never written. Endpoints given different secrets never
pair, and say which keys did not verify. Threads of this process, each with a
TCPStore client of its own, as test_sync_api.py."""

from __future__ import annotations

import datetime
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from helpers import hf_state_dict, in_threads, set_in_store, small_config, store_client
from sync_checks import mismatches, poisoned_destination
from llamarl_core.control import auth
from llamarl_core.sync import SyncError, SyncTimeoutError, WeightReceiver, WeightSender
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards
from llamarl_core.sync.transports import share_in_place

CONFIG = small_config("llama_gqa_bias")
SECRET = auth.new_secret()


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))


def _shards(fsdp: int, rank: int, version: int) -> dict[str, torch.Tensor]:
    return reference_fsdp_shards(hf_state_dict(CONFIG, 70 + version), fsdp, torch.float32)[rank]


def _expected(version: int) -> dict[str, torch.Tensor]:
    return reference_vllm_tp_shards(hf_state_dict(CONFIG, 70 + version), CONFIG, 1, torch.bfloat16)[0]


# ----------------------------------------------------------------------------- the store


def test_a_value_that_does_not_verify_reads_as_not_set(store):
    """Genuine values round-trip; a forged one (another secret, no tag, a genuine
    value copied from another key) is not read: check says False, get and wait wait
    for a genuine one and time out naming the key, or return it once the owner
    writes it; each distinct forged value is counted once, however often it is met."""
    ours = auth.AuthenticatedStore(store_client(store), SECRET, label="t/")
    raw = store_client(store)
    ours.set("a", b"\x00genuine")
    assert ours.get("a") == b"\x00genuine" and ours.check(["a"])
    before = auth.refused_count()
    forged = {"b": auth.sign(auth.new_secret(), "t/b", b"x"), "c": b"no tag at all",
              "d": raw.get("a")}  # a's genuine value, copied: bound to key a
    for key, value in forged.items():
        set_in_store(raw, key, value)
        assert not ours.check([key]) and not ours.check(["a", key])
        assert ours.forged(["a", key, "never-set"]) == [key]
        for _ in range(3):
            ours.check([key])
    assert auth.refused_count() - before == len(forged)  # met many times, counted once each
    ours.set_timeout(datetime.timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match=r"genuine values at \['b'\]: \['b'\] hold values that do not verify"):
        ours.get("b")
    with pytest.raises(dist.DistStoreError, match="do not verify"):
        ours.wait(["a", "c"], datetime.timedelta(seconds=0.3))
    ours.set_timeout(datetime.timedelta(seconds=10))
    # The owner's write replaces the forged value: a reader waiting meanwhile gets it.
    later = threading.Timer(0.2, lambda: auth.AuthenticatedStore(store_client(store), SECRET, "t/").set("b", b"ok"))
    later.start()
    assert ours.multi_get(["a", "b"]) == [b"\x00genuine", b"ok"]
    later.join()
    # read(): without waiting, not set / forged / genuine; a key deleted is simply not set.
    assert ours.read("never") == (False, None) and ours.read("c") == (True, None) and ours.read("a") == (True, b"\x00genuine")
    raw.delete_key("c")
    assert ours.read("c") == (False, None)
    # compare_set on genuine values; counters pass through untagged; a clone keeps the secret and the label.
    assert ours.compare_set("cs", b"", b"first") == b"first" and ours.compare_set("cs", b"first", b"second") == b"second"
    assert ours.compare_set("cs", b"other", b"third") == b"second"
    assert ours.add("n", 2) == 2 and raw.add("n", 0) == 2
    assert ours.clone().get("a") == b"\x00genuine"
    assert ours.timeout == ours.inner.timeout == dist.PrefixStore("p/", ours).timeout == datetime.timedelta(seconds=10)
    with pytest.raises(ValueError, match="at least 16"):
        auth.AuthenticatedStore(store, b"short")


def test_a_forged_optional_set_up_value_is_refused_not_taken_for_absent(store):
    """What a rank plans on (a relay's bucket table, the point-to-point bucket cap)
    may be absent; a forged one is refused naming its key, never read as absent
    (the two sides would bucket differently). Reports and markers forged are as
    good as none."""
    from llamarl_core.sync.protocol import Channel

    channel, raw = Channel(store_client(store), "optional", SECRET), store_client(store)
    assert channel.get_if_set("src/0/relay_buckets") is None  # never set
    channel.set("src/0/relay_buckets", [[["w", 0, 4, 4, 1]]])
    assert channel.get_if_set("src/0/relay_buckets") == [[["w", 0, 4, 4, 1]]]
    key = "llamarl/sync/optional//src/0/relay_buckets"
    set_in_store(raw, key, auth.sign(auth.new_secret(), "llamarl/sync/optional/src/0/relay_buckets", b"null"))
    with pytest.raises(SyncError, match="src/0/relay_buckets holds a value that does not verify"):
        channel.get_if_set("src/0/relay_buckets")
    assert channel.genuine("src/0/relay_buckets") is None and not channel.has("src/0/relay_buckets")


# ----------------------------------------------------------------------------- the sync


def _plant(raw: dist.Store, name: str, decoy_handle: dict) -> int:
    """Forged values, tagged under a stranger's own secret, at every key sync `name`
    reads in its first versions: what a stranger who knows the source writes before
    the ranks come up. Returns how many keys were planted."""
    stranger = auth.new_secret()
    prefix = f"llamarl/sync/{name}/"
    layout = json.dumps(hf_llama_fsdp(small_config("llama_tied"), 1, torch.float32).to_dict())
    values = {
        "src/layout": layout, "dst/layout": layout, "src/bucket_bytes": "1", "dst/bucket_bytes": "1",
        "src/0/info": '{"transport": "shm"}', "dst/0/info": '{"transport": "shm"}',
        "src/0/relay_buckets": json.dumps([[["lm_head.weight", 0, 4, 4, 1]]]),
        "dst/0/handle": json.dumps(decoy_handle), "dst/0/board": json.dumps(decoy_handle | {"incarnation": 1}),
        "src/0/offer/0": "[99, 1]", "src/0/error": '"forged failure"', "abandoned": '"forged: gone"',
        # The point-to-point group's rendezvous (gloo's keys under pg/): forged peer addresses.
        **{f"pg//{k}": "127.0.0.1:1" for k in ("0/0", "0/1", "1/0", "1/1", "rank_0", "rank_1")},
    }
    for key, value in values.items():  # a PrefixStore joins its prefix and a key with "/"
        set_in_store(raw, f"{prefix}/{key}", auth.sign(stranger, prefix + key, value.encode()))
    return len(values)


@pytest.mark.parametrize("transport", ["shm", "p2p"])
def test_forged_values_at_every_key_change_nothing(store, transport):
    """Three versions through a sync whose every key held a forged value first (a
    decoy shared-memory region behind the forged memory handle): each lands
    bit-exact, the decoy keeps its bytes, and the forged values were counted."""
    name = f"planted-{transport}"
    src, dst = hf_llama_fsdp(CONFIG, 1, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)
    decoy = {n: torch.full(shape, 7.0, dtype=dtype) for n, (shape, dtype) in dst.local_tensor_specs(0).items()}
    planted = _plant(store_client(store), name, share_in_place(decoy, "the decoy"))
    before = auth.refused_count()
    # The receiver first, until it has read a forged value (the senders' layout, which it waits for):
    # started together, the sender may overwrite every key the receiver reads before it reads one.
    with ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(lambda: WeightReceiver(store_client(store), dst, 0, poisoned_destination(dst, 0),
                                                       name=name, transport=transport, timeout=30, secret=SECRET))
        deadline = time.monotonic() + 30
        while auth.refused_count() == before:
            assert time.monotonic() < deadline and not receiving.done(), "the receiver read no forged value"
            time.sleep(0.01)
        sender = WeightSender(store_client(store), src, 0, _shards(1, 0, 1), name=name, transport=transport,
                              timeout=30, secret=SECRET)
        receiver = receiving.result(timeout=60)
    for version in (1, 2, 3):
        sender.tensors.update({n: t.copy_(_shards(1, 0, version)[n]) for n, t in sender.tensors.items()})
        results = in_threads(receiver.receive, lambda v=version: sender.send(v))
        assert results[0] == version and not isinstance(results[1], Exception), results
        assert not mismatches(_expected(version), receiver.weights()), mismatches(_expected(version), receiver.weights())
    assert all(bool((t == 7.0).all()) for t in decoy.values()), "a sender wrote into the decoy region"
    refused = auth.refused_count() - before
    print(f"{transport}: {planted} keys planted, {refused} forged values refused")
    assert refused > 0
    sender.close()
    receiver.close()


def test_a_forged_failure_report_during_a_receive_is_not_taken(store):
    """A stranger reports the sender failed (its error key forged, the failure count
    moved, as a failing sender does) and the receivers abandoned, while the receive
    waits on its ticket and the sender is still on its way: the receive ignores
    them, waits for the sender's answer and returns the genuine version."""
    name = "answer"
    src, dst = hf_llama_fsdp(CONFIG, 1, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)
    receiver, sender = in_threads(
        lambda: WeightReceiver(store_client(store), dst, 0, poisoned_destination(dst, 0), name=name, transport="shm",
                               timeout=30, secret=SECRET),
        lambda: WeightSender(store_client(store), src, 0, _shards(1, 0, 1), name=name, transport="shm", timeout=30,
                             secret=SECRET))
    raw, stranger = store_client(store), auth.new_secret()
    prefix = f"llamarl/sync/{name}/"

    def forge_then_send():
        deadline = time.monotonic() + 20
        while receiver._board.current() is None:  # the receive opened its ticket
            assert time.monotonic() < deadline
            time.sleep(0.005)
        before = auth.refused_count()
        for key, forged in (("src/0/error", b'"RuntimeError: forged"'), ("abandoned", b'"forged: gone"')):
            raw.set(f"{prefix}/{key}", auth.sign(stranger, prefix + key, forged))
        raw.add(f"{prefix}/src/failures", 1)
        time.sleep(0.4)  # the receive reads the reports (every 0.125 s), and must go on waiting
        assert auth.refused_count() > before  # it read the forged report, and refused it
        return sender.send(1)

    got = in_threads(receiver.receive, forge_then_send)
    assert got[0] == 1 and not isinstance(got[1], Exception), got
    assert not mismatches(_expected(1), receiver.weights())
    sender.close()
    receiver.close()


def test_endpoints_with_different_secrets_never_pair(store):
    """A receiver and a sender given different secrets: each set-up times out
    naming the keys whose values did not verify; no byte reaches the receiver's
    tensors. No secret at all, neither passed nor set in the environment, is
    refused before anything is written, with how to make one."""
    src, dst = hf_llama_fsdp(CONFIG, 1, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)
    params = poisoned_destination(dst, 0)
    untouched = {n: t.clone() for n, t in params.items()}
    made = in_threads(
        lambda: WeightReceiver(store_client(store), dst, 0, params, name="two", transport="shm", timeout=2,
                               secret=auth.new_secret()),
        lambda: WeightSender(store_client(store), src, 0, _shards(1, 0, 1), name="two", transport="shm", timeout=2,
                             secret=auth.new_secret()))
    for made_one in made:
        assert isinstance(made_one, SyncTimeoutError), made
        assert "hold values that do not verify under the sync's secret" in str(made_one), made_one
    assert not mismatches(untouched, params), mismatches(untouched, params)


def test_no_secret_is_refused_with_how_to_make_one(store, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    before = store.num_keys()
    with pytest.raises(ValueError, match="the weight sync 'none': no secret: pass secret=.*token_hex"):
        WeightSender(store, hf_llama_fsdp(CONFIG, 1, torch.float32), 0, _shards(1, 0, 1), name="none")
    assert store.num_keys() == before

