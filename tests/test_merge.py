"""`treecli merge` (issue 18): each method against a float64 NumPy reference written
here from the method's definition (mergekit's semantics), on small trees with known
answers, through the Python API and the CLI."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file
import treecli
from treecli import _merge, _selection
from treecli.merge_methods._sparsify import dare_keep
from treecli._combine import SUB_CHUNK

from .conftest import BF16, assert_clean_error

F16 = np.dtype(np.float16)


@pytest.mark.parametrize("method, consensus", [("dare_linear", False), ("dare_ties", True)])
def test_dare_rescales_each_task_vector_to_its_l1_norm_by_default_as_mergekit(method, consensus):
    """mergekit's RescaleNorm.l1: what is kept times ‖d‖₁ / ‖d ⊙ keep‖₁ over the leaf; the
    leaf spans several chunks, so the norms are summed across them."""
    base, ms = models(np.float32, shape=(3 * SUB_CHUNK + 77,), count=2)
    merged, _ = treecli.merge([{"w": m} for m in ms], method, base={"w": base}, density=0.3, seed=9)
    keeps = [dare_keep(9, "w", i, 0, base.size, 0.3) for i in range(2)]
    deltas = [m.astype(np.float64) - base.astype(np.float64) for m in ms]
    divisors = [np.abs(d * k).sum() / np.abs(d).sum() for d, k in zip(deltas, keeps)]  # 1 / the L1 factor
    want = reference(base, ms, [1.0, 1.0], keeps=keeps, rescale_by=divisors, consensus=consensus)
    # (the norms are summed chunk by chunk: the factor may differ in its last bits, the output by one ulp)
    np.testing.assert_allclose(np.asarray(merged["w"], np.float64), want.astype(np.float64), rtol=1.2e-7, atol=0)
    by_density, _ = treecli.merge([{"w": m} for m in ms], method, base={"w": base}, density=0.3, seed=9,
                                  rescale="density")
    assert not np.array_equal(np.asarray(by_density["w"]), np.asarray(merged["w"]))  # a named choice of its own
    with pytest.raises(treecli.UsageError, match="rescale='linf': choose one of l1, density, none"):
        treecli.merge([{"w": m} for m in ms], method, base={"w": base}, density=0.3, rescale="linf")


def reference(base, models, weights, *, trim=None, keeps=None, consensus=False, normalize=False, rescale_by=None,
              scale=1.0):
    """base + scale * mixed delta, from the definitions: ``trim`` = TIES density (the k largest
    float32 magnitudes, the first in element order among equals), ``keeps`` = DARE masks."""
    b = base.astype(np.float64).reshape(-1)
    deltas = [m.astype(np.float64).reshape(-1) - b for m in models]
    if trim is not None:
        k = int(trim * b.size)
        for i, d in enumerate(deltas):
            magnitude = np.abs(d).astype(np.float32)
            order = np.argsort(-magnitude, kind="stable")  # largest first, earlier first among equals
            mask = np.zeros(b.size, bool)
            mask[order[:k]] = True
            deltas[i] = d * mask
    if keeps is not None:  # rescale_by: one divisor, or one per model
        divisors = rescale_by if isinstance(rescale_by, list) else [rescale_by or 1.0] * len(deltas)
        deltas = [d * keep / r for d, keep, r in zip(deltas, keeps, divisors)]
    weighted = [d * w for d, w in zip(deltas, weights)]
    if consensus:
        majority = np.where(np.sum(weighted, axis=0) >= 0, 1.0, -1.0)
        agree = [np.sign(wd) == majority for wd in weighted]
        mixed = sum(np.where(a, wd, 0.0) for a, wd in zip(agree, weighted))
        divisor = sum(np.where(a, w, 0.0) for a, w in zip(agree, weights))
        divisor[divisor == 0] = 1
    else:
        mixed = sum(weighted)
        divisor = math.fsum(weights) if abs(math.fsum(weights)) >= 1e-8 else 1.0
    if normalize:
        mixed = mixed / divisor
    return (b + mixed * scale).astype(base.dtype).reshape(base.shape)


def models(dtype, shape=(48, 37), count=3, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(shape).astype(dtype)
    return base, [(base.astype(np.float64) + rng.standard_normal(shape) * 0.1).astype(dtype) for _ in range(count)]


def bits(array) -> bytes:
    return np.asarray(array).tobytes()


def test_ties_elects_signs_by_weighted_mass_hand_checked():
    base = {"w": np.zeros(4, np.float32)}
    a = {"w": np.array([1, -2, 3, 0.5], np.float32)}
    b = {"w": np.array([-3, 1, 1, -0.5], np.float32)}
    merged, _ = treecli.merge([a, b], "ties", base=base)
    # sums [-2, -1, 4, 0] elect [-, -, +, +]; the agreeing values are averaged
    assert np.asarray(merged["w"]).tolist() == [-3, -2, 2, 0.5]


@pytest.mark.parametrize("dtype", [np.float32, BF16, F16, np.float64])
@pytest.mark.parametrize("method, options, expected", [
    ("task_arithmetic", {"lambda_": 0.7}, {"scale": 0.7}),
    ("ties", {"density": 0.4}, {"trim": 0.4, "consensus": True, "normalize": True}),
    ("ties", {"density": 1.0, "normalize": False}, {"consensus": True}),
])
def test_task_methods_match_the_reference(dtype, method, options, expected):
    base, ms = models(dtype)
    weights = [1.0, 0.5, 2.0]
    merged, _ = treecli.merge([{"w": m} for m in ms], method, base={"w": base}, weights=weights, **options)
    want = reference(base, ms, weights, **expected)
    assert np.asarray(merged["w"]).dtype == dtype
    if dtype == np.float64:  # the elected sum is found another way: equal to within float64's rounding
        np.testing.assert_allclose(np.asarray(merged["w"]), want, rtol=1e-14, atol=1e-15)
    else:
        assert bits(merged["w"]) == bits(want)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.float32, BF16]), count=st.integers(1, 4),
       size=st.integers(10, 300), method=st.sampled_from(["ties", "dare_ties"]),
       density=st.sampled_from([0.1, 0.5, 0.9, 1.0]), normalize=st.booleans())
def test_consensus_methods_match_the_reference_with_zeros_ties_and_any_weights(data, dtype, count, size, method,
                                                                               density, normalize):
    """Deltas drawn from a few values, zero among them (a model equal to the base there), so
    that magnitudes tie, whole columns cancel and kept zeros are common; weights equal (the
    divisor counts agreeing models), negative, or all different."""
    values = st.sampled_from([0.0, 0.0, 0.25, -0.25, 0.5, -0.5, 1.5, -3.0])
    base = np.asarray(data.draw(st.lists(values, min_size=size, max_size=size)), np.float64).astype(dtype)
    deltas = [data.draw(st.lists(values, min_size=size, max_size=size)) for _ in range(count)]
    ms = [(base.astype(np.float64) + np.asarray(d)).astype(dtype) for d in deltas]
    weights = data.draw(st.sampled_from([[1.0] * count, [-0.5] * count, [0.5 + i for i in range(count)]]))
    merged, _ = treecli.merge([{"w": m} for m in ms], method, base={"w": base}, weights=weights, density=density,
                              normalize=normalize, seed=3, **({} if method == "ties" else {"rescale": "density"}))
    if method == "ties":
        want = reference(base, ms, weights, trim=density, consensus=True, normalize=normalize)
    else:
        keeps = [dare_keep(3, "w", i, 0, size, density) for i in range(count)]
        want = reference(base, ms, weights, keeps=keeps, rescale_by=density, consensus=True, normalize=normalize)
    if method == "ties" or density in (0.5, 1.0):  # exact arithmetic on these values: the same bits
        assert bits(merged["w"]) == bits(want)
    else:  # d / 0.9 is rounded, and the elected side is found as (total ± Σ|wd|) / 2, not summed
        # directly: equal to within float64's rounding (a cancellation to 0 may leave 1e-16), or
        # one step of the output dtype where that rounding straddles one of its halfway points
        got, exact = np.asarray(merged["w"], np.float64), want.astype(np.float64)
        one_step = np.abs(np.spacing(want)).astype(np.float64)
        assert np.all(np.abs(got - exact) <= np.maximum(one_step, 1e-13))


def test_ties_trims_exactly_k_across_blocks_and_ties_among_equal_magnitudes():
    """A leaf over several blocks, in bf16 so that many magnitudes are equal."""
    rng = np.random.default_rng(1)
    n = 2 * SUB_CHUNK + 999
    base = np.zeros(n, BF16)
    ms = [np.round(rng.standard_normal(n) * 4).astype(BF16) / 4 for _ in range(2)]  # few distinct magnitudes
    merged, _ = treecli.merge([{"w": m} for m in ms], "ties", base={"w": base}, density=0.3)
    want = reference(base, ms, [1.0, 1.0], trim=0.3, consensus=True, normalize=True)
    assert bits(merged["w"]) == bits(want)
    kept = [np.count_nonzero(np.asarray(treecli.merge([{"w": m}], "ties", base={"w": base}, density=0.3)[0]["w"]))
            for m in ms]
    assert kept == [int(0.3 * n)] * 2  # exactly k, never the ties beyond it


def spy(monkeypatch, cls, name) -> list:
    calls: list = []
    original = getattr(cls, name)

    def spied(self, *args):
        calls.append(args)
        return original(self, *args)

    monkeypatch.setattr(cls, name, spied)
    return calls


def test_ties_on_a_sampled_leaf_counts_near_the_estimate_in_one_pass(monkeypatch):
    """A leaf larger than the sample: the threshold comes from one pass that counts the keys
    above the sample's estimate and records those near it, ties at the cut included (found
    again in the one block of many that holds the cut)."""
    monkeypatch.setattr(_selection.Trims, "SAMPLE", 4096)
    monkeypatch.setattr(_selection.Trims, "SAMPLE_RUN", 512)
    monkeypatch.setattr(_selection.Trims, "BLOCK", 10_000)
    radix = spy(monkeypatch, _selection.Trims, "_radix")
    rng = np.random.default_rng(2)
    n = 3 * SUB_CHUNK + 999
    base = np.zeros(n, BF16)
    ms = [np.round(rng.standard_normal(n) * 4).astype(BF16) / 4 for _ in range(3)]  # few distinct magnitudes
    merged, _ = treecli.merge([{"w": m} for m in ms], "ties", base={"w": base}, density=0.35)
    assert bits(merged["w"]) == bits(reference(base, ms, [1.0] * 3, trim=0.35, consensus=True, normalize=True))
    assert radix == []


def test_ties_stays_exact_when_the_sample_misleads(monkeypatch):
    """The sampled runs hold tiny deltas and the rest large ones: the estimate is far off,
    and the radix passes find the exact threshold."""
    monkeypatch.setattr(_selection.Trims, "SAMPLE", 4096)
    monkeypatch.setattr(_selection.Trims, "SAMPLE_RUN", 512)
    radix = spy(monkeypatch, _selection.Trims, "_radix")
    rng = np.random.default_rng(4)
    n = 2 * SUB_CHUNK + 77
    step = 512 * -(-n // 4096)
    base = rng.standard_normal(n).astype(np.float32)
    ms = []
    for _ in range(2):
        delta = rng.standard_normal(n)
        for start in range(0, n, step):
            delta[start : start + 512] *= 1e-3
        ms.append((base + delta).astype(np.float32))
    merged, _ = treecli.merge([{"w": m} for m in ms], "ties", base={"w": base}, density=0.5)
    assert bits(merged["w"]) == bits(reference(base, ms, [1.0, 1.0], trim=0.5, consensus=True, normalize=True))
    assert len(radix) == 1 and radix[0] == ([0, 1],)


def test_ties_finds_the_cut_in_a_third_pass_when_the_bin_is_too_full_to_record(monkeypatch):
    monkeypatch.setattr(_selection.Trims, "SAMPLE", 1024)
    monkeypatch.setattr(_selection.Trims, "SAMPLE_RUN", 256)
    monkeypatch.setattr(_selection.Trims, "MAX_RECORDED", 8)  # too few for the near keys, then the bin
    third = spy(monkeypatch, _selection.Trims, "_find_cuts")
    rng = np.random.default_rng(3)
    n = SUB_CHUNK + 4321
    base = np.zeros(n, BF16)
    ms = [np.round(rng.standard_normal(n) * 2).astype(BF16) for _ in range(2)]
    merged, _ = treecli.merge([{"w": m} for m in ms], "ties", base={"w": base}, density=0.6)
    assert bits(merged["w"]) == bits(reference(base, ms, [1.0, 1.0], trim=0.6, consensus=True, normalize=True))
    assert len(third) == 1


def test_dare_is_the_same_whatever_the_chunks_and_keeps_about_density():
    keep = dare_keep(7, "layers.0.w", 1, 0, 100_003, 0.3)
    pieces = np.concatenate([dare_keep(7, "layers.0.w", 1, s, min(100_003, s + 777), 0.3)
                             for s in range(0, 100_003, 777)])
    assert (keep == pieces).all()
    assert abs(keep.mean() - 0.3) < 0.01
    assert not (keep == dare_keep(8, "layers.0.w", 1, 0, 100_003, 0.3)).all()  # the seed matters
    assert not (keep == dare_keep(7, "layers.0.w", 2, 0, 100_003, 0.3)).all()  # so does the model


@pytest.mark.parametrize("method, consensus", [("dare_linear", False), ("dare_ties", True)])
def test_dare_matches_the_reference_and_reads_alike_in_any_chunks(method, consensus):
    base, ms = models(np.float32, shape=(SUB_CHUNK + 5000,), count=2)
    merged, _ = treecli.merge([{"w": m} for m in ms], method, base={"w": base}, density=0.4, seed=5,
                              rescale="density")
    keeps = [dare_keep(5, "w", i, 0, base.size, 0.4) for i in range(2)]
    want = reference(base, ms, [1.0, 1.0], keeps=keeps, rescale_by=0.4, consensus=consensus)
    assert bits(merged["w"]) == bits(want)
    computed, _ = _merge.merge([{"w": m} for m in ms], method, base={"w": base}, density=0.4, seed=5,
                               rescale="density")
    leaf = computed["w"]  # read in pieces that match no block or chunk boundary
    pieces = np.concatenate([leaf.read_flat(s, min(leaf.size, s + 12345)) for s in range(0, leaf.size, 12345)])
    assert pieces.tobytes() == want.tobytes()


def test_a_ties_merge_of_lazy_ties_merges_finishes_and_matches_merging_the_computed_ones():
    """Each TIES leaf selects on first use on two threads; a merge whose inputs are
    themselves lazy merges nests those selections inside the helper thread's blocks."""
    import threading

    base, ms = models(np.float32, shape=(3 * SUB_CHUNK + 11,), count=4, seed=9)
    tree = lambda x: {"w": x}  # noqa: E731
    result: dict = {}

    def nested() -> None:
        inner = [_merge.merge([tree(ms[i]), tree(ms[i + 1])], "ties", base=tree(base), density=0.5)[0]
                 for i in (0, 2)]
        outer, _ = _merge.merge(inner, "ties", base=tree(base), density=0.4)
        result["lazy"] = outer["w"].read()
        computed = [{"w": t["w"].read()} for t in inner]
        result["eager"] = np.asarray(treecli.merge(computed, "ties", base=tree(base), density=0.4)[0]["w"])

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), "the nested merge did not finish (a deadlock between selections)"
    assert bits(result["lazy"]) == bits(result["eager"])


