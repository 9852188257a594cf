"""`tideflow router`: run the gateway process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.api import connection_limits
from engine.runtime import tls


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="run the OpenAI gateway in front of a group set")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--reuse-port", action="store_true",
                   help="share the port with other router replicas on this host (SO_REUSEPORT); the controller runs "
                        "its replicas so")
    p.add_argument("--model-name", default="default", help="model id clients ask for")
    p.add_argument("--model-dir", type=Path, default=None, help="checkpoint dir (tokenizer for PD groups)")
    p.add_argument("--api-key-file", type=Path, default=None, help="client keys, one per line (also $TIDEFLOW_API_KEYS)")
    p.add_argument("--rate-limit-rps", type=float, default=None, help="requests/s per API key")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request may move to another worker after its upstream broke mid-answer (0 = off)")
    p.add_argument("--route-wait-s", type=float, default=5.0,
                   help="how long a request waits for a routable group when none is (a standby activating); 503 after")
    p.add_argument("--health-interval-s", type=float, default=0.5)
    p.add_argument("--stall-timeout-s", type=float, default=1.5,
                   help="a member stream silent this long (members beat every 0.5 s while at work) is taken for a "
                        "stopped member: its requests move on and it is ejected")
    p.add_argument("--member-network", action="append", default=None, metavar="CIDR",
                   help="accept member endpoints only in this network (repeatable; default: any host)")
    p.add_argument("--controller-url", default=None,
                   help="take the groups from this controller (key in $TIDEFLOW_ROUTES_KEY); its admin API is then read-only")
    p.add_argument("--advertise", default=None, help="how this replica names itself to the controller (default host:port)")
    p.add_argument("--replica-port", type=int, default=None,
                   help="also listen on this port of --host, this replica's own (0: any free port), and report it to the "
                        "controller: with --reuse-port the shared port reaches any replica, this one only this one")
    p.add_argument("--replica-url", default=None,
                   help="report this URL as where this replica alone answers (a pod's own address, e.g. "
                        "http://$(POD_IP):8000); default: its --replica-port")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body accepted (413 above)")
    p.add_argument("--kv-routing", choices=["precise", "approximate", "least-queued"], default="precise",
                   help="place prompts on a group's members by the KV blocks each holds (precise: the members' KV "
                        "event feeds; approximate: where the router sent each prefix before; least-queued: by load "
                        "alone); --model-dir is needed for a colocated group's prompts to be read")
    p.add_argument("--max-open-per-key", type=int, default=256,
                   help="requests one API key may have open at once (429 beyond); 0: no cap")
    p.add_argument("--prompt-workers", type=int, default=2,
                   help="threads that parse large bodies and tokenize, hash and serialize prompts, off the event loop")
    connection_limits.add_arguments(p)
    tls.add_arguments(p, mutual=False)  # clients hold API keys, not certificates; an operator's certificate or the fleet's
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import gc

    from engine.api.connections import STARTUP_FAILURE, listening_socket, run_server

    from engine.router.app import ADMIN_KEYS_ENV, UPSTREAM_KEY_ENV, create_router_app, keys_from_env
    from engine.router.config import RouterConfig
    from engine.router.kv_index import KVRoutingConfig
    from engine.router.sync import ROUTES_KEY_ENV
    from engine.api.auth import key_source, secret_from_env
    from engine.telemetry import tracing

    try:
        identity = tls.identity_from_args(args, "tideflow router")
    except ValueError as exc:
        print(f"tideflow router: {exc}", file=sys.stderr)
        return 2
    own = None  # this replica's own listener, beside the (shared) port
    replica_url = args.replica_url
    if args.replica_port is not None:
        try:
            own = listening_socket(args.host, args.replica_port, False)
        except OSError as exc:
            print(f"tideflow router: cannot bind {args.host}:{args.replica_port}: {exc}", file=sys.stderr)
            return STARTUP_FAILURE
        host = f"[{args.host}]" if ":" in args.host else args.host
        replica_url = replica_url or f"{'https' if identity else 'http'}://{host}:{own.getsockname()[1]}"
    config = RouterConfig(host=args.host, port=args.port, reuse_port=args.reuse_port, model_name=args.model_name, model_dir=args.model_dir,
                          rate_limit_rps=args.rate_limit_rps, request_timeout_s=args.request_timeout_s,
                          max_attempts=args.max_attempts, migration_limit=args.migration_limit,
                          route_wait_s=args.route_wait_s,
                          health_interval_s=args.health_interval_s, stall_timeout_s=args.stall_timeout_s,
                          max_body_bytes=args.max_body_bytes, prompt_workers=args.prompt_workers,
                          max_open_per_key=args.max_open_per_key or None,
                          member_networks=args.member_network,
                          controller_url=args.controller_url, advertise=args.advertise, replica_url=replica_url,
                          kv_routing=KVRoutingConfig(mode=args.kv_routing),
                          connections=connection_limits.from_args(args))
    try:
        client_keys = key_source(args.api_key_file)  # read again when the file changes (a rotated key)
        upstream_key, routes_key = secret_from_env(UPSTREAM_KEY_ENV), secret_from_env(ROUTES_KEY_ENV)
    except (OSError, ValueError) as exc:
        print(f"tideflow router: keys: {exc}", file=sys.stderr)
        return 2
    tracing.setup("router")
    app = create_router_app(config, client_keys, keys_from_env(ADMIN_KEYS_ENV), upstream_key, routes_key)
    # Everything built so far lives as long as the process: frozen out of the collector's sight, a full
    # collection set off by a large body's objects scans those, not the 200,000 of the router's own modules
    # (such a collection took 270 ms in one call with the GIL held, so with the event loop waiting)
    gc.collect()
    gc.freeze()
    run_server(app, config.connections, host=config.host, port=config.port, reuse_port=config.reuse_port,
               own_socket=own, log_level="warning", timeout_graceful_shutdown=5, identity=identity)
    return 0
