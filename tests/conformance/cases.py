"""The conformance cases: one per feature a user's LightningModule may rely on.

``CASES`` are cases edgefleet must train like plain Lightning does; ``REFUSED`` are
cases it must refuse, each with the words its refusal message must contain; ``SEEDED``
are cases whose claim is reproducibility (the same seed, the same bits), as a board's
random numbers cannot be one process's.
"""

from __future__ import annotations

from tests.conformance.reference import Case

M = "tests.conformance.modules:"
D = "tests.conformance.data:"

CLASSIFICATION = D + "make_classification"
# 120 samples in global batches of 24: 5 steps an epoch, so 20 steps cross 4 epochs
# and an odd count leaves a short last window for accumulate_grad_batches=2.
SMALL = {"n": 120, "seed": 0}

CASES: list[Case] = [
    Case("own_ctor", M + "OwnCtorNet", {"lr": 0.1, "hidden": 16}, dataset=CLASSIFICATION),
    Case("lightning_import", M + "LightningImportNet", {"lr": 0.05}, dataset=CLASSIFICATION),
    Case("datamodule", M + "OwnCtorNet", {"lr": 0.1, "hidden": 12},
         datamodule=D + "ClassificationDataModule", datamodule_options={"n": 240, "seed": 1, "batch_size": 32}),
    Case("tokens_embedding", M + "EmbeddingNet", {"vocab": 50, "dim": 8, "lr": 0.1}, dataset=D + "make_tokens"),
    Case("float_regression", M + "RegressionNet", {"lr": 0.05}, dataset=D + "make_regression"),
    Case("dict_batches", M + "DictBatchNet", {"lr": 0.1}, dataset=D + "make_dicts"),
    Case("custom_collate", M + "CollateNet", {"lr": 0.1},
         datamodule=D + "CollateDataModule", datamodule_options={"n": 240, "seed": 0}),
    Case("step_scheduler", M + "StepSchedulerNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("epoch_scheduler", M + "EpochSchedulerNet", {"lr": 0.1}, dataset=CLASSIFICATION, dataset_options=SMALL),
    Case("plateau", M + "PlateauNet", {"lr": 0.1}, dataset=CLASSIFICATION, dataset_options=SMALL),
    Case("clip_norm", M + "OwnCtorNet", {"lr": 0.1}, dataset=CLASSIFICATION, trainer={"gradient_clip_val": 0.05}),
    Case("clip_value", M + "OwnCtorNet", {"lr": 0.1}, dataset=CLASSIFICATION,
         trainer={"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}),
    Case("accumulate", M + "OwnCtorNet", {"lr": 0.1}, dataset=CLASSIFICATION, dataset_options=SMALL,
         trainer={"accumulate_grad_batches": 2}),
    Case("batchnorm", M + "BatchNormNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("logged_metrics", M + "LoggingNet", {"lr": 0.1}, dataset=CLASSIFICATION, dataset_options=SMALL),
    Case("adam", M + "AdamNet", {"lr": 0.01}, dataset=CLASSIFICATION),
    Case("sgd_deterministic", M + "SgdNet", {"lr": 0.1}, dataset=CLASSIFICATION, trainer={"deterministic": True}),
    Case("bf16_mixed", M + "OwnCtorNet", {"lr": 0.1}, dataset=CLASSIFICATION, trainer={"precision": "bf16-mixed"}),
    # The loss's gain makes the first steps overflow at the default scale: 6 of 20 skipped at 4/8/12 (4 at 24 in one).
    Case("fp16_mixed", M + "LossGainNet", {"lr": 0.1, "gain": 64.0}, dataset=CLASSIFICATION,
         trainer={"precision": "16-mixed"}),
    # Issue 39: modules as outside users write them.
    Case("one_cycle", M + "OneCycleNet", {"lr": 0.2}, dataset=CLASSIFICATION),
    Case("ema", M + "EmaNet", {"lr": 0.1, "decay": 0.8}, dataset=CLASSIFICATION),
    Case("epoch_outputs", M + "EpochOutputsNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("datamodule_transfer_hooks", M + "LoggingNet", {"lr": 0.1},
         datamodule=D + "SensorDataModule", datamodule_options={"n": 240, "seed": 2, "batch_size": 32}),
    Case("module_transfer_hooks", M + "TransferHooksNet", {"lr": 0.1}, dataset=D + "make_raw_classification"),
    Case("batchnorm_cumulative", M + "CumulativeBatchNormNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("configure_model", M + "ConfigureModelNet", {"lr": 0.1, "hidden": 16}, dataset=CLASSIFICATION),
    Case("setup_model", M + "SetupNet", {"lr": 0.1, "hidden": 12}, dataset=CLASSIFICATION),
    Case("val_torchmetric", M + "ValMetricNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("param_groups", M + "ParamGroupsNet", {"lr": 0.01}, dataset=CLASSIFICATION),
    Case("frozen_layer", M + "FrozenLayerNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("tied_weights", M + "TiedWeightsNet", {"vocab": 50, "dim": 8, "lr": 0.5}, dataset=D + "make_tokens"),
    Case("epoch_mean_log", M + "EpochLogNet", {"lr": 0.1}, dataset=CLASSIFICATION),
    Case("trainer_figures", M + "TrainerFiguresNet", {"lr": 0.1}, dataset=CLASSIFICATION, dataset_options=SMALL,
         trainer={"accumulate_grad_batches": 2}),
]

REFUSED: list[tuple[Case, tuple[str, ...]]] = [
    (Case("two_optimizers", M + "TwoOptimizersNet", {"lr": 0.1}, dataset=CLASSIFICATION), ("optimizers",)),
    (Case("manual_optimization", M + "ManualOptNet", {"lr": 0.1}, dataset=CLASSIFICATION), ("manual optimization",)),
    # A metric object's state accumulates on each board: the refusal names the library and the attribute.
    (Case("train_torchmetric", M + "TrainMetricNet", {"lr": 0.1}, dataset=CLASSIFICATION), ("torchmetrics", "train_acc")),
    # configure_callbacks' callbacks would join the replica's Trainer and every board's: the refusal names them
    # and what the run has instead.
    (Case("module_callbacks", M + "ModuleCallbacksNet", {"lr": 0.1}, dataset=CLASSIFICATION),
     ("configure_callbacks", "EarlyStopping", "--target-accuracy", "ModelCheckpoint", "--checkpoint-every", "model.pt")),
]

SEEDED: list[Case] = [
    Case("dropout", M + "DropoutNet", {"lr": 0.1, "p": 0.3}, dataset=CLASSIFICATION),
]
