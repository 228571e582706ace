"""``merge``: mergekit's 20 methods, from flags or a mergekit config, streamed like ``average``.

``SPECS`` says what each method takes (a base, how many models, its parameters by
mergekit's names and defaults); ``merge`` resolves flags and ``merge_config`` a
config (``_mergeconfig``) into each leaf's ``LeafSettings``, and ``leaf_merge`` builds
the leaf. The task-vector methods live here, the others in ``_methods``:

- task vectors ``dᵢ = mᵢ − base``; TIES keeps each one's ``density`` fraction of
  largest magnitudes (``k = max(1, int(density · n))``), breadcrumbs those less the
  largest ``gamma`` fraction, DARE each element with probability ``density``, DELLA
  with a probability rising with its magnitude's rank in its row; what is kept is
  rescaled (``rescale``) to each task vector's L1 norm over the leaf
  (``‖d‖₁ / ‖d ⊙ keep‖₁``, found by a first pass; DARE and DELLA by default), or by
  ``1/density`` (DARE only), or not at all;
- the ``_ties`` methods and DELLA elect a sign per element from the weighted sum
  ``Σ wᵢdᵢ`` (``≥ 0`` is positive) and keep only the weighted deltas that agree with it;
- the mixed delta is ``Σ wᵢdᵢ`` (over the agreeing ones), divided by ``Σ wᵢ`` (over
  the same) when normalizing (by default for TIES and DELLA); then scaled by ``lambda``;
- SLERP interpolates two models by the angle between their flattened leaves, and
  falls back to linear interpolation when ``|cos| > 0.9995``.

Everything is computed in float64 a block at a time and rounded to the base's
dtype at the end; mergekit computes in the models' dtype. Leaves of other dtypes
(integer, bool, non-array) follow ``average``'s rules.

Streaming needs, per leaf, what mergekit reads off a whole tensor: SLERP one
pass for the dot product and the norms; TIES and breadcrumbs the exact ``k``-th largest
magnitude of each task vector, found by the streaming exact selection of ``_selection``.
DARE's and DELLA's coin flips come from a counter-based generator (SplitMix64's mixer)
keyed by the seed, the leaf's key path and the model, at each element's offset: the
same bytes whatever the chunk size or thread count.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import math
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from treecli import _combine, _gc, _keypath, _leaf, _mergeconfig, _methods, _tree
from treecli._bytes import stream
from treecli._combine import SUB_CHUNK, AverageReport
from treecli._errors import KeyPathError, UsageError, option
from treecli._keypath import format_keypath
from treecli._selection import Space, Trims, key_base, magnitude_keys

SLERP_PARALLEL = 0.9995  # mergekit's DOT_THRESHOLD: closer to parallel than this, interpolate linearly
SLERP_EPS = 1e-8


@dataclass(frozen=True)
class Method:
    """A task-vector method: how it sparsifies each task vector, and its defaults."""

    sparsify: str | None  # "magnitude" (TIES), "random" (DARE), "outliers" (breadcrumbs), "della" or None
    consensus: bool  # elect a sign per element
    normalize: bool  # divide by the sum of the (agreeing) weights
    rescale: bool  # rescale what is kept to the task vector's L1 norm (``merge``'s ``rescale`` says how)


TASK_METHODS = {
    "task_arithmetic": Method(None, False, False, False),
    "ties": Method("magnitude", True, True, False),
    "dare_ties": Method("random", True, False, True),
    "dare_linear": Method("random", False, False, True),
    "breadcrumbs": Method("outliers", False, False, False),
    "breadcrumbs_ties": Method("outliers", True, False, False),
    "della": Method("della", True, True, True),
    "della_linear": Method("della", False, False, True),
}
RESCALES = ("l1", "density", "none")  # the rescale of what is kept: mergekit's L1 norm, 1/density, none
REQUIRED = object()  # a parameter without a default


@dataclass(frozen=True)
class Param:
    """One of a method's parameters, as mergekit names it: one value for the leaf, or one
    per model besides the base (``per_model``)."""

    name: str
    default: Any
    per_model: bool = False
    kind: type = float


@dataclass(frozen=True)
class MethodSpec:
    """What a method takes: a base (``required``, ``optional``, or ``none``: a base given
    is one more model, as mergekit's methods that ignore it), how many models besides the
    base, and its parameters."""

    base: str
    models: tuple[int, int | None]
    params: tuple[Param, ...] = ()

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


def _task_params(spec: Method) -> tuple[Param, ...]:
    params = [Param("weight", 1.0, True), Param("lambda", 1.0), Param("normalize", spec.normalize, kind=bool),
              Param("int8_mask", False, kind=bool)]
    if spec.sparsify:
        params += [Param("density", 1.0, True), Param("rescale", spec.rescale, kind=bool)]
    if spec.sparsify == "outliers":
        params.append(Param("gamma", 0.01, True))
    if spec.sparsify == "della":
        params.append(Param("epsilon", 0.15, True))
    return tuple(params)


SPECS: dict[str, MethodSpec] = {
    "linear": MethodSpec("none", (1, None), (Param("weight", 1.0, True), Param("normalize", True, kind=bool))),
    **{name: MethodSpec("required", (1, None), _task_params(spec)) for name, spec in TASK_METHODS.items()},
    "slerp": MethodSpec("required", (1, 1), (Param("t", REQUIRED),)),
    "nuslerp": MethodSpec("optional", (2, 2), (Param("weight", 1.0, True), Param("nuslerp_row_wise", False, kind=bool),
                                               Param("nuslerp_flatten", True, kind=bool))),
    "multislerp": MethodSpec("optional", (1, None), (Param("weight", 1.0, True),
                                                     Param("normalize_weights", True, kind=bool), Param("eps", 1e-8))),
    "karcher": MethodSpec("none", (1, None), (Param("max_iter", 10, kind=int), Param("tol", 1e-5))),
    "model_stock": MethodSpec("required", (2, None), (Param("filter_wise", False, kind=bool),)),
    "nearswap": MethodSpec("required", (1, 1), (Param("t", REQUIRED),)),
    "ram": MethodSpec("required", (1, None), (Param("epsilon", 1e-5),)),
    "ramplus_tl": MethodSpec("required", (1, None), (Param("r", 0.1), Param("alpha", 0.2), Param("epsilon", 1e-5))),
    "sce": MethodSpec("required", (1, None), (Param("select_topk", 1.0), Param("int8_mask", False, kind=bool))),
    "arcee_fusion": MethodSpec("required", (1, 1)),
    "passthrough": MethodSpec("none", (1, 1), (Param("scale", None, True),)),
}
METHODS = tuple(SPECS)
# Every parameter name some method takes (a config naming another is a typo).
PARAMETERS = sorted({p.name for spec in SPECS.values() for p in spec.params})


@dataclass
class LeafSettings:
    """One output leaf's parameters: the method's shared ones, and one dict per model
    besides the base (in the order of the models)."""

    shared: dict[str, Any]
    models: list[dict[str, Any]]


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


# The flags of ``merge`` that take rules, by the parameter they set (``lambda_``: a Python keyword).
_RULE_FLAGS = {"density": "density", "lambda": "lambda_", "t": "t", "gamma": "gamma", "epsilon": "epsilon"}


_FLAG_CHECKS = {"density": (lambda v: 0 < v <= 1, "a density must lie in (0, 1]"),
                "gamma": (lambda v: 0 <= v <= 1, "gamma must lie in [0, 1]")}


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
    """Merge trees with mergekit's methods, streaming: see the module's docstring and
    ``SPECS`` for each method's parameters (a mergekit config: ``treecli.merge_config``).

    Args:
        trees: the models (lazy leaves, NumPy or JAX arrays).
        method: one of ``METHODS``: ``linear``, ``task_arithmetic``, ``ties``, ``dare_linear``,
            ``dare_ties``, ``breadcrumbs``, ``breadcrumbs_ties``, ``della``, ``della_linear``,
            ``slerp``, ``nuslerp``, ``multislerp``, ``karcher``, ``model_stock``, ``nearswap``,
            ``ram``, ``ramplus_tl``, ``sce``, ``arcee_fusion`` or ``passthrough``.
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
    if method not in SPECS:
        raise UsageError(f"unknown merge method {method!r}; choose one of {', '.join(METHODS)}")
    spec = SPECS[method]
    names = names or [f"model {i}" for i in range(len(trees))]
    weights = [1.0] * len(trees) if weights is None else [float(w) for w in weights]
    if len(weights) != len(trees):
        raise UsageError(f"{len(weights)} weights for {len(trees)} models")
    out_dtype = _output_dtype(dtype)
    if method == "linear":
        if base is not None:
            raise UsageError(f"the linear method takes no base; average the models ({option('base', 'BASE')} "
                             "is for the task methods and slerp)")
        return _combine.linear(list(trees), weights, names=names, normalize=True if normalize is None else normalize,
                               non_float=non_float, dtype=out_dtype)
    if method == "slerp" and base is None and trees:  # two models: the first is t = 0
        base, trees, base_name, names, weights = trees[0], trees[1:], names[0], names[1:], weights[1:]
    if spec.base == "none" and base is not None:
        trees, names, weights = [base, *trees], [base_name, *names], [1.0, *weights]
        base = None
    check_inputs(method, base is not None, len(trees))
    given = {"density": density, "lambda": lambda_, "t": t, "gamma": gamma, "epsilon": epsilon}
    rules = {}
    for name, value in given.items():
        if value is None:
            continue
        if spec.param(name) is None:
            takes = [p.name for p in spec.params if p.name in _RULE_FLAGS]
            raise UsageError(f"{option(_RULE_FLAGS[name], value)}: {name} is not a parameter of {method}"
                             + (f" (it takes {', '.join(takes)})" if takes else ""))
        rules[name] = Scoped(_RULE_FLAGS[name], value, None, *_FLAG_CHECKS.get(name, ()))
    extra = {}
    for name, value in (parameters or {}).items():
        p = spec.param(name)
        if p is None or name in _RULE_FLAGS or name in ("weight", "rescale", "normalize"):
            raise UsageError(f"{method} has no parameter {name!r} to set this way"
                             + (f"; it takes {', '.join(p.name for p in spec.params)}" if spec.params else ""))
        try:
            extra[name] = None if value is None else _mergeconfig.convert(value, p.kind)
        except UsageError as e:
            raise UsageError(f"parameter {name}: {e.message}") from None
    if rescale is not None:
        if spec.param("rescale") is None:
            raise UsageError(f"{option('rescale', rescale)} is for the methods that sparsify task vectors; "
                             f"{method} keeps what it keeps as it is")
        if rescale not in RESCALES:
            raise UsageError(f"{option('rescale', rescale)}: choose one of {', '.join(RESCALES)}")
        if rescale == "density" and TASK_METHODS[method].sparsify != "random":
            raise UsageError(f"{option('rescale', rescale)} is DARE's; {method} rescales by the L1 norm or not at all")
        extra["rescale"] = rescale
    if normalize is not None:
        if spec.param("normalize") is None:
            raise UsageError(f"{option('normalize', normalize)}: {method} has nothing to normalize")
        extra["normalize"] = normalize

    def settings(keypath: tuple) -> LeafSettings:
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
        return LeafSettings(shared, models)

    merged, report = merge_with(method, base, list(trees), settings, names=names, base_name=base_name, seed=seed,
                                non_float=non_float, checks=[functools.partial(s.check_matches, (base or trees[0]))
                                                             for s in rules.values()])
    return _as_dtype(merged, out_dtype, report), report


def _output_dtype(dtype: str | None) -> str | None:
    """The dtype a merge's ``dtype`` names, which must be a float one."""
    from treecli import _dtypes

    out_dtype = _dtypes.parse(dtype) if dtype else None
    if out_dtype is not None and not _dtypes.is_float(out_dtype):
        raise UsageError(f"{option('dtype', dtype)}: merges compute floating-point values; name a float dtype")
    return out_dtype


def check_inputs(method: str, has_base: bool, models: int, where: str = "") -> None:
    """A line naming what ``method`` needs when the inputs do not fit it."""
    spec = SPECS[method]
    if spec.base == "required" and not has_base:
        raise UsageError(f"{method} needs a base model{where} (the task vectors are each model less the base): "
                         f"give {option('base', 'BASE')}")
    low, high = spec.models
    if method == "slerp" and models + has_base != 2:
        raise UsageError(f"slerp interpolates two models, the base (t = 0) and one other{where}; "
                         f"{models + has_base} were given")
    if models < low or (high is not None and models > high):
        wanted = (f"exactly {low}" if low == high else f"at least {low}" if high is None else f"{low} to {high}")
        raise UsageError(f"{method} merges {wanted} model{'s' if (high or low) != 1 else ''}"
                         f"{' besides the base' if spec.base != 'none' else ''}{where}; {models} were given")


def merge_with(method: str, base: Any, trees: list[Any], settings: Callable[[tuple], LeafSettings], *,
               names: list[str], base_name: str = "base", seed: int = 0, non_float: str = "last",
               checks: Sequence[Callable[[], None]] = ()) -> tuple[Any, AverageReport]:
    """Merge ``trees`` (and ``base``) leaf by leaf with each leaf's ``settings``: structures
    compared and ``checks`` run before any data is read."""
    inputs, input_names = ([base] if base is not None else []) + trees, ([base_name] if base is not None else []) + names

    def merged(kp: tuple, text: str, leaves: list[_leaf.ArrayLeaf], report: AverageReport) -> Any:
        return leaf_merge(method, leaves, base is not None, settings(kp), seed, text, input_names, report)

    return _combine.combine_inputs(inputs, input_names, non_float, merged, "merged", checks=checks)


def leaf_merge(method: str, leaves: list[_leaf.ArrayLeaf], has_base: bool, settings: LeafSettings, seed: int,
               keypath: str, names: list[str], report: AverageReport) -> _leaf.ArrayLeaf:
    """One float leaf merged by ``method`` (``leaves``: the base first when ``has_base``)."""
    shared, per_model = settings.shared, settings.models
    for p in SPECS[method].params:
        values = [m[p.name] for m in per_model] if p.per_model else [shared[p.name]]
        if any(v is REQUIRED for v in values):
            raise UsageError(f"{method} needs {option(_RULE_FLAGS.get(p.name, p.name), p.name.upper())} for this leaf",
                             keypath=keypath)
        if p.kind is float and any(v is not None and not (isinstance(v, (int, float)) and math.isfinite(v))
                                   for v in values):
            raise UsageError(f"{p.name} must be a finite number, not {values}", keypath=keypath)
    if leaves[0].size == 0:
        return leaves[0]
    weights = [m.get("weight", 1.0) for m in per_model]
    if method == "linear":
        total = math.fsum(weights)
        if shared["normalize"]:
            if total == 0:
                raise UsageError("the weights sum to 0 and cannot be normalized", keypath=keypath)
            weights = [w / total for w in weights]
        convex = all(w >= 0 for w in weights) and math.isclose(sum(weights), 1.0)
        return _combine.averaged_leaf(leaves, weights, leaves[0].dtype_name, keypath, names, report, convex)
    if method in TASK_METHODS:
        return _task_leaf(leaves[0], leaves[1:], weights, TASK_METHODS[method], per_model, shared, seed,
                          keypath, report)
    if method == "slerp":
        return _slerp_leaf(leaves[0], leaves[1], shared["t"], keypath, names, report)
    if method == "nuslerp":
        return _methods.nuslerp(leaves, has_base, weights, shared["nuslerp_row_wise"], shared["nuslerp_flatten"],
                                keypath, names, report)
    if method == "multislerp":
        return _methods.multislerp(leaves, has_base, weights, shared["normalize_weights"], shared["eps"], keypath,
                                   names, report)
    if method == "karcher":
        return _methods.karcher(leaves, int(shared["max_iter"]), shared["tol"], keypath, names, report)
    if method == "model_stock":
        return _methods.model_stock(leaves, shared["filter_wise"], keypath, names, report)
    if method == "nearswap":
        return _methods.nearswap(leaves, shared["t"], keypath, report)
    if method in ("ram", "ramplus_tl"):
        return _methods.ram(leaves, shared["epsilon"], keypath, report, plus=method == "ramplus_tl",
                            r=shared.get("r", 0.1), alpha=shared.get("alpha", 0.2))
    if method == "sce":
        return _methods.sce(leaves, shared["select_topk"], keypath, report)
    if method == "arcee_fusion":
        return _methods.arcee_fusion(leaves, keypath, report)
    assert method == "passthrough", method
    scale = per_model[0]["scale"]
    return leaves[0] if scale is None else _combine.averaged_leaf(leaves, [float(scale)], leaves[0].dtype_name,
                                                                  keypath, names, report, convex=False)


# --- task vectors: task arithmetic, TIES, DARE, breadcrumbs, DELLA ---------------------------------------------------


def _task_leaf(base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], weights: list[float], spec: Method,
               per_model: list[dict[str, Any]], shared: dict[str, Any], seed: int, keypath: str,
               report: AverageReport) -> _leaf.ComputedLeaf:
    import numpy as np

    densities = [float(m.get("density", 1.0)) for m in per_model]
    for density in densities:
        if not 0 <= density <= 1:
            raise UsageError(f"density {density:g}: a density must lie in [0, 1]", keypath=keypath)
    scale, normalize = shared["lambda"], shared["normalize"]
    rescale = shared.get("rescale", False)
    rescale = {True: "l1", False: "none"}.get(rescale, rescale)  # (a config's booleans, or a named choice)
    # mergekit leaves a task vector whole at a density of 1 (no rescale either)
    sparse = [spec.sparsify is not None and d < 1 for d in densities]
    keeps = _keeps(spec, base, models, per_model, densities, seed, keypath) if any(sparse) else None
    l1 = _L1Rescale(base, models, keeps, sparse) if keeps is not None and rescale == "l1" else None
    by_density = rescale == "density"
    trims = keeps.trims if isinstance(keeps, _TopKeeps) and keeps.outliers is None else None
    in_dtype = base.dtype
    weight_sum = math.fsum(weights) if abs(math.fsum(weights)) >= 1e-8 else 1.0  # mergekit's guard
    # With equal weights the divisor is the weight times a count of agreeing models, kept in bytes.
    counted = len(set(weights)) == 1 and len(weights) < 256
    divisor = None if not (spec.consensus and normalize) else "counts" if counted else "weights"

    def block(start: int, stop: int, out, space: Space) -> None:
        # Every full-length step costs about as much as reading the block: the fewest steps,
        # all into this thread's buffers (fresh memory per step cost more than all the arithmetic).
        # Memory bandwidth, not arithmetic, is the limit here: simple steps ran no faster on two
        # threads or two processes than on one, and the kernel gained 1.4x from its second thread.
        b, b64, d, total = space.base, space.base64, space.delta, space.total
        # Where every kept delta is nonzero (a TIES threshold above 0 in every model, and a weight
        # that cannot round one to 0), the negative ones are counted as the kept less the positive ones.
        negatives_from_kept = (divisor == "counts" and trims is not None and all(sparse)
                               and trims.keeps_only_nonzero() and abs(weights[0]) >= 2.0**-900)
        base.read_into(start, stop, b)
        np.copyto(b64, b)
        base_key = key_base(b, space) if keeps is not None and keeps.needs_keys else None
        for i, (model, w) in enumerate(zip(models, weights)):
            m = space.model
            model.read_into(start, stop, m)
            np.copyto(d, m)  # (widening first, then subtracting, beat one mixed-type subtract: 61 vs 76 µs)
            d -= b64  # exact: the difference of two floats of up to 32 bits
            if sparse[i]:
                d *= keeps.mask(i, start, stop, space, base_key)
                if l1 is not None:
                    d *= l1.factors()[i]
                elif by_density:
                    d /= densities[i]
            if w != 1:
                d *= w
            if i == 0:
                np.copyto(total, d)
            else:
                total += d
            if spec.consensus:
                _tally(d, w, i == 0, divisor, space, kept=space.keep if negatives_from_kept else None)
        if spec.consensus:
            mixed = _elected(space, weights[0] if counted else None, normalize, negatives_from_kept)
        else:
            mixed = total
            if normalize:
                mixed /= weight_sum
        if scale != 1:
            mixed *= scale
        mixed += b64
        finite = np.isfinite(mixed, out=space.flag)
        if not finite.all():
            with report._lock:
                report.nonfinite_outputs[keypath] = (report.nonfinite_outputs.get(keypath, 0)
                                                     + finite.size - int(np.count_nonzero(finite)))
        out[...] = mixed  # round to nearest even into the leaf's dtype

    def fill(start: int, stop: int, out) -> None:
        with _combine.scratch_buffers(Space.BUFFERS) as buffers:
            for s in range(start, stop, SUB_CHUNK):
                e = min(stop, s + SUB_CHUNK)
                block(s, e, out[s - start : e - start], Space(buffers, e - s, in_dtype))

    def fill_chunk(start: int, stop: int, out) -> None:
        # The statistics of the whole leaf, here: from a block, their passes would run on one
        # thread (the other waiting for them).
        if isinstance(keeps, _TopKeeps):
            keeps.select()
        if l1 is not None:
            l1.factors()
        stream.on_two_threads(fill, start, stop, out, SUB_CHUNK)

    return _leaf.ComputedLeaf(base.shape, in_dtype, fill=fill_chunk, inputs=[base, *models])


