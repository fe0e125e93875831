"""``fathom generate`` over a mesh: several prompts as a batch, the batch padded where prompts x KV heads do not split
over the devices (and said), the CPU devices a mesh needs made by the command. The two-process launch itself:
tests/test_distributed.py."""

import os
import subprocess
import sys

import numpy as np
import pytest

from fathom_jax.cli import app as cli
from fathom_jax.cli import generate_command as gen
from fathom_jax.models import hub
from fathom_jax.models.config import LlamaConfig
from tests.support import CharTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# SmolLM2's attention layout (3 KV heads), tiny: what the batch and the mesh split
TINY = LlamaConfig(vocab=97, hidden=24, intermediate=32, n_layers=1, n_heads=3, n_kv_heads=3, head_dim=8)


@pytest.mark.parametrize("batch, kv_heads, devices, want", [(1, 3, 2, 2), (2, 3, 2, 2), (2, 3, 4, 4), (3, 3, 4, 4),
                                                            (1, 1, 2, 2), (1, 8, 4, 1), (3, 8, 4, 3), (1, 2, 4, 2)])
def test_mesh_batch_is_the_least_batch_whose_groups_split(batch, kv_heads, devices, want):
    got = gen.mesh_batch(batch, kv_heads, devices)
    assert got == want and got * kv_heads % devices == 0
    assert all((b * kv_heads) % devices for b in range(batch, got))


def test_the_split_line_says_what_each_device_holds_and_the_padding():
    assert gen.describe_split(2, 2, 3, 2) == ("--mesh 2 splits 2 sequence(s) x 3 KV head(s) = 6 (sequence, KV head) "
                                              "groups, 3 per device; each device holds 1 whole sequence(s): the batch "
                                              "is split")
    line = gen.describe_split(1, 2, 3, 2)
    assert line.endswith("; 1 prompt(s) x 3 = 3 groups do not split over 2 devices, so the batch is padded with 1 "
                         "copy(ies) of the last prompt (their tokens are not printed; give 2 prompts to use them)")
    assert "each device holds 4 of a sequence's 8 KV heads: the heads are split" in gen.describe_split(1, 1, 8, 2)
    assert "a sequence's KV heads span devices" in gen.describe_split(2, 2, 3, 3)


@pytest.fixture
def tiny(monkeypatch):
    """A real tiny model with 3 KV heads behind the hub, and ``models.generate`` recorded (its tokens made up)."""
    from flax import nnx

    import fathom_jax.models as models
    from fathom_jax.models import LlamaForCausalLM

    model = LlamaForCausalLM(TINY, rngs=nnx.Rngs(0))
    monkeypatch.setattr(hub, "model_config", lambda source=None: TINY)
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: CharTokenizer())
    monkeypatch.setattr(hub, "load_model", lambda source=None: (model, CharTokenizer(), TINY))
    seen = {}

    def fake_generate(model, prompt, n, *, capacity, attention_fn=None, lengths=None):
        seen.update(prompt=np.asarray(prompt), lengths=lengths, attn=attention_fn, capacity=capacity)
        batch = prompt.shape[0] if prompt.ndim == 2 else 1
        return np.arange(batch * n, dtype=np.int32).reshape((batch, n) if prompt.ndim == 2 else (n,))

    monkeypatch.setattr(models, "generate", fake_generate)
    return seen


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_one_prompt_over_two_devices_pads_the_batch_and_says_so(capsys, tiny):
    code, out, err = run(capsys, "generate", "abcdef", "--method", "fathom:8", "--k", "40", "--max-new-tokens", "3",
                         "--mesh", "2")
    assert code == 0, err
    assert gen.describe_split(1, 2, 3, 2) in err
    assert tiny["prompt"].shape == (2, 6) and (tiny["prompt"][0] == tiny["prompt"][1]).all()  # the copy
    assert np.asarray(tiny["lengths"]).tolist() == [6, 6] and tiny["attn"].placement.num_shards == 2
    assert out == "abcdef" + CharTokenizer().decode([0, 1, 2]) + "\n"  # the prompt's own tokens; the copy's dropped


