"""Where `load_pretrained` finds a model: a local directory, or a hub id in the Hugging Face cache (offline)."""

from __future__ import annotations

import pytest

from ndparallel.errors import ModelError
from ndparallel.weights.pretrained import model_directory

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


def _cache(tmp_path):
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_local_directory_is_used_as_is(tmp_path):
    assert model_directory(tmp_path) == tmp_path


def test_hub_id_from_the_cache(tmp_path):
    snapshot = _cache(tmp_path)
    assert model_directory("org/tiny", cache_dir=str(tmp_path), local_files_only=True) == snapshot
    assert model_directory("org/tiny", revision=COMMIT, cache_dir=str(tmp_path), local_files_only=True) == snapshot


@pytest.mark.parametrize("name", ["./no/such/dir", "org/missing"])
def test_what_cannot_be_found_is_one_line_naming_it(tmp_path, name):
    with pytest.raises(ModelError, match=f"{name!r} is neither a local directory nor a model") as info:
        model_directory(name, cache_dir=str(tmp_path), local_files_only=True)
    assert "\n" not in str(info.value)
