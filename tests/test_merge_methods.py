"""mergekit's methods beyond task arithmetic (issue 35), each against a float64 NumPy
reference written here from mergekit 0.1.5's definition, on whole vectors as mergekit
computes them (treecli streams them and reduces the geometric ones to inner products);
and the random ones (DARE, DELLA) by their statistics."""

from __future__ import annotations

import numpy as np
import pytest

import treecli
from treecli import merge_methods
from treecli.merge_methods import LeafMerge, LeafSettings, run
from treecli.merge_methods._sparsify import KeptMasks
from treecli._combine import SUB_CHUNK

from .conftest import BF16


def close(got, want, dtype=np.float32):
    """DESIGN.md's accuracy oracle: fp32 within rtol 1e-6 / atol 1e-7 of the float64 reference;
    bf16 and fp16 within one unit in the last place of it rounded to that dtype."""
    got = np.asarray(got)
    assert got.dtype == dtype
    if dtype == np.float32:
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-6, atol=1e-7)
    else:
        rounded = want.astype(dtype)
        ulp = np.abs(np.spacing(rounded)).astype(np.float64)
        assert np.all(np.abs(got.astype(np.float64) - rounded.astype(np.float64)) <= ulp)


def family(shape=(24, 16), count=3, dtype=np.float32, seed=0, scale=0.1, sparse=0.0):
    """A base and ``count`` models, each the base plus noise (none in a ``sparse`` fraction)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape)
    ms = [base + rng.standard_normal(shape) * scale * (rng.random(shape) >= sparse) for _ in range(count)]
    return base.astype(dtype), [m.astype(dtype) for m in ms]


def f64(x):
    return np.asarray(x, np.float64)


def merged(method, base, ms, **options):
    out, report = treecli.merge([{"w": m} for m in ms], method, base=None if base is None else {"w": base}, **options)
    return np.asarray(out["w"]), report


# --- float64 references, from mergekit's definitions -----------------------------------------------


def ref_nuslerp(base, ms, weights, row_wise=False, flatten=True):
    t = weights[1] / sum(weights)
    v0, v1 = (f64(m) - (f64(base) if base is not None else 0) for m in ms)
    shape = v0.shape
    if flatten:
        v0, v1 = v0.reshape(-1), v1.reshape(-1)
    elif row_wise:
        v0, v1 = v0.T, v1.T
    n0 = np.maximum(np.linalg.norm(v0, axis=-1, keepdims=True), 1e-7)
    n1 = np.maximum(np.linalg.norm(v1, axis=-1, keepdims=True), 1e-7)
    cos = np.clip(np.sum(v0 / n0 * v1 / n1, axis=-1, keepdims=True), -1, 1)
    theta = np.arccos(cos)
    out = (np.sin((1 - t) * theta) * v0 + np.sin(t * theta) * v1) / np.sin(theta)
    if row_wise and not flatten:
        out = out.T
    return out.reshape(shape) + (f64(base) if base is not None else 0)


def ref_multislerp(base, ms, weights, eps=1e-8):
    b = f64(base) if base is not None else 0
    vs = np.stack([(f64(m) - b).reshape(-1) for m in ms])
    w = np.asarray(weights, np.float64) / sum(weights)
    norms = np.linalg.norm(vs, axis=-1, keepdims=True)
    units = vs / (norms + eps)
    mean = (units * w[:, None]).sum(0)
    mean = mean / np.linalg.norm(mean)
    tangents = units - (units @ mean)[:, None] * mean
    tangent = (tangents * w[:, None]).sum(0)
    tn = np.linalg.norm(tangent) + eps
    out = (mean * np.cos(tn) + tangent * np.sin(tn) / tn) * float(norms[:, 0] @ w)
    return out.reshape(ms[0].shape) + b


def ref_karcher(ms, max_iter=10, tol=1e-5):
    xs = [f64(m).reshape(-1) for m in ms]
    norms = [np.linalg.norm(x) for x in xs]
    units = [x / n for x, n in zip(xs, norms)]
    a = np.full(len(xs), 1.0 / len(xs))
    mean = sum(ai * u for ai, u in zip(a, units))
    mean /= np.linalg.norm(mean)
    for _ in range(max_iter):
        tangent = np.zeros_like(mean)
        for ai, u in zip(a, units):
            dot = np.clip(mean @ u, -1, 1)
            theta = np.arccos(dot)
            if theta >= tol:
                tangent += ai * theta / np.sin(theta) * (u - dot * mean)
        tn = np.linalg.norm(tangent)
        if tn < tol:
            break
        mean = np.cos(tn) * mean + np.sin(tn) * tangent / tn
        mean /= np.linalg.norm(mean)
    return (float(a @ norms) * mean).reshape(ms[0].shape)


def ref_model_stock(base, ms, filter_wise=False):
    w0 = f64(base)
    ws = [f64(m) for m in ms]
    if not filter_wise:
        w0, ws = w0.reshape(-1), [w.reshape(-1) for w in ws]
    offsets = [w - w0 for w in ws]
    cos = []
    for i in range(len(offsets)):
        for j in range(i + 1, len(offsets)):
            a, b = offsets[i], offsets[j]
            cos.append(np.clip((a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1),
                                                             1e-6), -1, 1))
    c = np.mean(cos, axis=0)[..., None]
    n = len(ws)
    t = n * c / (1 + (n - 1) * c)
    return (t * sum(ws) / n + (1 - t) * w0).reshape(base.shape)


def ref_sce(base, ms, topk):
    b = f64(base).reshape(-1)
    tvs = np.stack([f64(m).reshape(-1) - b for m in ms])
    if topk < 1:
        var = np.var(tvs, axis=0).astype(np.float32)
        k = int(np.count_nonzero(var) * topk)
        order = np.argsort(-var, kind="stable")
        mask = np.zeros(b.size, bool)
        mask[order[:k]] = True
        tvs = tvs * mask
    majority = np.where(tvs.sum(0) >= 0, 1.0, -1.0)
    weights = (tvs**2).mean(1)
    weights = weights / weights.sum()
    erased = weights[:, None] * (np.sign(tvs) == majority)
    return (b + (tvs * erased).sum(0) / np.maximum(erased.sum(0), 1e-6)).reshape(base.shape)


def ref_ram(base, ms, epsilon=1e-5, plus=False, r=0.1, alpha=0.2):
    b = f64(base).reshape(-1)
    tvs = np.stack([f64(m).reshape(-1) - b for m in ms])
    nz = np.abs(tvs) > epsilon
    counts = nz.sum(0)
    unique, overlap = counts == 1, counts > 1
    lam = np.ones(len(ms))
    if plus:
        rho = (nz & overlap).sum(1) / np.maximum((nz & unique).sum(1), epsilon)
        lam = 1 + r * np.clip(rho, 0, alpha)
    tz = tvs * nz
    out = (tz * unique * lam[:, None] + tz * overlap / np.maximum(counts, 1)).sum(0)
    return (b + out).reshape(base.shape)


def ref_nearswap(base, m, t):
    a, b = f64(base), f64(m)
    w = np.clip(t / np.maximum(np.abs(a - b), 1e-6), 0, 1)
    return w * b + (1 - w) * a


def ref_arcee_fusion(base, m, sample=1_000_000):
    a, b = f64(base), f64(m)

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True) + 1e-8

    p, q = softmax(b), softmax(a)
    importance = np.abs(b - a) * np.sum(p * np.log(p / q), -1, keepdims=True)
    scores = importance.reshape(-1)
    if scores.size > sample:  # an even sample: elements ⌊i·n / sample⌋
        scores = scores[np.arange(sample) * scores.size // sample]
    ordered = np.sort(scores)
    q1, median, q3 = (ordered[int(q * (ordered.size - 1))] for q in (0.25, 0.5, 0.75))
    return np.where(importance >= median + 1.5 * (q3 - q1), b, a)


def ref_outliers_mask(delta, density, gamma):
    """mergekit's magnitude_outliers: of the magnitudes in ascending order keep [n_bot, n_bot + target)."""
    n = delta.size
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    order = np.argsort(np.abs(delta.reshape(-1)).astype(np.float32), kind="stable")
    mask = np.zeros(n, bool)
    mask[order[bottom : bottom + target]] = True
    return mask.reshape(delta.shape)


