"""The Lightning reference itself: every case trains, deterministically, on the intended batches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from tests.conformance import data
from tests.conformance.cases import CASES, REFUSED
from tests.conformance.reference import (
    Case,
    GlobalBatchSampler,
    fit_reference,
    initial_state,
    lightning_reference,
    load,
    relative_l2,
    state_of,
)

STEPS, GLOBAL_BATCH, SEED = 20, 24, 3
BY_NAME = {case.name: case for case in CASES}


def test_case_names_are_unique() -> None:
    names = [case.name for case in CASES] + [case.name for case, _ in REFUSED]
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
    case, word = REFUSED[0]
    with pytest.raises(Exception, match=word):
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
