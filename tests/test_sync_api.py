"""The sync API a framework embeds: real signatures, the non-blocking send (a trainer
overlapping its forward passes with a sync), `pending()`, and a sender's failure
reaching its receivers. Threads of this process, each with a TCPStore client of its
own, over shared memory (and point to point), as test_sync.py's threaded tests."""

import collections
import datetime
import inspect
import random
import re
import time

import pytest
import torch
import torch.distributed as dist
import transformers

from helpers import hf_state_dict, in_threads, llamarl_shm_entries, small_config, store_client
from sync_checks import mismatches, poisoned_destination
from llamarl_core.sync import (Layout, SendHandle, StaleReceiveError, SyncError, SyncTimeoutError, TornWeightsError,
                               WeightReceiver, WeightSender, module_layout, module_sender)
from llamarl_core.sync.presets import hf_llama_fsdp, vllm_llama_tp
from llamarl_core.sync.reference import reference_fsdp_shards, reference_vllm_tp_shards

CONFIG = small_config("llama_gqa_bias")


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))


def _shards(fsdp: int, rank: int, version: int) -> dict[str, torch.Tensor]:
    return reference_fsdp_shards(hf_state_dict(CONFIG, 40 + version), fsdp, torch.float32)[rank]


def _expected(tp: int, rank: int, version: int) -> dict[str, torch.Tensor]:
    return reference_vllm_tp_shards(hf_state_dict(CONFIG, 40 + version), CONFIG, tp, torch.bfloat16)[rank]


def _pair(store, name: str, transport: str = "shm", fsdp: int = 1, timeout: float = 30, **sender_options):
    """Senders (FSDP `fsdp`) and one receiver (TP 1) registered from threads: (senders, receiver)."""
    src, dst = hf_llama_fsdp(CONFIG, fsdp, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)
    made = in_threads(
        lambda: WeightReceiver(store_client(store), dst, 0, poisoned_destination(dst, 0), name=name,
                               transport=transport, timeout=timeout),
        *[lambda r=r: WeightSender(store_client(store), src, r, {n: t.clone() for n, t in _shards(fsdp, r, 1).items()},
                                   name=name, transport=transport, timeout=timeout, **sender_options)
          for r in range(fsdp)])
    assert not any(isinstance(m, Exception) for m in made), made
    return made[1:], made[0]


def _poll(condition, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.002)


def test_endpoints_show_their_real_parameters():
    """help() and inspect.signature show the parameters themselves, not (*args, **kwargs)."""
    common = ["store", "layout", "rank", "tensors", "name", "transport", "timeout", "bucket_bytes", "num_threads"]
    sender, receiver = inspect.signature(WeightSender), inspect.signature(WeightReceiver)
    assert list(sender.parameters) == [*common, "relay_buckets", "group", "secret", "delta"]
    assert list(receiver.parameters) == [*common, "p2p_bucket_bytes", "replica", "num_replicas", "relay_names",
                                         "secret"]
    for signature in (sender, receiver):
        kinds = [p.kind for p in signature.parameters.values()]
        assert kinds[:4] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 4
        assert set(kinds[4:]) == {inspect.Parameter.KEYWORD_ONLY}
        assert signature.parameters["name"].default == "weights" and signature.parameters["transport"].default == "auto"
    send = inspect.signature(WeightSender.send).parameters
    assert list(send) == ["self", "version", "timeout", "wait"] and send["wait"].default is True
    assert send["wait"].kind == inspect.Parameter.KEYWORD_ONLY
    assert list(inspect.signature(WeightReceiver.pending).parameters) == ["self"]
    assert list(inspect.signature(SendHandle.wait).parameters) == ["self", "timeout"]
    for cls, signature in [(WeightSender, sender), (WeightReceiver, receiver)]:  # each documented
        assert [n for n in signature.parameters if not re.search(rf"\b{n}\b", cls.__doc__)] == [], cls


