"""``slice``: index every array leaf, with different indices for different subtrees.

Rules are ``(pattern or None, index)``. A rule without pattern is the default
for every array leaf; a pattern rule applies to every leaf under the subtrees
it matches and overrides the default. ``None`` and non-array leaves pass
through (the nested ``tree_map`` of Equinox: the outer map hands each subtree
its index, the inner map applies it to each array).

The result is a tree of computed leaves: nothing is read until a writer asks
for chunks, and then only the source rows those chunks need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treecli import _index, _keypath, _leaf, _tree
from treecli._errors import KeyPathError, UsageError, option
from treecli._escape import clipped
from treecli._keypath import format_keypath
from treecli._tensor_ops import sliced_leaf


@dataclass
class Rule:
    """One ``--index [PATTERN=]INDEX``."""

    text: str
    pattern: str | None
    index: tuple

    @classmethod
    def parse(cls, text: str) -> "Rule":
        """``"encoder.layers=3"`` -> pattern ``encoder.layers``, index ``(3,)``; ``":, :128"`` -> default."""
        pattern, index_text = None, text
        try:
            pattern, index_text = _keypath.split_assignment(text)
        except KeyPathError:
            pass
        if pattern is not None:
            _keypath.parse(pattern.strip())  # a syntax error names the rule
            pattern = pattern.strip()
        try:
            index = _index.parse(index_text)
        except UsageError as e:
            raise UsageError(f"{option('rules', text)}: {e.message}") from None
        return cls(text, pattern, index)


@dataclass
class SliceReport:
    """What slicing did, for ``--dry-run`` and the summary line."""

    changed: list[tuple[str, tuple, tuple, str, str]] = field(default_factory=list)  # keypath, before, after, dtype, rule
    skipped: list[str] = field(default_factory=list)  # default rule, too few dimensions
    passed_through: int = 0

    def vectors_taken_apart(self) -> list[str]:
        """The 1-d leaves (a norm's or a bias's weights) an integer index took one element
        of: what ``model.layers.*=0`` does to a layer's norms when a layer was meant."""
        return [keypath for keypath, before, after, _, _ in self.changed if len(before) == 1 and not after]


def slice_tree(tree: Any, rules: list[Rule | str]) -> tuple[Any, SliceReport]:
    """Apply index rules to a tree; returns the new tree (computed leaves) and a report.

    Raises:
        UsageError: two default rules; a rule that does not fit a leaf (key path, shape and index named).
        KeyPathError: a pattern that matches nothing (closest key paths named), or two
            pattern rules matching one leaf.
    """
    rules = [Rule.parse(r) if isinstance(r, str) else r for r in rules]
    defaults = [r for r in rules if r.pattern is None]
    if len(defaults) > 1:
        raise UsageError(f"two default rules ({option('rules', defaults[0].text)}, "
                         f"{option('rules', defaults[1].text)}); give one")
    default = defaults[0] if defaults else None
    pattern_rules = [(r, _keypath.parse(r.pattern)) for r in rules if r.pattern is not None]
    for rule, parsed in pattern_rules:
        if not any(_keypath.matches(parsed, kp) for kp, _ in _tree.iter_nodes(tree)):
            raise _tree.no_match(tree, rule.pattern, f"{option('rules', rule.text)} matches nothing")

    report = SliceReport()

    def apply(keypath: tuple, leaf: Any) -> Any:
        text = format_keypath(keypath)
        hits = [rule for rule, parsed in pattern_rules if _keypath.covers(parsed, keypath)]
        if len(hits) > 1:
            raise KeyPathError(f"matched by two rules: {option('rules', hits[0].text)} and "
                               f"{option('rules', hits[1].text)}", keypath=text)
        if not _leaf.is_array(leaf):
            report.passed_through += 1
            return leaf
        leaf = _leaf.as_leaf(leaf)
        rule = hits[0] if hits else default
        if rule is None:
            report.passed_through += 1
            return leaf
        if rule is default and leaf.ndim < _index.indexed_dims(rule.index):
            report.skipped.append(text)
            return leaf
        try:
            shape = _index.result_shape(leaf.shape, rule.index)
        except IndexError as e:
            raise UsageError(
                f"index [{clipped(_index.format_index(rule.index))}] does not fit shape {list(leaf.shape)}: {e}",
                keypath=text,
            ) from None
        report.changed.append((text, leaf.shape, shape, leaf.dtype_name, rule.text))
        return sliced_leaf(leaf, rule.index, shape)

    return _tree.map_leaves(apply, tree), report