def _tally(d, w: float, first: bool, divisor: str | None, space: Space, kept=None) -> None:
    """Adds one weighted delta to the consensus sums: ``Σ|wᵢdᵢ|`` and, for the ``divisor``
    (``None`` when not normalizing), which models are positive and which negative: "counts",
    or "weights" (summed, when they differ). With ``kept`` (the model's keep mask, when every
    kept delta is nonzero), the kept are counted in place of the negative ones."""
    import numpy as np

    if first:
        np.abs(d, out=space.magnitude)
    else:
        np.abs(d, out=space.work)
        space.magnitude += space.work
    if divisor is None:
        return
    for sign, counts, weight_sums in ((np.greater, space.positive, space.positive_weight),
                                      (np.less, space.negative, space.negative_weight)):
        flag = kept if sign is np.less and kept is not None else sign(d, 0, out=space.flag)
        if divisor == "counts":
            if first:
                np.copyto(counts, flag.view(np.uint8))
            else:
                counts += flag.view(np.uint8)
        else:
            np.multiply(flag, w, out=space.work)
            if first:
                np.copyto(weight_sums, space.work)
            else:
                weight_sums += space.work


def _elected(space: Space, weight: float | None, normalize: bool, negatives_from_kept: bool = False):
    """The sum of the weighted deltas that agree with the elected sign (``+`` where
    ``Σ wᵢdᵢ ≥ 0``), divided by their weights when normalizing: in ``space.total``.

    With ``P`` the sum of the positive deltas and ``N`` of the negative ones, the total is
    ``P + N`` and ``Σ|wᵢdᵢ| = P − N``, so the elected side is ``(total ± Σ|wᵢdᵢ|) / 2``:
    two steps instead of a pass per model, and without cancellation (the two terms share a sign).
    """
    import numpy as np

    total, magnitude, negative = space.total, space.magnitude, space.flag
    np.less(total, 0, out=negative)
    total += 0.0  # -0.0 elects + (``>= 0``), so the sign bit taken next must be +0.0's
    # ``copysign(magnitude, total)`` as bits (the magnitude's sign bit is clear): 55 µs a block against 73
    sign = np.bitwise_and(total.view(np.uint64), np.uint64(1 << 63), out=space.work.view(np.uint64))
    magnitude.view(np.uint64)[...] |= sign
    total += magnitude
    total *= 0.5
    if not normalize:
        return total
    if weight is not None:
        if negatives_from_kept:  # (``_tally`` counted the kept ones)
            space.negative -= space.positive
        # counts: the negative ones where the elected sign is -, else the positive ones (byte masks)
        np.negative(negative.view(np.uint8), out=space.mask)
        np.bitwise_xor(space.negative, space.positive, out=space.negative)
        space.negative &= space.mask
        space.positive ^= space.negative
        # no agreeing model: divide by 1, as mergekit (``maximum(counts, 1)`` takes 55 µs a block, these 7)
        space.positive |= np.equal(space.positive, 0, out=space.flag).view(np.uint8)
        total /= space.positive
        if weight != 1:
            total /= weight
        return total
    divisor, other = space.positive_weight, space.negative_weight
    other -= divisor
    other *= negative
    divisor += other
    np.equal(divisor, 0, out=negative)
    if negative.any():
        divisor[negative] = 1
    total /= divisor
    return total


