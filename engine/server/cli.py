"""`tideflow serve --model DIR`: one colocated engine behind the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import json
import gc
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from engine.runtime.argtypes import positive_int
from engine.core.engine_config import EngineKnobs
from engine.runtime.errors import EXIT_ENGINE_FAILED, EXIT_WEIGHTS, TideflowError, exit_member
from engine.parallel.serve_args import add_arguments as add_dep_arguments, dep_serve_config
from engine.api import connection_limits
from engine.api.connection_limits import ConnectionLimits
from engine.api.limits import MEMBER_KEEP_ALIVE_S
from engine.runtime import tls
from tideflow_kernels.spec import KERNEL_MODES

log = logging.getLogger(__name__)

# connections any client address may hold; a member's router gets one more per request the engine admits
ADDRESS_ALLOWANCE = ConnectionLimits.model_fields["max_connections_per_address"].default


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve a checkpoint directory over the OpenAI API")
    p.add_argument("--model", required=True,
                   help="Hugging Face checkpoint directory, or a published version (s3://... or file://...) to pull")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-file", help="file with one API key per line (also: $TIDEFLOW_API_KEYS, comma-separated)")
    p.add_argument("--served-model-name", help="model id clients send (default: the directory's name)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--step-target-ms", type=float,
                   help="while sequences decode, a step holds only the prefill that fits this many ms at the measured "
                        "time per token (default and 0: off, every step may hold --max-batch-tokens)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-bytes", type=int)
    budget.add_argument("--kv-cache-fraction", type=float)
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-wait-ms", type=float, help="shuttle window; 0 dispatches arrivals at once")
    p.add_argument("--lone-arrival-ms", type=float,
                   help="an arrival with no other in the last this many ms skips the window (0: every window waits)")
    p.add_argument("--max-queue", type=int)
    p.add_argument("--max-client-tokens", type=int,
                   help="most prompt + max_tokens one client (API key) may have open here (429 beyond); 0 = no cap")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on cuda, run decode eagerly instead of replaying CUDA graphs captured per batch size at start")
    tiers = p.add_argument_group("KV tiers", "keep evicted KV blocks in host memory, on disk and in a shared store, and "
                                              "load a prompt's blocks from there instead of computing them")
    tiers.add_argument("--kv-host-bytes", type=int, help="G2: host memory for offloaded blocks; turns the tiers on")
    tiers.add_argument("--kv-disk-path", help="G3: a local directory for offloaded blocks")
    tiers.add_argument("--kv-disk-bytes", type=int, help="G3: most bytes kept in --kv-disk-path (default 8 GiB)")
    tiers.add_argument("--kv-store-url", help="G4: s3://bucket/prefix/ or file:///dir/ shared by the fleet")
    tiers.add_argument("--kv-tiers", help="every tier knob (KVTierConfig) as JSON or a JSON file path; the flags "
                                          "above override its fields")
    p.add_argument("--scheduling", choices=["fair", "fcfs"],
                   help="fair (default): clients (API keys) share steps, slots and KV by tokens served; fcfs: arrival order")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body accepted (413 above)")
    connection_limits.add_arguments(p, max_connections_per_address=f"{ADDRESS_ALLOWANCE} + max_num_seqs + max_queue "
                                                                   f"(--role encoder: {ADDRESS_ALLOWANCE}); counted "
                                                                   "per API server process")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=positive_int, default=None,
                   help="compute threads of the engine (default: $OMP_NUM_THREADS or every core this process may use); "
                        "a group member gets its CPU share")
    p.add_argument("--device", help="cpu (default), cuda (the first GPU this process sees) or cuda:<index>; the "
                                    "compiled ops of that device are built and used")
    tls.add_arguments(p, mutual=True)
    p.add_argument("--role", choices=["colocated", "prefill", "decode", "encoder"], default="colocated",
                   help="colocated: the whole request; prefill/decode/encoder: one stage of a disaggregated group")
    p.add_argument("--kv-transport", choices=["shm", "tcp"], default="shm",
                   help="KV transfer between prefill and decode (shm: same host, tcp: across hosts)")
    p.add_argument("--require-verified", action="store_true",
                   help="refuse to start unless --model is a verified weights cache (implied when it holds manifest.json)")
    p.add_argument("--metrics-group", default="", help="group label on every metric")
    p.add_argument("--metrics-version", default="", help="version label on every metric")
    add_dep_arguments(p)
    p.add_argument("--faults", help="tests and drills only: a FaultConfig (engine/api/fault_config.py) as JSON or a JSON file path")
    p.add_argument("--standby", action="store_true",
                   help="start silent: load and warm up, release the KV cache, serve only after POST /admin/activate")
    p.add_argument("--engine-core", choices=["thread", "process"], default="thread",
                   help="thread (default): the engine steps on a thread of the API server's process; process: in a "
                        "process of its own, apart from HTTP, tokenization and detokenization (colocated role)")
    p.add_argument("--api-server-count", type=positive_int, default=1,
                   help="API server processes sharing the port in front of one engine core (needs --engine-core process)")
    p.add_argument("--kernels", choices=KERNEL_MODES, default=None,
                   help="auto (default, or $TIDEFLOW_KERNELS): build and verify the compiled ops for these sources on "
                        "the first start, cached; cached: only a build already there; reference: torch's ops")
    p.set_defaults(func=serve)


def engine_config(args: argparse.Namespace):
    """EngineConfig from the flags that were given; the rest keep EngineConfig's defaults."""
    from engine.core.engine_config import EngineConfig

    names = ("max_num_seqs", "max_batch_tokens", "kv_cache_bytes", "kv_cache_fraction", "block_size", "max_wait_ms",
             "lone_arrival_ms", "max_queue", "max_client_tokens", "scheduling", "dtype", "device")
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.no_prefix_cache:
        given["enable_prefix_cache"] = False
    if args.enforce_eager:
        given["enforce_eager"] = True
    if args.step_target_ms is not None:
        given["step_target_ms"] = args.step_target_ms or None
    tiers = kv_tier_fields(args)
    if tiers:
        given["kv_tiers"] = tiers
    return EngineConfig(model_name=args.served_model_name or Path(args.model).resolve().name,
                        version=args.metrics_version, **given)