def test_slerp_of_orthogonal_and_parallel_leaves():
    a = {"o": np.array([1.0, 0.0], np.float32), "p": np.array([1.0, 2.0], np.float32)}
    b = {"o": np.array([0.0, 1.0], np.float32), "p": np.array([2.0, 4.0], np.float32)}
    merged, _ = treecli.merge([b], "slerp", base=a, t=0.5)
    half = math.sin(math.pi / 4)  # a quarter turn, halved
    np.testing.assert_allclose(np.asarray(merged["o"]), [half, half], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(merged["p"]), [1.5, 3.0], rtol=1e-6)  # parallel: linear
    at_zero, _ = treecli.merge([b], "slerp", base=a, t=0)
    assert bits(at_zero["o"]) == bits(a["o"])


def test_slerp_matches_the_reference_on_random_bf16_leaves():
    base, (other,) = models(BF16, count=1)
    merged, _ = treecli.merge([{"w": other}], "slerp", base={"w": base}, t=0.3)
    v0, v1 = base.astype(np.float64).reshape(-1), other.astype(np.float64).reshape(-1)
    cosine = (v0 / np.linalg.norm(v0)) @ (v1 / np.linalg.norm(v1))
    theta = math.acos(cosine)
    want = (math.sin(0.7 * theta) / math.sin(theta) * v0 + math.sin(0.3 * theta) / math.sin(theta) * v1)
    assert bits(merged["w"]) == bits(want.astype(BF16).reshape(base.shape))