# --- the methods ---------------------------------------------------------------------------------


@pytest.mark.parametrize("row_wise, flatten", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("with_base", [True, False])
def test_nuslerp_matches_the_reference(row_wise, flatten, with_base):
    base, ms = family(count=2)
    out, _ = merged("nuslerp", base if with_base else None, ms, weights=[0.3, 0.7],
                    parameters={"nuslerp_row_wise": row_wise, "nuslerp_flatten": flatten})
    close(out, ref_nuslerp(base if with_base else None, ms, [0.3, 0.7], row_wise, flatten))


@pytest.mark.parametrize("with_base", [True, False])
def test_multislerp_matches_the_reference(with_base):
    base, ms = family(count=3)
    out, _ = merged("multislerp", base if with_base else None, ms, weights=[1.0, 0.5, 0.25])
    close(out, ref_multislerp(base if with_base else None, ms, [1.0, 0.5, 0.25]))


def test_karcher_iterates_as_mergekit_and_takes_the_base_as_one_more_model():
    base, ms = family(count=2, scale=0.8)
    out, _ = merged("karcher", base, ms, parameters={"max_iter": 50, "tol": 1e-9})
    close(out, ref_karcher([base, *ms], max_iter=50, tol=1e-9))
    out, _ = merged("karcher", None, ms)  # the defaults: 10 steps, tol 1e-5
    close(out, ref_karcher(ms))


@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock_matches_the_reference_over_the_leaf_or_each_row(filter_wise):
    base, ms = family(count=3)
    out, _ = merged("model_stock", base, ms, parameters={"filter_wise": filter_wise})
    close(out, ref_model_stock(base, ms, filter_wise))


def test_sce_selects_by_variance_weights_by_energy_and_erases_minority_signs():
    base, ms = family(shape=(3 * SUB_CHUNK // 256 + 7, 256), count=3, sparse=0.3)  # over several blocks
    for topk in (1.0, 0.4):
        out, _ = merged("sce", base, ms, parameters={"select_topk": topk})
        close(out, ref_sce(base, ms, topk))
    # Task vectors of a few exact values: variances tie by the hundred thousand, and the first
    # of those equal to the cut's are kept, as a stable sort keeps them.
    rng = np.random.default_rng(5)
    base = (np.round(base * 64) / 64).astype(np.float32)  # every sum below exact
    ms = [(base + rng.integers(-2, 3, base.shape) * 0.25).astype(np.float32) for _ in range(3)]
    for topk in (0.3, 0.55):
        out, _ = merged("sce", base, ms, parameters={"select_topk": topk})
        close(out, ref_sce(base, ms, topk))


@pytest.mark.parametrize("plus", [False, True])
def test_ram_keeps_unique_changes_and_averages_shared_ones(plus):
    base, ms = family(count=3, sparse=0.6)
    options = {"r": 0.5, "alpha": 0.4} if plus else {}
    out, _ = merged("ramplus_tl" if plus else "ram", base, ms, parameters=options)
    close(out, ref_ram(base, ms, plus=plus, **options))


def test_nearswap_takes_close_values_and_steps_toward_far_ones():
    base, (m,) = family(count=1)
    out, _ = merged("nearswap", base, [m], t=0.05)
    close(out, ref_nearswap(base, m, 0.05))
    assert treecli.merge([{"w": m}], "nearswap", base={"w": base}, t="0.05")[0]  # (rules, as the other flags)


def test_arcee_fusion_takes_the_model_where_its_importance_is_an_outlier():
    base, (m,) = family(shape=(64, 32), count=1, scale=0.5)
    out, _ = merged("arcee_fusion", base, [m])
    want = ref_arcee_fusion(base, m)
    close(out, want)
    assert 0 < np.mean(np.asarray(out) == m) < 0.5  # some, not all, elements from the model
    base, (m,) = family(shape=(1100, 1000), count=1, scale=0.5)  # quantiles from a sample of 1M
    out, _ = merged("arcee_fusion", base, [m])
    close(out, ref_arcee_fusion(base, m))


def test_passthrough_copies_its_one_model_bit_for_bit_or_scales_it():
    base, (m,) = family(count=1, dtype=BF16)
    out, _ = merged("passthrough", None, [m])
    assert out.tobytes() == m.tobytes()
    scaled, _ = merged("passthrough", None, [m], parameters={"scale": 0.5})
    close(scaled, f64(m) * 0.5, BF16)
    with pytest.raises(treecli.UsageError, match="passthrough merges exactly 1 model"):
        merged("passthrough", None, [m, m])


@pytest.mark.parametrize("method, consensus", [("breadcrumbs", False), ("breadcrumbs_ties", True)])
def test_breadcrumbs_drops_the_smallest_and_the_largest_magnitudes(method, consensus):
    base, ms = family(shape=(2 * SUB_CHUNK + 999,), count=2)  # a leaf over several blocks: the streaming selection
    density, gamma = 0.6, 0.05
    out, _ = merged(method, base, ms, weights=[0.6, 0.4], density=density, gamma=gamma)
    deltas = [f64(m) - f64(base) for m in ms]
    masked = [d * ref_outliers_mask(d, density, gamma) * w for d, w in zip(deltas, [0.6, 0.4])]
    if consensus:
        majority = np.where(sum(masked) >= 0, 1.0, -1.0)
        masked = [d * (np.sign(d) == majority) for d in masked]
    close(out, f64(base) + sum(masked))
    kept = np.count_nonzero(np.asarray(merged(method, base, ms[:1], density=density, gamma=gamma)[0]) != base)
    assert kept == int(density * base.size)  # exactly the target: the 5% largest dropped, the smallest beyond


@pytest.mark.parametrize("shape", [(400, 1000), (20, 1000, 20)])  # ranked along the second axis
def test_della_keeps_with_probabilities_rising_with_magnitude_and_rescales_to_the_l1_norm(shape):
    base, (m,) = family(shape=shape, count=1)
    density, epsilon = 0.5, 0.3
    out, _ = merged("della_linear", base, [m], density=density, epsilon=epsilon, seed=4, rescale="none")
    delta = f64(m) - f64(base)
    kept = np.asarray(out) != base
    assert abs(kept.mean() - density) < 0.01
    ranks = np.argsort(np.argsort(np.abs(delta), axis=1), axis=1)  # per row, 0 the smallest
    smallest, largest = kept[ranks < 100].mean(), kept[ranks >= 900].mean()
    assert abs(smallest - (density - 0.9 * epsilon)) < 0.02 and abs(largest - (density + 0.9 * epsilon)) < 0.02
    rescaled, _ = merged("della_linear", base, [m], density=density, epsilon=epsilon, seed=4)  # l1 by default
    kept_delta = f64(rescaled) - f64(base)
    assert np.array_equal(kept_delta != 0, kept)
    np.testing.assert_allclose(np.abs(kept_delta).sum(), np.abs(delta).sum(), rtol=1e-6)
    again, _ = merged("della_linear", base, [m], density=density, epsilon=epsilon, seed=4)
    assert again.tobytes() == rescaled.tobytes()
    with pytest.raises(treecli.UsageError, match="density ± epsilon must lie in"):
        merged("della", base, [m], density=0.9, epsilon=0.15)


def test_per_model_densities_through_the_python_api():
    base, ms = family(shape=(1000,), count=2)
    settings = LeafSettings({"lambda": 1.0, "normalize": True, "int8_mask": False, "rescale": False},
                                   [{"weight": 1.0, "density": 0.2}, {"weight": 1.0, "density": 1.0}])
    leaf = leaf_merge("ties", [treecli._leaf.as_leaf(x) for x in (base, *ms)], True, settings, 0, "w",
                             ["base", "a", "b"], treecli._combine.AverageReport())
    out = leaf.read_flat(0, 1000)
    deltas = [f64(m) - f64(base) for m in ms]
    top = np.argsort(-np.abs(deltas[0]).astype(np.float32), kind="stable")[:200]
    trimmed = np.zeros(1000)
    trimmed[top] = deltas[0][top]
    majority = np.where(trimmed + deltas[1] >= 0, 1.0, -1.0)
    agree = [np.sign(d) == majority for d in (trimmed, deltas[1])]
    mixed = (trimmed * agree[0] + deltas[1] * agree[1]) / np.maximum(agree[0] * 1.0 + agree[1], 1)
    close(out, f64(base) + mixed)


def test_methods_refuse_what_they_cannot_take():
    base, ms = family(count=2)
    for method, inputs, match in [("nuslerp", ms[:1], "nuslerp merges exactly 2 models"),
                                  ("model_stock", ms[:1], "at least 2 models"),
                                  ("arcee_fusion", ms, "exactly 1 model")]:
        with pytest.raises(treecli.UsageError, match=match):
            merged(method, base, inputs)
    with pytest.raises(treecli.UsageError, match="model_stock has no parameter 'filterwise'"):
        merged("model_stock", base, ms, parameters={"filterwise": True})
    with pytest.raises(treecli.UsageError, match="needs a base model"):
        merged("sce", None, ms)
    with pytest.raises(treecli.UsageError, match="nearswap needs t"):
        merged("nearswap", base, ms[:1])


@pytest.mark.parametrize("method", sorted(merge_methods.METHODS))
def test_every_method_keeps_shape_and_dtype_on_any_rank(method):
    """Scalars, vectors, matrices and 3-D leaves (DELLA ranks along the second axis, rows
    are the last), in bf16, fp16 and fp32, with and without a base: outputs finite."""
    spec = merge_methods.REGISTRY[method]
    low, high = spec.models
    count = high if high is not None else max(low, 3)
    for shape in [(), (5,), (3, 4), (2, 3, 4), (0, 4)]:
        for dtype in (np.float32, BF16, np.float16):
            base, ms = family(shape=shape, count=count, dtype=dtype, seed=len(shape))
            options = {"t": 0.3} if spec.param("t") else {}
            if spec.param("density"):
                options["density"] = 0.5
            out, report = merged(method, None if spec.takes_no_base else base, ms, **options)
            assert out.shape == shape and out.dtype == dtype, (method, shape, dtype)
            assert np.isfinite(out.astype(np.float64)).all() and not report.warnings(), (method, shape, dtype)


@pytest.mark.parametrize("method", ["dare_ties", "della_linear"])
def test_masks_kept_between_the_l1_pass_and_the_output_or_made_again_merge_alike(method, monkeypatch):
    base, ms = family(shape=(300, 1000), count=2)  # three blocks of each model's mask
    kept, _ = merged(method, base, ms, density=0.5, seed=3)
    monkeypatch.setattr(KeptMasks, "CACHE_BYTES", 20_000)  # under a leaf's masks: the oldest go
    some, _ = merged(method, base, ms, density=0.5, seed=3)
    monkeypatch.setattr(KeptMasks, "CACHE_BYTES", 0)  # none kept: every mask made twice
    none, _ = merged(method, base, ms, density=0.5, seed=3)
    assert kept.tobytes() == some.tobytes() == none.tobytes()
    assert 0.4 < np.mean(kept != base) < 0.9


def test_masks_kept_for_a_leaf_read_in_part_go_with_the_leaf():
    """A leaf read in part (a process's share of it) leaves the masks of the other blocks
    kept; they are dropped when the leaf is."""
    import gc

    base, (m,) = family(shape=(300, 1000), count=1)
    settings = LeafSettings({"lambda": 1.0, "normalize": False, "int8_mask": False, "rescale": True},
                                   [{"weight": 1.0, "density": 0.5}])
    leaf = leaf_merge("dare_linear", [treecli._leaf.as_leaf(x) for x in (base, m)], True, settings, 1, "w",
                             ["base", "m"], treecli._combine.AverageReport())
    leaf.read_flat(0, 10)  # the L1 pass keeps every block's mask; this read takes the first
    assert KeptMasks._bytes > 0
    del leaf
    gc.collect()
    assert KeptMasks._bytes == 0


@pytest.mark.parametrize("shape", [(37, 129), (5, 129, 7)])
def test_della_coins_are_the_same_whatever_the_chunking(shape):
    base, (m,) = family(shape=shape, count=1)
    settings = LeafSettings({"lambda": 1.0, "normalize": False, "int8_mask": False, "rescale": True},
                                   [{"weight": 1.0, "density": 0.4, "epsilon": 0.2}])
    leaf = leaf_merge("della_linear", [treecli._leaf.as_leaf(x) for x in (base, m)], True, settings, 11, "w",
                             ["base", "m"], treecli._combine.AverageReport())
    whole = leaf.read_flat(0, base.size)
    pieces = np.concatenate([leaf.read_flat(s, min(base.size, s + 77)) for s in range(0, base.size, 77)])
    assert whole.tobytes() == pieces.tobytes()


def leaf_merge(method: str, leaves: list, has_base: bool, settings: LeafSettings, seed: int, keypath: str,
               names: list[str], report) -> treecli._leaf.ArrayLeaf:
    """One leaf merged by the registered ``method``, as ``merge`` does it."""
    return run.leaf_merge(merge_methods.REGISTRY[method],
                          LeafMerge(leaves, has_base, settings, seed, keypath, names, report))
