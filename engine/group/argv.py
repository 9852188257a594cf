"""The `tideflow serve` command line of one group member, for both backends (local processes and Kubernetes
pods): where they differ is only what they pass in (addresses, the model's path, a rank as a number or as
the pod's $(LWS_WORKER_INDEX))."""

from __future__ import annotations

from engine.group.spec import InferenceGroup, RoleSpec


def serve_argv(group: InferenceGroup, spec: RoleSpec, *, model: str, host: str, port: int, served_name: str,
               rank: str | int | None = None, dist_addr: str | None = None, standby: bool = False) -> list[str]:
    """`serve ...` for a member of `spec`'s role; `rank` and `dist_addr` are needed when an instance has
    several members (DEP ranks rendezvous at `dist_addr`)."""
    e = spec.engine
    args = [
        "serve", "--role", spec.role, "--metrics-group", group.name, "--metrics-version", group.version,
        "--host", host, "--port", str(port), "--model", model, "--served-model-name", served_name,
        "--max-num-seqs", str(e.max_num_seqs),
        "--max-batch-tokens", str(e.max_batch_tokens),
        "--block-size", str(e.block_size),
        "--max-wait-ms", str(e.max_wait_ms),
        "--max-queue", str(e.max_queue),
        "--threads", str(spec.resources.threads),
    ]
    if e.lone_arrival_ms != type(e).model_fields["lone_arrival_ms"].default:  # the default goes without saying
        args += ["--lone-arrival-ms", str(e.lone_arrival_ms)]
    if not e.enable_prefix_cache:
        args.append("--no-prefix-cache")
    if e.enforce_eager:
        args.append("--enforce-eager")
    if e.scheduling != type(e).model_fields["scheduling"].default:
        args += ["--scheduling", e.scheduling]
    if e.step_target_ms != type(e).model_fields["step_target_ms"].default:
        args += ["--step-target-ms", str(e.step_target_ms or 0)]
    if e.max_client_tokens != type(e).model_fields["max_client_tokens"].default:
        args += ["--max-client-tokens", str(e.max_client_tokens)]
    if e.max_connections_per_address is not None:
        args += ["--max-connections-per-address", str(e.max_connections_per_address)]
    if e.kv_cache_bytes is not None:
        args += ["--kv-cache-bytes", str(e.kv_cache_bytes)]
    if e.kv_cache_fraction is not None:
        args += ["--kv-cache-fraction", str(e.kv_cache_fraction)]
    if group.model.dtype:
        args += ["--dtype", group.model.dtype]
    if spec.resources.gpus:  # the backend shows the member only its own GPUs: cuda is the first of them
        args += ["--device", "cuda"]
    if spec.role in ("prefill", "decode"):
        args += ["--kv-transport", group.transfer]
    if spec.members_per_instance > 1:
        if rank is None or dist_addr is None:
            raise ValueError(f"role {spec.role} has {spec.members_per_instance} members per instance: "
                             "a member's rank and the rendezvous address are needed")
        args += ["--dep-rank", str(rank), "--dep-size", str(spec.members_per_instance), "--dist-addr", dist_addr]
        fields = type(spec).model_fields
        if spec.eplb_interval_steps != fields["eplb_interval_steps"].default:
            args += ["--eplb-interval-steps", str(spec.eplb_interval_steps)]
        if spec.eplb_threshold != fields["eplb_threshold"].default:
            args += ["--eplb-threshold", str(spec.eplb_threshold)]
        if spec.redundant_experts:
            args += ["--redundant-experts", str(spec.redundant_experts)]
    if e.kv_tiers is not None:
        args += ["--kv-tiers", e.kv_tiers.model_dump_json(exclude_defaults=True)]
    if e.faults is not None:
        args += ["--faults", e.faults.model_dump_json()]
    if e.engine_core != "thread":
        args += ["--engine-core", e.engine_core, "--api-server-count", str(e.api_server_count)]
    if standby:
        if e.api_server_count > 1:
            raise ValueError(f"role {spec.role} runs {e.api_server_count} API servers per member: a standby member "
                             "needs one (its serving switch lives in one process)")
        args.append("--standby")
    return args