def test_slerp_of_a_leaf_over_many_blocks_is_the_reference_and_the_same_every_time():
    base, (other,) = models(np.float32, shape=(3 * SUB_CHUNK + 17,), count=1, seed=6)
    runs = [np.asarray(treecli.merge([{"w": other}], "slerp", base={"w": base}, t=0.3)[0]["w"]) for _ in range(3)]
    v0, v1 = base.astype(np.float64), other.astype(np.float64)
    theta = math.acos((v0 @ v1) / (np.linalg.norm(v0) * np.linalg.norm(v1)))
    want = math.sin(0.7 * theta) / math.sin(theta) * v0 + math.sin(0.3 * theta) / math.sin(theta) * v1
    np.testing.assert_allclose(runs[0], want, rtol=1e-6, atol=1e-7)
    assert bits(runs[0]) == bits(runs[1]) == bits(runs[2])


@pytest.mark.parametrize("method, options", [("ties", {"density": 0.5}), ("task_arithmetic", {}),
                                             ("slerp", {"t": 0.5})])
def test_non_finite_values_are_reported_with_their_key_path(method, options, cli, tmp_path):
    base, ms = models(np.float32, count=1 if method == "slerp" else 2)
    ms[0][3, 4] = np.nan
    merged, report = treecli.merge([{"w": m} for m in ms], method, base={"w": base}, **options)
    assert np.isnan(np.asarray(merged["w"])[3, 4])
    assert any(line.startswith("w:") for line in report.warnings()), report.warnings()
    treecli.save({"w": base}, tmp_path / "base.safetensors")
    treecli.save({"w": ms[0]}, tmp_path / "a.safetensors")
    flags = [f"--{k}={v}" for k, v in options.items()]
    result = cli("merge", "--method", method, "--base", tmp_path / "base.safetensors", tmp_path / "a.safetensors",
                 *flags, "-o", tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    assert "warning: w: " in result.stderr and "non-finite values in the output" in result.stderr


def test_rules_scope_parameters_to_subtrees():
    base, ms = models(np.float32, count=2)
    tree = lambda x: {"mlp": {"w": x}, "attn": {"w": x}}  # noqa: E731
    merged, _ = treecli.merge([tree(m) for m in ms], "ties", base=tree(base), density=["0.5", "mlp.**=0.2"])
    assert bits(merged["mlp"]["w"]) == bits(reference(base, ms, [1, 1], trim=0.2, consensus=True, normalize=True))
    assert bits(merged["attn"]["w"]) == bits(reference(base, ms, [1, 1], trim=0.5, consensus=True, normalize=True))
    sl, _ = treecli.merge([tree(ms[0])], "slerp", base=tree(base), t=["0", "mlp.**=1"])
    assert bits(sl["mlp"]["w"]) == bits(ms[0]) and bits(sl["attn"]["w"]) == bits(base)


def test_empty_leaves_merge_and_a_density_keeps_at_least_one_element_as_mergekit():
    base = {"e": np.zeros((0, 4), np.float32), "s": np.zeros((), np.float32)}
    a = {"e": np.zeros((0, 4), np.float32), "s": np.ones((), np.float32)}
    merged, _ = treecli.merge([a], "ties", base=base, density=["1", "e=0.5"])
    assert np.asarray(merged["e"]).shape == (0, 4) and float(np.asarray(merged["s"])) == 1.0
    merged, _ = treecli.merge([a], "ties", base=base, density=0.5)  # int(0.5 * 1) = 0 elements: one kept
    assert float(np.asarray(merged["s"])) == 1.0


def test_integer_leaves_follow_averages_rules():
    base = {"w": np.zeros(3, np.float32), "step": np.int64(1)}
    a = {"w": np.ones(3, np.float32), "step": np.int64(1)}
    b = {"w": np.ones(3, np.float32), "step": np.int64(2)}
    merged, report = treecli.merge([a, b], "task_arithmetic", base=base)
    assert int(np.asarray(merged["step"])) == 2 and report.differing == ["step"]
    with pytest.raises(treecli.StructureError, match="cannot be merged"):
        treecli.merge([a, b], "task_arithmetic", base=base, non_float="error")


@pytest.mark.parametrize("call, fragment", [
    (lambda a, b, base: treecli.merge([a, b], "slerp", base=base, t=0.5), "two models"),
    (lambda a, b, base: treecli.merge([a], "ties", base=base, density=0), "(0, 1]"),
    (lambda a, b, base: treecli.merge([a], "ties", base=base, density=1.5), "(0, 1]"),
    (lambda a, b, base: treecli.merge([a], "ties", base=base, density=["0.5", "nothing.**=0.3"]), "matches nothing"),
    (lambda a, b, base: treecli.merge([a], "ties", base=base, density=["w=0.5", "*=0.3"]), "two rules"),
    (lambda a, b, base: treecli.merge([a, b], "ties"), "base"),
    (lambda a, b, base: treecli.merge([a], "slerp", base=base), "t"),
    (lambda a, b, base: treecli.merge([a], "task_arithmetic", base=base, density=0.5),
     "density is not a parameter of task_arithmetic (it takes lambda)"),
    (lambda a, b, base: treecli.merge([a, b], "median", base=base), "unknown merge method"),
    (lambda a, b, base: treecli.merge([a], "slerp", base=base, t=0.5, density=0.5), "density is not a parameter of slerp (it takes t)"),
    (lambda a, b, base: treecli.merge([a], "ties", base=base, t=0.5), "t is not a parameter of ties (it takes lambda, density)"),
    (lambda a, b, base: treecli.merge([a], "ties", base={"w": np.zeros(4, np.float32)}), "differ"),
])
def test_refusals(call, fragment):
    a, b, base = ({"w": np.full(3, v, np.float32)} for v in (1, 2, 0))
    with pytest.raises(treecli.TreecliError) as info:
        call(a, b, base)
    assert fragment in str(info.value)


def test_cli_merges_mixed_formats_and_names_flags(tmp_path, cli):
    base, ms = models(BF16, count=2)
    treecli.save({"layers": {"0": {"w": base}}}, tmp_path / "base.safetensors")
    treecli.save({"layers": {"0": {"w": ms[0]}}}, tmp_path / "a.npz")
    treecli.save({"layers": {"0": {"w": ms[1]}}}, tmp_path / "b.safetensors")
    out = tmp_path / "ties.safetensors"
    result = cli("merge", "--method", "ties", "--base", tmp_path / "base.safetensors", tmp_path / "a.npz",
                 tmp_path / "b.safetensors", "--density", "0.5", "--weights", "1,2", "-o", out)
    assert result.code == 0, result.stderr
    want = reference(base, ms, [1.0, 2.0], trim=0.5, consensus=True, normalize=True)
    assert bits(treecli.load(out)["layers"]["0"]["w"]) == bits(want)
    assert_clean_error(cli("merge", "--method", "ties", "--base", tmp_path / "base.safetensors",
                           tmp_path / "a.npz", "--density", "2", "-o", tmp_path / "x.safetensors"), "--density '2'")
    assert_clean_error(cli("merge", "--method", "slerp", tmp_path / "a.npz", tmp_path / "b.safetensors",
                           tmp_path / "base.safetensors", "--t", "0.5", "-o", tmp_path / "y.safetensors"),
                       "two models")
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "y.safetensors").exists()


