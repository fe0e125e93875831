"""``fathom generate``: greedy decoding of one prompt or a batch, dense or sparse, on one device or over a mesh of
devices that may span several processes (one per host, or several on one machine).

    fathom generate --prompt-file fathom_jax/format.py --method fathom:32 --k 64 --max-new-tokens 8
    fathom generate "def add(a, b):" "The capital of France is" --method fathom:32 --mesh 2   # a batch of 2, split

A mesh splits the cache's (sequence, KV head) groups (``batch x KV heads``) over its devices. SmolLM2 has 3 KV heads
and Gemma 3 one, so a mesh of 2 splits a batch of 2 prompts; where the groups do not split evenly the batch is padded
with copies of the last prompt, and the command says so (:func:`mesh_batch`). On the CPU, the CLI makes the devices
a mesh asks for itself (``jax_num_cpu_devices``, unless ``XLA_FLAGS`` or the config already set a count).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from fathom_jax.cli.args import (BUDGET_GUIDE, K_TYPE, UsageError, add_model_arguments, check_memory, check_method,
                                 check_positions, describe_state, method_spec, param_count, peak_bytes, positive_int,
                                 sparse_summary, state_bytes, untuned_error)

NEEDS_TUNED_CALIBRATION = ("fathom_tuned",)  # reads budgets tuned per (layer, KV head): generate has none to load


def register(subparsers) -> None:
    from fathom_jax import distributed, methods

    p = subparsers.add_parser("generate", help="greedy decoding, dense or with a sparse scan",
                              description="Greedy decoding of a prompt (or a batch of prompts), dense or with top-k "
                                          "sparse attention driven by a scan method; prints the text, and for a "
                                          "sparse run what it read.",
                              epilog=BUDGET_GUIDE)
    p.add_argument("prompt", nargs="*", default=[], help="the text to continue (several: a batch, one sequence "
                                                         "each; or --prompt-file)")
    p.add_argument("--prompt-file", action="append", default=None,
                   help="read a prompt from this file instead (repeat it for a batch)")
    p.add_argument("--max-new-tokens", type=positive_int(1), default=32, help="tokens to generate (for each prompt)")
    p.add_argument("--method", type=generate_method, default="dense",
                   help="dense, or a scan: " + _generate_specs(methods) + "; a scan may share its selection across "
                   "layers: METHOD@share=LAYERS@budget=POSITIONS[@rank=mass|weight|rank][@attend=all|topk] (e.g. "
                   "fathom:48@share=0,2,mid@budget=512; attend=topk: each sharing head its own exact top k of the set)")
    p.add_argument("--k", type=K_TYPE, default=128,
                   help="tokens attended per query head (4 sink + 32 local + top-scoring rest)")
    p.add_argument("--calibration", choices=["session", "corpus"], default="session",
                   help="statistics for Fathom/KLT/DS/Loki: the prompt's own keys, or a capture of the "
                        "calibration text (Python's language reference)")
    p.add_argument("--calib-tokens", type=positive_int(18, " (calibration skips the first 16 tokens)"), default=1024,
                   help="tokens of calibration text (corpus)")
    p.add_argument("--implementation", choices=["xla", "triton"], default=None,
                   help="scan and top-k: jnp reference or Pallas kernels (default: triton on a GPU, xla elsewhere)")
    p.add_argument("--placement", choices=["device", "pinned_host"], default="device",
                   help="where the K/V cache and key index live: device memory or pinned host memory")
    p.add_argument("--rows", type=_rows, default=None, metavar="FORMAT",
                   help="how the cache stores K/V rows: 'model' (the model's dtype, default) or a row format with "
                        "per-token scales, e.g. k8v8 (8-bit K and V, 260 B per token at head_dim 128 instead of "
                        "512; fathom_jax.rows.formats)")
    p.add_argument("--step-config", type=_step_config, default=None, metavar="KEY=VALUE,...",
                   help="how each sparse decode step runs, for tuning (fathom_jax.decode.StepConfig): read=staged|"
                        "direct, pipeline=auto|N, index_writes=every_step|full_blocks, row_cache=SLOTS, "
                        "layer_unroll=N, gather_programs / fetch_programs=auto|N, xla_*=VALUE, topk.FIELD=N; "
                        "the defaults are the fastest measured")
    p.add_argument("--mesh", type=positive_int(1), default=1,
                   help="devices to split the cache's (sequence, KV head) groups over (sparse decoding; each device "
                        "scans and fetches for its own groups from its own slice of memory); where the prompts x KV "
                        "heads do not split evenly, the batch is padded with copies of the last prompt (said when it "
                        "runs); on the CPU the devices are made for it; with several processes, spans them all (a "
                        "multiple of the process count)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes (one per host, or several on one machine): process 0's address (default: "
                        "$JAX_COORDINATOR_ADDRESS, or a SLURM job's); every process runs the same command")
    p.add_argument("--num-processes", type=positive_int(1), default=None,
                   help="processes of the job (default: $JAX_NUM_PROCESSES or the SLURM job's tasks)")
    p.add_argument("--process-id", type=positive_int(0), default=None,
                   help="this process, 0 .. processes - 1 (default: $JAX_PROCESS_ID or the SLURM task)")
    p.add_argument("--join-timeout", type=positive_int(1), default=distributed.JOIN_TIMEOUT_S, metavar="SECONDS",
                   help="several processes: how long each waits for the others to join before it gives up")
    add_model_arguments(p)
    p.set_defaults(func=_generate, join=_join)


def generate_method(text: str):
    """``--method`` of generate: :func:`method_spec`, less what needs a tuned calibration (:func:`untuned_error`)."""
    method = method_spec(text)
    base = getattr(method, "method", method)  # a SharedMethod's scan method
    message = None if method == "dense" else untuned_error(base, "generate's session or corpus statistics")
    if message:
        raise argparse.ArgumentTypeError(message)
    return method


def _generate_specs(methods) -> str:
    """The spec forms generate accepts (:func:`generate_method`), for its --help."""
    return ", ".join(cls.spec_syntax.replace("[:observed]", "") for name, cls in methods.REGISTRY.items()
                     if name not in NEEDS_TUNED_CALIBRATION)


def _step_config(text: str):
    """``--step-config key=value,...``: how each decode step runs (fathom_jax.decode.StepConfig), validated."""
    from fathom_jax.decode import StepConfig

    try:
        return StepConfig.parse(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rows(text: str):
    """``--rows``: the decode cache's K/V row format (``model``, or a format with per-token scales), validated."""
    from fathom_jax.rows.layout import row_format

    try:
        return row_format(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _read_prompts(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``[(text, where it came from)]``, one per sequence of the batch; none empty."""
    if args.prompt and args.prompt_file:
        raise UsageError("argument --prompt-file: give the prompts as text or as --prompt-file, not both")
    prompts = []
    for path in args.prompt_file or ():
        try:
            with open(path, encoding="utf-8") as f:
                prompts.append((f.read(), f"--prompt-file {path!r}"))
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"argument --prompt-file: cannot read {path!r} ({err})") from None
    prompts += [(text, "prompt") for text in args.prompt]
    if not prompts:
        prompts = [("", "prompt")]
    for text, where in prompts:
        if not text.strip():
            raise UsageError(f"argument {where}: the prompt is empty; give the text to continue (or --prompt-file "
                             "PATH)")
    return prompts


def mesh_batch(batch: int, kv_heads: int, devices: int) -> int:
    """The least batch of at least ``batch`` sequences whose ``batch x kv_heads`` groups split evenly over
    ``devices``: the mesh splits groups, and a model's KV heads (SmolLM2's 3, Gemma 3's 1) rarely divide it."""
    step = devices // math.gcd(kv_heads, devices)
    return -(-batch // step) * step


def describe_split(batch: int, padded: int, kv_heads: int, devices: int) -> str:
    """One line: how ``--mesh`` splits the groups, and the padding it needed."""
    groups, per = padded * kv_heads, padded * kv_heads // devices
    if per % kv_heads == 0:
        held = f"each device holds {per // kv_heads} whole sequence(s): the batch is split"
    elif kv_heads % per == 0:
        held = f"each device holds {per} of a sequence's {kv_heads} KV heads: the heads are split"
    else:
        held = "a sequence's KV heads span devices"
    line = (f"--mesh {devices} splits {padded} sequence(s) x {kv_heads} KV head(s) = {groups} (sequence, KV head) "
            f"groups, {per} per device; {held}")
    if padded > batch:
        line += (f"; {batch} prompt(s) x {kv_heads} = {batch * kv_heads} groups do not split over {devices} devices, "
                 f"so the batch is padded with {padded - batch} copy(ies) of the last prompt (their tokens are not "
                 f"printed; give {padded} prompts to use them)")
    return line


def _on_cpu() -> bool:
    """Whether JAX will run on the CPU: ``JAX_PLATFORMS`` says so, or no accelerator plugin is installed."""
    import pkgutil
    from importlib import metadata

    import jax

    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    try:
        import jax_plugins

        names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    except ImportError:
        names = []
    names += [ep.name for ep in metadata.entry_points(group="jax_plugins")]
    return not any(kind in name for name in names for kind in ("cuda", "rocm", "tpu"))


def make_cpu_devices(mesh: int, processes: int) -> str | None:
    """On the CPU, give this process its share of ``--mesh``'s devices (XLA:CPU makes one device unless told);
    returns a line saying so, or None where the count was set already (``XLA_FLAGS``' device count, the
    ``jax_num_cpu_devices`` config), JAX started already, one device suffices, or JAX runs on an accelerator."""
    import jax
    from jax._src import xla_bridge

    per = -(-mesh // processes)
    user_set = ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
                or jax.config.jax_num_cpu_devices >= 0)
    if per <= 1 or user_set or xla_bridge.backends_are_initialized() or not _on_cpu():
        return None
    jax.config.update("jax_num_cpu_devices", per)
    return f"--mesh {mesh} on the CPU: {per} CPU devices in this process" + (
        f" (and in each of the other {processes - 1})" if processes > 1 else "")


def _join(args: argparse.Namespace) -> tuple[list[tuple[str, str]], bool]:
    """``(prompts, several processes)``: the prompts read, then this process joins the job's others (one per host or
    several on a machine: ``--coordinator``, the ``JAX_*`` variables or a SLURM job; nothing to join for one process)
    and, on the CPU, makes its devices of the mesh. Both must come before anything touches JAX's devices, the CLI's
    backend check included, so :func:`fathom_jax.cli.app.main` calls this first; again (from :func:`_generate`) it
    returns what the first call found. A process still waiting when ``--join-timeout`` passes fails with one line
    naming the coordinator (``distributed.JoinError``); Ctrl-C stops the wait."""
    if getattr(args, "joined", None) is None:
        from fathom_jax import distributed

        prompts = _read_prompts(args)  # an empty prompt fails here, before waiting for the other processes
        if args.num_processes is not None and args.mesh > 1 and args.mesh % args.num_processes:
            raise UsageError(f"argument --mesh: {args.mesh} devices do not split evenly over --num-processes "
                             f"{args.num_processes}: every process holds a share of the mesh, so use a multiple of "
                             f"{args.num_processes}")
        say = lambda line: print(f"[generate] {line}", file=sys.stderr, flush=True)  # noqa: E731
        try:
            several = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                             join_timeout_s=args.join_timeout, waiting=say)
        except ValueError as e:
            raise UsageError(f"argument --coordinator / --num-processes / --process-id: {e}") from None
        except distributed.JoinError as e:
            raise distributed.JoinError(f"{e} (--join-timeout {args.join_timeout})") from None
        if several:
            import jax

            say(f"joined: {jax.process_count()} processes")
        from jax._src import distributed as jax_distributed

        note = make_cpu_devices(args.mesh, jax_distributed.global_state.num_processes or 1)
        if note:
            say(note)
        args.joined = (prompts, several)
    return args.joined


def _generate_mesh(devices: int):
    """A one-axis mesh of the first ``devices`` devices for ``--mesh`` (None for one device), checked first."""
    from fathom_jax.placement import device_mesh

    try:
        return device_mesh(devices)
    except ValueError as e:
        raise UsageError(f"argument --mesh: {e}") from None


def _padded(ids: list[list[int]]):
    import numpy as np

    prompts = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for row, seq in zip(prompts, ids):
        row[: len(seq)] = seq
    return prompts, np.array([len(seq) for seq in ids], np.int32)


def _generate(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from fathom_jax import decode, distributed
    from fathom_jax.models import generate, hub

    texts, several = _join(args)  # done already when run from fathom_jax.cli.app.main
    config = hub.model_config(args.model)
    batch = padded = len(texts)
    sparse = (args.method != "dense" or args.placement != "device" or args.mesh > 1 or args.rows is not None
              or batch > 1)  # a batch of prompts of their own lengths: the sparse cache (the dense one is not ragged)
    mesh = _generate_mesh(args.mesh)
    if mesh is not None:
        padded = mesh_batch(batch, config.n_kv_heads, args.mesh)
    method = shared = None
    if sparse:
        from fathom_jax import methods
        from fathom_jax.methods.sharing import SharedMethod

        method = methods.Dense() if args.method == "dense" else args.method
        if isinstance(method, SharedMethod):
            shared, method = method, method.method
            try:  # the layers must be the model's: refused before it loads
                selecting = shared.sharing.plan(config).selecting
            except ValueError as err:
                raise UsageError(f"argument --method: {err}") from None
        check_method(method, config.head_dim)
    tokenizer = hub.load_tokenizer(args.model)
    ids = []
    for text, where in texts:
        seq = tokenizer.encode(text)
        if not seq:
            raise UsageError(f"argument {where}: the prompt tokenizes to nothing; give some text to continue")
        ids.append([tokenizer.bos_id, *seq] if getattr(tokenizer, "add_bos", False) else seq)  # Gemma asks for BOS
    ids += [ids[-1]] * (padded - batch)
    prompts, lengths = _padded(ids)
    distributed.check_same(prompts, "the prompts' token ids")
    longest = int(lengths.max())
    capacity = longest + args.max_new_tokens
    check_positions(capacity, config, args.allow_long_context,
                    f"the prompt ({longest} tokens) + --max-new-tokens {args.max_new_tokens} =")
    state = state_bytes(config, max(capacity, args.k) if sparse else capacity, method, rows=args.rows, batch=padded)
    # On the CPU every device of this process holds its own copy of the weights, in the same memory.
    local = (args.mesh // jax.process_count()) if jax.default_backend() == "cpu" else 1
    need = peak_bytes(config, max(capacity, args.k), batch=padded, cache=sum(state.values()))
    check_memory(need + 4 * param_count(config) * (local - 1), f"generate over {capacity} tokens", args.no_memory_check)
    calibration, corpus = "session", sparse and args.calibration == "corpus" and method.needs_calibration
    if corpus:
        from fathom_jax.eval import texts as eval_texts

        check_positions(args.calib_tokens, config, args.allow_long_context, f"--calib-tokens {args.calib_tokens} asks for")
        calib_ids = tokenizer.encode(eval_texts.calibration_text()[0])
        if len(calib_ids) < args.calib_tokens:
            raise UsageError(f"argument --calib-tokens: the calibration text has {len(calib_ids)} tokens with this "
                             f"model's tokenizer, fewer than {args.calib_tokens}")

    say = lambda line: print(f"[generate] {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"loading {args.model or 'smollm2'}")
    model, _, _ = hub.load_model(args.model)
    kwargs = {}
    if sparse:
        if corpus:
            from fathom_jax.calibrate import calibrate
            from fathom_jax.models import capture_qkv

            cap = capture_qkv(model, jnp.asarray(calib_ids[: args.calib_tokens]))
            calibration = calibrate(cap["k"], cap["q"])
        placement = decode.Placement(args.placement, mesh=mesh)
        attention_fn = decode.from_spec(shared or method, k=args.k, calibration=calibration,
                                        implementation=args.implementation, placement=placement, step=args.step_config,
                                        rows=args.rows)
        if args.k >= capacity:
            say(f"note: k={args.k} >= prompt + new tokens ({capacity}): every token is selected, the output is dense "
                "decoding's; use a longer prompt (--prompt-file) or a smaller --k")
        capacity = max(capacity, args.k)  # the cache must hold at least k rows
        if attention_fn.placement.note:
            say(f"note: {attention_fn.placement.note}")
        say(attention_fn.label)
        kwargs["attention_fn"] = attention_fn
        if mesh is not None:  # the weights on every device once (each program would copy them otherwise)
            from flax import nnx

            say(describe_split(batch, padded, config.n_kv_heads, args.mesh))
            nnx.update(model, placement.replicate(nnx.state(model)))
        if several:  # the cache split over the mesh: the layers that cache the whole context (the windows stay apart)
            say(distributed.holding({k: n for k, n in state.items() if k != "windows"}, mesh))
    memory = kwargs["attention_fn"].placement.memory_kind if sparse else "device"
    say(describe_state(config, state, memory))
    t0 = time.time()
    if args.allow_long_context:  # generate applies the CLI's checks too: the same opt-outs
        kwargs["allow_long_context"] = True
    if args.no_memory_check:
        kwargs["memory_check"] = False
    if padded > 1:
        kwargs["lengths"] = jnp.asarray(lengths)
    out = generate(model, jnp.asarray(prompts if padded > 1 else prompts[0]), args.max_new_tokens, capacity=capacity,
                   **kwargs)
    tokens = distributed.to_host(out).reshape(padded, -1)  # every process calls it (an all-gather over processes)
    seconds = time.time() - t0
    if sparse:
        summary = sparse_summary(method, args.k, longest + args.max_new_tokens - 1, config.head_dim)
        say(summary.line())
        if shared is not None:
            say(f"selection shared across layers: layers {', '.join(map(str, selecting))} scan and select; the others "
                f"attend their {shared.sharing.budget} positions and read no index (the bits above are a "
                "selection layer's)")
    made = batch * args.max_new_tokens
    say(f"{args.max_new_tokens} tokens{f' for each of {batch} prompts' if batch > 1 else ''} in {seconds:.1f} s, "
        f"{made / seconds:.1f} tokens/s (prompt of {longest} tokens{' at most' if batch > 1 else ''}; compile "
        "included)")
    if jax.process_index() == 0:  # every process holds the tokens; one prints them
        for i, (text, where) in enumerate(texts):
            if batch > 1:
                print(f"--- {i + 1} of {batch} ({where}) ---")
            print(("" if where != "prompt" else text) + tokenizer.decode(tokens[i].tolist()))
    return 0
