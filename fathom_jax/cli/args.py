"""The CLI's argument types and checks: everything ``fathom`` verifies before it loads a model.

One rule per argument, stated once (``k >= 36``, positive counts, methods against the model's head_dim,
contexts against its ``max_position_embeddings``, the memory a run needs against what is available, a
writable ``--out``), the error convention (:class:`UsageError`: one line, exit status 2), and the metadata
every results file records. Subcommands registered from other modules reuse them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import shlex
import tempfile
from collections.abc import Callable

from fathom_jax.models.sizing import available_bytes, cache_layers, param_count, peak_bytes, shortfall  # noqa: F401  (the CLI's API)

EXIT_FAILURE = 1
EXIT_USAGE = 2
# Where the commands write unless --out says otherwise: a folder git ignores (.gitignore), so that a run never
# overwrites a committed file nor makes later results record their commit as -dirty. results/ holds the committed
# runs (--out results replaces one; `fathom compare` compares a run with it).
RUNS = "runs"
NO_JAX = ("fetch-model", "compare")  # commands that never start JAX's backend
MIN_K = 36  # every query head keeps 4 sink + 32 local tokens (fathom_jax.select)
GiB = 1024**3
MiB = 1024**2

BUDGET_GUIDE = """\
choosing a scan budget (bits are per token, per KV head, per layer; D = the model's head_dim):
  fathom:B      reads B code bits (at most 4 D) spread over the channels the query needs, plus 16 bits
                of fp16 scale per 64 tokens for each channel it reads: B + 0.25 x channels read.
  sparq:R       reads R whole channels at 4 bits: 4.25 R bits (D = 64: sparq:8 = 34, sparq:16 = 68;
                D = 128: sparq:16 = 68, sparq:32 = 136).
  fathom:B is a code-bit budget at the model's own D, not rescaled from the paper's D = 128. To compare
  with sparq:R at equal bits pick B a little under 4 R; on SmolLM2 (D = 64,
  results/fidelity_smollm2_8k.md) fathom:28 reads 32.4 bits (SparQ r = 8: 34), fathom:48 55.1 bits
  (SparQ r = 16: 68), fathom:64 73.1 bits. Dense attention reads 16 D bits (1024 at D = 64).
  --k is the tokens each query head attends to (4 sink + 32 local + the top-scoring rest): k must be
  at least 36, and is sparse only when it is well below the context."""


class UsageError(Exception):
    """A bad argument: reported as one line naming it, exit status 2."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in --help, except for flags and for None (whose help says what happens instead)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block) and ``--debug`` on every (sub)command."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        # SUPPRESS: a subcommand's unset --debug must not overwrite `fathom --debug <command>`.
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="show the full traceback of an error")

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def positive_int(minimum: int = 1, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (``why`` explains the bound in the message)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}{why}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def method_spec(text: str):
    """An argparse type: ``dense`` or a scan method spec (fathom_jax.methods.parse), with or without a selection
    shared across layers (``fathom:48@share=0,2@budget=512``: a fathom_jax.methods.sharing.SharedMethod)."""
    from fathom_jax.methods import sharing

    if text.strip().lower() == "dense":
        return "dense"
    try:
        return sharing.parse_method(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


K_TYPE = positive_int(MIN_K, " (every query head keeps 4 sink + 32 local tokens)")


def fraction(text: str) -> float:
    """An argparse type: a finite number in (0, 1] (``inf`` and ``nan`` parse as floats, and overflowed later)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"expected a fraction of the context in (0, 1], got {text!r}")
    return value


def untuned_error(method, statistics: str) -> str | None:
    """Why ``method`` cannot run on ``statistics`` that are no tuned calibration (None: it can): ``fathom_tuned``
    reads tuned budgets, ``:observed`` the calibration keys' plane errors (``methods.needs_tuned_calibration``)."""
    from fathom_jax.methods import FathomTuned, needs_tuned_calibration

    needs = needs_tuned_calibration(method)
    if needs is None:
        return None
    if isinstance(method, FathomTuned):
        return (f"{method.spec} reads {needs}, which {statistics} are not (fathom tune makes one; fathom sweep "
                "measures tuned budgets); here use a flat budget in bits as read, e.g. fathom_bits:55")
    return (f"{method.spec}: it reads {needs}, which {statistics} do not hold; drop ':observed' "
            f"({method.spec.replace(':observed', '')})")


class Distinct(argparse.Action):
    """``nargs="+"`` values each given once: ``--context 256 256`` would run one study twice into the same files."""

    def __call__(self, parser, namespace, values, option_string=None):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise argparse.ArgumentError(self, f"{', '.join(map(str, repeated))} given more than once")
        setattr(namespace, self.dest, values)


@contextlib.contextmanager
def running(command: str):
    """Around a command that uses JAX (all but fetch-model): its backend checked first (:func:`check_backend`),
    and a run-time check that fires reported as the library's CheckError, message first. Every command stops
    within seconds of the first Ctrl-C (:func:`fathom_jax.eval.interrupt.handled`)."""
    from fathom_jax.eval import interrupt

    # What an interrupt says where the command keeps no log of its own (generate, tune, fetch-model); the long runs'
    # own line (fathom_jax.eval.resume.stop_on_interrupt) says what they saved and how to resume.
    said = lambda: f"\n[{command}] interrupted: it writes its results only when it ends, so nothing was saved"  # noqa: E731
    with interrupt.handled(), interrupt.reporting(said):
        try:
            if command in NO_JAX:
                yield
                return
            check_backend()
            from fathom_jax.checks import reraise

            with reraise():
                yield
        except KeyboardInterrupt:
            interrupt.report()
            raise SystemExit(interrupt.EXIT_INTERRUPTED) from None
        except Exception:
            if not interrupt.requested():
                raise
            # The interrupt surfaced as another error (JAX wraps one raised in a static argument's __eq__).
            interrupt.report()
            raise SystemExit(interrupt.EXIT_INTERRUPTED) from None


def check_backend() -> None:
    """JAX's backend starts (``JAX_PLATFORMS=cuda`` on a machine without a GPU gave a 28-line traceback)."""
    import jax

    try:
        jax.devices()
    except Exception as err:  # JAX raises RuntimeError, or AssertionError when the platform is not installed
        wanted = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "the default"
        detail = " ".join(str(err).split())[:200] or type(err).__name__
        raise UsageError(f"JAX cannot start the platform(s) JAX_PLATFORMS={wanted!r} asks for on this machine "
                         f"({detail}); unset JAX_PLATFORMS, or set it to one this machine has (cpu, or cuda on a GPU "
                         "machine with the gpu extra: bash scripts/setup_env.sh --gpu)") from None


# ----------------------------------------------------------------------------------------------
# Checks shared by the commands (all run before any model weights are loaded)


def check_out_dir(path: str, argument: str = "--out") -> str:
    """Create ``path`` and prove it writable now, not after a long run."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".fathom-write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"argument {argument}: cannot write to {path!r} ({err.strerror or err})") from None
    return path


def compare_with_committed(command: str, written: str) -> None:
    """One line, where results file ``written`` has a committed twin (``results/`` of this checkout, same name): whether
    it measures what the committed one does (``fathom_jax.eval.compare``), and the command that compares them."""
    from fathom_jax.eval import compare

    twin = compare.committed_twin(written)
    if twin is None:
        return
    a, b = os.path.relpath(written), os.path.relpath(twin)
    print(f"[{command}] {compare.files(a, b).line()}; again: fathom compare {shlex.quote(a)} {shlex.quote(b)}",
          flush=True)


def check_method(method, head_dim: int, argument: str = "--method") -> None:
    try:
        method.validate(head_dim)
    except ValueError as err:
        raise UsageError(f"argument {argument}: {err}") from None


def check_positions(tokens: int, config, allow_long: bool, what: str) -> None:
    limit = config.max_position_embeddings
    if tokens > limit and not allow_long:
        raise UsageError(
            f"{what} {tokens} tokens, more than the model's {limit} positions (max_position_embeddings); "
            "shorten it, or pass --allow-long-context to run past the trained length anyway"
        )


def state_bytes(config, capacity: int, method=None, *, rows=None, batch: int = 1, itemsize: int = 4
                ) -> dict[str, int]:
    """Bytes of a generation's decode state at ``capacity`` tokens, by kind: the K/V rows of the layers that cache
    the whole context (``kv``) and, with a sparse ``method`` (its cache rounded up to whole blocks), their key index
    (``planes``, ``scales``, ...: :func:`fathom_jax.decode.cache_bytes`), its K/V rows in the row format ``rows``
    (``--rows``; None: the model dtype); ``windows``: the sliding-window layers' rings, in device memory whatever the
    placement. ``method`` None: the dense cache."""
    full, local, window = cache_layers(config)
    groups, d = batch * config.n_kv_heads, config.head_dim
    if method is None:
        out = {"kv": 2 * full * groups * capacity * d * itemsize}
    else:
        from fathom_jax import decode
        from fathom_jax.rows.layout import RowLayout
        from fathom_jax.index.parts import KEYS

        layout = RowLayout.of(rows, d, f"f{itemsize}")
        out = decode.cache_bytes(method.parts - {KEYS}, layout, n_layers=full, groups=groups, capacity=capacity)
    if local:
        out["windows"] = 2 * local * groups * window * d * itemsize
    return out


def describe_state(config, sizes: dict[str, int], memory: str) -> str:
    """One line: where the decode state's bytes (:func:`state_bytes`) go."""
    full, local, window = cache_layers(config)
    held = {kind: n for kind, n in sizes.items() if kind != "windows"}
    kinds = " + ".join(f"{kind} {readable_bytes(n)}" for kind, n in held.items())
    which = "global layers" if local else "layers"
    line = f"decode state: {full} {which}' cache {readable_bytes(sum(held.values()))} ({kinds}) in {memory} memory"
    if local:
        line += f"; {local} sliding-window layers' {window}-token rings {readable_bytes(sizes['windows'])} in device memory"
    return line


def readable_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_memory(need: int, what: str, skip: bool) -> None:
    """The run's sizing (:func:`fathom_jax.models.sizing.peak_bytes`) against the memory available now."""
    message = None if skip else shortfall(need, what, available_bytes(), "--no-memory-check")
    if message:
        raise UsageError(message)


MODEL_HELP = ("a bundled model ({names}: scripts/setup_env.sh or fathom fetch-model downloads and caches it), a local "
              "HF safetensors directory (config.json, tokenizer.json, *.safetensors) or a Llama-architecture or Gemma 3 "
              "GGUF file; default: smollm2 (SmolLM2-135M-Instruct)")


def model_help() -> str:
    from fathom_jax.models.hub import KNOWN_MODELS

    return MODEL_HELP.format(names=", ".join(KNOWN_MODELS))


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--allow-long-context", action="store_true",
                   help="run past the model's max_position_embeddings (its output there is untrained)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="skip the check that the run's estimated peak memory is available")


def model_slug(source: str | None) -> str:
    from fathom_jax.models.hub import known_model

    known = known_model(source)
    if known is not None:
        return known.slug
    name = os.path.basename(os.path.normpath(source))
    return re.sub(r"[^a-z0-9]+", "_", os.path.splitext(name)[0].lower()).strip("_") or "model"


def model_title(source: str | None) -> str:
    """What results files call the model: the registry's title for a known name, else the path."""
    from fathom_jax.models.hub import known_model

    known = known_model(source)
    return known.title if known is not None else os.fspath(source)


# ----------------------------------------------------------------------------------------------
# sweep


def run_metadata(args: argparse.Namespace) -> dict:
    """What a results file records about the run that wrote it: command line, commit, host."""
    return {
        "command": "fathom " + shlex.join(args.argv),
        "commit": git_commit(),
        "host": {"cpus": os.cpu_count(), "memory_gib": _total_memory_gib()},
    }


def _total_memory_gib() -> float | None:
    from fathom_jax.placement.host_memory import physical_bytes

    total = physical_bytes()
    return None if total is None else round(total / GiB, 1)


def git_commit() -> str | None:
    """The checkout's commit, ``-dirty`` when it has uncommitted changes; None outside a git checkout."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *cmd: subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=here, timeout=10)  # noqa: E731
        commit = run("rev-parse", "--short", "HEAD").stdout.strip()
        if not commit:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------------------------
# fetch-model


@dataclasses.dataclass(frozen=True)
class SparseSummary:
    """What a sparse run read, for the line the CLI prints."""

    label: str
    k: int
    context: int
    bits: float | None  # per token per KV head per layer; None: query-dependent
    bits_bound: float
    dense_bits: float

    def line(self) -> str:
        share = f"k = {self.k} of {self.context} context tokens ({100 * min(self.k, self.context) / self.context:.1f}%)"
        if self.bits is not None:
            bits = f"{self.bits:.1f} bits"
        else:
            bits = f"at most {self.bits_bound:.1f} bits"
        return (f"{self.label}: {share} per query head at the last step; its scan reads {bits} per token "
                f"per KV head per layer (dense keys: {self.dense_bits:.0f})")


def sparse_summary(method, k: int, context: int, head_dim: int) -> SparseSummary:
    from fathom_jax import format as fmt
    from fathom_jax.index.parts import KEYS

    fixed = method.fixed_bits_per_token(head_dim)
    if KEYS in method.parts:
        fixed = fmt.key_bits_per_token(head_dim)
    bound = fixed if fixed is not None else float(getattr(method, "budget", 4 * head_dim)) + \
        method.max_active(head_dim) * fmt.SCALE_BITS_PER_TOKEN
    return SparseSummary(method.label, k, context, fixed, bound, fmt.key_bits_per_token(head_dim))