def test_equinox_modules_merge_into_their_own_type():
    eqx = pytest.importorskip("equinox")
    import jax

    base, a, b = (eqx.nn.MLP(2, 3, 4, 2, key=jax.random.PRNGKey(seed)) for seed in range(3))
    merged, _ = treecli.merge([a, b], "task_arithmetic", base=base, lambda_=0.5)
    assert type(merged) is eqx.nn.MLP and isinstance(merged.layers[0].weight, jax.Array)
    want = (np.asarray(base.layers[0].weight, np.float64)
            + 0.5 * (np.asarray(a.layers[0].weight, np.float64) - np.asarray(base.layers[0].weight)
                     + np.asarray(b.layers[0].weight, np.float64) - np.asarray(base.layers[0].weight)))
    assert bits(merged.layers[0].weight) == bits(want.astype(np.float32))


def test_the_rescale_flag_names_the_choice(cli, tmp_path):
    base, ms = models(np.float32, count=2)
    for name, array in (("base", base), ("a", ms[0]), ("b", ms[1])):
        save_file({"w": array}, str(tmp_path / f"{name}.safetensors"))
    args = ["merge", "--method", "dare_linear", "--base", tmp_path / "base.safetensors", tmp_path / "a.safetensors",
            tmp_path / "b.safetensors", "--density", "0.5"]
    assert cli(*args, "-o", tmp_path / "density.safetensors", "--rescale", "density").code == 0
    expected, _ = treecli.merge([{"w": m} for m in ms], "dare_linear", base={"w": base}, density=0.5,
                                rescale="density")
    assert load_file(str(tmp_path / "density.safetensors"))["w"].tobytes() == bits(expected["w"])
    assert_clean_error(cli(*args, "-o", tmp_path / "x.safetensors", "--rescale", "l2"),
                       "--rescale 'l2': choose one of l1, density, none")
    assert_clean_error(cli("merge", "--method", "ties", "--base", tmp_path / "base.safetensors",
                           tmp_path / "a.safetensors", "--rescale", "density", "-o", tmp_path / "t.safetensors"),
                       "--rescale 'density' is for dare_linear, dare_ties; ties takes l1 or none")