def kv_tier_fields(args: argparse.Namespace) -> dict:
    """The KV tier knobs given, --kv-tiers' JSON under the single flags; empty when none were."""
    fields = {}
    if args.kv_tiers:
        text = Path(args.kv_tiers).read_text() if not args.kv_tiers.lstrip().startswith("{") else args.kv_tiers
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError("--kv-tiers must be a JSON object of KVTierConfig fields")
    for flag, name in (("kv_host_bytes", "host_bytes"), ("kv_disk_path", "disk_path"), ("kv_disk_bytes", "disk_bytes"),
                       ("kv_store_url", "store_url")):
        if getattr(args, flag) is not None:
            fields[name] = getattr(args, flag)
    return fields


def member_connection_limits(args: argparse.Namespace, config: EngineKnobs) -> ConnectionLimits:
    """A member's bounded reads. In a fleet every request comes from the router's address, so that address may
    hold, past any address's allowance, one connection per request the engine admits (running and queued):
    with the allowance alone, the router's 257th open request was refused at connect though the queue had room."""
    return connection_limits.from_args(
        args, max_connections_per_address=ADDRESS_ALLOWANCE + config.max_num_seqs + config.max_queue)


def serve(args: argparse.Namespace) -> int:
    from engine.api.connections import run_server
    from engine.api.fault_config import FaultConfig
    from engine.server.faults import FaultInjector
    from engine.core.llm_engine import LLMEngine
    from engine.server.app import create_app
    from engine.api.auth import key_source
    from engine.telemetry import tracing
    from engine.telemetry.metrics import MetricFactory, ServingMetrics
    from engine.weights import WeightsError, local_model_dir, require_verified
    from engine.weights.manifest import MANIFEST_NAME
    from engine.runtime import intraop
    from engine.runtime.device import resolve_device
    from engine.model.config import read_config
    from engine.model.tokenizer import Tokenizer
    from tideflow_kernels.startup import arch_for, startup_ops

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()  # `main` set WARNING (DEBUG with -v) first: a member logs its start and progress
    root.setLevel(min(root.level, logging.INFO))
    try:
        args.model = str(local_model_dir(args.model))  # a weights URL is pulled and verified first
    except WeightsError as exc:
        print(f"tideflow serve: {exc}", file=sys.stderr)
        return EXIT_WEIGHTS
    except (TideflowError, OSError) as exc:
        print(f"tideflow serve: {exc}", file=sys.stderr)
        return 1
    try:  # members take mutual TLS when they know the fleet's CA: only its routers, controller and peers get in
        args.identity = tls.identity_from_args(args, "tideflow serve")
    except ValueError as exc:
        return refused_start(exc)
    args.mutual = args.identity is not None and args.identity.ca is not None
    tracing.setup(args.role, args.metrics_group, args.metrics_version)
    if args.role == "encoder":
        from engine.server.encoder_app import serve_encoder

        return serve_encoder(args)
    if args.engine_core == "process" or args.api_server_count > 1:
        return serve_split(args)
    intraop.serial_process(args.threads)  # before any torch op: the engine thread alone runs parallel ops
    try:
        config = engine_config(args)
        limits = member_connection_limits(args, config)
        keys = key_source(args.api_key_file)  # the key file (or $TIDEFLOW_API_KEY_FILE) read again when it changes
        faults = FaultInjector(FaultConfig.parse(args.faults)) if args.faults else None
        if args.require_verified or (Path(args.model) / MANIFEST_NAME).exists():
            require_verified(args.model)
        read_config(args.model, config.dtype)  # a wrong checkpoint is refused before the kernel build, not after
        Tokenizer(args.model)
        startup_ops(arch_for(resolve_device(config.device)), args.kernels)
        metrics = ServingMetrics(MetricFactory(group=args.metrics_group, version=args.metrics_version, role=args.role))
        dep = dep_serve_config(args)
        if dep is not None and config.kv_tiers is not None:
            raise ValueError("KV tiers serve a single-rank engine; a DEP instance (--dep-size > 1) runs without them")
        if dep is not None:
            from engine.parallel.serving import build_dep_engine

            engine = build_dep_engine(args.model, config, dep, metrics)
        else:
            engine = LLMEngine.from_dir(args.model, config, metrics)
    except (ValidationError, WeightsError, TideflowError, OSError, ValueError) as exc:
        return refused_start(exc)
    engine.on_failure = lambda why: exit_member(EXIT_ENGINE_FAILED, why)
    log.info("serving %s on %s://%s:%d (%d KV blocks of %d tokens)", config.model_name, tls.scheme(), args.host, args.port,
             engine.allocator.num_blocks, config.block_size)
    app = create_app(engine, config.model_name, keys, transport=None if args.role == "colocated" else args.kv_transport,
                     faults=faults, standby=args.standby, host=args.host, max_body_bytes=args.max_body_bytes,
                     body_timeout_s=limits.body_timeout_s)
    # The model, tokenizer and modules live as long as the process: frozen out of the collector's sight, as in
    # the router, so a collection set off by one large body's objects does not scan them with the GIL held
    gc.collect()
    gc.freeze()
    run_server(app, limits, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=MEMBER_KEEP_ALIVE_S,
               identity=args.identity, mutual=args.mutual)
    return 0


