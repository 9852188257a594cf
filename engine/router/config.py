"""Router settings (one pydantic model; the CLI and the group spec fill it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, IPvAnyNetwork

from engine.router.kv_index import KVRoutingConfig
from engine.api.connection_limits import ConnectionLimits


class RouterConfig(BaseModel):
    host: str = Field("127.0.0.1", description="bind address; loopback unless told otherwise")
    port: int = Field(8080, ge=0, le=65535, description="OpenAI API port (0 = any free port)")
    reuse_port: bool = Field(False, description="share the port with other router replicas on this host (SO_REUSEPORT): "
                                                "the kernel spreads connections over the live ones")
    model_name: str = Field("default", description="model id clients ask for")
    model_dir: Path | None = Field(None, description="checkpoint dir for the tokenizer (needed for PD groups)")
    block_size: int = Field(16, ge=1, description="KV block size, for prefix-affinity hashes")
    request_timeout_s: float = Field(300.0, gt=0, description="whole-request deadline")
    connect_timeout_s: float = Field(5.0, gt=0, description="upstream connect deadline")
    first_token_timeout_s: float = Field(120.0, gt=0, description="deadline for an upstream's first byte")
    stall_timeout_s: float = Field(
        1.5, gt=0, description="an upstream stream that sends nothing (no event, no heartbeat) for this long is taken "
                               "for a member that stopped: the request moves to another group and the member is "
                               "ejected. Members send a heartbeat each 0.5 s while their engine is at work, a long "
                               "prompt included")
    max_attempts: int = Field(3, ge=1, le=10, description="tries of a stage that failed before any token was sent")
    migration_limit: int = Field(
        3, ge=0, le=10, description="times one request may move to another worker after its upstream broke "
                                    "mid-answer (0 = off: the client gets an error event)")
    route_wait_s: float = Field(
        5.0, ge=0, description="how long a request (new or migrating) waits for a routable group when none is, "
                               "e.g. while a standby activates after a fall; 503 after")
    health_interval_s: float = Field(0.5, gt=0, description="period of the /ready probes")
    eject_after: int = Field(2, ge=1, description="failed probes before an endpoint is ejected")
    readmit_after: int = Field(2, ge=1, description="passed probes before an ejected endpoint is re-admitted")
    member_networks: list[IPvAnyNetwork] | None = Field(
        None, description="networks member endpoints must be in (IP literals or localhost only); None = any host")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest request body accepted (413 above)")
    connections: ConnectionLimits = Field(default_factory=ConnectionLimits,
                                          description="bounded reads of the clients' connections")
    prompt_workers: int = Field(2, ge=1, le=64, description="threads that parse large bodies and tokenize, template, "
                                                            "hash and serialize prompts, off the event loop")
    prompt_queue: int = Field(64, ge=1, description="prompts waiting for those threads beyond which a request gets 503 "
                                                    "at once")
    rate_limit_rps: float | None = Field(None, gt=0, description="requests per second per API key (None = off)")
    rate_limit_burst: int = Field(20, ge=1, description="bucket size of the per-key limiter")
    max_open_per_key: int | None = Field(
        256, ge=1, description="requests one API key may have open through this router at once; 429 beyond (None: "
                               "no cap). Members share their engines between keys fairly (scheduling: fair)")
    controller_url: str | None = Field(
        None, description="take the groups from this controller (watch) instead of the admin API; keeps the last "
                          "route set while the controller is away")
    advertise: str | None = Field(None, description="how this replica names itself to the controller (default host:port)")
    replica_url: str | None = Field(
        None, pattern=r"^https?://[^/\s]+$",
        description="where this replica alone answers (a port of its own beside a shared one, or its pod's address): "
                    "reported to the controller, so a scrape and the canary judge read every replica's metrics and "
                    "samples, not whichever one the shared port picks")
    kv_routing: KVRoutingConfig = Field(default_factory=KVRoutingConfig,
                                        description="placing prompts by the KV the members hold (engine.router.kv_index)")
