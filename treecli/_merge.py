"""``merge`` from flags: mergekit's methods (``treecli.merge_methods``) on trees, streamed
like ``average``. The method's parameters come from flags that take rules (``Scoped``:
a default and ``PATTERN=VALUE`` per leaf), the rest by mergekit's names; each leaf's
settings are resolved and the method's kernel builds the leaf (``merge_methods.run``).
A mergekit config runs through ``_configmerge``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

from treecli import _combine, _keypath, _mergeconfig, _tree, merge_methods
from treecli._combine import AverageReport
from treecli._errors import KeyPathError, UsageError, option
from treecli._keypath import format_keypath
from treecli.merge_methods import run


class Scoped:
    """A parameter given as rules: ``VALUE`` is the default, ``PATTERN=VALUE`` the value
    for the leaves under a pattern (``--density 0.5 --density 'model.layers.*.mlp.**=0.7'``)."""

    def __init__(self, flag: str, rules: list[str] | float | None, default: float | None,
                 check: Callable[[float], bool] = math.isfinite, requirement: str = "a finite number"):
        self.flag = flag
        self.default = default
        self.rules: list[tuple[str, str, Any, float]] = []  # (rule, pattern, parsed pattern, value)
        texts = [] if rules is None else [str(rules)] if isinstance(rules, (int, float, str)) else list(rules)
        defaults = []
        for text in texts:
            try:
                pattern, value_text = _keypath.split_assignment(text)
            except KeyPathError:
                pattern, value_text = None, text
            try:
                value = float(value_text)
            except ValueError:
                raise UsageError(f"{option(flag, text)}: {value_text.strip()!r} is not a number") from None
            if not math.isfinite(value) or not check(value):
                raise UsageError(f"{option(flag, text)}: {requirement}")
            if pattern is None:
                defaults.append(text)
                self.default = value
            else:
                self.rules.append((text, pattern.strip(), _keypath.parse(pattern.strip()), value))
        if len(defaults) > 1:
            raise UsageError(f"two defaults ({option(flag, defaults[0])}, {option(flag, defaults[1])}); give one")

    def check_matches(self, tree: Any) -> None:
        for text, pattern, parsed, _ in self.rules:
            if not any(_keypath.matches(parsed, kp) for kp, _ in _tree.iter_nodes(tree)):
                raise _tree.no_match(tree, pattern, f"{option(self.flag, text)} matches nothing")

    def value(self, keypath: tuple) -> float | None:
        hits = [(text, value) for text, _, parsed, value in self.rules if _keypath.covers(parsed, keypath)]
        if len(hits) > 1:
            raise KeyPathError(f"matched by two rules: {option(self.flag, hits[0][0])} and "
                               f"{option(self.flag, hits[1][0])}", keypath=format_keypath(keypath))
        return hits[0][1] if hits else self.default


def merge(
    trees: list[Any],
    method: str,
    *,
    base: Any = None,
    weights: list[float] | None = None,
    density: list[str] | float | None = None,
    lambda_: list[str] | float | None = None,
    t: list[str] | float | None = None,
    gamma: list[str] | float | None = None,
    epsilon: list[str] | float | None = None,
    seed: int = 0,
    rescale: str | None = None,
    normalize: bool | None = None,
    parameters: dict[str, Any] | None = None,
    names: list[str] | None = None,
    base_name: str = "base",
    non_float: str = "last",
    dtype: str | None = None,
) -> tuple[Any, AverageReport]:
    """Merge trees with mergekit's methods, streaming: see ``treecli.merge_methods`` for
    each method's parameters (a mergekit config: ``_configmerge.merge_config``).

    Args:
        trees: the models (lazy leaves, NumPy or JAX arrays).
        method: one of ``merge_methods.METHODS`` (the registry: ``linear``, ``ties``, ``slerp``, ...).
        base: the base model; required by the task methods. For ``slerp`` the base
            and one model, or two models without a base (the first is ``t = 0``).
        weights: one per model (default 1 each).
        density, lambda_, t, gamma, epsilon: a number, or rules (``"0.5"``, ``"model.layers.*=0.7"``).
        seed: the random seed of DARE and DELLA.
        rescale: how what a sparsifying method keeps is rescaled: ``"l1"`` (mergekit's:
            to the task vector's L1 norm over the leaf), ``"density"`` (by ``1/density``;
            DARE only) or ``"none"``; default the method's own (``l1`` for DARE and DELLA).
        normalize: divide by the summed weights (default: the method's own).
        parameters: the method's other parameters by mergekit's names (``{"filter_wise": True}``).
        non_float: as ``average``'s.
        dtype: the output dtype of float leaves (default: the inputs' own; where they
            differ, the dtype they promote to, as in mergekit: bf16 with f32 gives f32).

    Returns:
        The merged tree (computed leaves) and a report that fills in while it is read.
    """
    spec = merge_methods.method_named(method)
    names = names or [f"model {i}" for i in range(len(trees))]
    weights = [1.0] * len(trees) if weights is None else [float(w) for w in weights]
    if len(weights) != len(trees):
        raise UsageError(f"{len(weights)} weights for {len(trees)} models")
    if not all(math.isfinite(w) for w in weights):
        raise UsageError(f"weights {weights} are not all finite numbers")
    if non_float not in ("error", "first", "last"):
        raise UsageError(f"non_float must be 'last', 'first' or 'error', not {non_float!r}")
    out_dtype = _output_dtype(dtype)
    if spec.base == "refused" and base is not None:
        raise UsageError(f"{method} takes no base; it merges the models ({option('base', 'BASE')} is for the task "
                         "methods and slerp)")
    if spec.base == "first" and base is None and trees:  # the first model is the base
        base, trees, base_name, names, weights = trees[0], trees[1:], names[0], names[1:], weights[1:]
    if spec.base == "added" and base is not None:
        trees, names, weights = [base, *trees], [base_name, *names], [1.0, *weights]
        base = None
    run.check_inputs(spec, base is not None, len(trees))
    given = {"density": density, "lambda": lambda_, "t": t, "gamma": gamma, "epsilon": epsilon}
    rules = {}
    for name, value in given.items():
        if value is None:
            continue
        if spec.param(name) is None:
            takes = [p.name for p in spec.params if p.name in run.RULE_FLAGS]
            raise UsageError(f"{option(run.RULE_FLAGS[name], value)}: {name} is not a parameter of {method}"
                             + (f" (it takes {', '.join(takes)})" if takes else ""))
        rules[name] = Scoped(run.RULE_FLAGS[name], value, None, *(spec.param(name).check or ()))
    extra = {}
    for name, value in (parameters or {}).items():
        p = spec.param(name)
        if p is None or name in run.RULE_FLAGS or name in ("weight", "rescale", "normalize"):
            raise UsageError(f"{method} has no parameter {name!r} to set this way"
                             + (f"; it takes {', '.join(p.name for p in spec.params)}" if spec.params else ""))
        try:
            extra[name] = None if value is None else _mergeconfig.convert(value, p.kind)
        except UsageError as e:
            raise UsageError(f"parameter {name}: {e.message}") from None
    if rescale is not None:
        if not spec.rescales:
            raise UsageError(f"{option('rescale', rescale)} is for the methods that sparsify task vectors; "
                             f"{method} keeps what it keeps as it is")
        if rescale not in spec.rescales:
            takers = [m.name for m in merge_methods.REGISTRY.values() if rescale in m.rescales]
            raise UsageError(f"{option('rescale', rescale)} is for {', '.join(takers)}; {method} takes "
                             f"{' or '.join(spec.rescales)}" if takers else
                             f"{option('rescale', rescale)}: choose one of {', '.join(spec.rescales)}")
        extra["rescale"] = rescale
    if normalize is not None:
        if spec.param("normalize") is None:
            raise UsageError(f"{option('normalize', normalize)}: {method} has nothing to normalize")
        extra["normalize"] = normalize

    def settings(keypath: tuple) -> merge_methods.LeafSettings:
        shared: dict[str, Any] = {}
        models: list[dict[str, Any]] = [{} for _ in trees]
        for p in spec.params:
            if p.name in rules:
                value = rules[p.name].value(keypath)
            elif p.name == "weight":
                value = None
            else:
                value = extra.get(p.name, p.default)
            if p.per_model:
                for i, m in enumerate(models):
                    m[p.name] = weights[i] if p.name == "weight" else p.default if value is None else value
            else:
                shared[p.name] = p.default if value is None else value
        return merge_methods.LeafSettings(shared, models)

    merged, report = run.merge_with(spec, base, list(trees), settings, names=names, base_name=base_name, seed=seed,
                                    non_float=non_float,
                                    checks=[functools.partial(s.check_matches, (base or trees[0]))
                                            for s in rules.values()])
    return _combine.cast_floats(merged, out_dtype, report), report


def _output_dtype(dtype: str | None) -> str | None:
    """The dtype a merge's ``dtype`` names, which must be a float one."""
    from treecli import _dtypes

    out_dtype = _dtypes.parse(dtype) if dtype else None
    if out_dtype is not None and not _dtypes.is_float(out_dtype):
        raise UsageError(f"{option('dtype', dtype)}: merges compute floating-point values; name a float dtype")
    return out_dtype
