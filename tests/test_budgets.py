"""budgets.py: a --compression target is a ceiling. Every policy of the registry takes every target from 1/2 to
1/32 on the CPU's default K^T (int4 for the policies that read K^T) at 1k-16k tokens: it achieves the target, or
reads less and says so (a budget larger than all it can spend), or, where even its smallest setting reads more
than asked (FlexGen's top-k reads all of K), refuses in one line naming its range."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from budgets import REACH_TOLERANCE, Storage, reachable_compression, solve_target
from cache import KVFormat
from cli import UserError
from conftest import channels_file
from model import ModelArgs
from policies import POLICIES, AttentionSettings

SMOLLM2 = ModelArgs.from_shape("smollm2")  # 30 layers, d = 64, fp32 activations: the embedded model's shape
TARGETS = [Fraction(1, n) for n in (2, 4, 8, 16, 32)]
LENGTHS = (1024, 4096, 16384)


def storage_for(policy: str) -> Storage:
    reads_kt = POLICIES[policy].reads_kt
    return Storage(KVFormat(kt_dtype="int4" if reads_kt else "same"), torch.float32)


def settings_for(policy: str, target: Fraction) -> AttentionSettings:
    return AttentionSettings(policy, compression=target, sparq_r=16 if policy == "sparq-fixed-r" else None,
                             channels=channels_file(SMOLLM2) if policy == "doublesparse" else None)


@pytest.mark.parametrize("policy", [name for name in POLICIES if name != "dense"])
def test_every_policy_takes_every_target(policy):
    for target in TARGETS:
        for seq_len in LENGTHS:
            settings = settings_for(policy, target)
            try:
                budget = solve_target(settings, seq_len, SMOLLM2, storage_for(policy))
            except UserError as e:  # only where its smallest setting reads more than asked
                lowest, _ = reachable_compression(settings, seq_len, SMOLLM2, storage_for(policy))
                assert lowest > float(target) and "out of reach" in str(e), (policy, target, seq_len, lowest)
                continue
            assert budget.achieved <= float(target) * (1 + REACH_TOLERANCE), (policy, target, seq_len, budget)
            if budget.achieved < float(target) * (1 - REACH_TOLERANCE):  # less than asked: said, never refused
                assert "below the target" in budget.describe(), budget.describe()


def test_a_generous_target_is_spent_and_a_small_one_shrinks_k():
    """SparQ at 1/4 on the int4 K^T (3.3k tokens: all of K^T is 0.11 of dense's bytes, where it was refused)
    reads every component and spends the rest on positions; at 1/32 on 1k tokens (k = 128 alone would read more)
    it halves k until r fits; FlexGen's top-k under 1/2 is out of reach; Quest at 1/16 on 16k takes larger pages
    where 16-position pages' metadata alone would be the whole budget."""
    int4 = storage_for("sparq")
    generous = solve_target(AttentionSettings("sparq", compression=Fraction(1, 4)), 3329, SMOLLM2, int4)
    assert generous.settings.sparq_r == 64 and generous.settings.sparq_k > 128
    assert generous.achieved == pytest.approx(0.25, rel=REACH_TOLERANCE)
    small = solve_target(AttentionSettings("sparq", compression=Fraction(1, 32)), 1024, SMOLLM2, int4)
    assert small.settings.sparq_k < 128 and small.achieved == pytest.approx(1 / 32, rel=REACH_TOLERANCE)
    with pytest.raises(UserError, match="out of reach of topk"):
        solve_target(AttentionSettings("topk", compression=Fraction(1, 4)), 4096, SMOLLM2, storage_for("topk"))
    quest = solve_target(AttentionSettings("quest", compression=Fraction(1, 32)), 16384, SMOLLM2, storage_for("quest"))
    assert quest.settings.page_size > 16 and quest.achieved <= 1 / 32 * (1 + REACH_TOLERANCE)