def test_prompts_of_several_lengths_decode_as_one_right_padded_batch(capsys, tiny, tmp_path):
    """Several prompts (or --prompt-file, repeated) are a batch, dense included (through the sparse cache: the dense
    cache is not ragged); each continuation printed under its prompt's name."""
    code, out, err = run(capsys, "generate", "abcdefgh", "xyz", "--max-new-tokens", "2", "--k", "40")
    assert code == 0, err
    assert tiny["prompt"].shape == (2, 8) and np.asarray(tiny["lengths"]).tolist() == [8, 3]
    assert tiny["attn"].method.name == "dense" and "for each of 2 prompts" in err
    decode = CharTokenizer().decode
    assert out == f"--- 1 of 2 (prompt) ---\nabcdefgh{decode([0, 1])}\n--- 2 of 2 (prompt) ---\nxyz{decode([2, 3])}\n"
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for f, text in zip(files, ("first prompt", "second")):
        f.write_text(text)
    code, out, err = run(capsys, "generate", "--prompt-file", str(files[0]), "--prompt-file", str(files[1]),
                         "--max-new-tokens", "2", "--k", "40")
    assert code == 0 and tiny["prompt"].shape == (2, 12) and f"(--prompt-file '{files[1]}') ---\n{decode([2, 3])}\n" in out
    code, _, err = run(capsys, "generate", "x", "--prompt-file", str(files[0]))
    assert code == 2 and "give the prompts as text or as --prompt-file, not both" in err
    code, _, err = run(capsys, "generate", "x", " ")
    assert code == 2 and "argument prompt: the prompt is empty" in err


def test_a_mesh_that_the_processes_do_not_divide_is_refused_before_joining(capsys, monkeypatch):
    from fathom_jax import distributed

    monkeypatch.setattr(distributed, "initialize", lambda *a, **k: pytest.fail("joined before checking --mesh"))
    code, _, err = run(capsys, "generate", "x", "--mesh", "3", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                       "--process-id", "0")
    assert code == 2 and err.count("\n") == 1
    assert "argument --mesh: 3 devices do not split evenly over --num-processes 2" in err


_DEVICES = """
from fathom_jax.cli.generate_command import make_cpu_devices
print(make_cpu_devices({mesh}, {processes}))
import jax
print(jax.local_device_count(), jax.default_backend())
"""


@pytest.mark.parametrize("mesh, processes, flags, want", [
    (4, 2, "", ("--mesh 4 on the CPU: 2 CPU devices in this process (and in each of the other 1)", "2 cpu")),
    (2, 1, "", ("--mesh 2 on the CPU: 2 CPU devices in this process", "2 cpu")),
    (2, 2, "", ("None", "1 cpu")),  # one device each: nothing to make
    (4, 1, "--xla_force_host_platform_device_count=3", ("None", "3 cpu")),  # the user's count stands
])
def test_the_cpu_devices_a_mesh_needs_are_made_before_jax_starts(mesh, processes, flags, want):
    """A fresh interpreter (the device count is fixed once JAX starts): ``--mesh`` on the CPU ran only with an
    ``XLA_FLAGS`` device count the README did not give."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags, PYTHONPATH=ROOT)
    run_ = subprocess.run([sys.executable, "-c", _DEVICES.format(mesh=mesh, processes=processes)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert run_.returncode == 0, run_.stderr
    assert tuple(run_.stdout.splitlines()) == want


def test_a_selection_shared_across_layers_reaches_the_attention(capsys, tiny):
    """``--method METHOD@share=...@budget=B``: the hook shares the selection; a plan the model cannot hold is refused
    before the model loads."""
    code, _, err = run(capsys, "generate", "abcdefgh" * 6, "--method", "sparq:4@share=0@budget=44", "--k", "40",
                       "--max-new-tokens", "2")
    assert code == 0, err
    assert tiny["attn"].sharing.budget == 44 and tiny["attn"].method.spec == "sparq:4"
    assert "selection shared across layers: layers 0 scan and select" in err
    code, _, err = run(capsys, "generate", "abc", "--method", "sparq:4@share=0,9@budget=44", "--k", "40")
    assert code == 2 and "layer 9 is out of range" in err and "loading" not in err
    code, _, err = run(capsys, "generate", "abc", "--method", "sparq:4@share=0@budget=44@rank=best", "--k", "40")
    assert code == 2 and "ranking must be one of" in err