def test_forward_passes_overlap_sends_and_every_version_lands_whole(store):
    """A transformers trainer sends each version with wait=False and runs a forward
    pass while the send is in flight (the receivers take the version only once that
    forward pass is done, so it did overlap); each of three versions lands on both
    generator ranks bit for bit, pending() having announced it first, and the
    forward pass read the weights the send left untouched."""
    tp, versions, name = 2, (1, 2, 3), "overlap"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(CONFIG)
    inputs = torch.tensor([[1, 17, 230, 5, 999]])
    dst = vllm_llama_tp(CONFIG, tp, torch.bfloat16)

    def trainer():
        with module_sender(store_client(store), model, 0, 1, name=name, timeout=30) as sender:
            for v in versions:
                with torch.no_grad():  # the optimizer step: the weights change in place
                    for n, p in model.named_parameters():
                        p.copy_(hf_state_dict(CONFIG, 40 + v)[n])
                handle = sender.send(v, wait=False)
                with torch.no_grad():
                    logits = model(inputs).logits
                assert not handle.done()  # the receivers wait for the key below
                store.set(f"test/forward/{v}", "done")
                assert handle.wait(timeout=30) > 0
                with torch.no_grad():
                    assert torch.equal(model(inputs).logits, logits)
        return "sent"

    def generator(rank):
        problems = []
        with WeightReceiver(store_client(store), dst, rank, poisoned_destination(dst, rank), name=name,
                            timeout=30) as receiver:
            assert receiver.pending() is None  # nothing offered yet
            for v in versions:
                _poll(lambda: receiver.pending() == v)
                store_client(store).wait([f"test/forward/{v}"])
                assert receiver.receive() == v and receiver.pending() is None
                problems += [f"v{v} {line}" for line in mismatches(_expected(tp, rank, v), receiver.weights())]
        return problems

    assert in_threads(trainer, lambda: generator(0), lambda: generator(1)) == ["sent", [], []]
    assert llamarl_shm_entries() == []


@pytest.mark.parametrize("transport", ["shm", "p2p"])
def test_pending_before_an_offer_after_it_and_after_receive(store, transport):
    """None before any send; the version once the send started (and while it waits);
    None again once received, the next version after it. Point to point the receiver
    counts the versions it took from each sender: no offer has to be taken back."""
    (sender,), receiver = _pair(store, f"pending-{transport}", transport)
    assert receiver.pending() is None
    for v in (1, 2):
        handle = sender.send(v, wait=False)
        _poll(lambda: receiver.pending() == v)
        assert receiver.pending() == v  # it stays until received
        assert receiver.receive(timeout=10) == v
        assert receiver.pending() is None
        assert handle.wait(timeout=10) > 0 and handle.done() and handle.exception() is None
        assert receiver.pending() is None
    sender.close()
    receiver.close()


def test_a_receive_told_its_version_will_not_come_leaves_the_offer_standing(store):
    """The sender holds version 2 and the receive asks for version 1: it is told
    version 1 will not come (StaleReceiveError, untouched), and the offer of version
    2 still stands for pending(), which the next receive takes."""
    (sender,), receiver = _pair(store, "stale-offer")
    handle = sender.send(2, wait=False)
    _poll(lambda: receiver.pending() == 2)
    with pytest.raises(StaleReceiveError, match="version 1 will not come"):
        receiver.receive(expect=1, timeout=10)
    assert not receiver.torn and receiver.pending() == 2
    assert receiver.receive(timeout=10) == 2 and handle.wait(timeout=10) > 0
    assert receiver.pending() is None
    sender.close()
    receiver.close()


BAD_TIMEOUTS = (0, -1.0, float("nan"), float("inf"), 10**400, True, "5")


def bad_timeout(bad) -> str:
    return re.escape(f"timeout must be a positive number of seconds, at most 9.223e+09, got {bad!r}")


