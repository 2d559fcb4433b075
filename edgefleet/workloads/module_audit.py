"""Refuse, before any board starts, a module whose training hooks use a torchmetrics ``Metric``.

Each board runs the training hooks on its own slice of every global batch. What ``training_step``
logs travels with the board's gradient and the coordinator averages it over the boards' samples
(``agent.step_logs``), but that only works for numbers: a ``Metric`` keeps a state (counts, sums)
that would have to be merged across boards, and the fleet does not merge Metric states yet. Such
a module would train, and its training metric would be missing or one board's slice only; so it
is refused here, naming the hook and the attribute.

The check reads the hooks' bytecode (``dis``) and runs none of the module's code: it looks for
``self.<name>`` where ``<name>`` is a Metric attribute, follows ``self.<method>(...)`` calls to
the module's own helpers (``_shared_step(batch, "train")``) and ``super()`` calls, and is
conservative about ``getattr(self, f"{stage}_acc")``. torchmetrics is never imported here: a
module without it must not pay for it, so a Metric is recognised by its classes' names.
"""

from __future__ import annotations

import dis
import inspect
import itertools
import logging
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edgefleet.protocol.errors import ConfigError

log = logging.getLogger(__name__)

TRAINING_HOOKS = ("training_step", "on_train_batch_start", "on_train_batch_end", "on_train_epoch_start",
                  "on_train_epoch_end", "on_before_backward", "on_after_backward")
FOLLOW_DEPTH = 2  # self.<helper>() calls followed from a hook: the helper, and the helpers it calls

_METRIC_CLASSES = ("Metric", "MetricCollection")
_CONTAINER_CLASSES = ("ModuleDict", "ModuleList", "Sequential")  # torch.nn containers: self.metrics["train"]
_LIBRARY_PACKAGES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities",
                     "torchmetrics")
# Attribute access on self that the check cannot follow to a name.
_DYNAMIC_ATTRIBUTES = ("__getattr__", "__getattribute__", "__dict__", "_modules", "get_submodule")
_PLAIN_ITEMS = 64  # items of a plain dict or list attribute looked at: a list of samples is not a metric holder
_ATTRIBUTE_OPS = ("LOAD_ATTR", "LOAD_METHOD")  # LOAD_METHOD up to 3.11, a flagged LOAD_ATTR from 3.12
_SKIPPED_OPS = ("CACHE", "EXTENDED_ARG", "NOP")  # no stack effect: must not break a self.a.b chain

ADVICE = ("Log a plain tensor computed in training_step instead, e.g. self.log(\"train_acc\", "
          "(preds == y).float().mean()), which the fleet averages over the boards' samples; or use the Metric "
          "in validation_step only, which runs on the coordinator over the whole validation set.")


@dataclass
class _Uses:
    """What one function's bytecode does with ``self``."""

    chains: list[tuple[str, ...]] = field(default_factory=list)  # self.a.b -> ("a", "b")
    super_calls: list[str] = field(default_factory=list)  # super().name
    dynamic: bool = False  # getattr(self, <computed name>) or self.__dict__ and the like


@dataclass(frozen=True)
class _Finding:
    route: tuple[str, ...]  # the hook, then the helpers it reaches the use through
    attribute: str | None  # the Metric attribute's path; None for a dynamic getattr(self, ...)


def _class_names(obj: Any, names: tuple[str, ...], package: str) -> bool:
    """Whether a class in ``obj``'s MRO is named one of ``names`` and comes from ``package``."""
    return any(klass.__name__ in names and (klass.__module__ or "").split(".")[0] == package
               for klass in type(obj).__mro__)


def is_metric(obj: Any) -> bool:
    """Whether ``obj`` is a torchmetrics ``Metric`` or ``MetricCollection``, without importing torchmetrics."""
    return _class_names(obj, _METRIC_CLASSES, "torchmetrics")