def refused_start(exc: Exception) -> int:
    """Say why the member cannot start and give its exit status: 2 for a bad flag, EXIT_WEIGHTS for weights."""
    from engine.weights import WeightsError

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        print(f"tideflow serve: --{'-'.join(str(p) for p in first['loc']).replace('_', '-')}: {first['msg']}",
              file=sys.stderr)
        return 2
    print(f"tideflow serve: {exc}", file=sys.stderr)
    return EXIT_WEIGHTS if isinstance(exc, WeightsError) else 1


def split_refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot run with the engine core in a process of its own (None: they can)."""
    if args.engine_core != "process":
        return "--api-server-count above 1 needs --engine-core process"
    if args.role != "colocated":
        return f"--engine-core process serves the colocated role only, not --role {args.role}"
    if args.dep_size > 1:
        return "--engine-core process does not run DEP ranks; leave --dep-size out or use --engine-core thread"
    if args.standby and args.api_server_count > 1:
        return "--standby needs one API server (its switch lives in one process); drop --api-server-count"
    return None


def serve_split(args: argparse.Namespace) -> int:
    """The engine core in a process of its own and `--api-server-count` API servers in front (engine/server/api_servers.py)."""
    from engine.core.core_process import CoreSpec
    from engine.server.api_servers import ApiServerSpec, ExtraApiServers, remove_socket_dir, serve_api
    from engine.server.core_client import CoreClient, CoreGone, socket_dir, start_core
    from engine.api.auth import key_source
    from engine.api.fault_config import FaultConfig
    from engine.model.tokenizer import Tokenizer
    from engine.weights import WeightsError, require_verified
    from engine.weights.manifest import MANIFEST_NAME

    refusal = split_refusal(args)
    if refusal is not None:
        print(f"tideflow serve: {refusal}", file=sys.stderr)
        return 2
    try:
        config = engine_config(args)
        if args.faults:
            FaultConfig.parse(args.faults)  # a bad --faults is refused here, not by each API server
        key_source(args.api_key_file)  # and so is a bad key entry (the API servers read the same)
        if args.require_verified or (Path(args.model) / MANIFEST_NAME).exists():
            require_verified(args.model)
        tokenizer = Tokenizer(args.model)
    except (ValidationError, WeightsError, TideflowError, OSError, ValueError) as exc:
        return refused_start(exc)
    sockets = socket_dir()
    core_spec = CoreSpec(model_dir=args.model, engine=config, input_address=f"ipc://{sockets}/core", socket_dir=str(sockets),
                         threads=args.threads, kernels=args.kernels, metrics_group=args.metrics_group,
                         metrics_version=args.metrics_version, role=args.role)
    api_spec = ApiServerSpec(model_dir=args.model, model_name=config.model_name, input_address=core_spec.input_address,
                             socket_dir=str(sockets), host=args.host, port=args.port, api_key_file=args.api_key_file,
                             faults=args.faults, max_body_bytes=args.max_body_bytes, reuse_port=args.api_server_count > 1,
                             connections=member_connection_limits(args, config), identity=args.identity,
                             mutual=args.mutual)
    core = start_core(core_spec)
    extras = None
    try:
        try:
            client = CoreClient(core_spec.input_address, tokenizer, sockets, core)
        except CoreGone as exc:
            print(f"tideflow serve: {exc}", file=sys.stderr)
            return EXIT_ENGINE_FAILED
        client.on_failure = lambda why: (remove_socket_dir(sockets), exit_member(EXIT_ENGINE_FAILED, why))
        log.info("serving %s on %s://%s:%d: engine core pid %d, %d API server(s), %d KV blocks",
                 config.model_name, tls.scheme(), args.host, args.port, core.pid, args.api_server_count, client.kv_blocks)
        if args.api_server_count > 1:
            extras = ExtraApiServers(api_spec, args.api_server_count)
        serve_api(api_spec, client, warm_up=True, standby=args.standby)
    finally:
        if extras is not None:
            extras.stop()
        core.stop()
        remove_socket_dir(sockets)
    return 0
