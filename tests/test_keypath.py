import pytest
from hypothesis import given
from hypothesis import strategies as st

from treecli import _tree
from treecli._errors import KeyPathSyntaxError
from treecli._keypath import Segment, covers, format_keypath, matches, natural_sort_key, parse, split_assignment


def test_dotted_paths_parse_to_keys_and_bare_integers():
    assert parse("params.dense.kernel") == (Segment("key", "params"), Segment("key", "dense"), Segment("key", "kernel"))
    assert parse("layers.0") == (Segment("key", "layers"), Segment("bare", "0"))


def test_brackets_quote_odd_keys_and_jax_keystr_is_accepted():
    assert parse('model["a.b"].weight') == (Segment("key", "model"), Segment("key", "a.b"), Segment("key", "weight"))
    assert parse("['params']['dense'][0]") == (Segment("key", "params"), Segment("key", "dense"), Segment("index", 0))
    assert parse('["0"]') == (Segment("key", "0"),)


@pytest.mark.parametrize(
    "text, position, reason",
    [
        ("a..b", 2, "empty segment"),
        (".[0]", 0, "empty segment"),  # `.layers` (JAX's keystr) parses, a dot before a bracket does not
        ("a.", 2, "ends with '.'"),
        ("a[", 1, "unterminated '['"),
        ('a["x', 1, "unterminated quoted key"),
        ('a["x"b', 5, "expected ']'"),
        ("a[x]", 2, "integer index or a quoted key"),
        ("a b", 1, "not allowed in a bare key"),
        ('a]b', 1, "not allowed in a bare key"),
        ('a["x"]b', 6, "expected '.' or '['"),
    ],
)
def test_syntax_errors_name_the_position_and_reason(text, position, reason):
    with pytest.raises(KeyPathSyntaxError) as info:
        parse(text)
    assert info.value.position == position
    assert reason in info.value.message
    assert info.value.details == [text, " " * position + "^"]


def test_format_quotes_only_what_needs_it():
    assert format_keypath(("model", "layers", "0", "weight")) == "model.layers.0.weight"
    assert format_keypath(("model", "a.b", "weight")) == 'model["a.b"].weight'
    assert format_keypath(("opt_state", 0, "mu")) == "opt_state.0.mu"
    assert format_keypath(("", "x y", 'q"')) == '[""]["x y"]["q\\""]'
    assert format_keypath(()) == ""


def _resolves_to(keypath, tree):
    return _tree.find(tree, format_keypath(keypath)) == [keypath]


keys = st.one_of(st.text(max_size=12), st.integers(min_value=0, max_value=10**6))


@given(st.lists(keys, min_size=1, max_size=5))
def test_format_then_parse_round_trips(keypath):
    keypath = tuple(keypath)
    parsed = parse(format_keypath(keypath))
    assert len(parsed) == len(keypath)
    assert matches(parsed, keypath)
    for segment, key in zip(parsed, keypath):
        if isinstance(key, str) and not key.lstrip("-").isdigit():
            assert segment == Segment("key", key)


@given(st.dictionaries(st.text(max_size=6), st.dictionaries(st.text(max_size=6), st.integers(), min_size=1),
                       min_size=1, max_size=4))
def test_every_formatted_key_path_resolves_to_its_own_node(tree):
    for keypath, _ in _tree.iter_nodes(tree):
        if keypath:
            assert _resolves_to(keypath, tree)


def test_bare_integers_match_sequence_indices_and_digit_string_keys():
    assert matches(parse("layers.0"), ("layers", "0"))
    assert matches(parse("layers.0"), ("layers", 0))
    assert not matches(parse("layers[0]"), ("layers", "0"))
    assert not matches(parse('layers["0"]'), ("layers", 0))


def test_globs_and_double_star():
    assert matches(parse("**.bias"), ("a", "b", "bias"))
    assert matches(parse("**.bias"), ("bias",))
    assert matches(parse("model.layers.*.mlp.**"), ("model", "layers", "3", "mlp", "up", "w"))
    assert not matches(parse("model.layers.*.mlp.**"), ("model", "layers", "3", "attn", "w"))
    assert matches(parse("*_proj"), ("q_proj",))
    assert not matches(parse("*_proj"), ("q_proj", "weight"))
    assert covers(parse("*_proj"), ("q_proj", "weight"))
    assert covers(parse("opt_state"), ("opt_state", 0, "mu", "w"))


def test_natural_order_puts_2_before_10():
    assert sorted(["10", "2", "1", "b", "a10", "a9"], key=natural_sort_key) == ["1", "2", "10", "a9", "a10", "b"]


def test_assignment_splits_at_the_first_equals_outside_quotes():
    assert split_assignment('a["x=y"].b=3') == ('a["x=y"].b', "3")
    assert split_assignment("a=b=c") == ("a", "b=c")
    with pytest.raises(KeyPathSyntaxError):
        split_assignment("abc")
