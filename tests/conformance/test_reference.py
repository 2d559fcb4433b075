"""The Lightning reference itself: every case trains, deterministically, on the intended batches."""

from __future__ import annotations

import dataclasses

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
import torchmetrics
from torch.utils.data import default_collate

from tests.conformance import data
from tests.conformance.cases import CASES, REFUSED, SEEDED
from tests.conformance.reference import (
    Case,
    GlobalBatchSampler,
    build_layers,
    case_data,
    ddp_reference,
    fit_reference,
    initial_state,
    integer_mismatches,
    lightning_reference,
    lightning_run,
    load,
    overrides,
    relative_l2,
    state_of,
)

STEPS, GLOBAL_BATCH, SEED = 20, 24, 3
BY_NAME = {case.name: case for case in CASES}


def test_case_names_are_unique() -> None:
    names = [case.name for case in CASES] + [case.name for case, _ in REFUSED] + [case.name for case in SEEDED]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_reference_trains(case: Case) -> None:
    trained = lightning_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert all(torch.isfinite(v).all() for v in trained.values() if torch.is_floating_point(v))
    assert relative_l2(trained, initial_state(case, seed=SEED)) > 1e-4


@pytest.mark.parametrize("name", ["batchnorm", "custom_collate", "plateau"])
def test_reference_is_deterministic(name: str) -> None:
    first = lightning_reference(BY_NAME[name], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    second = lightning_reference(BY_NAME[name], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_relative_l2_known_pair() -> None:
    b = {"w": torch.tensor([3.0, 4.0]), "b": torch.zeros(2), "count": torch.tensor(7)}
    a = {"w": torch.tensor([3.0, 4.5]), "b": torch.zeros(2), "count": torch.tensor(9)}
    assert relative_l2(a, b) == pytest.approx(0.1)  # ||(0, 0.5)|| / ||(3, 4)||; int buffers ignored
    assert relative_l2(b, b) == 0.0


def test_batch_sampler_cuts_each_epochs_permutation() -> None:
    sampler = GlobalBatchSampler(50, 8, seed=5)
    assert len(sampler) == 6
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = torch.randperm(50, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        assert list(sampler) == [order[k * 8:(k + 1) * 8] for k in range(6)]
    sampler.sampler.set_epoch(0)  # the path Lightning takes: loader.batch_sampler.sampler.set_epoch
    assert sampler.epoch == 0


def test_lightning_advances_the_epoch_of_the_batch_sampler() -> None:
    model, loader = fit_reference(BY_NAME["epoch_scheduler"], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert model.trainer.global_step == STEPS
    assert loader.batch_sampler.epoch == STEPS // (120 // GLOBAL_BATCH) - 1


def test_accumulation_steps_the_short_last_window_at_half_weight() -> None:
    """With 5 batches an epoch and accumulate_grad_batches=2, Lightning steps after batches 1, 3
    and 4; the lone batch 4's loss is still divided by 2. A hand-written loop must agree exactly."""
    case = BY_NAME["accumulate"]
    reference = lightning_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    dataset = load(case.dataset)(split="train", **case.dataset_options)
    torch.manual_seed(SEED)
    model = load(case.model)(**case.model_options)
    optimizer = model.configure_optimizers()
    sampler, steps, epoch = GlobalBatchSampler(len(dataset), GLOBAL_BATCH, SEED), 0, 0
    while steps < STEPS:
        sampler.set_epoch(epoch)
        batches = list(sampler)
        for k, indices in enumerate(batches):
            x, y = default_collate([dataset[i] for i in indices])
            (F.cross_entropy(model(x), y) / 2).backward()
            if k % 2 == 1 or k == len(batches) - 1:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if steps == STEPS:
                    break
        epoch += 1
    assert relative_l2(state_of(model), reference) < 1e-6


def test_deterministic_flag_does_not_leak() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    lightning_reference(BY_NAME["sgd_deterministic"], steps=2, global_batch=GLOBAL_BATCH, seed=SEED)
    assert torch.are_deterministic_algorithms_enabled() == before


def test_lightning_refuses_two_optimizers_too() -> None:
    case, words = REFUSED[0]
    with pytest.raises(Exception, match=words[0]):
        lightning_reference(case, steps=2, global_batch=GLOBAL_BATCH, seed=SEED)


@pytest.mark.parametrize("factory,x_dtype,y_dtype,x_shape", [
    (data.make_classification, torch.float32, torch.int64, (8,)),
    (data.make_tokens, torch.int64, torch.int64, (6,)),
    (data.make_regression, torch.float32, torch.float32, (8,)),
])
def test_factories_shapes_and_seeds(factory, x_dtype, y_dtype, x_shape) -> None:
    train = factory(split="train", n=30, seed=1)
    x, y = train[4]
    assert len(train) == 30 and x.dtype == x_dtype and x.shape == x_shape and y.dtype == y_dtype and y.dim() == 0
    assert torch.equal(factory(split="train", n=30, seed=1)[4][0], x)
    assert not torch.equal(factory(split="val", n=30, seed=1)[4][0], x)
    assert not torch.equal(factory(split="train", n=30, seed=2)[4][0], x)


def test_regression_targets_are_not_integers() -> None:
    _, y = default_collate(list(data.make_regression(n=50)))
    assert (y != y.trunc()).all()


def test_dict_samples_and_pad_collate() -> None:
    sample = data.make_dicts(n=10)[0]
    assert sample["features"].shape == (8,) and sample["label"].dtype == torch.int64
    x, y, lengths = data.pad_collate([data.make_sequences(n=10)[i] for i in range(4)])
    assert x.shape == (4, int(lengths.max()), 4) and y.shape == (4,) and lengths.dtype == torch.int64


# ------------------------------------------------------------------------------------------------
# Issue 39's cases: the reference runs each and exercises the feature the case is about.

BATCH_SIZES = [4, 8, 12]
ALL_MODULES = CASES + [case for case, _ in REFUSED] + SEEDED
# Where torch or Lightning itself needs more than the meta device gives.
OFF_META = {"batchnorm_cumulative": "BatchNorm(momentum=None) reads num_batches_tracked's value",
            "manual_optimization": "self.optimizers() needs a Trainer"}


class _StepLosses(pl.Callback):
    """Each training batch's loss, by epoch, as ``training_step`` returned it."""

    def __init__(self) -> None:
        self.by_epoch: dict[int, list[float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.by_epoch.setdefault(trainer.current_epoch, []).append(float(outputs["loss"]))


class _StartState(pl.Callback):
    """The module's state when training starts (after ``setup``, ``configure_model`` and ``configure_optimizers``)."""

    state: dict[str, torch.Tensor]

    def on_train_start(self, trainer, pl_module) -> None:
        self.state = state_of(pl_module)


def _fit(name: str, *callbacks: pl.Callback, steps: int = STEPS) -> pl.LightningModule:
    model, _ = fit_reference(BY_NAME[name], steps=steps, global_batch=GLOBAL_BATCH, seed=SEED, callbacks=list(callbacks))
    return model


def test_one_cycle_spans_exactly_the_run() -> None:
    model = _fit("one_cycle")
    scheduler = model.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.total_steps == STEPS and scheduler.last_epoch == STEPS
    assert model.trainer.optimizers[0].param_groups[0]["lr"] < 0.2 / 25  # annealed below where it started


def test_ema_lags_the_weights() -> None:
    trained = lightning_reference(BY_NAME["ema"], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    initial = initial_state(BY_NAME["ema"], seed=SEED)
    ema = {k: v for k, v in trained.items() if k.startswith("ema_")}
    weights = {"ema_" + k.removeprefix("net.").replace(".", "_"): v for k, v in trained.items() if k.startswith("net.")}
    assert ema.keys() == weights.keys()
    assert relative_l2(weights, ema) > 1e-2 and relative_l2(initial, ema) > 1e-2


def test_epoch_outputs_log_the_epochs_mean_and_are_cleared() -> None:
    losses = _StepLosses()
    model = _fit("epoch_outputs", losses)
    assert len(losses.by_epoch) == 2 and model.training_step_outputs == []
    last = losses.by_epoch[1]
    assert float(model.trainer.callback_metrics["training_epoch_mean"]) == pytest.approx(sum(last) / len(last), rel=1e-6)


def _spy(monkeypatch: pytest.MonkeyPatch, klass: type, hooks: tuple[str, ...]) -> dict[str, int]:
    calls = dict.fromkeys(hooks, 0)
    for hook in hooks:
        original = getattr(klass, hook)

        def counted(self, *args, _original=original, _hook=hook):
            calls[_hook] += 1
            return _original(self, *args)

        monkeypatch.setattr(klass, hook, counted)
    return calls


TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


@pytest.mark.parametrize(("name", "klass"), [("datamodule_transfer_hooks", data.SensorDataModule),
                                             ("module_transfer_hooks", load("tests.conformance.modules:TransferHooksNet"))])
def test_transfer_hooks_see_training_and_validation_batches(name: str, klass: type,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch, klass, TRANSFER_HOOKS)
    model = _fit(name)
    val_batches = 2 * len(case_data(BY_NAME[name]).val_loader())  # 2 epochs of 10 batches, validated after each
    assert model.trainer.global_step == STEPS
    assert calls == dict.fromkeys(TRANSFER_HOOKS, STEPS + val_batches)


def test_datamodule_hooks_cast_and_standardise() -> None:
    dm = data.SensorDataModule(n=240, seed=2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["readings"].dtype == torch.float64
    moved = dm.transfer_batch_to_device(dm.on_before_batch_transfer(batch, 0), torch.device("cpu"), 0)
    assert moved.readings.dtype == torch.float32
    x, y = dm.on_after_batch_transfer(moved, 0)
    assert x.mean().abs() < 0.5 and 0.5 < x.std() < 1.5 and torch.equal(y, batch["label"])


def test_module_hooks_clip_cast_and_standardise() -> None:
    model = load(BY_NAME["module_transfer_hooks"].model)()
    x_raw, y = default_collate([data.make_raw_classification(n=240)[i] for i in range(240)])
    clipped, _ = model.on_before_batch_transfer((x_raw, y), 0)
    assert not torch.equal(clipped, x_raw) and clipped.max() <= 25.0  # the readings beyond 2 sigma are clipped
    moved = model.transfer_batch_to_device((clipped, y), torch.device("cpu"), 0)
    assert moved[0].dtype == torch.float32
    x, _ = model.on_after_batch_transfer(moved, 0)
    assert x.mean().abs() < 0.5 and 0.5 < x.std() < 1.5


@pytest.mark.parametrize("name", ["batchnorm", "batchnorm_cumulative"])
def test_num_batches_tracked_counts_steps_in_both_references(name: str) -> None:
    lightning = lightning_reference(BY_NAME[name], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    ddp = ddp_reference(BY_NAME[name], steps=STEPS, batch_sizes=BATCH_SIZES, seed=SEED)
    assert int(lightning["net.1.num_batches_tracked"]) == STEPS and integer_mismatches(ddp, lightning) == []
    assert integer_mismatches({**ddp, "net.1.num_batches_tracked": torch.tensor(STEPS + 1)}, lightning) != []


def test_cumulative_batchnorm_averages_over_all_batches() -> None:
    """momentum=None: the running mean is the plain mean of the steps' batch means (DDP: rank 0's slices)."""
    case = BY_NAME["batchnorm_cumulative"]
    momentum = lightning_reference(BY_NAME["batchnorm"], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    cumulative = lightning_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert not torch.allclose(momentum["net.1.running_mean"], cumulative["net.1.running_mean"])


@pytest.mark.parametrize("name", ["configure_model", "setup_model"])
def test_layers_built_late_start_from_the_seeds_draws(name: str) -> None:
    case = BY_NAME[name]
    assert list(load(case.model)(**case.model_options).parameters()) == []  # nothing before fit
    start = _StartState()
    trained = _fit(name, start)
    initial = initial_state(case, seed=SEED)
    assert initial and start.state.keys() == initial.keys()
    assert all(torch.equal(start.state[k], initial[k]) for k in initial)
    assert relative_l2(state_of(trained), initial) > 1e-2


def test_lightning_logs_a_training_torchmetric() -> None:
    case, words = next((c, w) for c, w in REFUSED if c.name == "train_torchmetric")
    assert words == ("torchmetrics", "train_acc")
    model, _ = fit_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert 0.0 <= float(model.trainer.callback_metrics["train_acc_epoch"]) <= 1.0


def test_validation_torchmetric_is_logged() -> None:
    run = lightning_run(BY_NAME["val_torchmetric"], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    assert 0.0 < run.metrics["val_acc"] <= 1.0 and run.metrics["val_loss"] > 0.0


def test_dropout_is_reproducible_under_lightning_and_active() -> None:
    case = SEEDED[0]
    first, second = (lightning_reference(case, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED) for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in first)
    # Same initial weights, no dropout: other weights, so the masks took part.
    torch.manual_seed(SEED)
    no_dropout = Case("no_dropout", case.model, {**case.model_options, "p": 0.0}, dataset=case.dataset)
    assert relative_l2(lightning_reference(no_dropout, steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED), first) > 1e-3


def test_param_groups_keep_their_settings() -> None:
    model = _fit("param_groups")
    groups = model.trainer.optimizers[0].param_groups
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in groups] == [(0.01, 0.1, 2), (0.03, 0.0, 2)]


def test_frozen_layer_keeps_its_initial_weights() -> None:
    trained = lightning_reference(BY_NAME["frozen_layer"], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    initial = initial_state(BY_NAME["frozen_layer"], seed=SEED)
    assert all(torch.equal(trained[k], initial[k]) for k in ("backbone.weight", "backbone.bias"))
    assert not torch.equal(trained["head.1.weight"], initial["head.1.weight"])


def test_tied_weights_stay_one_parameter() -> None:
    model = _fit("tied_weights")
    assert model.head.weight is model.embed.weight
    assert relative_l2(state_of(model), initial_state(BY_NAME["tied_weights"], seed=SEED)) > 1e-3


def test_on_epoch_logging_reports_the_epochs_mean() -> None:
    losses = _StepLosses()
    model = _fit("epoch_mean_log", losses)
    last = losses.by_epoch[max(losses.by_epoch)]
    reported = float(model.trainer.callback_metrics["train_loss"])
    assert reported == pytest.approx(sum(last) / len(last), rel=1e-6) and reported != pytest.approx(last[-1], rel=1e-3)


def test_trainer_figures_under_max_steps() -> None:
    trained = lightning_reference(BY_NAME["trainer_figures"], steps=STEPS, global_batch=GLOBAL_BATCH, seed=SEED)
    # max_epochs=-1, max_steps=20, no data loaded yet (inf), 20 steps, accumulate_grad_batches=2; then
    # 120 samples in batches of 24 once training starts.
    assert trained["trainer_figures"].tolist() == [-1, STEPS, -1, STEPS, 2, 5]


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.skip(OFF_META[case.name])) if case.name in OFF_META
                                  else case for case in ALL_MODULES], ids=lambda case: case.name)
def test_modules_keep_tensors_on_the_models_device(case: Case) -> None:
    """On the 'meta' device a tensor made on the CPU inside a step fails as it would on a GPU: each module's
    batch hooks, training_step, on_train_batch_end and validation_step run there (metric objects aside:
    torchmetrics checks its inputs' values, which meta tensors lack)."""
    meta = torch.device("meta")
    model = build_layers(load(case.model)(**case.model_options)).to(meta)
    source = case_data(case)
    batch = source.collate_fn([source.train_set[i] for i in range(6)])
    hooks = model
    if case.datamodule is not None:
        hooks = load(case.datamodule)(**case.datamodule_options)
        hooks.setup("fit")
    batch = hooks.on_after_batch_transfer(hooks.transfer_batch_to_device(hooks.on_before_batch_transfer(batch, 0), meta, 0), 0)
    with_metrics = any(isinstance(m, torchmetrics.Metric) for m in model.modules())
    if not with_metrics:
        loss = model.training_step(batch, 0)
        assert loss.device == meta
        model.on_train_batch_end({"loss": loss}, batch, 0)
    if overrides(model, "validation_step") and not with_metrics:
        model.validation_step(batch, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", ALL_MODULES, ids=lambda case: case.name)
def test_modules_train_on_a_gpu(case: Case) -> None:
    gpu = dataclasses.replace(case, trainer={**case.trainer, "accelerator": "gpu"})
    model, _ = fit_reference(gpu, steps=3, global_batch=GLOBAL_BATCH, seed=SEED)
    assert model.trainer.global_step == 3
