"""The training worker: runs jobs in its own process, started by the agent's JobRunner.

It reads jobs from stdin, one JSON line each (``{"command": <verified TrainCommand or
ProfileCommand>, "board": <agent.job_runner.WorkerContext>}``), runs them one after the other
and writes events as JSON lines on the stdout it was given; everything else it or Lightning
prints goes to stderr. End of input ends the worker. A job that fails ends it too, so that the
next job starts in a fresh process. Exit codes: 0 every job finished (or was stopped), 3 a job
could not run here (unknown model or dataset, refused by the exchange), 1 anything else.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import signal
import sys
import traceback
from typing import Any

from edgefleet.agent.cpu_threads import board_threads
from edgefleet.agent.exchange_credential import hello_credential
from edgefleet.agent.heap import release_free_heap
from edgefleet.agent.job_runner import KEPT, WorkerContext
from edgefleet.agent.step_logs import StepLogs
from edgefleet.agent.worker_events import EventWriter
from edgefleet.protocol.codec import decode_value
from edgefleet.protocol.errors import DecodeError, EdgeTrainError, NeighbourFault
from edgefleet.protocol.jobs import ProfileCommand, StopCommand, TrainCommand, command_from_dict
from edgefleet.protocol.outer_optimizer import OuterOptimizer
from edgefleet.protocol.split_schedule import SplitSchedule
from edgefleet.protocol.stage_sync import StageSync
from edgefleet.protocol.sync_schedule import SyncSchedule
from edgefleet.workloads.device_errors import explain_device_error
from edgefleet.workloads.lightning_api import callback_class, package_of
from edgefleet.workloads.module_checkpoint import extra_from_wire, restore_extra
from edgefleet.workloads.quiet_lightning import quiet_lightning
from edgefleet.workloads.seeding import BatchSeeder, StepSeeding


def run_job(job: TrainCommand, events: EventWriter, context: WorkerContext | None = None) -> int:
    import torch  # torch and the training stack: loaded by the job's process, not at the worker's start

    torch.set_num_threads(job.threads or board_threads())  # threads beyond the board's quota only spin

    # the training stack (torch, Lightning), after torch's threads are set
    from edgefleet.agent.worker_exchange import ExchangeClient, GradientExchange, StopTraining
    from edgefleet.workloads.fleet_trainer import (
        EpochBatchSampler,
        LoopPositioner,
        TrainerOptions,
        board_accelerator,
        make_trainer,
        position_of,
        steps_per_epoch,
    )
    from edgefleet.workloads.layer_cut import cut_model, head_size
    from edgefleet.workloads.loss_scaling import new_scaler, precision_plugin
    from edgefleet.workloads.module_setup import DataModuleHooks, RunFigures, prepare_module
    from edgefleet.workloads.params import exchange_size, to_torch_tree
    from edgefleet.workloads.preflight import optimizer_setup
    from edgefleet.workloads.registry import build_model
    from edgefleet.workloads.sharding import GlobalBatchPlan, LocalBatchPlan
    from edgefleet.workloads.training_data import load_training_data

    options = dict(job.model_options)
    if job.lr is not None:
        options["lr"] = job.lr
    data = load_training_data(dataset=job.dataset, dataset_options=job.dataset_options, datamodule=job.datamodule,
                              datamodule_options=job.datamodule_options, cached=True, with_val=False)
    trainer_options = TrainerOptions(accumulate_grad_batches=job.accumulate_grad_batches,
                                     gradient_clip_val=job.gradient_clip_val,
                                     gradient_clip_algorithm=job.gradient_clip_algorithm, deterministic=job.deterministic,
                                     precision=job.precision)
    spec = job.pipeline_spec  # a pipeline: stage 0's boards hold the global batch between them, the later stages none
    group = spec.group if spec is not None else len(job.batch_sizes)
    data_sizes = job.batch_sizes[:group]
    later_stage = spec is not None and job.board_index >= group  # trains a later stage over the whole batch
    if job.data_mode == "global":
        plan = GlobalBatchPlan(len(data.train), data_sizes, job.seed)
        batches_per_epoch = _batches_per_epoch(job, plan.steps_per_epoch, data.source)
    else:
        local = LocalBatchPlan(len(data.train), job.batch_size, job.seed, board_seed=job.board_index)
        batches_per_epoch = job.batches_per_epoch or local.steps_per_epoch
    model = build_model(job.model, options, data=data.train)
    # setup("fit") and configure_model() once, as Trainer.fit calls them, with the run's figures: the
    # layers they build exist before the welcome's weights are loaded into them
    figures = prepare_module(model, RunFigures(batches_per_epoch=batches_per_epoch, total_steps=job.total_steps,
                                               max_epochs=job.max_epochs, options=trainer_options), data.datamodule)
    optimizer = optimizer_setup(model, figures).optimizer
    cut = cut_model(model, job.placement) if job.placement else None  # layer placement: the boards train the head
    count = exchange_size(optimizer, model) if cut is None else head_size(optimizer, cut)
    stage: Any = None
    if spec is not None:  # pipeline stages: this board trains its stage's layers
        from edgefleet.agent.stage_worker import (  # torch: pipelined jobs only
            link_stage,
            load_stage_weights,
            release_other_stages,
            stage_host_loader,
            stage_of,
        )

        stage = stage_of(job, model, optimizer)
        count = stage.elements
        release_other_stages(stage, model)

    keys = (context.board_key_file, context.fleet_key_file) if context is not None else ("", "")
    token, proof = hello_credential(job, board_key_file=keys[0], fleet_key_file=keys[1])
    client = ExchangeClient(job.exchange_host, job.exchange_port, tls_sha256=job.exchange_tls_sha256)
    tail: Any = None
    links: Any = None
    try:
        welcome = client.hello(job_id=job.job_id, board_id=job.board_id, token=token, param_count=count, proof=proof)
        if stage is not None:  # this board's stage's weights alone
            load_stage_weights(stage, model, to_torch_tree(decode_value(welcome.model)))
        else:
            model.load_state_dict(to_torch_tree(decode_value(welcome.model)))
        start = welcome.step
        if cut is not None:
            from edgefleet.agent.remote_tail import TailLink, install  # torch: placed jobs only

            tail = TailLink(job.exchange_host, job.tail_port, tls_sha256=job.exchange_tls_sha256)
            tail.hello(job_id=job.job_id, board_id=job.board_id, token=token, proof=proof, start=start)
            install(model, cut, tail)
        if stage is not None:
            links = link_stage(stage, job, model, board_key_file=context.board_key_file if context is not None else "",
                               start=start)
        if welcome.module_state is not None:  # joining mid-run: what the module's on_save_checkpoint kept, as on resume
            restore_extra(model, extra_from_wire(welcome.module_state), global_step=start,
                          epoch=position_of(start, batches_per_epoch, trainer_options.accumulate_grad_batches).epoch)
        if job.data_mode == "global":
            # The job's batch sizes are the initial split; the welcome lists later re-splits still in
            # force or announced, and each step's result may announce another (the schedule follows them).
            # The schedule counts batches, the coordinator optimizer steps: with --accumulate-grad-batches a
            # re-split from step s starts at the first batch of s's window.
            schedule = SplitSchedule(plan.batch_sizes)
            first_batch = functools.partial(_first_batch, batches_per_epoch=batches_per_epoch,
                                            accumulate=trainer_options.accumulate_grad_batches)
            for split in welcome.splits:
                schedule.add(first_batch(split.from_step), split.batch_sizes)
            indices_of: Any = functools.partial(plan.indices_under, schedule, board_index=0 if later_stage else job.board_index)
            batch_size: Any = (lambda step: sum(schedule.batch_sizes_at(first_batch(step))) if later_stage  # noqa: E731
                               else schedule.batch_sizes_at(first_batch(step))[job.board_index])
            if stage is not None and stage.grouped_later:  # its units' samples (a pipeline's split never changes)
                batch_size = links.plan.routes.rows_of(stage.stage, stage.member)
            on_split: Any = lambda step, sizes: schedule.add(first_batch(step), sizes)  # noqa: E731
        else:
            indices_of, batch_size, on_split = local.indices, job.batch_size, None
        position = position_of(start, batches_per_epoch, trainer_options.accumulate_grad_batches)
        sync = SyncSchedule(every=job.sync_every, warmup=job.sync_warmup, total_steps=job.total_steps,
                            steps_per_epoch=steps_per_epoch(batches_per_epoch, trainer_options.accumulate_grad_batches),
                            outer=OuterOptimizer(name=job.outer_optimizer, lr=job.outer_lr, momentum=job.outer_momentum))
        own_stage = later_stage and not stage.grouped_later
        package = package_of(model)
        exchange = callback_class(package, GradientExchange, "GradientExchange")(
            client, batch_size=batch_size, start_step=start, wire_dtype=job.wire_dtype,
            optimizer_state=decode_value(welcome.optimizer), on_step=events.progress, on_split=on_split,
            scheduler_states=decode_value(welcome.schedulers or []), step_logs=StepLogs(model), sync=sync,
            only=(cut.head_params if cut is not None else stage.params if stage is not None else None),
            # a pipeline's vector carries no buffers (the coordinator refuses modules with them): an empty module
            buffers=(cut.head_layers() if cut is not None else torch.nn.Module() if stage is not None else None),
            # a later stage of one board keeps its own gradient (the answer is stage 0's average); a later group's boards
            # step on their group's average, as stage 0's do
            keep_own=own_stage, result_elements=stage.stage0_elements if own_stage else None,
            stage_sync=(StageSync(every=stage.spec.state_every, steps_per_epoch=sync.steps_per_epoch,
                                  total_steps=job.total_steps, start=start) if own_stage and stage is not None else None),
            waited_s=(lambda: links.waited_s) if links is not None else None,
            outer_state=decode_value(welcome.outer_state) if welcome.outer_state is not None else None)
        positioner = callback_class(package, LoopPositioner, "LoopPositioner")(position)
        seeder = BatchSeeder(job.seed, job.board_index, batches_per_epoch)  # the same draws in every rerun of this split
        callbacks = [positioner, callback_class(package, StepSeeding, "StepSeeding")(seeder)]
        if data.datamodule is not None:
            callbacks.append(callback_class(package, DataModuleHooks, "DataModuleHooks")(data.datamodule))
        accelerator = board_accelerator()  # a Jetson's GPU: each step's gradient is copied to the host, tensor by tensor
        events.emit("running", f"joined at step {start} ({accelerator}, {torch.get_num_threads()} torch threads)",
                    step=start)
        precision: Any = None
        if trainer_options.loss_scaled:  # 16-mixed: the fleet's loss scale now (a board joining mid-run starts at it)
            precision = precision_plugin(package, accelerator, new_scaler(accelerator, welcome.loss_scale))
        trainer = make_trainer(package, options=trainer_options, total_steps=job.total_steps,
                               callbacks=[*callbacks, exchange], accelerator=accelerator, max_epochs=job.max_epochs,
                               precision_plugin=precision)
        sampler = EpochBatchSampler(indices_of, position, before_batch=seeder.before_loading)
        loader = (stage_host_loader(position) if later_stage  # a later stage's inputs come over its links
                  else data.train_loader(sampler))
        del welcome  # its frame's buffer (the model's bytes) is freed once the optimizer state is restored from it
        try:
            trainer.fit(model, train_dataloaders=loader)
        except StopTraining as stop:
            events.emit("finished", f"stopped by the coordinator: {stop}", step=exchange.step)
            return 0
        events.emit("finished", step=exchange.step)
        return 0
    finally:
        client.close()
        if tail is not None:
            tail.close()
        if links is not None:
            links.close()


def _first_batch(step: int, *, batches_per_epoch: int, accumulate: int) -> int:
    """The first batch (counted from the start of training) of optimizer step ``step``'s window."""
    from edgefleet.workloads.fleet_trainer import position_of  # torch: loaded with the job, not with the worker

    return position_of(step, batches_per_epoch, accumulate).first_batch