# --- what each sparsifying method keeps of a task vector -------------------------------------------


def _keeps(spec: Method, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], per_model: list[dict[str, Any]],
           densities: list[float], seed: int, keypath: str):
    size = base.size
    if spec.sparsify == "magnitude":  # TIES: the k largest magnitudes, at least one (as mergekit)
        return _TopKeeps(Trims(base, models, [size if d >= 1 else max(1, int(d * size)) if d > 0 else 0
                                              for d in densities]))
    if spec.sparsify == "outliers":
        # Breadcrumbs: of the magnitudes in ascending order, mergekit keeps [n_bot, n_bot + target)
        # with n_bot = size - target - n_top (n_top = int(gamma · size), fewer where the target needs
        # them): the largest size - n_bot less the largest size - n_bot - target.
        uppers, outliers = [], []
        for d, m in zip(densities, per_model):
            gamma = float(m.get("gamma", 0.01))
            if not 0 <= gamma <= 1:
                raise UsageError(f"gamma {gamma:g}: the fraction of outliers must lie in [0, 1]", keypath=keypath)
            target = int(d * size) if d < 1 else size
            bottom = max(0, size - target - int(gamma * size))
            uppers.append(size - bottom)
            outliers.append(size - bottom - target if d < 1 else 0)
        return _TopKeeps(Trims(base, models, uppers), Trims(base, models, outliers))
    if spec.sparsify == "della":
        epsilons = [float(m.get("epsilon", 0.15)) for m in per_model]
        for d, e in zip(densities, epsilons):
            if d < 1 and (d + e >= 1 or d - e <= 0):
                raise UsageError(f"epsilon {e:g} with density {d:g}: density ± epsilon must lie in (0, 1)",
                                 keypath=keypath)
        return _DellaKeeps(base, models, densities, epsilons, seed, keypath)
    return _DareKeeps(densities, seed, keypath)


