"""Model and dataset specs: built-in names, import paths, entry points, options, and the errors."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads import registry
from edgefleet.workloads.datasets import (
    load_digits_dataset,
    make_synthetic_dataset,
)
from edgefleet.workloads.models import MLP, ConvMLP, LeNet5, ResNetSmall
from edgefleet.workloads.registry import (
    available_datasets,
    available_models,
    build_dataset,
    build_model,
    dataset_attribute,
    parse_options,
    resolve_dataset,
    resolve_model,
)
from tests.workloads import user_plugins

PLUGINS = "tests.workloads.user_plugins"


@pytest.fixture
def installed_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend a package registered a model and a dataset (real EntryPoint objects, loaded for real)."""
    fake = {
        registry.MODEL_GROUP: [EntryPoint("tiny", f"{PLUGINS}:TinyModel", registry.MODEL_GROUP),
                               EntryPoint("broken", "no_such_package.models:Model", registry.MODEL_GROUP),
                               EntryPoint("lenet5", f"{PLUGINS}:TinyModel", registry.MODEL_GROUP)],
        registry.DATASET_GROUP: [EntryPoint("blobs", f"{PLUGINS}:make_blobs", registry.DATASET_GROUP)],
    }
    monkeypatch.setattr(registry, "entry_points", lambda group: fake.get(group, []))


def test_builtin_names() -> None:
    assert resolve_model("lenet5") is LeNet5 and resolve_model("mlp") is MLP
    assert resolve_model("resnet") is resolve_model("resnet_small") is ResNetSmall
    assert resolve_model("conv_mlp") is ConvMLP
    assert resolve_dataset("digits") is load_digits_dataset and resolve_dataset(" synthetic ") is make_synthetic_dataset


def test_unknown_model_lists_what_is_available(installed_entry_points: None) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_model("lenet")
    message = str(caught.value)
    assert "unknown model 'lenet' (did you mean 'lenet5'?)" in message
    assert "Built-in: lenet5, mlp, resnet_small, resnet, conv_mlp" in message
    assert "Entry points (edgefleet.models): broken, tiny" in message
    assert "package.module:Name" in message


def test_unknown_dataset_lists_what_is_available() -> None:
    with pytest.raises(ConfigError, match=r"unknown dataset 'mnist'.*Built-in: digits, synthetic, npz\. "
                                          r"Entry points \(edgefleet.datasets\): none installed"):
        resolve_dataset("mnist")


def test_entry_points_resolve_but_never_shadow_builtins(installed_entry_points: None) -> None:
    assert resolve_model("tiny") is user_plugins.TinyModel
    assert resolve_model("lenet5") is LeNet5
    assert available_models() == ["lenet5", "mlp", "resnet_small", "resnet", "conv_mlp", "broken", "tiny"]
    assert available_datasets() == ["digits", "synthetic", "npz", "blobs"]
    with pytest.raises(ConfigError, match=r"model entry point 'broken' \(no_such_package.models:Model\) failed to load"):
        resolve_model("broken")


def test_import_path_model() -> None:
    model = build_model(f"{PLUGINS}:TinyModel", {"hidden": 5}, input_shape=(2, 3), num_classes=4)
    assert isinstance(model, user_plugins.TinyModel)
    assert model(torch.zeros(1, 2, 3)).shape == (1, 4)


@pytest.mark.parametrize(("spec", "message"), [
    (f"{PLUGINS}:NotAModel", r"is the class tests.workloads.user_plugins.NotAModel, not a LightningModule subclass"),
    (f"{PLUGINS}:make_blobs", r"is the function tests.workloads.user_plugins.make_blobs, not a LightningModule subclass"),
    (f"{PLUGINS}:Missing", r"'tests.workloads.user_plugins' has no attribute 'Missing'"),
    ("no_such_package.models:Model", r"cannot import module 'no_such_package.models' \(ModuleNotFoundError"),
    (f"{PLUGINS}:", r"must look like package.module:Name"),
])
def test_import_path_model_errors_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_model(spec)


def test_a_model_instance_is_told_to_give_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(user_plugins, "MODEL_INSTANCE", user_plugins.TinyModel((2,), 2), raising=False)
    with pytest.raises(ConfigError, match="give the class, not an instance"):
        resolve_model(f"{PLUGINS}:MODEL_INSTANCE")


def test_a_lightning_dot_pytorch_module_is_built_with_its_own_signature() -> None:
    import lightning.pytorch

    model = build_model("tests.conformance.modules:LightningImportNet", {"lr": 0.3})
    assert isinstance(model, lightning.pytorch.LightningModule) and model.lr == 0.3
    with pytest.raises(ConfigError, match="has no option 'hidden'"):
        build_model("tests.conformance.modules:LightningImportNet", {"hidden": 3})


