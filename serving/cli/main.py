"""The `pathserve` command line.

Errors the user can fix (a bad path, key, value or prompt) print one line naming what is wrong and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from serving.checkpoints import cli as checkpoint_cli
from serving.config import ConfigError, ServingConfig
from serving.deploy import cli as deploy_cli
from serving.errors import GenerationError, UserError, failure
from serving.maxtext_config import is_config_file
from serving.startup.profile import FROM_DEFAULT, Given, given_config

if TYPE_CHECKING:  # the model commands import JAX when they run, not when the CLI starts
    from serving.launch import Launched
    from serving.request import SamplingParams

EXIT_USAGE = 2
# The default of `cpu_kernels` for every command that runs a model (auto, on or off); a config file
# or a key=value override still wins. The test suite's switch between the two compute backends.
CPU_KERNELS_ENV = "PATHSERVE_CPU_KERNELS"


def _port(text: str) -> int:
    value = _int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535), got {value}")
    return value


def _at_least_2(text: str) -> int:
    value = _positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be 2 or more, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _lease_seconds(text: str) -> float:
    """--lease-seconds: at least serving.batch.claims.MIN_LEASE_S (renewals come every lease / 4)."""
    from serving.batch.claims import MIN_LEASE_S

    value = _positive_float(text)
    if value < MIN_LEASE_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_LEASE_S:g} seconds, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[MAXTEXT_CONFIG.yml] [SOURCE] [key=value ...]",
        help="a MaxText config file (as MaxText and JetStream take it first: its base_config chain, "
        "logical_axis_rules and model_name; pathserve ships MaxText's inference recipes under "
        "configs/maxtext/), a converted checkpoint, a Hugging Face directory or a GGUF file "
        "(default: SmolLM2-135M-Instruct; or load_parameters_path=), then config overrides",
    )
    parser.add_argument("--config", help="a serving config YAML (keys as in configs/), or a MaxText config file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=_int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=_int, default=0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason"}')
    gen.set_defaults(handler=cmd_generate)

    ppl = commands.add_parser("perplexity", help="perplexity of the model on a text file")
    _add_model_args(ppl)
    ppl.add_argument("--text-file", required=True, type=Path)
    ppl.add_argument(
        "--window", type=_at_least_2, default=1024, help="tokens per scored window (2 or more: a window scores its tokens after the first)"
    )
    ppl.add_argument("--json", action="store_true")
    ppl.set_defaults(handler=cmd_perplexity)

    chat = commands.add_parser("chat", help="chat with the model on the terminal (empty line or EOF ends)")
    _add_model_args(chat)
    chat.add_argument("--max-tokens", type=_positive_int, default=256)
    chat.add_argument("--temperature", type=_non_negative_float, default=0.0)
    chat.add_argument("--seed", type=_int, default=0)
    chat.set_defaults(handler=cmd_chat)

    serve = commands.add_parser(
        "serve",
        help="serve the JetStream and OpenAI HTTP APIs, and JetStream's gRPC API on grpc_port "
        "(default: SmolLM2-135M-Instruct, int8)",
        description="For the default model (no SOURCE, no --config), the keys of "
        "configs/serving/default.yml apply under the key=value overrides.",
    )
    _add_model_args(serve)
    serve.add_argument(
        "--host", help="address to listen on (default 127.0.0.1; the container image's default command passes 0.0.0.0)"
    )
    serve.add_argument("--port", type=_port, help="default 8000")
    serve.add_argument(
        "--uds",
        metavar="PATH",
        help="listen on this unix socket instead of --host/--port (gRPC on PATH.grpc unless grpc_port=0), "
        "as sidecars and gateways connect, and on a TPU VM without TCP",
    )
    serve.set_defaults(handler=cmd_serve)

    batch = commands.add_parser(
        "batch",
        help="run a JSONL file (or a prefix of them) of prompts through the engine, resumably",
        description='Input lines: OpenAI batch requests or {"id", "prompt", "max_tokens"}. '
        "The output prefix gets one results-*.jsonl per shard, _manifest.json and _summary.json.",
    )
    _add_model_args(batch)
    batch.add_argument("--input", required=True, help="a .jsonl file, or a directory / gs:// prefix of them")
    batch.add_argument("--output", required=True, help="a directory or gs:// prefix for the results")
    batch.add_argument("--shard-size", type=_positive_int, default=1000, help="input lines per shard")
    batch.add_argument("--restart", action="store_true", help="discard earlier results under --output")
    batch.add_argument(
        "--worker-id",
        default=None,
        help="this worker's name among many on one output; stable across its restarts (e.g. the "
        "pod's index), it takes back its own claims at once (default: unique to this process)",
    )
    batch.add_argument(
        "--lease-seconds",
        type=_lease_seconds,
        default=60.0,
        help="a shard whose worker stopped renewing its claim this long is taken over by another",
    )
    batch.add_argument("--quiet", action="store_true", help="no progress on stderr")
    batch.set_defaults(handler=cmd_batch)

    bench = commands.add_parser(
        "bench",
        help="benchmarks: serve (a running server), overhead (HTTP vs offline engine), offline",
        description="pathserve bench serve|overhead|offline --help says each one's arguments",
        add_help=False,
    )
    bench.add_argument("-h", "--help", action="help", help="show this help and exit")
    bench.add_argument("what", choices=("serve", "overhead", "offline"))
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=cmd_bench)

    checkpoint_cli.add_parsers(commands)
    deploy_cli.add_parser(commands)
    return parser


def split_model_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """SOURCE is the one argument that is not key=value (a path may contain '=' if it exists)."""
    _, source, overrides = split_args(args)
    return source, overrides


def split_args(args: Sequence[str]) -> tuple[str | None, str | None, list[str]]:
    """(MaxText config file, SOURCE, overrides): a first argument ending in .yml / .yaml is a MaxText
    config file, as in `python3 -m MaxText.maxengine_server CONFIG.yml key=value ...`."""
    config = None
    if args and is_config_file(args[0]):
        config, args = args[0], args[1:]
    source, overrides = None, []
    for arg in args:
        if "=" in arg and not Path(arg).exists():
            overrides.append(arg)
        elif source is None:
            source = arg
        else:
            raise ConfigError(f"more than one SOURCE given: {source!r} and {arg!r}")
    return config, source, overrides


def _sampling(ns: argparse.Namespace, stop_ids: tuple[int, ...]) -> SamplingParams:
    from serving.request import SamplingParams

    try:
        return SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_k=getattr(ns, "top_k", 0),
            top_p=getattr(ns, "top_p", 1.0),
            seed=ns.seed,
            stop_ids=stop_ids,
        )
    except ValueError as exc:
        raise GenerationError(str(exc)) from None


# One-shot commands serve one request at a time and compile only the shapes they use; a config
# file or key=value overrides still win.
ONE_SHOT_DEFAULTS = {"per_device_batch_size": 1, "enable_model_warmup": False}


def _launch(ns: argparse.Namespace) -> Launched:
    """The engine and its device loop, exactly as `serve` starts them (the same defaults)."""
    from serving.launch import launch

    given, source = _given(ns, ONE_SHOT_DEFAULTS)
    return launch(given.config, source, given.origins)


def _stream(launched: Launched, prompt_ids: list[int], sampling: SamplingParams):
    """Text deltas of one request through the orchestrator; the completion is on the handle."""
    handle = launched.orchestrator.submit(prompt_ids, sampling)
    return handle, handle.stream()


def _checked(completion):
    """The completion, unless the device loop failed under it (its traceback is in the log)."""
    if (failed := failure([completion.finish_reason])) is not None:
        raise failed
    return completion


def cmd_generate(ns: argparse.Namespace) -> int:
    if not ns.prompt.strip():
        raise GenerationError("--prompt is empty")
    launched = _launch(ns)
    try:
        tokenizer = launched.model.tokenizer
        sampling = _sampling(ns, tokenizer.eos_ids)
        prompt_ids = (
            tokenizer.encode_chat([{"role": "user", "content": ns.prompt}])
            if ns.chat
            else tokenizer.encode_prompt(ns.prompt)
        )
        handle, deltas = _stream(launched, prompt_ids, sampling)
        for delta in deltas:
            if not ns.json:
                print(delta.text, end="", flush=True)
        completion = _checked(handle.completion)
        if ns.json:
            print(json.dumps({
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                **launched.engine.summary(),
            }))
        else:
            print()
    finally:
        launched.orchestrator.stop(timeout=10)
    return 0


def cmd_perplexity(ns: argparse.Namespace) -> int:
    from serving.engine.engine import Engine
    from serving.runtime import init_runtime, make_mesh
    from serving.startup.plan import plan_launch

    try:
        text = ns.text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationError(f"cannot read --text-file {ns.text_file}: {exc}") from None
    given, source = _given(ns, ONE_SHOT_DEFAULTS)
    init_runtime(given.config.devices)
    plan = plan_launch(given.config, source)
    engine = Engine(plan.load(), plan.engine, make_mesh(plan.config.devices))
    params = engine.load_params()
    ids = engine.model.tokenizer.encode_prompt(text)
    window = min(ns.window, engine.limits.max_prefill_length)
    total, count = 0.0, 0
    for start in range(0, len(ids), window):
        chunk = ids[start : start + window]
        if len(chunk) >= 2:
            total -= float(engine.prompt_logprobs(params, engine.limits.pad(chunk), len(chunk)).sum())
            count += len(chunk) - 1
    if count == 0:
        raise GenerationError(f"{ns.text_file}: fewer than 2 tokens; perplexity is undefined")
    ppl = math.exp(total / count)
    print(
        json.dumps({"perplexity": ppl, "tokens": count, **engine.summary()})
        if ns.json
        else f"perplexity {ppl:.4f} over {count} tokens"
    )
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    launched = _launch(ns)
    try:
        return _chat(ns, launched)
    finally:
        launched.orchestrator.stop(timeout=10)


def _chat(ns: argparse.Namespace, launched: Launched) -> int:
    tokenizer, limits = launched.model.tokenizer, launched.engine.limits
    sampling = _sampling(ns, tokenizer.eos_ids)
    messages: list[dict[str, str]] = []
    print(f"pathserve chat with {launched.model.config.name} (empty line or Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        prompt_ids = tokenizer.encode_chat(messages)
        try:
            limits.check(len(prompt_ids), sampling)
        except GenerationError:
            messages = messages[-1:]  # forget older turns rather than stop the conversation
            prompt_ids = tokenizer.encode_chat(messages)
        print("model> ", end="", flush=True)
        handle, deltas = _stream(launched, prompt_ids, sampling)
        for delta in deltas:
            print(delta.text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": _checked(handle.completion).text})


def _given(ns: argparse.Namespace, command_defaults: dict | None = None) -> tuple[Given, str | None]:
    """The config (with where each key came from: serving.startup.profile) and SOURCE. The serving
    profile applies to any model unless a MaxText config file is given; `command_defaults` over it,
    a config file and key=value overrides over both."""
    maxtext, source, overrides = split_args(ns.args)
    if maxtext and ns.config:
        raise ConfigError(f"both a MaxText config file ({maxtext}) and --config {ns.config}: give one")
    if source and "://" not in source and not Path(source).exists():
        raise ConfigError(f"SOURCE not found: {source}")
    given = given_config(maxtext or ns.config, overrides, source, command_defaults, _env_defaults())
    return given, source


def _env_defaults() -> dict[str, str]:
    """`cpu_kernels` from $PATHSERVE_CPU_KERNELS, when set."""
    value = os.environ.get(CPU_KERNELS_ENV, "").strip().lower()
    if not value:
        return {}
    if value not in ("auto", "on", "off"):
        raise ConfigError(f"{CPU_KERNELS_ENV}={value!r}: one of auto, on, off")
    return {"cpu_kernels": value}


def cmd_serve(ns: argparse.Namespace) -> int:
    from serving.api.server import serve

    given, source = _given(ns)
    if ns.uds:  # nothing given is left unheard: TCP's flags and a gRPC port have no place on a socket
        if ns.host is not None or ns.port is not None:
            raise ConfigError("--uds listens on a unix socket: give it, or --host/--port, not both")
        if given.origin("grpc_port") != FROM_DEFAULT and given.config.grpc_port != 0:
            raise ConfigError(
                f"grpc_port={given.config.grpc_port} with --uds: gRPC listens on {ns.uds}.grpc there "
                "(grpc_port=0 turns it off)"
            )
    if not _is_leader(given.config):
        return _follow(ns.command, given, source)
    host = "127.0.0.1" if ns.host is None else ns.host
    port = 8000 if ns.port is None else ns.port
    return serve(given.config, source, host, port, given.origins, uds=ns.uds)


def cmd_batch(ns: argparse.Namespace) -> int:
    from serving.batch.errors import IncompleteError
    from serving.batch.runner import run_batch

    given, source = _given(ns)
    cfg, launched = given.config, None
    if not _is_leader(cfg):
        return _follow(ns.command, given, source)
    from serving.launch import launch

    start = functools.partial(launch, origins=given.origins)
    if cfg.runtime == "multicontroller":
        # The followers bring the engine up whatever is left to run: so does process 0.
        launched = launch(cfg, source, given.origins)
        start = lambda cfg, source: launched  # noqa: E731
    try:
        summary = run_batch(
            ns.input, ns.output, source, cfg, shard_size=ns.shard_size, restart=ns.restart,
            progress=not ns.quiet, start=start, worker_id=ns.worker_id, lease_s=ns.lease_seconds,
        )
    except IncompleteError as exc:  # not a usage error: the run itself fell short
        print(f"pathserve batch: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if launched is not None:
            launched.orchestrator.stop(timeout=30)
    print(summary.to_json())
    return 0


def _is_leader(cfg: ServingConfig) -> bool:
    """Process 0 (or the only process). runtime=multicontroller brings JAX's distributed runtime up
    here, before any server starts: only process 0 serves."""
    if cfg.runtime != "multicontroller":
        return True
    import jax

    from serving.runtime import init_runtime

    init_runtime(cfg.devices)
    return jax.process_index() == 0


def _follow(command: str, given: Given, source: str | None) -> int:
    """A follower of a multi-controller slice: no servers, no reader; execute process 0's plans."""
    import jax

    from serving.launch import follow_plans

    where = f"process {jax.process_index()} of {jax.process_count()}"
    print(f"pathserve {command}: {where} follows process 0 (no servers here)", file=sys.stderr, flush=True)
    try:
        executed = follow_plans(given.config, source, given.origins)
    except UserError:
        raise
    except Exception as exc:  # a failed collective: process 0 (or another peer) is gone
        print(f"pathserve {command}: error: {where} lost the group: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: JAX's shutdown barrier would wait for the dead peer
    print(f"pathserve {command}: {where}: process 0 stopped after {executed} plans", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)  # see serving.orchestrator.lockstep.meet_at_exit


def offline_parser(prog: str = "pathserve bench offline") -> argparse.ArgumentParser:
    """`pathserve bench offline`'s arguments: the model's as `serve` takes them, and the prompts."""
    parser = argparse.ArgumentParser(prog=prog, description="offline engine tokens/s over a prompts file (JSON)")
    _add_model_args(parser)
    parser.add_argument("--prompts", required=True, type=Path, help='a JSON list of {"prompt": text}')
    parser.add_argument("--max-tokens", type=_positive_int, required=True)
    parser.add_argument(
        "--rounds-from-stdin",
        action="store_true",
        help='stay loaded and run a round per "BATCH COUNT" line on stdin (JSON line each)',
    )
    return parser


# `pathserve bench serve` and `bench overhead` are loadtest's HTTP benchmarks: programs of their
# own (the product imports nothing of loadtest), told the name they run under.
BENCH_PROG_ENV = "PATHSERVE_BENCH_PROG"
BENCH_PROGRAMS = {"serve": "loadtest.bench", "overhead": "loadtest.overhead"}


def cmd_bench(ns: argparse.Namespace) -> int:
    prog = f"pathserve bench {ns.what}"
    if ns.what in BENCH_PROGRAMS:
        import subprocess

        command = [sys.executable, "-m", BENCH_PROGRAMS[ns.what], *ns.rest]
        return subprocess.run(command, env={**os.environ, BENCH_PROG_ENV: prog}).returncode
    offline_ns = offline_parser(prog).parse_args(ns.rest)
    from serving.offline_bench import measure, serve_rounds

    # as `serve` has them (the serving profile under the arguments, where each key came from):
    # `bench overhead` runs both on one set of arguments and compares them
    given, source = _given(offline_ns)
    cfg = given.config
    try:
        prompts = [item["prompt"] for item in json.loads(offline_ns.prompts.read_text())]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--prompts {offline_ns.prompts}: {exc}") from None
    if offline_ns.rounds_from_stdin:
        serve_rounds(cfg, source, prompts, offline_ns.max_tokens, sys.stdin, sys.stdout, given.origins)
        return 0
    print(json.dumps(measure(cfg, source, prompts, offline_ns.max_tokens, given.origins)))
    return 0


def apply_log_level(level: str) -> None:
    """PATHSERVE_LOG_LEVEL (DEBUG, INFO, WARNING, ...): pathserve's own log lines at that level and
    above to stderr (start-up's phases, warmup's compiles, the memory plan); unset, warnings only."""
    if not level:
        return
    if not isinstance(logging.getLevelName(level.upper()), int):
        raise ConfigError(f"PATHSERVE_LOG_LEVEL: {level!r} is not a log level (DEBUG, INFO, WARNING, ERROR)")
    logger = logging.getLogger("serving")
    logger.setLevel(level.upper())
    if not any(getattr(h, "pathserve", False) for h in logger.handlers):  # once per process
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        handler.pathserve = True
        logger.addHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (argparse stops collecting positionals there).
    if extra and (not hasattr(ns, "args") or any(a.startswith("-") or "=" not in a for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        ns.args = [*ns.args, *extra]
    try:
        apply_log_level(os.environ.get("PATHSERVE_LOG_LEVEL", ""))
        return ns.handler(ns)
    except UserError as exc:
        print(f"pathserve {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130

