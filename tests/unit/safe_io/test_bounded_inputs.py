"""YAML and regular expressions from files: bounded, each refusal one line."""

from __future__ import annotations

import time

import pytest

from ndparallel.errors import CheckpointError, ConfigError
from ndparallel.safe_io import bounded_regex, bounded_yaml


@pytest.mark.parametrize(
    "text, message",
    [
        ("a: &a [*a]", "contains itself through an alias"),
        ("a: &a [1, 2]\nb: [*a, *a]", None),  # aliases that stay small are fine
        ("[" * 65 + "]" * 65, "is nested more than 64 levels deep"),
        ("[" * 50000 + "]" * 50000, "is nested too deeply to read"),
    ],
)
def test_yaml_is_refused_when_it_contains_itself_or_nests_too_deeply(text, message):
    if message is None:
        assert bounded_yaml.load(text, source="c.yaml") == {"a": [1, 2], "b": [[1, 2], [1, 2]]}
        return
    with pytest.raises(ConfigError, match=f"c.yaml {message}") as caught:
        bounded_yaml.load(text, source="c.yaml")
    assert "\n" not in str(caught.value)


def test_a_regex_that_backtracks_without_end_is_stopped(monkeypatch):
    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]
    assert bounded_regex.fullmatches(r".*\.layers\.[02]\..*", names, what="target_regex") == {names[0], names[2]}
    monkeypatch.setattr(bounded_regex, "TIMEOUT_S", 1.0)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"extra.json target_regex '\(\.\*\)\*\(\.\*\)\*X' takes more than 1 s"):
        bounded_regex.fullmatches("(.*)*(.*)*X", names, what="extra.json target_regex", error=CheckpointError)
    assert time.monotonic() - start < 10
    with pytest.raises(ConfigError, match=r"'\(' is not a usable regular expression \(re.error: missing \)"):
        bounded_regex.fullmatches("(", names, what="target_regex")
