"""The rank-agreement header and its message, without a spawn (the spawned layouts are in test_reducer_layouts)."""

from __future__ import annotations

import os
import subprocess
import sys

from slime_rc import RolloutCorrectionConfig
from slime_rc.correction import agreement
from slime_rc.slime.settings import SlimeMisSettings


def test_fingerprint_is_the_same_in_another_process_with_another_hash_seed():
    config = RolloutCorrectionConfig(is_level="sequence", is_upper_bound=2.5)
    code = ("from slime_rc import RolloutCorrectionConfig; from slime_rc.correction import agreement; "
            "print(agreement.fingerprint(RolloutCorrectionConfig(is_level='sequence', is_upper_bound=2.5)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONHASHSEED="12345"))
    assert int(out.stdout.strip()) == agreement.fingerprint(config)


def test_fingerprint_tells_settings_apart():
    a = RolloutCorrectionConfig(is_level="token", is_upper_bound=2.0)
    assert agreement.fingerprint(a) == agreement.fingerprint(RolloutCorrectionConfig(is_level="token",
                                                                                     is_upper_bound=2.0))
    assert agreement.fingerprint(a) != agreement.fingerprint(RolloutCorrectionConfig(is_level="token",
                                                                                     is_upper_bound=2.0001))
    assert agreement.fingerprint(SlimeMisSettings(use_tis=True)) != agreement.fingerprint(SlimeMisSettings())


def test_agreeing_headers_give_no_message_and_each_difference_is_named():
    config = RolloutCorrectionConfig(is_level="token")
    # ranks 0, 1 form one CP group (key 0), ranks 2, 3 another (key 2); DP peers may hold different counts
    same = [agreement.header(config, n, key, rank) for rank, (n, key) in enumerate([(5, 0), (5, 0), (7, 2), (7, 2)])]
    assert agreement.disagreement("f", same) is None

    other_version = [list(h) for h in same]
    other_version[3][agreement.PROTOCOL] += 1
    message = agreement.disagreement("f", other_version)
    assert "different slime-rc versions (ranks 0, 1, 2; rank 3)" in message

    uneven = [list(h) for h in same]
    uneven[1][agreement.SEQUENCES] = 4
    message = agreement.disagreement("f", uneven)
    assert "rank 0 holds 5; rank 1 holds 4" in message and "rank 2" not in message

    other = RolloutCorrectionConfig(is_level="token", veto_threshold=1e-4)
    mixed = same[:2] + [agreement.header(other, 7, 2, 2), agreement.header(other, 7, 2, 3)]
    settings = [agreement.settings_dict(c) for c in (config, config, other, other)]
    message = agreement.disagreement("f", mixed, settings)
    assert message.startswith("f: the ranks disagree before their first collective")
    assert "veto_threshold: ranks 0, 1 have None, ranks 2, 3 have 0.0001" in message
    assert "is_level" not in message  # only the keys that differ