def test_input_shape_and_classes_are_given_only_to_a_constructor_that_takes_them() -> None:
    dataset = build_dataset(f"{PLUGINS}:make_blobs", "train", {})
    taker = build_model(f"{PLUGINS}:TinyModel", {"hidden": 5}, data=dataset)
    assert taker.net[-1].out_features == 3  # inferred from the targets
    own = build_model("tests.conformance.modules:OwnCtorNet", {"hidden": 7}, data=dataset)
    assert own.hparams.hidden == 7


def test_build_model_checks_options() -> None:
    model = build_model("mlp", {"layers": 3, "width": 64}, input_shape=(1, 8, 8), num_classes=10)
    assert isinstance(model, MLP) and model.hparams["layers"] == 3
    with pytest.raises(ConfigError, match=r"model 'mlp' has no option 'widht' \(did you mean 'width'\?\); "
                                          r"its options: lr, optimizer, momentum, layers, width"):
        build_model("mlp", {"widht": 64}, input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ConfigError, match="'num_classes' is set by edgefleet"):
        build_model("mlp", {"num_classes": 3}, input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ConfigError, match="optimizer = 'lbfgs' is not supported"):
        build_model("lenet5", {"optimizer": "lbfgs"}, input_shape=(1, 32, 32), num_classes=10)


def test_build_builtin_dataset_with_options() -> None:
    dataset = build_dataset("synthetic", "val", parse_options("n=100,shape=2x4,classes=3"))
    assert len(dataset) == 20 and dataset.input_shape == (2, 4) and dataset.num_classes == 3
    with pytest.raises(ConfigError, match="dataset 'digits' has no option 'n'"):
        build_dataset("digits", "train", {"n": 5})
    with pytest.raises(ConfigError, match="split = 'test'"):
        build_dataset("digits", "test")


def test_user_factory_without_split_is_split_90_10_and_keeps_its_samples() -> None:
    spec = f"{PLUGINS}:make_blobs"
    train, val = build_dataset(spec, "train", {"n": 50}), build_dataset(spec, "val", {"n": 50})
    assert (len(train), len(val)) == (45, 5)
    assert set(train.indices.tolist()).isdisjoint(val.indices.tolist())
    inputs, target = train[0]
    assert isinstance(inputs, np.ndarray) and inputs.dtype == np.float64 and type(target) is int  # as the factory made them
    assert dataset_attribute(train, "input_shape", "m") == (2, 3) and dataset_attribute(train, "num_classes", "m") == 3
    model = build_model("mlp", data=train)
    batch = default_collate([train[i] for i in range(4)])
    assert model(batch[0].float()).shape == (4, 3)


def test_user_dataset_with_split_and_attributes() -> None:
    train = build_dataset(f"{PLUGINS}:SplitBlobs", "train", {"n": 8})
    val = build_dataset(f"{PLUGINS}:SplitBlobs", "val", {"n": 8})
    assert len(train) == len(val) == 8 and train.num_classes == 5 and train.input_shape == (4,)
    assert train[3][0][0].item() == 3 and val[3][0][0].item() == 1003


def test_user_dataset_errors(installed_entry_points: None) -> None:
    with pytest.raises(ConfigError, match="is the int 42, not callable"):
        resolve_dataset(f"{PLUGINS}:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="is empty"):
        build_dataset("blobs", "train", {"n": 0})
    with pytest.raises(ConfigError, match="has no option 'size'"):
        build_dataset("blobs", "train", {"size": 3})


def test_parse_options() -> None:
    assert parse_options("layers=3, width=64,lr=2e-3,pool=avg,fast=true,n_val=none,name='12'") == {
        "layers": 3, "width": 64, "lr": 2e-3, "pool": "avg", "fast": True, "n_val": None, "name": "12"}
    assert parse_options("") == {} and parse_options("shape=1x32x32,") == {"shape": "1x32x32"}
    with pytest.raises(ConfigError, match="'layers' must look like key=value"):
        parse_options("layers")
    with pytest.raises(ConfigError, match="given twice"):
        parse_options("a=1,a=2")


def test_pure_datasets_are_kept_between_jobs_and_files_are_not(tmp_path: Path) -> None:
    import numpy as np

    first = registry.build_dataset_cached("synthetic", "train", {"n": 64})
    assert registry.build_dataset_cached("synthetic", "train", {"n": 64}) is first
    assert registry.build_dataset_cached("synthetic", "train", {"n": 65}) is not first
    registry.build_dataset_cached("digits", "train", {})
    assert registry.build_dataset_cached("synthetic", "train", {"n": 64}) is not first  # only the last two are kept
    path = tmp_path / "data.npz"
    np.savez(path, x=np.zeros((4, 3), np.float32), y=np.array([0, 1, 0, 1]))
    npz = registry.build_dataset_cached("npz", "train", {"path": str(path)})
    assert registry.build_dataset_cached("npz", "train", {"path": str(path)}) is not npz