def _batches_per_epoch(job: TrainCommand, here: int, source: str) -> int:
    """The job's batches per epoch, checked against this board's copy of the data.

    Raises:
        EdgeTrainError: the board's data gives another count: it is not the coordinator's data.
    """
    if job.batches_per_epoch and job.batches_per_epoch != here:
        raise EdgeTrainError(f"{source} gives {here} global batches per epoch on this board, {job.batches_per_epoch} "
                             "on the coordinator: every board needs the same data in global data mode (or use "
                             "--data-mode local)")
    return here


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this worker if the agent dies (kill -9 included): no orphaned jobs."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the agent's own stop() still ends the worker
        pass
    if os.getppid() == 1:  # the agent died before prctl took effect
        sys.exit(1)


def _read_job(line: str) -> tuple[Any, Any]:
    """The job and board context one stdin line holds.

    Raises:
        DecodeError: not JSON, not a job, or invalid fields.
    """
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise DecodeError(f"the worker's input is not a JSON job ({exc})") from None
    if not isinstance(data, dict):
        raise DecodeError("the worker's input is not a JSON object")
    command = command_from_dict(data.get("command", data))  # a bare command works too
    if isinstance(command, StopCommand):
        raise DecodeError("a stop command is not a job")
    return command, WorkerContext.from_dict(data.get("board"))


