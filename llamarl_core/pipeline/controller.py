"""The single controller: starts the executors, runs the event loop, routes
rollouts (generator -> reward -> trainer) and triggers the DDMA weight syncs. What
to sample and what to train (the staleness bound included) is decided by its
Scheduler (scheduler.py). It holds no tensors of the model: only token ids,
rewards and timings pass through it. What the run writes as it goes (metrics,
evaluations, the trace; kept up to the checkpoint on resume) is its
RunRecorder's (recorder.py).

Step s of the trainer trains the weights of version s on samples whose oldest
token was sampled with version v >= s - max_staleness (older ones are dropped
and counted) and produces version s + 1, which the trainer ranks then push
straight into the generator ranks' parameters; the generator takes it between
two decode steps. In sync mode (max_staleness 0) generation and training take
turns: prompts for step s go to each replica right behind its command to receive
version s (it samples them once that version has landed: a generator runs its
commands in order; a replica whose receive fails samples nothing trained on), and
the trainer waits for them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import warnings
from collections import Counter
from pathlib import Path

from ..control import Heartbeat, StoreQueue
from ..control.auth import refused_count
from ..spelling import names_flags, option
from ..sync.protocol import abandon_receivers
from .config import TrainConfig
from .executors import CONTROLLER_BEAT, EVENTS, GENERATOR, REWARD, TRAINER, has_inbox, inbox_name, sync_name_of
from .export import export_policy
from .gpu_share import CONTROL as MPS_CONTROL
from .gpu_share import MpsDaemon, generator_percent, role_percent
from .inputs import INPUTS, write_inputs
from .learner import MAX_STATS, StepStats
from .messages import (
    Checkpoint,
    Checkpointed,
    Event,
    Failed,
    Prompts,
    Ready,
    Receive,
    ReceiveFailed,
    Received,
    Reconnect,
    Relay,
    Samples,
    Score,
    Scored,
    Stop,
    Sync,
    Synced,
    SyncFailed,
    Train,
    Trained,
    Working,
)
from .plugins import check_main_guard
from .preflight import check_run
from .processes import LocalExecutors
from .replicas import ReplicaSyncs, RestartPolicy
from .recorder import RunRecorder
from .report import cpu_times, steal_fraction
from .rollout import Sample
from .run_folder import FolderLock, RunFolderError, check_run_folder
from .scheduler import Scheduler

EVENT_POLL_S = 0.05
DEAD_REPORT_S = 1.0  # how long the report of an executor found dead may still take to arrive
# What the trainer ranks' step reports add to a step's metrics, averaged over the ranks; truncated completions are
# counted by the controller over every rank's samples.
TRAINER_STATS = tuple(f.name for f in dataclasses.fields(StepStats) if f.name != "truncated_samples")


class PipelineError(RuntimeError):
    """The run cannot go on (an executor failed, or nothing happened for too long)."""


class Controller:
    """Runs one training run (see the module docstring). out_dir: where everything
    goes; if it holds a checkpoint the run resumes from it. on_step(metrics) is
    called after each trainer step (the CLI prints and draws its progress bar).
    executors: where the executors run (processes.py): forked on this host unless
    given (torchrun ranks, from llamarl_core.launch). model, tokenizer, dataset:
    the run's inputs as Python objects, written into out_dir/inputs/ first
    (inputs.py; a fresh run only, refused while another controller holds the
    folder, which this one then holds until run() ends), config.run.model /
    dataset then naming them; removed again when a check refuses the run."""

    def __init__(self, config: TrainConfig, out_dir: Path, on_step=None, on_event=None, executors=None,
                 resume: bool = False, *, model=None, tokenizer=None, dataset=None):
        # Absolute: the executors (under torchrun, on other hosts too) get it as a string.
        self.out, self.resume = Path(out_dir).resolve(), resume
        self.on_step = on_step or (lambda m: None)
        self.on_event = on_event or (lambda msg: None)
        given = [name for name, obj in (("model", model), ("tokenizer", tokenizer), ("dataset", dataset))
                 if obj is not None]
        if given and resume:
            raise ValueError(f"{'= / '.join(given)}=: a resumed run reads its inputs from its run folder: "
                             f"Controller(TrainConfig.load(out / 'config.json'), out, resume=True)")
        self._lock: FolderLock | None = None  # the run folder, held from here until run() ends (given inputs)
        if not given:
            self.config = config
            self._check(executors)
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.out.mkdir()
            made = True
        except FileExistsError:
            made = False
        # Held while the inputs are written and checked, and on until run() ends: another
        # controller (running here, or holding inputs of its own here) is refused, and
        # none writes over this one's inputs.
        self._lock = FolderLock(self.out, self.on_event)
        wrote = False
        try:
            if (self.out / "config.json").exists():
                raise RunFolderError(f"{self.out} already holds a run: pick another folder for a run of "
                                     f"{', '.join(given)}=")
            self.config = write_inputs(self.out, config, model=model, tokenizer=tokenizer, dataset=dataset)
            wrote = True
            self._check(executors)
        except BaseException:
            if wrote:  # what this controller wrote, and the folder if it made it, while it holds it
                shutil.rmtree(self.out / INPUTS, ignore_errors=True)
            if made:
                shutil.rmtree(self.out, ignore_errors=True)
            self._lock.release()
            raise

    def _check(self, executors) -> None:
        config = self.config
        self.data = check_run(config, torchrun=executors is not None)
        self.generator_tp = config.generator.processes  # generator executors per replica
        self.num_replicas = config.generator.replicas
        self.generator_ranks = self.generator_tp * self.num_replicas
        self.executors = executors or LocalExecutors(self.out, engine=config.generator.backend != "llama")
        self.inboxes: dict[tuple[str, int], StoreQueue] = {}
        self.restarts = RestartPolicy(self.executors.restartable, str(self.out / "checkpoint"),
                                      f"the same torchrun command with `train --out {self.out} --resume` continues it")
        self.mps: MpsDaemon | None = None  # gpu_share "mps:P": the run's MPS daemon while it runs
        if generator_percent(config.generator.gpu_share) is not None:
            if not isinstance(self.executors, LocalExecutors):
                raise ValueError(f"{option('gpu_share', config.generator.gpu_share)} starts an MPS daemon on the "
                                 "controller's "
                                 "host: it shares a GPU among executors the controller starts itself (not torchrun's)")
            if shutil.which(MPS_CONTROL) is None:
                raise ValueError(f"{option('gpu_share', config.generator.gpu_share)}: {MPS_CONTROL} is not on PATH "
                                 "(it comes "
                                 "with the NVIDIA driver)")

    # -- processes ------------------------------------------------------------------------
    def _start(self, role: str, rank: int, **extra) -> None:
        # An inbox that nobody reads would keep its messages in the Store for the whole run.
        inbox = None
        if has_inbox(role, rank, self.generator_tp):
            inbox = inbox_name(role, rank, extra.get("incarnation", 0))
            self.inboxes[(role, rank)] = StoreQueue(self.store, inbox, self.executors.secret)
        percent = role_percent(self.config.generator.gpu_share, role)
        if percent is not None:  # set in the executor before it initialises CUDA
            extra["mps_env"] = self.mps.client_env(percent)
        self.executors.start(role, rank, self.config.to_dict(), {**extra, "inbox": inbox, "flags": names_flags()})

    def _tell(self, role: str, command) -> None:
        """Put `command` (messages.py) in the inbox of every rank of `role` that has one."""
        for (r, _), inbox in self.inboxes.items():
            if r == role:
                inbox.put(command)

    def _tell_replica(self, replica: int, command) -> None:
        self.inboxes[(GENERATOR, replica * self.generator_tp)].put(command)

    def _replica_ranks(self, replica: int) -> range:
        return range(replica * self.generator_tp, (replica + 1) * self.generator_tp)

    def _start_replica(self, replica: int) -> None:
        """Start replica `replica`'s ranks, under its current incarnation; its relays
        feed its children under theirs."""
        incarnations = self.replicas.incarnation
        children = {child: incarnations[child] for child in self.replicas.tree[replica]}
        for rank in self._replica_ranks(replica):
            self._start(GENERATOR, rank, incarnation=incarnations[replica], children=children, out_dir=str(self.out))

    def _check_alive(self) -> None:
        lost: dict[int, str] = {}
        for role, rank, why in self.executors.exited():
            if role != GENERATOR:
                # Its error report, sent before it exited, names the cause (_handle raises it).
                deadline = time.monotonic() + DEAD_REPORT_S
                while (event := self.events.get(max(deadline - time.monotonic(), 0.0))) is not None:
                    self._handle(event)
                if (role, rank) not in self.ready_ranks:
                    why += (" before it started, reporting nothing: it died before running any of llamarl's code "
                            "(while multiprocessing imported the main script again in it, or unpickled its "
                            "arguments); the error is on this process's stderr")
                raise PipelineError(f"{role} rank {rank} {why}; the last checkpoint is in {self.out / 'checkpoint'}")
            lost.setdefault(rank // self.generator_tp, f"generator rank {rank} {why}")
        if lost:
            self._restart_replicas(lost)

    def _restart_replicas(self, lost: dict[int, str], detail: str = "", counted: bool = True) -> None:
        """Replace the generator replicas in `lost` (replica -> why), alone: the others
        go on sampling (replicas.py says how each is fed again). counted: towards
        the restart limit (not a replica cut off by another's loss): RestartPolicy decides."""
        why = "; ".join(lost.values())
        refusal = self.restarts.refusal(why, starting=any(not self.replicas.up[r] for r in lost), counted=counted)
        if refusal is not None:
            raise PipelineError(f"{refusal}\n{detail}" if detail else refusal)
        self.last_progress = time.monotonic()  # the new replicas' start-up begins now
        names = ", ".join(str(r) for r in sorted(lost))
        if 0 in lost:
            self.on_event(f"{why}: restarting it and re-syncing weights v{self.scheduler.step} (replicas {names})")
        else:
            self.on_event(f"{why}: restarting it and re-syncing it with the next version (replicas {names}; the "
                          "others go on)")
        for replica in lost:
            self.generating[replica] = 0  # its groups are issued again
            for rank in self._replica_ranks(replica):
                self.inboxes.pop((GENERATOR, rank), None)
                self.executors.stop(GENERATOR, rank)
                self.ready_ranks.discard((GENERATOR, rank))
        for replica in lost:
            # A parent (or the trainer) waiting for the dead replica to ask for a version stops
            # waiting now, not at its timeout (its new incarnation registers under a new name).
            abandon_receivers(self.store, sync_name_of(self.replicas.incarnation[replica], replica),
                              f"generator replica {replica} was lost", secret=self.executors.secret)
        self.scheduler.replicas_lost(set(lost))
        for version in self.replicas.lost(set(lost)):
            self._sync_complete(version)
        for replica in sorted(lost):
            self._start_replica(replica)
            parent = self.replicas.parent.get(replica)
            if parent is not None and parent not in lost:  # a new parent feeds it from the start
                self._tell_replica(parent, Relay(child=replica, incarnation=self.replicas.incarnation[replica]))
        if 0 in lost:
            self.recorder.drop_pending_evals()  # lost with replica 0; the re-sync evaluates its own version if due
            self._tell(TRAINER, Reconnect(incarnation=self.replicas.incarnation[0]))
            self.resync_pending = True  # the current weights go to the new replica 0 once it is up

    # -- event handling ----------------------------------------------------------------
    def _handle(self, event: Event) -> None:
        """Take one executor's report (messages.py): the values it refused go to the
        metrics, the report to its handler (_HANDLERS), then its spans to the trace."""
        try:
            self._dispatch(event)
        finally:  # after the handler, which may send the next executor its work; a failure's spans too
            self.recorder.trace.add([(event.role, event.rank, *span) for span in event.spans])

    def _dispatch(self, event: Event) -> None:
        role, rank, report = event.role, event.rank, event.body
        if event.refused is not None:  # every report but a heartbeat
            self.refused_by[(role, rank, event.incarnation)] = event.refused
        if role == GENERATOR and event.incarnation != self.replicas.incarnation[rank // self.generator_tp]:
            return  # from a replica that has been replaced
        if isinstance(report, Working):
            # A heartbeat of an executor in a long computation: progress only while this run
            # waits on that computation. Executors beat for their whole life, so counting every
            # beat would let a run whose reward never answers wait forever.
            if self._waiting_on(role, rank):
                self.last_progress = time.monotonic()
            return
        self.last_progress = time.monotonic()
        handler = self._HANDLERS.get(type(report))
        if handler is None:
            raise PipelineError(f"{role} rank {rank} sent a {type(report).__name__}, which the controller does not "
                                "take")
        getattr(self, handler)(role, rank, report)

    def _on_failed(self, role: str, rank: int, report: Failed) -> None:
        if role == GENERATOR:
            self._restart_replicas({rank // self.generator_tp: f"generator rank {rank} failed: {report.message}"},
                                   report.traceback)
            return
        raise PipelineError(f"{role} rank {rank} failed: {report.message}\n{report.traceback}")

    def _on_ready(self, role: str, rank: int, report: Ready) -> None:
        self.ready_ranks.add((role, rank))
        if role == GENERATOR:
            replica = rank // self.generator_tp
            if all((GENERATOR, k) in self.ready_ranks for k in self._replica_ranks(replica)):
                self.replicas.ready(replica)
        self.hosts["executors"][f"{role} {rank}"] = report.host
        self.hosts["weight_transports"].update(report.transports)
        (self.out / "hosts.json").write_text(json.dumps(self.hosts, indent=2, sort_keys=True) + "\n")
        if role == TRAINER:  # where a resumed run goes on (every rank reports the same)
            self.scheduler = Scheduler(self.config, report.step, report.data_position)
            if rank == 0 and self.config.sync.delta and "p2p" not in report.transports.values():
                warnings.warn(f"{option('sync_delta')}: trainer rank 0 reaches every generator rank it writes through "
                              f"{', '.join(sorted(set(report.transports.values())))} on its own host, where versions "
                              "go whole (deltas go point to point, to generator ranks on other hosts)", stacklevel=1)

    def _on_samples(self, role: str, rank: int, report: Samples) -> None:
        replica = rank // self.generator_tp
        samples = report.samples
        # The reward executor gets what it scores by (a prompt group, held out or not, the
        # completion's tokens) and answers with the rewards; the samples wait here. Sent
        # first: the checks below raise before a reward is taken (the run stops on them).
        self.bunches += 1
        self.inboxes[(REWARD, 0)].put(Score(bunch=self.bunches, groups=[x.group for x in samples],
                                            eval=[x.eval for x in samples], tokens=[x.tokens for x in samples]))
        self._check_samples(samples)
        self.scoring[self.bunches] = (samples, replica, self.replicas.incarnation[replica])
        self.gen_busy += report.busy
        self.generating[replica] -= sum(not x.eval for x in samples)

    def _on_received(self, role: str, rank: int, report: Received) -> None:
        replica = rank // self.generator_tp
        self.gen_busy += report.busy
        # The generator's stall: its receive(), pause to resume (the slowest replica's).
        self.stall_seconds[report.version] = max(self.stall_seconds.get(report.version, 0.0), report.seconds)
        if report.relay_failed:
            self.on_event(f"generator replica {replica}: version {report.version} landed, relaying it "
                          f"failed: {report.relay_failed}")
        if self.replicas.landed(report.version, replica):
            self._sync_complete(report.version)

    def _on_receive_failed(self, role: str, rank: int, report: ReceiveFailed) -> None:
        # Its weights may be torn and its unfinished samples were sampled with them: replaced
        # either way, its groups going to the others (counted as a restart only at its own fault).
        replica = rank // self.generator_tp
        excused = self.replicas.receive_failed(report.version, replica, report.attempt)
        if excused and report.stale:
            return  # that version will not come, and nothing was written: its weights stay
        why = (f"generator replica {replica} failed to receive version {report.version}"
               + (" (the replica feeding it was lost)" if excused else f": {report.message}"))
        self._restart_replicas({replica: why}, counted=not excused)

    def _on_scored(self, role: str, rank: int, report: Scored) -> None:
        samples, replica, incarnation = self.scoring.pop(report.bunch)
        if incarnation != self.replicas.incarnation[replica]:
            return  # sampled by a replica that has since been replaced; its groups were re-issued
        if len(report.rewards) != len(samples):
            raise PipelineError(f"the reward executor returned {len(report.rewards)} rewards for "
                                f"{len(samples)} samples")
        for sample, reward in zip(samples, report.rewards):
            sample.reward = reward
        train = [x for x in samples if not x.eval]
        if train:
            self.scheduler.add_samples(train)
        if len(train) < len(samples):
            self.recorder.evaluated([x for x in samples if x.eval])

    def _on_trained(self, role: str, rank: int, report: Trained) -> None:
        self.trained.append(report)
        if len(self.trained) == self.config.trainer.world:
            self._step_trained()

    def _on_synced(self, role: str, rank: int, report: Synced) -> None:
        if report.generator != self.replicas.incarnation[0]:
            return  # a sync to a replica 0 that has been replaced
        self.sync_seconds[report.version] = max(self.sync_seconds.get(report.version, 0.0), report.seconds)
        if self.replicas.sent(report.version):
            self._sync_complete(report.version)

    def _on_checkpointed(self, role: str, rank: int, report: Checkpointed) -> None:
        self.checkpointing -= 1

    def _on_sync_failed(self, role: str, rank: int, report: SyncFailed) -> None:
        if report.generator != self.replicas.incarnation[0]:
            return  # a sync to a replica 0 that has been replaced
        self._check_alive()  # a dead replica 0 is restarted (and the sync redone) here
        if report.generator == self.replicas.incarnation[0]:
            raise PipelineError(f"weight sync of version {report.version} failed: {report.message}; "
                                f"the last checkpoint is in {self.out / 'checkpoint'}")

    # Each report's handler, by method name (a subclass's override is the one called).
    _HANDLERS = {Failed: "_on_failed", Ready: "_on_ready", Samples: "_on_samples", Received: "_on_received",
                 ReceiveFailed: "_on_receive_failed", Scored: "_on_scored", Trained: "_on_trained",
                 Synced: "_on_synced", Checkpointed: "_on_checkpointed", SyncFailed: "_on_sync_failed"}

    def _check_samples(self, samples: list) -> None:
        """PipelineError naming the generator for a sample that breaks the Generator contract."""
        for x in samples:
            problem = x.contract_problem(self.scheduler.step, self.data.model_config.vocab_size,
                                         self.data.max_new_tokens)
            if problem:
                raise PipelineError(f"generator {self.config.generator.backend!r} returned a sample of prompt group "
                                    f"{x.group} with {problem}")

    def _waiting_on(self, role: str, rank: int) -> bool:
        """Whether the run waits on this executor's work: it is starting, or (the
        trainer) training a batch, saving a checkpoint, sending a version or waiting
        for a new replica 0; (a generator) sampling what it was given, receiving a
        version or (replica 0) evaluating; (the reward) scoring samples. A beat says
        the process is alive, not that its computation advances: a hang inside a
        step or a sync is caught by the timeouts of its collectives and syncs."""
        if (role, rank) not in self.ready_ranks:
            return True
        if role == TRAINER:
            return (self.scheduler.training is not None or self.checkpointing > 0 or self.resync_pending
                    or any(sync.trainer > 0 for sync in self.replicas.pending.values()))
        if role == GENERATOR:
            replica = rank // self.generator_tp
            return (self.generating[replica] > 0 or bool(self.replicas.receiving[replica])
                    or (replica == 0 and self.recorder.evals_pending()))
        return bool(self.scoring)

    def _sync_complete(self, version: int) -> None:
        """Steps whose weights have now landed: written by _write_landed, after the prompts go out."""
        for step in sorted(s for s in self.records if s < version):
            self.landed.append(self.records.pop(step) | {"sync_time_s": self.sync_seconds.pop(version, 0.0),
                                                         "stall_time_s": self.stall_seconds.pop(version, 0.0)})
        for times in (self.sync_seconds, self.stall_seconds):  # versions no step record will read (the first, re-syncs)
            for old in [v for v in times if v <= version]:
                del times[old]

    def _begin_sync(self, version: int) -> None:
        # Replica 0 gets the version from the trainer ranks, the others relayed down the
        # replicas' tree; each reports it landed (replicas.py: which replicas a sync includes).
        # An evaluation rides on the sync it evaluates: replica 0 runs it as soon as
        # these weights land, before anything else (a later version cannot overtake it).
        evaluate = self.recorder.eval_prompts(version)
        targets = self.replicas.begin(version)
        sync = self.replicas.pending[version]
        for replica, children in targets.items():
            if replica in sync.told:
                self._tell_replica(replica, Receive(version=version, evaluate=evaluate if replica == 0 else None,
                                                    relay_to=children, attempt=sync.attempt))
        self._tell(TRAINER, Sync(version=version))
        if self.checkpoint_due is not None and self.checkpoint_due[0] == version:
            # Behind the sync of the step it saves (the trainer runs its commands in
            # order): the generators get the weights first and sample while the
            # checkpoint is written, instead of waiting for it (a 1B model's took longer
            # than the sync timeout on a GPU).
            self._tell(TRAINER, Checkpoint(data_position=self.checkpoint_due[1]))
            self.checkpointing += self.config.trainer.world
            self.checkpoint_due = None

    def _step_trained(self) -> None:
        reports, self.trained = self.trained, []
        batch = self.scheduler.trained()
        self._begin_sync(self.scheduler.step)  # first: the weights move while the step's record is made
        if self.config.run.mode == "sync" and self.scheduler.step in self.replicas.pending:
            # The next step's prompts, right behind the weights, to the replicas receiving them:
            # a generator runs its commands in order, so it samples them with that version
            # as soon as it has landed, without a round trip through here.
            self._issue_prompts({r: True for r in self.replicas.pending[self.scheduler.step].replicas})
        stats = [dataclasses.asdict(r.stats) for r in reports]
        s, samples = batch.step, batch.samples
        self.records[s] = {
            "step": s,
            "reward": sum(x.reward for x in samples) / len(samples),
            "samples": len(samples),
            "completion_tokens": sum(len(x.tokens) for x in samples),
            "staleness": dict(Counter(str(s - x.oldest_version) for x in samples)),
            "dropped": batch.dropped,
            "train_time_s": max(r.seconds for r in reports),
            "truncated": sum(not x.finished for x in samples),  # completions that hit max_new_tokens
            # The trainer ranks' statistics (loss, grad norm, learning rate, mismatch KL, KL to the
            # reference, ...), averaged over the ranks; a maximum (max_abs_log_ratio), the ranks' maximum.
            **{key: None if stats[0][key] is None else
               max(r[key] for r in stats) if key in MAX_STATS else sum(r[key] for r in stats) / len(stats)
               for key in TRAINER_STATS},
        }
        hooked = {key for r in reports for key in r.hook}
        if hooked:  # what the step hook returned, averaged over the ranks that returned it
            self.records[s]["hook"] = {key: sum(r.hook[key] for r in reports if key in r.hook) /
                                       sum(key in r.hook for r in reports) for key in sorted(hooked)}
        if self.config.run.log_rollouts:
            self.recorder.rollouts(s, samples)

    def _write_landed(self) -> None:
        """Write the records _sync_complete took (metrics.jsonl, the step hook)."""
        for record in self.landed:
            now = time.monotonic()
            # gen_time_s: the replicas' generating seconds since the last step, per replica.
            record.update(step_time_s=now - self.last_step_end, gen_time_s=self.gen_busy / self.num_replicas,
                          **self.recorder.clocks(now),
                          # Messages and Store values refused so far (forged, or not parsing), by this process
                          # and every executor, since this run started.
                          forged_messages=refused_count() - self.refused_before + sum(self.refused_by.values()))
            self.gen_busy, self.last_step_end = 0.0, now
            self.recorder.step(record)
        self.landed = []

    # -- scheduling --------------------------------------------------------------------
    def _issue_prompts(self, holding: dict[int, bool] | None = None) -> None:
        # The replicas holding weights; landed: version `step`, every sync reported, no
        # trained step waiting for its weights to land (or, given, the replicas that will
        # hold version `step` before they read these prompts).
        if holding is None:
            holding = self.replicas.holding(self.scheduler.step, settled=not self.records)
        for replica, groups in self.scheduler.issue(holding).items():
            self._tell_replica(replica, Prompts(groups=[(g, self.data.prompt_ids(g)) for g in groups]))
            self.generating[replica] += len(groups) * self.config.run.samples_per_prompt

    def _maybe_train(self) -> None:
        """Hand the next batch to the trainer. In async mode it is queued right behind
        the weight sync of the step just trained (the trainer runs its commands in
        order), so it does not wait for that sync to be reported back; it still waits
        one round trip through the controller after each step (about 1.3 ms). In sync
        mode only once the sync has landed and the batch was generated with the new
        weights."""
        cfg = self.config
        if self.scheduler.step >= cfg.run.steps or self.resync_pending:
            return
        if cfg.run.mode == "sync" and (self.replicas.pending or self.records or self.checkpointing):
            return
        batch = self.scheduler.take_batch()
        if batch is None:
            return
        per_rank = cfg.run.prompts_per_step // cfg.trainer.world
        for rank in range(cfg.trainer.world):
            part = [x for g in batch.groups[rank * per_rank:(rank + 1) * per_rank] for x in g]
            self.inboxes[(TRAINER, rank)].put(Train(step=batch.step, samples=part))
        done = batch.step + 1
        if cfg.run.checkpoint_every and (done % cfg.run.checkpoint_every == 0 or done == cfg.run.steps):
            # Saved once its step's weights are on their way (see _begin_sync), with the data
            # position after its batch.
            self.checkpoint_due = (done, self.scheduler.data_position)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> dict:
        """Run to the last step; returns the summary (also in summary.json). Saves
        config.json into the run folder first: a run stopped for any reason goes on
        from its last checkpoint with `Controller(TrainConfig.load(out /
        "config.json"), out, resume=True).run()` (or `llamarl train --out OUT
        --resume`). RunFolderError, before anything starts, for a folder that
        holds a run and resume=False, a run of another configuration (other than
        in `steps` and the trainer's world), a checkpoint it cannot resume
        (run_folder.check_run_folder), or a folder another controller holds (a
        run still going there: run_folder.FolderLock). gpu_share "mps:P": the run's MPS daemon (its log in
        out/mps) starts before config.json is written (PipelineError if it does
        not) and is told to quit after the executors have ended."""
        cfg = self.config
        if isinstance(self.executors, LocalExecutors):
            check_main_guard()
        lock, self._lock = self._lock, None
        if lock is None:
            self.out.mkdir(parents=True, exist_ok=True)
            lock = FolderLock(self.out, self.on_event)
        with lock:
            return self._run_locked(cfg)

    def _run_locked(self, cfg: TrainConfig) -> dict:
        check_run_folder(self.out, cfg, self.resume)
        saved = self.out / "config.json"
        if generator_percent(cfg.generator.gpu_share) is None:
            return self._run(saved)
        try:  # before config.json: a daemon that does not start leaves no run behind
            self.mps = MpsDaemon.start(log_folder=self.out / "mps")
        except RuntimeError as exc:
            raise PipelineError(str(exc)) from None
        try:
            return self._run(saved)
        finally:  # after its clients, the executors, have ended (_run's own clean-up)
            daemon, self.mps = self.mps, None
            if not daemon.stop():
                self.on_event(f"llamarl: the MPS daemon of {option('gpu_share', cfg.generator.gpu_share)} did not "
                              "quit; "
                              f"end it with: echo quit | CUDA_MPS_PIPE_DIRECTORY={daemon.pipe} {MPS_CONTROL}")

    def _run(self, saved: Path) -> dict:
        cfg = self.config
        cfg.save(saved)
        self.store = self.executors.open_store(cfg.run.timeout_s)
        self.events = StoreQueue(self.store, EVENTS, self.executors.secret)
        # The executors' idle waits check this beat: without it for timeout_s, they exit.
        self.beat = Heartbeat(self.store, CONTROLLER_BEAT)
        self._reset_state()
        self.cpu_before = cpu_times()
        try:
            self._start(REWARD, 0)
            for rank in range(cfg.trainer.world):
                self._start(TRAINER, rank, incarnation=0, out_dir=str(self.out))
            for replica in range(self.num_replicas):
                self._start_replica(replica)
            self._wait_ready()
            self._loop()
            summary = self.recorder.summary(steal_fraction(self.cpu_before, cpu_times()))
            if cfg.run.checkpoint_every:  # the policy of the last checkpoint
                export_policy(self.out, self.data.model_config, self.data.tokenizer, self.out / "model",
                              self.data.model)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            return summary
        finally:
            self._shutdown()
            self.recorder.close()

    def _next_event(self, deadline_what: str) -> None:
        """Handle the next event, if one comes within EVENT_POLL_S (the caller then
        checks that every executor is alive, _check_alive)."""
        event = self.events.get(EVENT_POLL_S)
        if event is None:
            if time.monotonic() - self.last_progress > self.config.run.timeout_s:
                raise PipelineError(f"no executor reported anything for {self.config.run.timeout_s:.0f} s while "
                                    f"waiting for {deadline_what}{self._outstanding()}; stopping (the last "
                                    f"checkpoint is in {self.out / 'checkpoint'})")
        else:
            self._handle(event)

    def _outstanding(self) -> str:
        """What the run was waiting on, for the error of a stalled run."""
        parts = [f"{n} groups issued to generator replica {r} and not complete"
                 for r, n in sorted(Counter(self.scheduler.sampling_replicas().values()).items())]
        if self.scoring:
            parts.append(f"the reward executor scoring {len(self.scoring)} bunches of samples")
        return f" ({'; '.join(parts)})" if parts else ""

    def _everyone(self) -> set[tuple[str, int]]:
        """(role, rank) of every executor of the run."""
        return {(REWARD, 0)} | {(TRAINER, r) for r in range(self.config.trainer.world)} | {
            (GENERATOR, r) for r in range(self.generator_ranks)}

    def _wait_ready(self) -> None:
        self.last_progress = time.monotonic()
        everyone = self._everyone()
        while not everyone <= self.ready_ranks:
            self._next_event("the executors to start")
            self._check_alive()
        self.recorder.keep_until(self.scheduler.step)  # a resumed run's records of the steps before its checkpoint
        self._begin_sync(self.scheduler.step)  # the trainer's weights (fresh, warmed up or resumed) go to the generator
        self.last_step_end = time.monotonic()
        self.recorder.rl_started(self.last_step_end)

    def _reset_state(self) -> None:
        self.recorder = RunRecorder(self.out, self.config, self.data, self.on_step, self.on_event)
        self.ready_ranks: set[tuple[str, int]] = set()
        self.refused_by: dict[tuple, int] = {}  # (role, rank, incarnation) -> the values it refused
        self.refused_before = refused_count()  # this process's, before the run
        # Where each executor runs (hostname/boot id/net ns/pid ns) and the transport of each weight-sync pair.
        self.hosts: dict[str, dict[str, str]] = {"executors": {}, "weight_transports": {}}
        self.scheduler = Scheduler(self.config)
        self.trained: list[dict] = []  # the trainer ranks' reports of the step in training
        self.records: dict[int, dict] = {}  # trained steps whose new weights have not landed yet
        self.landed: list[dict] = []  # the records of steps whose weights landed, not written yet
        self.replicas = ReplicaSyncs(self.num_replicas, self.config.trainer.world)  # and the syncs in flight
        self.sync_seconds: dict[int, float] = {}  # version -> the trainer ranks' longest send()
        self.stall_seconds: dict[int, float] = {}  # version -> the replicas' longest receive()
        self.resync_pending = False
        self.gen_busy = 0.0
        self.checkpointing = 0
        self.checkpoint_due: tuple[int, int] | None = None  # (version, data position): see _begin_sync
        # Bunches of samples sent to the reward executor and not scored yet: number -> (the
        # samples, the replica and its incarnation that sampled them).
        self.scoring: dict[int, tuple[list[Sample], int, int]] = {}
        self.bunches = 0
        self.generating = [0] * self.num_replicas  # samples each replica was given and has not returned

    def _loop(self) -> None:
        cfg = self.config
        try:  # until the last step's weights have landed (its record written) and its checkpoint is saved
            while (self.scheduler.step < cfg.run.steps or self.records or self.replicas.pending or self.checkpointing
                   or self.recorder.evals_pending()):
                self._next_event(f"trainer step {self.scheduler.step}")
                if self.resync_pending and self.replicas.up[0] and not self.replicas.pending:
                    self.resync_pending = False
                    self._begin_sync(self.scheduler.step)
                self._maybe_train()
                self._issue_prompts()  # after: a batch just handed to the trainer frees room for the next
                self._write_landed()
                self._check_alive()  # a dead generator is restarted here
        finally:
            self._write_landed()  # what the last _check_alive took in, also when it raised

    def _shutdown(self) -> None:
        for inbox in self.inboxes.values():
            inbox.put(Stop())
        # A vLLM generator shuts its engine down on Stop (several seconds here). A
        # checkpoint queued before Stop (behind a sync that failed, say) gets up to
        # timeout_s more to be written: it is the one a resume needs.
        grace_s = ((30 if self.config.generator.backend == "vllm" else 10)
                   + (self.config.run.timeout_s if self.checkpointing else 0))
        # One still setting up (waiting for a generator that failed to start, say) reads no inbox.
        self.executors.shutdown(grace_s=grace_s, unready=self._everyone() - self.ready_ranks)
        self.beat.stop()
        self.events.close()