def test_bad_timeouts_and_versions_are_refused_before_anything_is_posted(store):
    """Point to point, where a header posted and then timed out breaks the pair: a
    timeout that is not a positive number of seconds a wait can take, and a
    version that is not an int64 of at least 0, raise ValueError naming them at
    every call that takes one, before anything is posted (NaN in a wait on the
    board never ended); the next version then lands as if nothing had been
    asked. (A sender refused at set-up reports it under its name, which its
    receivers would read: the refusals here use a name of their own.)"""
    src, dst = hf_llama_fsdp(CONFIG, 1, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)
    for bad in BAD_TIMEOUTS:
        with pytest.raises(ValueError, match=bad_timeout(bad)):
            WeightSender(store_client(store), src, 0, _shards(1, 0, 1), name="bad-set-up", transport="p2p",
                         timeout=bad)
        with pytest.raises(ValueError, match=bad_timeout(bad)):
            WeightReceiver(store_client(store), dst, 0, poisoned_destination(dst, 0), name="bad-set-up",
                           transport="p2p", timeout=bad)
    # No layout, or one of nothing (an empty model): refused, not a sync that "succeeds" with no version.
    with pytest.raises(TypeError, match="layout must be a llamarl_core.sync.Layout, got NoneType"):
        WeightSender(store_client(store), None, 0, {}, name="bad-set-up")
    with pytest.raises(ValueError, match="the layout has no parameters"):
        WeightReceiver(store_client(store), Layout(1, []), 0, {}, name="bad-set-up")
    with pytest.raises(ValueError, match="Module has no parameters: nothing to sync"):
        module_layout(torch.nn.Module(), 1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        module_layout({"w": torch.zeros(2)}, 1)
    (sender,), receiver = _pair(store, "bad-args", transport="p2p")
    for bad in BAD_TIMEOUTS:
        message = bad_timeout(bad)
        for call in (lambda: sender.send(1, timeout=bad), lambda: sender.send(1, timeout=bad, wait=False),
                     lambda: receiver.receive(timeout=bad), lambda: sender.close(timeout=bad)):
            with pytest.raises(ValueError, match=message):
                call()
    for bad in (True, -1, 2**63, 1.0, "1"):
        with pytest.raises(ValueError, match=re.escape(f"version must be a non-negative int below 2**63 (it goes as "
                                                       f"an int64), got {bad!r}")):
            sender.send(bad)
    assert receiver.pending() is None  # nothing was offered
    handle = sender.send(2**63 - 1, wait=False)
    with pytest.raises(ValueError, match=bad_timeout(float("nan"))):
        handle.wait(timeout=float("nan"))
    assert receiver.receive(timeout=20) == 2**63 - 1 and handle.wait(timeout=20) > 0
    assert mismatches(_expected(1, 0, 1), receiver.weights()) == []
    sender.close()
    sender.close(timeout=float("nan"))  # closed: nothing to do, nothing checked
    receiver.close()


def test_a_point_to_point_timeout_ends_the_pair_and_the_errors_say_what_to_do(store):
    """A receive that times out with no send running: gloo closes the receiver's
    pairs for good, and the timeout and every later receive say that the pair
    cannot be used again and to register anew (not only that a peer died). The
    sender's send of the next version may pass into its socket's buffers before
    it reads the pair closed: when it fails (the pair closed, or its send timed
    out on it: both seen here), it says the same."""
    (sender,), receiver = _pair(store, "timed-out", transport="p2p", timeout=15)
    again = "a point-to-point pair cannot be used again: register every sender and receiver again under a new name"
    with pytest.raises(SyncTimeoutError, match=re.escape(f"did not complete in time ({again})")):
        receiver.receive(timeout=0.5)
    handle = sender.send(1, wait=False)
    for _ in range(2):
        with pytest.raises(SyncError, match=re.escape(f"(a timeout closed this rank's pairs; {again})")):
            receiver.receive(timeout=10)
    error = handle.exception(timeout=30)
    assert error is None or isinstance(error, SyncError) and f"{again})" in str(error), error
    sender.close()
    receiver.close()


@pytest.mark.parametrize("transport", ["shm", "p2p"])
def test_a_handle_says_when_its_send_has_offered_the_version(store, transport):
    """SendHandle.offered() returns once the send has offered its version (the
    receiver's pending() shows it; over p2p with delta, after the sender's scans),
    before the receive takes it; at once for a send that has ended. A bad timeout
    is refused."""
    (sender,), receiver = _pair(store, f"offered-{transport}", transport=transport, delta=transport == "p2p")
    for version in (1, 2):  # p2p: the second a delta against the first
        handle = sender.send(version, wait=False)
        handle.offered(timeout=10)
        assert receiver.pending() == version
        assert receiver.receive(timeout=10) == version and handle.wait(timeout=10) >= 0
        handle.offered(timeout=1e-3)  # ended: at once
    assert mismatches(_expected(1, 0, 1), receiver.weights()) == []
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        handle.offered(timeout=float("nan"))
    sender.close()
    receiver.close()


def test_a_second_send_in_flight_is_refused(store):
    (sender,), receiver = _pair(store, "second")
    first = sender.send(1, wait=False)
    with pytest.raises(SyncTimeoutError, match="the send of version 1 is still running after 0.1 s"):
        first.wait(timeout=0.1)
    for wait in (True, False):
        with pytest.raises(SyncError, match="sender rank 0: the send of version 1 is still in flight"):
            sender.send(2, wait=wait)
    assert receiver.receive(timeout=10) == 1 and first.wait(timeout=10) > 0
    second = sender.send(2, wait=False)  # the first is over: the next may start
    assert receiver.receive(timeout=10) == 2 and second.wait(timeout=10) == first.wait()
    assert mismatches(_expected(1, 0, 1), receiver.weights()) == []  # the shards still hold version 1
    sender.close()
    receiver.close()


def test_close_stops_a_send_in_flight_and_the_receiver_hears_of_it(store):
    """A send waiting for a receiver that never asks: close() stops it within a ticket
    poll, unmaps nothing until it has stopped, and the receiver is told."""
    (sender,), receiver = _pair(store, "close")
    handle = sender.send(1, wait=False)
    _poll(lambda: receiver.pending() == 1)
    start = time.monotonic()
    sender.close(timeout=10)
    assert time.monotonic() - start < 2.5 and handle.done() and sender._opened == {}
    error = handle.exception()
    assert isinstance(error, SyncError) and "sender rank 0: closed while sending version 1" in str(error)
    with pytest.raises(SyncError, match="sender rank 0 failed: SyncError: sender rank 0: closed while sending"):
        receiver.pending()
    with pytest.raises(SyncError, match="sender rank 0 is closed"):
        sender.send(2)
    sender.close()  # once closed, nothing to do
    receiver.close()


def _timed(call):
    """(the call's exception, time.monotonic() when it began, when it ended)."""
    began = time.monotonic()
    try:
        call()
    except Exception as exc:  # returned, checked by the caller
        return exc, began, time.monotonic()
    return None, began, time.monotonic()


def test_a_failed_send_fails_the_waiting_receive_within_2_s(store):
    """Sender rank 1's send raises (its tensor no longer matches the layout) while
    the receiver waits for both ranks, rank 0 never sending (stuck, say, in a
    collective with rank 1): the receive raises SyncError naming rank 1 and quoting
    its error well within 2 s. A receive after the failure raises at once, the
    weights untouched; once rank 1 sends again the next version lands."""
    (good, bad), receiver = _pair(store, "failed-send", fsdp=2)
    name = "model.layers.0.mlp.up_proj.weight"
    registered = bad.tensors[name].data
    bad.tensors[name].data = torch.zeros(3, 3)

    def failing_send():
        time.sleep(0.3)  # the receive is waiting by now
        return _timed(lambda: bad.send(1))

    (received, _, received_at), (sent, sent_at, _) = in_threads(
        lambda: _timed(lambda: receiver.receive(timeout=20)), failing_send)
    assert isinstance(sent, ValueError) and re.search(rf"sender rank 1: '{re.escape(name)}' has shape", str(sent))
    assert isinstance(received, SyncError), received
    quoted = f"receiver rank 0: sender rank 1 failed: ValueError: sender rank 1: '{name}' has shape (3, 3)"
    assert quoted in str(received), received
    # From the call of the failing send (its error comes at once) to the receiver's error.
    print(f"failing send called -> receiver error: {received_at - sent_at:.3f} s (a waiting receive)")
    assert received_at - sent_at < 2.0
    assert receiver.torn  # its ticket was open: rank 0 could have been writing
    start = time.monotonic()
    with pytest.raises(SyncError, match="sender rank 1 failed: ValueError"):
        receiver.receive(timeout=20)
    assert time.monotonic() - start < 2.0
    bad.tensors[name].data = registered
    # Rank 1's report stands until it sends again: its send() clears it before returning a handle.
    handles = [good.send(2, wait=False), bad.send(2, wait=False)]
    assert receiver.receive(timeout=20) == 2 and [h.wait(timeout=20) > 0 for h in handles] == [True, True]
    assert mismatches(_expected(1, 0, 1), receiver.weights()) == []
    for endpoint in (good, bad, receiver):
        endpoint.close()


@pytest.mark.parametrize("refused_rank", [0, 1])
def test_a_sender_refused_at_set_up_fails_the_receivers_set_up_within_2_s(store, refused_rank):
    """A sender whose tensors the layout refuses raises ValueError and reports it; the
    receiver waiting in its set-up (for the layouts: rank 0; for every rank's device
    info: rank 1) raises SyncError naming it within 2 s, not at its 30 s timeout."""
    src, dst = hf_llama_fsdp(CONFIG, 2, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)
    name = f"refused-{refused_rank}"

    def sender(rank):
        shards = _shards(2, rank, 1)
        if rank == refused_rank:
            time.sleep(0.3)  # the receiver is waiting by now
            shards["model.norm.weight"] = torch.zeros(5)
        return _timed(lambda: WeightSender(store_client(store), src, rank, shards, name=name, timeout=2))

    def receiver():
        return _timed(lambda: WeightReceiver(store_client(store), dst, 0, poisoned_destination(dst, 0), name=name,
                                             timeout=30))

    results = in_threads(receiver, *[lambda r=r: sender(r) for r in range(2)])
    (received, _, received_at), (refused, refused_at, _) = results[0], results[1 + refused_rank]
    assert isinstance(refused, ValueError), refused
    assert isinstance(received, SyncError) and not isinstance(received, SyncTimeoutError), received
    assert (f"sender rank {refused_rank} failed: ValueError: sender rank {refused_rank}: 'model.norm.weight' has "
            "shape (5,)") in str(received)
    print(f"refused sender called -> receiver error: {received_at - refused_at:.3f} s (set-up)")
    assert received_at - refused_at < 2.0
    if refused_rank == 1:  # rank 0 waited for rank 1's device info, which never came
        assert isinstance(results[1][0], SyncTimeoutError) and "no word from sender rank 1" in str(results[1][0])


class _AfterRequest:
    """A receiver's Store (a real one) that runs `action` once, right after its
    `at`-th request, or before its first blocking wait if that comes first: a
    failure reported between two given requests of a receive."""

    def __init__(self, store, at: int, action):
        self._store, self._at, self._action, self.requests = store, at, action, 0

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def request(*args, **kwargs):
            if name in ("wait", "wait_get") and self.requests < self._at:
                self._at = self.requests
                self._action()
            result = method(*args, **kwargs)
            self.requests += 1
            if self.requests == self._at:
                self._action()
            return result

        return request


def test_abort_reaches_the_receive_whatever_the_order(store):
    """abort() between any two Store requests of a receive (before it asks for a
    version, as it opens its ticket, as it checks for failures), and at random times
    around it: the receive raises SyncError naming the sender and its reason, never
    waiting for its timeout; the next send clears the report and lands."""
    (sender,), receiver = _pair(store, "abort")
    real = receiver.channel.store
    orders = [("request", at) for at in range(6)] + [("random", i) for i in range(10)]
    rng = random.Random(0)
    for v, (kind, at) in enumerate(orders, start=1):
        receive_after = abort_after = None
        if kind == "request":  # after request 0 (before the receive), 1, ..., 5 (before its wait, if earlier)
            receiver.channel.store = _AfterRequest(real, at, lambda: sender.abort(f"step {v} failed"))
        else:
            receive_after, abort_after = rng.uniform(0, 0.02), rng.uniform(0, 0.02)

        def receive():
            if receive_after is not None:
                time.sleep(receive_after)
            return _timed(lambda: receiver.receive(timeout=10))

        def abort():
            if abort_after is not None:
                time.sleep(abort_after)
                sender.abort(f"step {v} failed")
            elif at == 0:
                sender.abort(f"step {v} failed")

        (received, began, ended), _ = in_threads(receive, abort)
        receiver.channel.store = real
        assert isinstance(received, SyncError) and not isinstance(received, SyncTimeoutError), (kind, at, received)
        assert f"sender rank 0 failed: aborted: step {v} failed" in str(received), received
        assert ended - began < 2.0, (kind, at, ended - began)
        # The report stands until the next send: send() clears it before it returns a
        # handle, so the receive after it waits for that send (a receive racing the
        # send() call may still find the report, and raise it again).
        handle = sender.send(v, wait=False)
        assert receiver.receive(timeout=10) == v, (kind, at)
        assert handle.wait(timeout=10) > 0, (kind, at)
    sender.close()
    receiver.close()


def test_a_sender_failing_after_it_served_does_not_fail_the_receive_the_others_finish(store):
    """Two senders write one receiver: sender 0 serves the version, then aborts (its
    trainer failed after the send) while sender 1 is still a second away. The
    receive waits for sender 1 and lands the version whole: sender 0's failure
    rings the receiver's board, but it answered its own slot already."""
    (first, second), receiver = _pair(store, "served-then-failed", fsdp=2)
    await_ticket = second._await_ticket

    def late(*args, **kwargs):
        time.sleep(1.0)
        return await_ticket(*args, **kwargs)

    second._await_ticket = late

    def send_then_abort():
        written = first.send(1, timeout=20)
        first.abort("the trainer failed after its send")
        return written

    received, written, _ = in_threads(lambda: receiver.receive(timeout=20), send_then_abort,
                                      lambda: second.send(1, timeout=20))
    assert received == 1 and written > 0, received
    assert mismatches(_expected(1, 0, 1), receiver.weights()) == []
    with pytest.raises(SyncError, match="the trainer failed after its send"):
        receiver.pending()  # the report stands until sender 0 sends again
    for sender in (first, second):
        sender.close()
    receiver.close()


def test_a_restarted_sole_writer_failing_before_it_writes_answers_that_the_weights_are_torn(store):
    """Sender rank 0, the receiver's only writer, dies in the middle of a copy (its
    object dropped, part of the weights overwritten, the receive waiting); the rank
    registered again aborts before its first send. It cannot know what its
    predecessor wrote, so its answer says written: the receive raises SyncError
    saying the weights are torn, and weights() refuses them, never "nothing was
    written". Its next send lands whole."""
    (dead,), receiver = _pair(store, "restarted-sole-writer")
    name = "model.layers.0.mlp.down_proj.weight"

    def receive():
        return _timed(lambda: receiver.receive(timeout=20))

    def die_then_restart():
        _poll(lambda: receiver._board.current() is not None)  # the receive opened its ticket: senders may write
        time.sleep(0.3)  # past its last look at the failure reports: it waits for the answer
        receiver.tensors[name].fill_(7.0)  # what the dead rank copied before it died
        restarted = WeightSender(store_client(store), dead.layout, 0, {n: t.clone() for n, t in _shards(1, 0, 2).items()},
                                 name="restarted-sole-writer", transport="shm", timeout=30)
        restarted.abort("the restarted trainer failed before its first step")
        return restarted

    (received, _, _), restarted = in_threads(receive, die_then_restart)
    assert isinstance(restarted, WeightSender), restarted
    assert isinstance(received, SyncError) and not isinstance(received, SyncTimeoutError), received
    assert str(received).startswith("receiver rank 0: sender rank 0 failed: aborted: the restarted trainer failed "
                                    "before its first step; weights torn"), received
    assert receiver.torn
    with pytest.raises(TornWeightsError):
        receiver.weights()
    handle = restarted.send(2, wait=False)  # its report stands until this send() clears it
    assert receiver.receive(timeout=20) == 2 and handle.wait(timeout=20) > 0
    assert mismatches(_expected(1, 0, 2), receiver.weights()) == []
    for endpoint in (restarted, dead, receiver):
        endpoint.close()


def test_an_abort_racing_the_copies_never_calls_written_weights_untouched(store, monkeypatch):
    """abort() against a send copying over shared memory (4 KiB buckets: one copy
    table after another), at every step: before the receive, once the receiver's
    ticket is open and nothing is copied yet, as each table is copied (from inside
    the sender's copy loop), and from another thread at random times. The receive
    lands the version or raises SyncError; where it says "nothing was written" the
    weights are bitwise what they were before, torn only if they were before (and
    it says so), and otherwise weights() refuses them."""
    import llamarl_core.sync.sender as sender_module

    (sender,), receiver = _pair(store, "abort-race", bucket_bytes=4096)
    handle = sender.send(1, wait=False)
    assert receiver.receive(timeout=20) == 1 and handle.wait(timeout=20) > 0
    num_tables = len(sender._tables[0])
    assert num_tables > 10
    at = {"step": None}  # where the sender's own thread aborts (None: a thread of the test does, or nobody)
    copied = {"tables": 0}
    run_table, await_ticket = sender_module.run_segment_table, sender._await_ticket

    def hooked_table(*args, **kwargs):
        if at["step"] == copied["tables"]:
            sender.abort(at["reason"])  # arrives as this table is copied
        copied["tables"] += 1
        return run_table(*args, **kwargs)

    def hooked_ticket(*args, **kwargs):
        ticket = await_ticket(*args, **kwargs)
        if at["step"] == "ticket":
            sender.abort(at["reason"])  # the ticket is open, nothing copied yet
        return ticket

    monkeypatch.setattr(sender_module, "run_segment_table", hooked_table)
    monkeypatch.setattr(sender, "_await_ticket", hooked_ticket)
    rng, seen = random.Random(5), collections.Counter()
    steps = ["before", "ticket", 0, num_tables - 1, *rng.sample(range(1, num_tables - 1), 10)] + ["thread"] * 20
    for v, step in enumerate(steps, start=2):
        before = {n: t.clone() for n, t in receiver.tensors.items()}
        was_torn = receiver.torn
        for n, t in _shards(1, 0, v).items():
            sender.tensors[n].copy_(t)
        at.update(step=step, reason=f"step {v} failed")
        copied["tables"] = 0
        handle = sender.send(v, wait=False)  # clears the last abort's report before it returns
        if step == "before":
            sender.abort(at["reason"])

        def abort_from_a_thread(ticket=receiver._ticket, delay=rng.uniform(0, 0.004)):
            if step == "thread":  # soon after the receiver takes its ticket
                _poll(lambda: receiver._ticket > ticket)
                time.sleep(delay)
                sender.abort(at["reason"])

        received, _ = in_threads(lambda: receiver.receive(timeout=20), abort_from_a_thread)
        handle.exception(timeout=20)  # ended, aborted or not
        # The sender is done with the receiver's last ticket, served or answered (or, had the
        # abort come before the receiver opened it, the one before): its next send serves a later one.
        assert sender.book.served[0] >= receiver._ticket - 1, (step, sender.book.served, receiver._ticket)
        if received == v:
            assert step == "thread", (step, v)
            seen["landed"] += 1
            assert mismatches(_expected(1, 0, v), receiver.weights()) == [], v
        elif isinstance(received, SyncError) and "; nothing was written" in str(received):
            seen["untouched"] += 1
            assert receiver.torn == was_torn and step in ("before", "ticket", "thread"), (step, received)
            assert str(received).endswith("still torn from an earlier receive)" if was_torn else "written"), received
            assert all(torch.equal(t.view(torch.uint8), before[n].view(torch.uint8))
                       for n, t in receiver.tensors.items()), (step, v)
        else:
            assert isinstance(received, SyncError) and not isinstance(received, SyncTimeoutError), (step, received)
            assert f"aborted: step {v} failed" in str(received) and receiver.torn, (step, received)
            seen["torn"] += 1
            with pytest.raises(TornWeightsError):
                receiver.weights()
    print(dict(seen))
    assert seen["untouched"] >= 2 and seen["torn"] >= 12, seen
    sender.close()
    receiver.close()


def test_an_exception_leaving_the_sender_block_is_reported(store):
    """`with WeightSender(...)`: the trainer's own exception reaches the receiver as a SyncError quoting it."""
    src, dst = hf_llama_fsdp(CONFIG, 1, torch.float32), vllm_llama_tp(CONFIG, 1, torch.bfloat16)

    def trainer():
        with WeightSender(store_client(store), src, 0, _shards(1, 0, 1), name="with", timeout=30) as sender:
            sender.send(1)
            raise RuntimeError("the loss is NaN")

    def generator():
        with WeightReceiver(store_client(store), dst, 0, poisoned_destination(dst, 0), name="with", timeout=30) as r:
            return r.receive(), _timed(lambda: r.receive(timeout=20))[0]

    raised, (version, second) = in_threads(trainer, generator)
    assert isinstance(raised, RuntimeError) and version == 1
    assert isinstance(second, SyncError), second
    assert "sender rank 0 failed: aborted: RuntimeError: the loss is NaN" in str(second)


def test_the_package_exports_its_api_and_a_moved_name_still_imports_with_a_warning_naming_its_home():
    """llamarl_core.sync exports the API a user builds a sync from, each name defined;
    a name it exported up to 0.1 still imports from it, as the same object as at its
    new home, with a DeprecationWarning naming that home; any other name is an
    AttributeError."""
    import importlib

    import llamarl_core.sync as sync

    assert len(sync.__all__) == len(set(sync.__all__)) <= 20
    assert all(getattr(sync, name) is not None for name in sync.__all__)
    assert not set(sync.__all__) & set(sync.MOVED)
    for name, (module, new) in sync.MOVED.items():
        with pytest.warns(DeprecationWarning, match=rf"llamarl_core\.sync\.{name} is now {re.escape(module)}\.{new};"):
            moved = getattr(sync, name)
        assert moved is getattr(importlib.import_module(module), new)
    with pytest.warns(DeprecationWarning, match="module_sender"):
        from llamarl_core.sync import fsdp_sender
    assert fsdp_sender is module_sender
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        sync.no_such_name  # noqa: B018


def test_a_version_scanned_before_its_offer_is_timed_from_the_receivers_first_word(store, monkeypatch):
    """A delta pair on the host scans a version before the offer (stream.prescan).
    Where every element changed, no delta is kept and every bucket goes whole: the
    pair's send is still timed from the receiver's first word on, each bucket's
    packing included (here slowed to 50 ms), so that the density limit's figure
    for a full send is that send's time, not the scans' alone."""
    from llamarl_core.sync import stream
    from llamarl_core.sync.delta_pair import DensityLimit

    observed, observe, pack = [], DensityLimit.observe, stream.run_segment_table

    def timed(self, seconds, full_bytes, densities):
        observed.append(seconds)
        return observe(self, seconds, full_bytes, densities)

    def slow_pack(*args, **kwargs):
        time.sleep(0.05)
        return pack(*args, **kwargs)

    monkeypatch.setattr(DensityLimit, "observe", timed)
    (sender,), receiver = _pair(store, "prescan-timed", transport="p2p", bucket_bytes=1 << 16, delta=True)
    buckets = len(sender._tables[0])
    assert buckets >= 3
    for version in (1, 2):
        if version == 2:
            with torch.no_grad():
                for t in sender.tensors.values():
                    t.add_(1.0)  # every bf16 element of the receiver changes
            monkeypatch.setattr(stream, "run_segment_table", slow_pack)
        handle = sender.send(version, wait=False)
        assert receiver.receive(timeout=30) == version and handle.wait(timeout=30) > 0
    assert sender.last_send.dense_buckets == buckets and sender.last_send.delta_buckets == 0
    assert len(observed) == 2 and observed[1] >= 0.05 * buckets * 0.9, (observed, buckets)
    moved = {n: t + 1.0 for n, t in hf_state_dict(CONFIG, 41).items()}  # version 1's state, every element + 1
    assert mismatches(reference_vllm_tp_shards(moved, CONFIG, 1, torch.bfloat16)[0], receiver.weights()) == []
    sender.close()
    receiver.close()
