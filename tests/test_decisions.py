"""Every scheduling decision of tests/decisions.py's configurations is as recorded in tests/decisions.json
(recorded before the scheduler was split into a core and policies, at f6976cb). A change that means to
change decisions records them again: `python tests/decisions.py tests/decisions.json`, and says why."""
import json
import os

import pytest

from decisions import CONFIGS, fingerprint

RECORDED = json.load(open(os.path.join(os.path.dirname(__file__), "decisions.json")))


def test_every_configuration_is_recorded():
    assert sorted(RECORDED) == sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decisions_are_as_recorded(name):
    assert fingerprint(**CONFIGS[name]) == RECORDED[name]