class _KeptMasks:
    """The masks an L1 rescale's pass made, packed (a bit an element), for the output's
    pass over the same blocks: it takes each once instead of making it again (DARE's
    coins, DELLA's ranking). At most CACHE_BYTES are kept, across every leaf of the
    process: when more come, the oldest go (those of a leaf whose output was written by
    another process, or in other blocks), and are made again if asked for. A leaf's go
    with it, when it is no longer used."""

    CACHE_BYTES = 64 << 20
    _packed: collections.OrderedDict = collections.OrderedDict()  # (owner, model, start, stop) -> bits
    _bytes = 0
    _lock = threading.Lock()
    _owners = itertools.count()
    _orphans = _gc.Orphans(_lock, lambda owner: _KeptMasks._forget(owner))  # leaves no longer used

    def __init__(self):
        self._owner = next(self._owners)
        weakref.finalize(self, _KeptMasks._orphans.collected, self._owner)

    @classmethod
    def _forget(cls, owner: int) -> None:
        """Drop an owner's masks (the lock held)."""
        for key in [key for key in cls._packed if key[0] == owner]:
            cls._bytes -= cls._packed.pop(key).nbytes

    def take(self, key: tuple[int, int, int], out) -> bool:
        """Into ``out``, the mask kept for ``key``, forgetting it; False when none is."""
        import numpy as np

        with _KeptMasks._lock:
            packed = self._packed.pop((self._owner, *key), None)
            if packed is None:
                return False
            _KeptMasks._bytes -= packed.nbytes
        out[...] = np.unpackbits(packed, count=out.size).view(bool)
        return True

    def keep(self, key: tuple[int, int, int], mask) -> None:
        import numpy as np

        packed = np.packbits(mask)
        with _KeptMasks._lock:
            self._orphans.drain()
            while self._packed and _KeptMasks._bytes + packed.nbytes > self.CACHE_BYTES:
                _KeptMasks._bytes -= self._packed.popitem(last=False)[1].nbytes
            if packed.nbytes <= self.CACHE_BYTES:
                self._packed[(self._owner, *key)] = packed
                _KeptMasks._bytes += packed.nbytes


