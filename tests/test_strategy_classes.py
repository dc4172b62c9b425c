"""``rules.base.strategies_of`` shares the strategies of rules of one structure whose factor sizes split alike:
what it returns is always what the rule's own ``strategies`` works out."""

from __future__ import annotations

import itertools

import pytest

from shardsolve.mesh import MeshSpec
from shardsolve.rules.base import Rule, strategies_of

TEMPLATES = [
    "([i, j], [i, j])->([i, j]) {{i={0}, j={1}}}",
    "([i, k], [k, j])->([i, j]) {{i={0}, j={1}, k={2}}} reduction={{k}}",
    "([i, j])->([i]) {{i={0}, j={1}}} reduction={{j}}(max)",
    "([ij])->([i, j]) {{i={0}, j={1}}}",
    "([i, j, k])->([i, jk]) {{i={0}, j={1}, k={2}}}",
]
SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 30, 64]
MESHES = ["a=2,b=4", "a=2,b=2,c=2", "x=8", "a=1,b=4", "a=3,b=2"]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("uneven", [True, False])
def test_shared_strategies_are_each_rules_own(template, mesh, uneven):
    spec = MeshSpec.parse(mesh)
    for sizes in itertools.product(SIZES, repeat=template.count("=") - template.count("reduction=")):
        rule = Rule.parse(template.format(*sizes))
        fixed = (1,) if len(rule.operands) > 1 else ()
        want = tuple(rule.strategies(spec, fixed_operands=fixed, allow_uneven=uneven))
        assert strategies_of(rule, spec, fixed, uneven) == want, str(rule)