def metric_attributes(model: Any) -> dict[str, str]:
    """The module's attributes that are or hold torchmetrics Metrics: dotted path -> what it is.

    A Metric registered twice (``self.metric = self.train_acc``) is found under both names. Torch
    containers holding one (``nn.ModuleDict``) and plain dicts/lists in the module's ``__dict__``
    count too, since ``self.metrics["train"]`` reaches the Metric through them.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    found = {name: type(module).__name__ for name, module in modules.items() if name and is_metric(module)}
    for name in list(found):
        parts = name.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if prefix not in found and _class_names(modules.get(prefix), _CONTAINER_CLASSES, "torch"):
                found[prefix] = f"{type(modules[prefix]).__name__} holding {name}"
    for name, value in vars(model).items():
        if name == "_modules":  # nn.Module's own registry, walked above
            continue
        held = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        metric = next((item for item in itertools.islice(held, _PLAIN_ITEMS) if is_metric(item)), None)
        if metric is not None and name not in found:
            found[name] = type(metric).__name__ if metric is value else f"{type(value).__name__} holding a Metric"
    return found


def _pushed_locals(instruction: dis.Instruction) -> tuple[str, ...]:
    """The local or cell variables ``instruction`` pushes, in order (superinstructions push two from 3.13)."""
    op = instruction.opname
    if "LOAD_FAST" not in op and op != "LOAD_DEREF":
        return ()
    names = instruction.argval if isinstance(instruction.argval, tuple) else (instruction.argval,)
    return tuple(names[1:]) if op.startswith("STORE_") else tuple(names)  # STORE_FAST_LOAD_FAST (stored, loaded)


def _loads_self(instruction: dis.Instruction, self_name: str, position: int) -> bool:
    """Whether ``instruction`` pushes ``self`` (as its last push with -1, its first with 0)."""
    names = _pushed_locals(instruction)
    return bool(names) and names[position] == self_name


def _is_call(instruction: dis.Instruction) -> bool:
    return instruction.opname.startswith("CALL") or instruction.opname == "PRECALL"


def _getattr_is_dynamic(rest: list[dis.Instruction], self_name: str) -> bool | None:
    """For the instructions after ``LOAD_GLOBAL getattr``: True for ``getattr(self, <computed>)``.

    False for ``getattr(self, "literal"[, default])``, None when the first argument is not ``self``.
    Anything not clearly a literal name counts as computed: the check errs towards refusing.
    """
    rest = [ins for ins in rest if ins.opname != "PUSH_NULL"][:4]
    if not rest or not _loads_self(rest[0], self_name, 0):
        return None
    if len(_pushed_locals(rest[0])) > 1:  # LOAD_FAST_LOAD_FAST (self, name)
        return True
    if len(rest) > 1 and rest[1].opname in _ATTRIBUTE_OPS:  # getattr(self.metrics, ...): its chain covers it
        return None
    if len(rest) > 2 and rest[1].opname == "LOAD_CONST" and isinstance(rest[1].argval, str):
        if _is_call(rest[2]):
            return False
        if len(rest) > 3 and rest[2].opname.startswith("LOAD_") and _is_call(rest[3]):  # a simple default
            return False
    return True


def _scan(code: types.CodeType, self_name: str) -> _Uses:
    """Where ``code`` (and the closures and comprehensions inside it) reads attributes of ``self``."""
    uses = _Uses()
    instructions = [ins for ins in dis.get_instructions(code) if ins.opname not in _SKIPPED_OPS]
    chain: list[str] | None = None
    after_super = False
    for index, ins in enumerate(instructions):
        op = ins.opname
        if chain is not None and op in _ATTRIBUTE_OPS:
            chain.append(str(ins.argval))
            continue
        if chain:
            uses.chains.append(tuple(chain))
        chain = None
        if after_super and (op in _ATTRIBUTE_OPS or "SUPER" in op):  # super().x, LOAD_SUPER_ATTR from 3.12
            uses.super_calls.append(str(ins.argval))
            after_super = False
        elif _loads_self(ins, self_name, -1):
            chain = []
        elif op in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "super":
            after_super = True
        elif op in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "getattr":
            uses.dynamic |= bool(_getattr_is_dynamic(instructions[index + 1:index + 6], self_name))
    if chain:
        uses.chains.append(tuple(chain))
    uses.dynamic |= any(chain[0] in _DYNAMIC_ATTRIBUTES for chain in uses.chains)
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and self_name in const.co_freevars:  # lambdas, closures, <listcomp>
            inner = _scan(const, self_name)
            uses.chains += inner.chains
            uses.super_calls += inner.super_calls
            uses.dynamic |= inner.dynamic
    return uses


def _code_of(attribute: Any) -> tuple[types.CodeType, str] | None:
    """The bytecode of a method found on a class and the name its ``self`` has there, if it can be read.

    None for what has no readable body of the user's (a C function, a ``functools.partial``, a
    Lightning default, a static or class method: those have no ``self``).
    """
    if isinstance(attribute, (staticmethod, classmethod)):
        return None
    if isinstance(attribute, property):
        attribute = attribute.fget
    try:
        function = inspect.unwrap(attribute)  # torch.no_grad() and other functools.wraps decorators
    except Exception:  # a __wrapped__ cycle, an object whose attribute lookup fails: skipped, never fatal
        return None
    code = getattr(function, "__code__", None)
    module = str(getattr(function, "__module__", None) or "")
    if not isinstance(code, types.CodeType) or module.split(".")[0] in _LIBRARY_PACKAGES or code.co_argcount < 1:
        return None
    return code, code.co_varnames[0]


def _lookup(model: Any, name: str, after: type | None = None) -> tuple[types.CodeType, str, type] | None:
    """``name``'s method on the module's class (or past ``after`` in the MRO, for ``super()``)."""
    mro = type(model).__mro__
    start = mro.index(after) + 1 if after is not None and after in mro else 0
    for klass in mro[start:]:
        if name in vars(klass):
            found = _code_of(vars(klass)[name])
            return None if found is None else (*found, klass)
    return None


def _findings(model: Any, hook: str, metrics: dict[str, str]) -> Iterator[_Finding]:
    """The Metric uses reachable from ``hook``, following helper and ``super()`` calls."""
    first = _lookup(model, hook)
    pending: list[tuple[tuple[types.CodeType, str, type], tuple[str, ...], int]] = []
    if first is not None:
        pending.append((first, (hook,), 0))
    seen: set[types.CodeType] = set()
    while pending:
        (code, self_name, owner), route, depth = pending.pop()
        if code in seen:
            continue
        seen.add(code)
        try:
            uses = _scan(code, self_name)
        except (TypeError, ValueError) as exc:  # bytecode dis cannot read: skip it, never fail the launch
            log.debug("cannot inspect %s: %s", code.co_name, exc)
            continue
        for chain in uses.chains:
            paths = [".".join(chain[:end]) for end in range(len(chain), 0, -1)]
            used = next((path for path in paths if path in metrics), None)
            if used is not None:
                yield _Finding(route, used)
            elif depth < FOLLOW_DEPTH and (helper := _lookup(model, chain[0])) is not None:
                pending.append((helper, (*route, chain[0]), depth + 1))
        if uses.dynamic:
            yield _Finding(route, None)
        for name in uses.super_calls:  # super() does not count as a level: it is the same hook
            parent = _lookup(model, name, after=owner)
            if parent is not None:
                pending.append((parent, route, depth))


def _describe(finding: _Finding, metrics: dict[str, str]) -> str:
    hook, helpers = finding.route[0], finding.route[1:]
    where = hook + (f" (through {' and '.join(f'self.{h}()' for h in helpers)})" if helpers else "")
    if finding.attribute is not None:
        return f"{where} uses self.{finding.attribute} ({metrics[finding.attribute]})"
    names = ", ".join(sorted(name for name in metrics if name.split(".")[0] == name or name.split(".")[0] not in metrics))
    return (f"{where} calls getattr(self, <a name computed at run time>) and the module has Metric attributes "
            f"({names}), so it may fetch one of them (if it fetches something else, write that attribute by its "
            "literal name so this check can see it)")


def audit_training_metrics(model: Any) -> None:
    """Refuse a module whose training hooks use a torchmetrics Metric attribute.

    Args:
        model: The user's LightningModule (either Lightning package), as built for the fleet.

    Raises:
        ConfigError: naming each hook and Metric attribute, why the fleet cannot log it, and what to do.
    """
    metrics = metric_attributes(model)
    if not metrics:
        return
    findings = list(dict.fromkeys(f for hook in TRAINING_HOOKS for f in _findings(model, hook, metrics)))
    if not findings:
        return
    uses = "; ".join(_describe(finding, metrics) for finding in findings)
    raise ConfigError(f"{type(model).__qualname__} uses a torchmetrics Metric in its training hooks: {uses}. Each board runs the "
                      "training hooks on its own slice of every global batch, so each board would log its own "
                      "slice's metric, and the fleet does not merge Metric states across boards yet. " + ADVICE)


__all__ = ["ADVICE", "FOLLOW_DEPTH", "TRAINING_HOOKS", "audit_training_metrics", "is_metric", "metric_attributes"]