class _TopKeeps:
    """TIES' keeps (the ``k`` largest magnitudes of each task vector) or, with ``outliers``,
    breadcrumbs' (those less the largest few), by the streaming exact selection."""

    needs_keys = True
    remembers = False  # its mask is a comparison with the keys this block computes anyway

    def __init__(self, trims: Trims, outliers: Trims | None = None):
        self.trims, self.outliers = trims, outliers

    def select(self) -> None:
        self.trims.select()
        if self.outliers is not None:
            self.outliers.select()

    def mask(self, i: int, start: int, stop: int, space: Space, base_key):
        keys = magnitude_keys(space.model, base_key, space)
        keep = self.trims.keep(i, start, stop, keys, space.keep)
        if self.outliers is not None:
            keep &= ~self.outliers.keep(i, start, stop, keys, space.flag)
        return keep


class _DareKeeps:
    """DARE's keeps: each element with probability ``density``, by ``dare_keep``'s coins."""

    needs_keys = False
    remembers = True

    def __init__(self, densities: list[float], seed: int, keypath: str):
        self._densities, self._seed, self._keypath = densities, seed, keypath
        self._kept = _KeptMasks()

    def mask(self, i: int, start: int, stop: int, space: Space, base_key, remember: bool = False):
        if not self._kept.take((i, start, stop), space.keep):
            dare_keep(self._seed, self._keypath, i, start, stop, self._densities[i], out=space.keep,
                      work=space.coins)
            if remember:
                self._kept.keep((i, start, stop), space.keep)
        return space.keep


