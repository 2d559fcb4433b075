"""Turning a model or dataset spec from the job config into a LightningModule or a Dataset.

A spec is one of:

* a built-in name (``lenet5``, ``mlp``, ``resnet_small``/``resnet``, ``conv_mlp``; ``digits``, ``synthetic``, ``npz``),
* an import path ``package.module:Name`` (``Name`` may be dotted: ``module:Outer.Inner``),
* the name of an installed entry point in group ``edgefleet.models`` or ``edgefleet.datasets``.

Built-ins win over entry points of the same name, so a package cannot silently replace one.
Variant options are a dict (from the job config, or :func:`parse_options` on the CLI) passed as
keyword arguments; an option the model or factory does not take is a ConfigError naming the ones it does.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import reprlib
import typing
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, cast

import torch
from torch.utils.data import Dataset, IterableDataset

from edgefleet.protocol.errors import ConfigError
from edgefleet.workloads.datasets import (
    BUILTIN_DATASETS,
    DatasetFactory,
    check_split,
    split_indices,
)
from edgefleet.workloads.lightning_api import is_datamodule_class, is_lightning_module_class
from edgefleet.workloads.models import BUILTIN_MODELS

MODEL_GROUP = "edgefleet.models"
DATASET_GROUP = "edgefleet.datasets"
# Train/val split of a user dataset whose factory takes no ``split``: fixed, independent of the
# training seed, so every board and the coordinator agree on it.
USER_SPLIT_SEED = 90
USER_VAL_FRACTION = 0.1


# ------------------------------------------------------------------------------------------ resolving

def available_models() -> list[str]:
    """Built-in model names, then installed ``edgefleet.models`` entry points."""
    return _available(BUILTIN_MODELS, MODEL_GROUP)


def available_datasets() -> list[str]:
    """Built-in dataset names, then installed ``edgefleet.datasets`` entry points."""
    return _available(BUILTIN_DATASETS, DATASET_GROUP)


def resolve_model(spec: str) -> type[Any]:
    """The LightningModule class a model spec names (of ``pytorch_lightning`` or ``lightning.pytorch``).

    Raises:
        ConfigError: Unknown name (lists what is available), failed import, or not a
            LightningModule subclass.
    """
    model = _resolve(spec, BUILTIN_MODELS, MODEL_GROUP, "model")
    if is_lightning_module_class(model):
        return typing.cast(type, model)
    raise ConfigError(f"model {spec!r} is {_describe(model)}, not a LightningModule subclass. A model must be a "
                      "class deriving from LightningModule (pytorch_lightning or lightning.pytorch); its "
                      "constructor's keyword arguments are --model-options")


def resolve_datamodule(spec: str) -> type[Any]:
    """The LightningDataModule class a ``package.module:Class`` spec names.

    Raises:
        ConfigError: failed import, or not a LightningDataModule subclass.
    """
    if ":" not in spec:
        raise ConfigError(f"datamodule {spec!r}: give an import path, package.module:Class")
    module = _import_object(spec.strip(), "datamodule")
    if is_datamodule_class(module):
        return typing.cast(type, module)
    raise ConfigError(f"datamodule {spec!r} is {_describe(module)}, not a LightningDataModule subclass "
                      "(pytorch_lightning or lightning.pytorch)")


def resolve_dataset(spec: str) -> DatasetFactory:
    """The factory a dataset spec names: called with ``**options`` (and ``split=`` if it takes one).

    Raises:
        ConfigError: Unknown name (lists what is available), failed import, or not callable.
    """
    factory = _resolve(spec, BUILTIN_DATASETS, DATASET_GROUP, "dataset")
    if callable(factory):
        return cast("Callable[..., Dataset[Any]]", factory)
    raise ConfigError(f"dataset {spec!r} is {_describe(factory)}, not callable; a dataset spec must name a function "
                      "or class that returns a map-style dataset of (input, target) pairs")


def _resolve(spec: str, builtins: Mapping[str, Any], group: str, kind: str) -> Any:
    name = spec.strip()
    if name in builtins:
        return builtins[name]
    if ":" in name:
        return _import_object(name, kind)
    for entry_point in entry_points(group=group):
        if entry_point.name == name:
            try:
                return entry_point.load()
            except Exception as exc:
                raise ConfigError(f"{kind} entry point {name!r} ({entry_point.value}) failed to load: "
                                  f"{type(exc).__name__}: {exc}") from exc
    known = _available(builtins, group)
    close = difflib.get_close_matches(name, known, n=1)
    plugins = [n for n in known if n not in builtins]
    raise ConfigError(
        f"unknown {kind} {spec!r}{f' (did you mean {close[0]!r}?)' if close else ''}. "
        f"Built-in: {', '.join(builtins)}. Entry points ({group}): {', '.join(plugins) or 'none installed'}. "
        f"Or give an import path, package.module:Name")


def _available(builtins: Mapping[str, Any], group: str) -> list[str]:
    plugins = sorted({ep.name for ep in entry_points(group=group)} - set(builtins))
    return [*builtins, *plugins]


def _import_object(path: str, kind: str) -> Any:
    module_name, _, attribute_path = path.partition(":")
    if not module_name or not attribute_path:
        raise ConfigError(f"{kind} import path {path!r} must look like package.module:Name")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{kind} {path!r}: cannot import module {module_name!r} "
                          f"({type(exc).__name__}: {exc}); is it installed on this machine?") from exc
    obj: Any = module
    for attribute in attribute_path.split("."):
        if not hasattr(obj, attribute):
            raise ConfigError(f"{kind} {path!r}: {getattr(obj, '__name__', module_name)!r} has no attribute {attribute!r}")
        obj = getattr(obj, attribute)
    return obj


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if is_lightning_module_class(type(obj)) or is_datamodule_class(type(obj)):
        return f"an instance of {type(obj).__qualname__} (give the class, not an instance)"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
    return f"the {type(obj).__name__} {reprlib.repr(obj)}"


# ------------------------------------------------------------------------------------------- building

MODEL_DATA_ARGUMENTS = ("input_shape", "num_classes")  # given to a model's constructor only if it takes them


def build_model(spec: str, options: Mapping[str, Any] | None = None, *, data: Any = None,
                input_shape: Sequence[int] | None = None, num_classes: int | None = None) -> Any:
    """Construct the model ``spec`` names with its own signature: ``Cls(**options)``.

    ``input_shape`` and ``num_classes`` are passed too, as keywords, if the constructor has
    parameters of those names (the built-in models do): taken from the training dataset's
    attributes of those names, else inferred from its samples (:func:`dataset_attribute`).

    Args:
        spec: Built-in name, import path or entry point name.
        options: The constructor's keyword arguments, e.g. ``{"layers": 3, "width": 64}``.
        data: The training dataset, asked only when the constructor wants its shape or classes.
        input_shape: Given instead of the dataset's, if the constructor takes it.
        num_classes: Given instead of the dataset's, if the constructor takes it.

    Raises:
        ConfigError: Unknown spec, unknown option, or the constructor rejected the options.
    """
    model_class = resolve_model(spec)
    options = dict(options or {})
    parameters = _parameters(model_class)
    wanted = [name for name in MODEL_DATA_ARGUMENTS if name in parameters]
    _check_options(model_class, options, f"model {spec!r}", reserved=tuple(wanted))
    explicit = {"input_shape": tuple(input_shape) if input_shape is not None else None, "num_classes": num_classes}
    given = {name: explicit[name] if explicit[name] is not None else dataset_attribute(data, name, f"model {spec!r}")
             for name in wanted}
    try:
        return model_class(**given, **options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {spec!r} with options {options} failed to build: {exc}") from exc


def build_datamodule(spec: str, options: Mapping[str, Any] | None = None) -> Any:
    """Construct the LightningDataModule ``spec`` names as ``Cls(**options)``.

    Raises:
        ConfigError: Unknown spec, unknown option, or the constructor rejected the options.
    """
    module_class = resolve_datamodule(spec)
    options = dict(options or {})
    _check_options(module_class, options, f"datamodule {spec!r}", reserved=())
    try:
        return module_class(**options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"datamodule {spec!r} with options {options} failed to build: {exc}") from exc


def dataset_attribute(dataset: Any, name: str, what: str) -> Any:
    """``input_shape`` or ``num_classes`` of a training dataset, for a model constructor that takes it.

    The dataset's attribute of that name, else inferred: ``input_shape`` from the first sample's
    input, ``num_classes`` as the largest integer target + 1 (reading every sample once: set the
    attribute on large datasets).

    Raises:
        ConfigError: there is no dataset, or its samples are not ``(input, integer target)`` pairs.
    """
    if dataset is None:
        raise ConfigError(f"{what}'s constructor takes {name}, but there is no dataset to take it from")
    value = getattr(dataset, name, None)
    if value is not None:
        return tuple(int(d) for d in value) if name == "input_shape" else int(value)
    first = dataset[0]
    if not (isinstance(first, (tuple, list)) and len(first) == 2):
        raise ConfigError(f"{what}'s constructor takes {name}, which cannot be inferred from samples of type "
                          f"{type(first).__name__}; give the dataset a {name} attribute, or drop the parameter")
    if name == "input_shape":
        return tuple(torch.as_tensor(first[0]).shape)
    targets = [torch.as_tensor(dataset[i][1]) for i in range(len(dataset))]
    if any(t.is_floating_point() or t.is_complex() or t.numel() != 1 for t in targets):
        raise ConfigError(f"{what}'s constructor takes num_classes, but the targets are not integer class labels; "
                          "give the dataset a num_classes attribute, or drop the parameter")
    return max(int(t) for t in targets) + 1


PURE_DATASETS = ("digits", "synthetic")  # built from their options alone: safe to keep between jobs
DATASET_CACHE_SIZE = 2                    # the train split of the last job or two
_dataset_cache: dict[str, Any] = {}


def build_dataset_cached(spec: str, split: str = "train", options: Mapping[str, Any] | None = None) -> Any:
    """:func:`build_dataset`, kept for the next job of a worker that stays (``[training] keep_worker``).

    Only datasets that are a pure function of their options (:data:`PURE_DATASETS`) are kept; a
    file on the board or a user's factory may change between jobs and is built anew every time.
    Generating 40,000 synthetic samples takes seconds on a board limited to a tenth of a CPU.
    """
    if spec.strip() not in PURE_DATASETS:
        return build_dataset(spec, split, options)
    key = json.dumps([spec.strip(), split, dict(options or {})], sort_keys=True, default=str)
    dataset = _dataset_cache.pop(key, None)
    if dataset is None:
        dataset = build_dataset(spec, split, options)
    _dataset_cache[key] = dataset  # most recent last
    while len(_dataset_cache) > DATASET_CACHE_SIZE:
        del _dataset_cache[next(iter(_dataset_cache))]
    return dataset


def build_dataset(spec: str, split: str = "train", options: Mapping[str, Any] | None = None) -> Any:
    """Construct split ``split`` of the dataset ``spec`` names.

    Built-ins return a :class:`~workloads.datasets.TensorClassificationDataset`. A user factory is
    called with ``split=`` if it has a ``split`` parameter; otherwise its whole dataset is split
    90/10 with a fixed seed. User datasets are wrapped in a :class:`UserDatasetView`, which returns
    their samples unchanged (any dtype or structure).

    Raises:
        ConfigError: Unknown spec or option, bad split, or not a map-style dataset.
    """
    check_split(split)
    factory = resolve_dataset(spec)
    options = dict(options or {})
    _check_options(factory, options, f"dataset {spec!r}", reserved=("split",))
    builtin = spec.strip() in BUILTIN_DATASETS
    takes_split = builtin or "split" in _parameters(factory)
    try:
        dataset = factory(split=split, **options) if takes_split else factory(**options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"dataset {spec!r} with options {options} failed to build: {exc}") from exc
    if builtin:
        return dataset
    view = UserDatasetView.wrap(dataset, spec)
    if takes_split:
        return view
    train_indices, val_indices = split_indices(len(view), USER_VAL_FRACTION, USER_SPLIT_SEED)
    return view.subset(train_indices if split == "train" else val_indices)


def _parameters(func: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(func).parameters)
    except (TypeError, ValueError):   # some builtins and C extensions have no signature
        return {}


def _check_options(func: Callable[..., Any], options: Mapping[str, Any], what: str, reserved: tuple[str, ...]) -> None:
    for key in reserved:
        if key in options:
            raise ConfigError(f"{what}: {key!r} is set by edgefleet, not an option")
    parameters = _parameters(func)
    if not parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return   # it takes **kwargs (or we cannot tell): let it judge its own options
    accepted = [name for name, p in parameters.items()
                if name not in reserved and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in options:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            raise ConfigError(f"{what} has no option {key!r}{f' (did you mean {close[0]!r}?)' if close else ''}; "
                              f"its options: {', '.join(accepted) or 'none'}")


class UserDatasetView(Dataset[Any]):
    """A user's map-style dataset, or a subset of it; samples are returned exactly as the dataset gives them.

    Attributes:
        base: The user's dataset.
        indices: Rows of ``base`` this view shows, or None for all.
        collate_fn: The user dataset's own ``collate_fn`` attribute, if it has one.
    """

    def __init__(self, base: Any, indices: torch.Tensor | None) -> None:
        self.base = base
        self.indices = indices
        for name in ("input_shape", "num_classes", "collate_fn"):  # the user's, passed through when set
            if getattr(base, name, None) is not None:
                setattr(self, name, getattr(base, name))

    @classmethod
    def wrap(cls, dataset: Any, spec: str) -> UserDatasetView:
        """Check ``dataset`` is a non-empty map-style dataset."""
        if isinstance(dataset, IterableDataset):
            raise ConfigError(f"dataset {spec!r} returned an IterableDataset ({type(dataset).__name__}): the fleet "
                              "picks each board's samples by index so that every step trains on the same global "
                              "batch; return a map-style dataset (with __len__ and __getitem__) instead")
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise ConfigError(f"dataset {spec!r} returned {_describe(dataset)}; it must be map-style "
                              "(with __len__ and __getitem__), e.g. a torch Dataset or a list of samples")
        if len(dataset) == 0:
            raise ConfigError(f"dataset {spec!r} is empty")
        return cls(dataset, None)

    def subset(self, indices: torch.Tensor) -> UserDatasetView:
        """The same view restricted to ``indices`` (positions in this view)."""
        base_indices = indices if self.indices is None else self.indices[indices]
        return UserDatasetView(self.base, base_indices)

    def __len__(self) -> int:
        return len(self.base) if self.indices is None else len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.base[index if self.indices is None else int(self.indices[index])]


# -------------------------------------------------------------------------------------------- options

def parse_options(text: str) -> dict[str, Any]:
    """Parse ``"layers=3,width=64,optimizer=sgd"`` into ``{"layers": 3, "width": 64, "optimizer": "sgd"}``.

    Values become int, float, bool (``true``/``false``), None (``none``/``null``) or str; quotes
    force a string. Shapes are written with ``x`` (``shape=1x32x32``) as commas separate options.

    Raises:
        ConfigError: An item without ``=``, an empty key, or a key given twice.
    """
    options: dict[str, Any] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise ConfigError(f"option {item.strip()!r} in {text!r} must look like key=value")
        if key in options:
            raise ConfigError(f"option {key!r} is given twice in {text!r}")
        options[key] = _parse_value(value.strip())
    return options


def _parse_value(value: str) -> Any:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            pass
    return value


__all__ = ["DATASET_GROUP", "MODEL_GROUP", "UserDatasetView", "available_datasets", "available_models",
           "build_datamodule", "build_dataset", "build_dataset_cached", "build_model", "dataset_attribute",
           "parse_options", "resolve_datamodule", "resolve_dataset", "resolve_model"]