class _TorchDefaults:
    """Puts back what one job may change for the next in a kept worker (torch's threads, deterministic algorithms)."""

    def __init__(self) -> None:
        self.threads: int | None = None

    def restore(self) -> None:
        import torch  # every job needs it; the first import here costs the job nothing extra

        torch.use_deterministic_algorithms(False)  # a job's Trainer(deterministic=True) sets it process-wide
        if self.threads is None:
            self.threads = torch.get_num_threads()
        elif torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def _run_one(line: str, events: EventWriter, defaults: _TorchDefaults) -> int:
    """Run the job of one input line, reporting its failure as a ``failed`` event; its exit code."""
    try:
        job, context = _read_job(line)
        defaults.restore()
        # Lightning's INFO lines (each twice) and the libraries' deprecation warnings filled the stderr tail the agent
        # reports when a job fails; the user's module's warnings still show there
        quiet_lightning()
        if isinstance(job, ProfileCommand):
            from edgefleet.agent.profile_worker import run_profile  # torch and Lightning: only for a profile job

            return run_profile(job, events, context)
        return run_job(job, events, context)
    except NeighbourFault as exc:  # a pipeline neighbour left: this process is sound, a kept worker takes the re-plan
        events.emit("failed", str(exc), data={"worker": KEPT})
        return 0
    except EdgeTrainError as exc:  # unknown model or dataset, refused by the exchange, bad job
        events.emit("failed", str(exc))
        return 3
    except Exception as exc:
        traceback.print_exc()
        events.emit("failed", explain_device_error(exc) or f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        gc.collect()  # a kept worker waits for the next job with what the last one freed given back
        release_free_heap()  # to the kernel too: the heap keeps freed memory while a job runs (agent.heap)


def main() -> int:
    _die_with_parent()
    # Events go to the stdout we were given; anything printed by us or Lightning goes to stderr.
    events = EventWriter(os.fdopen(os.dup(1), "w", buffering=1))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    defaults = _TorchDefaults()
    code = 0
    for line in iter(sys.stdin.readline, ""):
        if not line.strip():
            continue
        code = _run_one(line, events, defaults)
        if code != 0:
            return code  # after a failure the next job gets a fresh process, not a possibly broken one
    return code


if __name__ == "__main__":
    sys.exit(main())