class _DellaKeeps:
    """DELLA's keeps (mergekit's ``della_magprune``): along each row (the second axis; a
    1-D leaf is one row) an element is kept with probability ``density − epsilon`` for the
    smallest magnitude rising evenly to ``density + epsilon`` for the largest, by
    counter-based coins (``coin_bits``) drawn in rank order: the row's ``j``-th smallest
    magnitude takes the coin of the row's ``j``-th place, so no chunking or thread count
    changes a keep. Magnitudes are ranked at bfloat16 precision (see ``_compute``): where
    two are equal at it, the earlier ranks lower. A block is widened to whole rows to rank
    them."""

    needs_keys = False
    remembers = True

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], densities: list[float],
                 epsilons: list[float], seed: int, keypath: str):
        import numpy as np

        self._base, self._models = base, models
        self._seed, self._keypath = seed, keypath
        shape = base.shape
        self._unit = math.prod(shape[1:]) if len(shape) >= 2 else max(1, base.size)  # one index of axis 0
        self._row = shape[1] if len(shape) >= 2 else max(1, base.size)  # the ranked axis' length
        # Per model and rank, the keep probability times 2³² (float32 arithmetic, as mergekit's).
        spread = (np.arange(self._row, dtype=np.float32) / np.float32(self._row - 1) if self._row > 1
                  else np.zeros(1, np.float32))
        self._thresholds = [((d - e) + spread * np.float32(2 * e)).astype(np.float64) * 2.0**32
                            for d, e in zip(densities, epsilons)]
        self._kept = _KeptMasks()

    def mask(self, i: int, start: int, stop: int, space: Space, base_key, remember: bool = False):
        if not self._kept.take((i, start, stop), space.keep):
            space.keep[...] = self._compute(i, start, stop)
            if remember:
                self._kept.keep((i, start, stop), space.keep)
        return space.keep

    def _compute(self, i: int, start: int, stop: int):
        import numpy as np

        unit, row = self._unit, self._row
        lo, hi = start // unit * unit, min(self._base.size, -(-stop // unit) * unit)
        b, m = np.empty(hi - lo, self._base.dtype), np.empty(hi - lo, self._models[i].dtype)
        self._base.read_into(lo, hi, b)
        self._models[i].read_into(lo, hi, m)
        # Ranked by the magnitude's top 16 bits (its bfloat16 truncation: exact for a bf16
        # checkpoint), earlier first among equals: a radix sort of 16-bit keys ran 5.6 ns an
        # element here, a comparison sort of float32 ones 31 ns.
        magnitude = np.abs(np.subtract(m, b, dtype=np.float32))
        keys = np.right_shift(magnitude.view(np.uint32), 16).astype(np.uint16).reshape(-1, row, unit // row)
        order = np.argsort(keys, axis=1, kind="stable")
        # The coins in rank order: whether the j-th smallest is kept is one comparison with the
        # j-th place's coin, and the keeps go back to the elements' places in one scatter.
        coins = coin_bits(self._seed, self._keypath, i, lo, hi).reshape(keys.shape)
        kept_by_rank = coins < self._thresholds[i].reshape(1, -1, 1)
        # Each place's element as an index into the block (a flat scatter ran 2x put_along_axis').
        slabs, inner = keys.shape[0], keys.shape[2]
        if inner > 1:
            order *= inner
        order += np.arange(0, slabs * unit, unit).reshape(-1, 1, 1) + np.arange(inner).reshape(1, 1, -1)
        keep = np.empty(hi - lo, bool)
        keep[order.reshape(-1)] = kept_by_rank.reshape(-1)
        return keep[start - lo : stop - lo]


class _L1Rescale:
    """The rescale of what a sparsifying method keeps as mergekit's (``RescaleNorm.l1``):
    each task vector's kept elements scaled by ``‖d‖₁ / ‖d ⊙ keep‖₁`` over the whole leaf (1
    where either is below 1e-7), found on first use by one pass over the inputs, in float64."""

    def __init__(self, base: _leaf.ArrayLeaf, models: list[_leaf.ArrayLeaf], keeps: Any, sparse: list[bool]):
        self._base, self._models, self._keeps, self._sparse = base, models, keeps, sparse
        self._lock = threading.Lock()
        self._factors: list[float] | None = None

    def factors(self) -> list[float]:
        with self._lock:  # (blocks run on two threads; the first to ask makes the pass)
            if self._factors is None:
                self._factors = self._measure()
            return self._factors

    def _measure(self) -> list[float]:
        """Per model, ``‖d‖₁ / ‖d ⊙ keep‖₁``, in one pass on two threads (run before the
        output's blocks fan out to them: see ``_task_leaf``'s ``fill_chunk``)."""
        import numpy as np

        if isinstance(self._keeps, _TopKeeps):
            self._keeps.select()
        def measure(start: int) -> list[tuple[float, float]]:
            """Per model, ``(‖d‖₁, ‖d ⊙ keep‖₁)`` over one block."""
            stop = min(self._base.size, start + SUB_CHUNK)
            sums = []
            with _combine.scratch_buffers(Space.BUFFERS) as buffers:
                space = Space(buffers, stop - start, self._base.dtype)
                self._base.read_into(start, stop, space.base)
                np.copyto(space.base64, space.base)
                base_key = key_base(space.base, space) if self._keeps.needs_keys else None
                d = space.delta
                for i, model in enumerate(self._models):
                    if not self._sparse[i]:
                        sums.append((0.0, 0.0))
                        continue
                    model.read_into(start, stop, space.model)
                    np.copyto(d, space.model)
                    d -= space.base64
                    if self._keeps.remembers:  # made once, kept for the output's pass
                        keep = self._keeps.mask(i, start, stop, space, base_key, remember=True)
                    else:
                        keep = self._keeps.mask(i, start, stop, space, base_key)
                    np.abs(d, out=d)
                    before = float(d.sum())
                    d *= keep  # (in place: a dot with the bool mask would cast it to a new array)
                    sums.append((before, float(d.sum())))
            return sums

        partials = stream.map_on_two_threads(measure, range(0, self._base.size, SUB_CHUNK))
        factors = []
        for i in range(len(self._models)):  # summed in block order: the same bytes whatever the threads
            before = math.fsum(block[i][0] for block in partials)
            after = math.fsum(block[i][1] for block in partials)
            factors.append(before / after if before >= 1e-7 and after >= 1e-7 else 1.0)
        return factors


def coin_bits(seed: int, keypath: str, model: int, start: int, stop: int, work=None):
    """32 random bits for each element ``[start, stop)`` of one model's task vector (in
    ``work`` if given: two uint64 arrays of ``(stop - start) / 2 + 1`` words or more).

    Counter-based: elements ``2j`` and ``2j + 1`` take the low and high 32 bits of
    SplitMix64's output for the state ``key + (j + 1) * golden``, the key hashed from
    (seed, key path, model), so no chunking or thread count changes a coin."""
    import numpy as np

    key = int.from_bytes(hashlib.blake2b(f"{seed}\0{keypath}\0{model}".encode(), digest_size=8).digest(), "little")
    first, last = start // 2 + 1, (stop + 1) // 2 + 1
    z, shifted = (np.empty(last - first, np.uint64) for _ in range(2)) if work is None else (
        w[: last - first] for w in work)
    np.add(_counters(last - first), np.uint64(first), out=z)
    with np.errstate(over="ignore"):
        z *= np.uint64(0x9E3779B97F4A7C15)
        z += np.uint64(key)
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, None)):
            np.right_shift(z, np.uint64(shift), out=shifted)
            z ^= shifted
            if factor:
                z *= np.uint64(factor)
    return z.view("<u4")[start % 2 : start % 2 + stop - start]


def dare_keep(seed: int, keypath: str, model: int, start: int, stop: int, density: float, *, out=None,
              work=None):
    """DARE's keep mask for elements ``[start, stop)`` of one model's task vector (into
    ``out`` if given, working in ``work``, as ``coin_bits``'): an element is kept where its
    32 bits are below ``density * 2**32``."""
    import numpy as np

    coins = coin_bits(seed, keypath, model, start, stop, work)
    return np.less(coins, np.uint32(min(2**32 - 1, int(density * 2**32))), out=out)


@functools.lru_cache(maxsize=1)
def _iota(count: int):
    import numpy as np

    return np.arange(count, dtype=np.uint64)


