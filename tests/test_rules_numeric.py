"""Every rule family, run numerically on sharded data (DTensor's strategy validation).

For a representative equation of each family, a deterministic sample of the
rule's strategies on 8 fake CPU devices is laid out, run on local shards with
``shardsolve.rules.local.run_local`` inside ``jax.shard_map``, recombined and
compared with the unsharded primitive (see ``shardsolve.rules.validate``).
``experiments/validate_rules.py`` runs every strategy instead of a sample.
"""

from __future__ import annotations

import pytest
from rule_cases import CASES, MESHES, by_name, equation

from shardsolve.mesh import MeshSpec
from shardsolve.rules.base import Rule
from shardsolve.rules.validate import check_many, validate

SAMPLE = 8  # strategies per (equation, mesh), plus a few partial and reducing ones


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rule_is_numerically_valid(case, mesh):
    eqn = equation(case)
    checked, bad = validate(
        eqn, MeshSpec.parse(mesh), limit=SAMPLE, int_range=case.int_range, rtol=case.rtol, atol=case.atol
    )
    assert checked >= 1
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.parametrize(
    "case_name, wrong_rule",
    [
        ("cumsum", "([i, j])->([i, j]) {i=8, j=4}"),  # the scanned dimension split
        ("argmax", "([i, j])->([i]) {i=8, j=4} reduction={j}"),  # argmax as a summed reduction
        ("exp", "([i, j])->([i, j]) {i=8, j=4} linear={(0)}"),  # exp claimed linear
        ("embedding_grad", "([i, j], [k, l, m], [k, l, j])->([i, j]) {i=16, j=8, k=4, l=8, m=1} linear={(0, 2)}"),
    ],
)
def test_validator_catches_wrong_rules(case_name, wrong_rule):
    eqn = equation(by_name(case_name))
    rule = Rule.parse(wrong_rule)
    mesh = MeshSpec.parse("a=2,b=4")
    strategies = [s for s in rule.strategies(mesh) if s.assignment or s.partial_via]
    bad = check_many(eqn, rule, strategies, mesh, int_range=by_name(case_name).int_range)
    assert bad, f"no strategy of the wrong rule {wrong_rule} was caught"