def _counters(count: int):
    """``0, 1, ..., count - 1`` as uint64, from one array made once per size class."""
    return _iota(max(count, SUB_CHUNK // 2 + 1))[:count]


# --- SLERP ---------------------------------------------------------------------------------------


def _slerp_leaf(v0: _leaf.ArrayLeaf, v1: _leaf.ArrayLeaf, t: float | None, keypath: str, names: list[str],
                report: AverageReport) -> _leaf.ComputedLeaf:
    """The weighted sum of the two models, its weights from a first pass over both (their
    inner products: ``_methods.inner_products``, as the other geometric methods')."""
    if t is None:
        raise UsageError(f"no {option('t', 'PATTERN=T')} rule covers this leaf; add a default {option('t', 'T')}",
                         keypath=keypath)

    def weights() -> tuple[float, float]:
        gram = _methods.inner_products([v0, v1], base=False)
        return _slerp_factors(t, float(gram[0, 1]), math.sqrt(gram[0, 0]), math.sqrt(gram[1, 1]))

    return _methods.weighted([v0, v1], weights, keypath, names, report)


def _slerp_factors(t: float, dot: float, norm0: float, norm1: float) -> tuple[float, float]:
    """The weights of ``v0`` and ``v1``: mergekit normalizes each (when its norm exceeds
    1e-8), takes the cosine, and interpolates linearly when it is nearly ±1."""
    cosine = dot / ((norm0 if norm0 > SLERP_EPS else 1.0) * (norm1 if norm1 > SLERP_EPS else 1.0))
    if abs(cosine) > SLERP_PARALLEL:
        return 1.0 - t, t
    theta = math.acos(cosine)
    return math.sin((1 - t) * theta) / math.sin(theta), math.sin(t * theta) / math.sin(theta)


# --- a mergekit config -----------------------------------------------------------------------------


def load_config(config: Any, where: str = "the config") -> _mergeconfig.MergeConfig:
    """A mergekit config (its parsed YAML: ``_mergeconfig.parse``), checked against the methods."""
    if isinstance(config, _mergeconfig.MergeConfig):
        return config
    if isinstance(config, (str, Path)):
        raise UsageError("a config file is read by treecli.merge(config=PATH) or merge --config; here, give its "
                         "parsed mapping")
    return _mergeconfig.load(config, PARAMETERS, list(METHODS), where)


def merge_config(config: Any, trees: dict[str, Any], *, seed: int = 0, non_float: str = "last",
                 layer_pattern: str | None = None) -> tuple[Any, AverageReport]:
    """Run a mergekit config on ``trees`` (each model the config names, by that name): its
    method, base, models or slices, parameters (per model, per slice, global; gradients over
    the layers; filters), ``dtype`` (the inputs rounded to it; the arithmetic is float64)
    and ``out_dtype``. A layer's number is read from each key path by ``layer_pattern``
    (a regular expression whose first group is the number; default ``_keypath.LAYER_PATTERN``).
    The report's ``messages`` carry the config's warnings."""
    from treecli import _dtypes

    config = load_config(config)
    pattern = _keypath.layer_regex(layer_pattern or config.layer_pattern,
                                   "layer_pattern" if not layer_pattern else "--layer-pattern")
    dtype = _dtypes.parse(config.dtype) if config.dtype else None
    out_dtype = _dtypes.parse(config.out_dtype) if config.out_dtype else dtype
    for name, d in (("dtype", dtype), ("out_dtype", out_dtype)):
        if d is not None and not _dtypes.is_float(d):
            raise UsageError(f"{name} {d}: merges compute floating-point values; name a float dtype")
    missing = [m for m in config.models() if m not in trees]
    if missing:
        raise UsageError(f"no tree for {missing[0]!r}, which the config names")
    report = AverageReport()
    report.messages.extend(config.warnings)
    inputs = {name: _as_dtype(tree, dtype, report) for name, tree in trees.items()}
    if config.from_slices:
        merged = _stacked_slices(config, inputs, pattern, seed, report)
    else:
        merged, report = _merged_models(config, inputs, pattern, seed, non_float, report)
    if out_dtype is not None:
        merged = _as_dtype(merged, out_dtype, report)
    return merged, report


def _as_dtype(tree: Any, dtype: str | None, report: AverageReport) -> Any:
    """``tree`` with its float leaves rounded to ``dtype`` (lazily), the rest as they are."""
    from treecli import _dtypes

    if dtype is None:
        return tree

    def cast(kp: tuple, x: Any) -> Any:
        if not _leaf.is_array(x):
            return x
        leaf = _leaf.as_leaf(x)
        if not _dtypes.is_float(leaf.dtype_name) or leaf.dtype_name == dtype:
            return x
        return _combine.cast_leaf(leaf, dtype, format_keypath(kp), report.messages.append)

    return _tree.map_leaves(cast, tree)


def _settings(config: _mergeconfig.MergeConfig, out_slice: _mergeconfig.OutputSlice, models: list[str],
              method: str, text: str, t: float) -> LeafSettings:
    """One tensor's parameters: each model's own, then the slice's, then the global ones."""
    spec = SPECS[method]
    sources = {s.model: s.parameters for s in out_slice.sources}
    shared_scopes = [out_slice.parameters, config.parameters]
    shared: dict[str, Any] = {}
    per_model: list[dict[str, Any]] = [{} for _ in models]

    def resolve(p: Param, scopes: list[dict]) -> Any:
        for scope in scopes:
            if p.name in scope:
                try:
                    value = _mergeconfig.evaluate(scope[p.name], text, t, p.kind)
                except UsageError as e:
                    raise UsageError(f"parameter {p.name}: {e.message}", keypath=text) from None
                if value is not None:
                    return value
        return p.default

    for p in spec.params:
        if p.per_model:
            for i, model in enumerate(models):
                per_model[i][p.name] = resolve(p, [sources.get(model, {}), *shared_scopes])
        else:
            shared[p.name] = resolve(p, shared_scopes)
    return LeafSettings(shared, per_model)


def _unused_parameters(config: _mergeconfig.MergeConfig, report: AverageReport) -> None:
    """A warning for each parameter the config sets that its method does not take."""
    spec = SPECS[config.method]
    named = set(config.parameters)
    for s in config.slices:
        named |= set(s.parameters) | {n for source in s.sources for n in source.parameters}
    for name in sorted(named):
        if spec.param(name) is None:
            report.messages.append(f"parameter {name} is not one of {config.method}'s; ignored")


def _layer_of(text: str, pattern) -> tuple[int, int] | None:
    """The layer number in a key path's text and where it starts, or None."""
    found = pattern.search(text)
    if not found:
        return None
    try:
        return int(found.group(1)), found.start(1)
    except (TypeError, ValueError):
        raise UsageError(f"the layer pattern captured {found.group(1)!r} in {text}, not a layer number") from None


def _merged_models(config: _mergeconfig.MergeConfig, trees: dict[str, Any], pattern, seed: int, non_float: str,
                   report: AverageReport) -> tuple[Any, AverageReport]:
    """``models``: every tensor merged across whole models; ``t`` of a gradient is the
    layer's position among the base's (the first model's) layers."""
    method, spec, out_slice = config.method, SPECS[config.method], config.slices[0]
    _unused_parameters(config, report)
    names = [s.model for s in out_slice.sources]
    base = config.base_model
    if spec.base == "none":
        if base is not None and base not in names:
            names.append(base)  # (mergekit adds the base as one more input)
        base = None
    elif base is not None:
        names = [n for n in names if n != base]
    check_inputs(method, base is not None, len(names), " (the config's models)")
    first = trees[base or names[0]]
    layers = {layer[0] for kp, _ in _tree.flatten(first) if (layer := _layer_of(format_keypath(kp), pattern))}
    count = max(layers) + 1 if layers else 1

    def settings(keypath: tuple) -> LeafSettings:
        text = format_keypath(keypath)
        layer = _layer_of(text, pattern)
        t = 0.0 if layer is None else (layer[0] / (count - 1) if count > 1 else 1.0)
        return _settings(config, out_slice, names, method, text, t)

    merged, own = merge_with(method, trees[base] if base else None, [trees[n] for n in names], settings,
                             names=names, base_name=base or "base", seed=seed, non_float=non_float)
    own.messages[:0] = report.messages
    return merged, own


def _renumbered(keypath: tuple, start: int, number: int) -> tuple:
    """``keypath`` with the component whose text starts at ``start`` of its text made ``number``."""
    for i, key in enumerate(keypath):
        at = len(format_keypath(keypath[:i])) + (1 if i else 0)
        if at == start:
            return (*keypath[:i], number if isinstance(key, int) else str(number), *keypath[i + 1:])
    raise UsageError(f"the layer number of {format_keypath(keypath)} is not a whole key of its path")


def _stacked_slices(config: _mergeconfig.MergeConfig, trees: dict[str, Any], pattern, seed: int,
                    report: AverageReport) -> Any:
    """``slices``: output layers stacked slice after slice, each output layer merged from
    one layer of each source (renumbered from 0 up); tensors outside every layer from the
    first slice's sources, or the last's for the final norm and head (mergekit's "post"
    weights: key paths naming ``norm``, ``head`` or ``ln_f`` outside the layers)."""
    method, spec = config.method, SPECS[config.method]
    _unused_parameters(config, report)
    first_slice = config.slices[0]
    template = trees[first_slice.sources[0].model]
    flats = {name: _tree.by_text(tree) for name, tree in trees.items()}
    outside = [kp for kp, _ in _tree.flatten(template) if _layer_of(format_keypath(kp), pattern) is None]
    layer_keys: dict[str, dict[int, list[tuple[tuple, int]]]] = {}  # per model: layer -> (key path, number's offset)

    def layers_of(name: str) -> dict[int, list[tuple[tuple, int]]]:
        if name not in layer_keys:
            found: dict[int, list[tuple[tuple, int]]] = {}
            for kp, _ in _tree.flatten(trees[name]):
                layer = _layer_of(format_keypath(kp), pattern)
                if layer is not None:
                    found.setdefault(layer[0], []).append((kp, layer[1]))
            if not found:
                raise UsageError(f"{name}: no key path holds a layer number (such as model.layers.N.); name the "
                                 "pattern with layer_pattern")
            layer_keys[name] = found
        return layer_keys[name]

    items: list[tuple[tuple, Any]] = []

    def merged_leaf(out_slice: _mergeconfig.OutputSlice, texts: list[str], out_text: str, t: float,
                    where: str) -> Any:
        base = out_slice.base_model or config.base_model
        names = [s.model for s in out_slice.sources]
        if spec.base == "none":
            base = None
        elif base is not None:
            if base not in names:
                raise UsageError(f"{where}: the base model {base!r} is not among the slice's sources")
            names = [n for n in names if n != base]
        check_inputs(method, base is not None, len(names), f" ({where})")
        order = ([base] if base else []) + names
        text_of = {s.model: text for s, text in zip(out_slice.sources, texts)}
        values = []
        for name in order:
            value = flats[name].get(text_of[name])
            if value is None:
                raise UsageError(f"{name}: no leaf {text_of[name]} (for {out_text}, {where})")
            values.append(value)
        if not (_leaf.is_array(values[0]) and _dtypes_float(values[0])):
            return values[-1]
        leaves = [_leaf.as_leaf(v) for v in values]
        for name, leaf in zip(order[1:], leaves[1:]):
            if not _tree.same_layout(leaves[0], leaf):
                raise UsageError(f"{name}: {text_of[name]} is {leaf.dtype_name}{list(leaf.shape)}, "
                                 f"{order[0]}'s {leaves[0].dtype_name}{list(leaves[0].shape)} ({where})")
        settings = _settings(config, out_slice, names, method, out_text, t)
        return leaf_merge(method, leaves, base is not None, settings, seed, out_text, order, report)

    post = ("norm", "head", "ln_f")
    after = [kp for kp in outside if any(word in format_keypath(kp) for word in post)]
    for kp in [kp for kp in outside if kp not in after]:
        text = format_keypath(kp)
        items.append((kp, merged_leaf(first_slice, [text] * len(first_slice.sources), text, 0.0,
                                      "outside the layers")))
    number = 0
    for index, out_slice in enumerate(config.slices):
        start, stop = out_slice.sources[0].layers
        for offset in range(stop - start):
            t = offset / (stop - start - 1) if stop - start > 1 else 1.0
            by_layer = layers_of(out_slice.sources[0].model)
            if start + offset not in by_layer:
                raise UsageError(f"{out_slice.sources[0].model}: no layer {start + offset} (slices[{index}]); "
                                 f"it has layers {min(by_layer)} to {max(by_layer)}")
            for kp, at in by_layer[start + offset]:
                out_kp = _renumbered(kp, at, number)
                texts = [format_keypath(_renumbered(kp, at, s.layers[0] + offset)) for s in out_slice.sources]
                items.append((out_kp, merged_leaf(out_slice, texts, format_keypath(out_kp), t,
                                                  f"slices[{index}], layer {start + offset}")))
            number += 1
    last = config.slices[-1]
    for kp in after:
        text = format_keypath(kp)
        items.append((kp, merged_leaf(last, [text] * len(last.sources), text, 0.0, "outside the layers")))
    return _tree.unflatten(items, template=template)


def _dtypes_float(value: Any) -> bool:
    from treecli import _dtypes

    return _dtypes.is_float(_leaf.as_leaf(value).dtype_name)
