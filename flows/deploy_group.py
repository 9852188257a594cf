"""deploy_group: weights to the node cache -> the shared KV store's expiry -> desired state to the controller -> all
Ready -> take traffic."""

from __future__ import annotations

from prefect import flow

from engine.control.models import GroupView
from engine.group.spec import InferenceGroup, ModelRef
from engine.weights import cache_dir_for
from flows.params import DeployParams
from tasks.fleet import changing_fleet
from tasks.groups import await_group_ready, register_group, start_group
from tasks.kv import kv_expiry
from tasks.weights import pull_weights


@flow(name="deploy_group", log_prints=True)
def deploy_group(params: DeployParams = DeployParams()) -> GroupView:
    """Ends once the group is Ready and takes its weight (or Failed at ready_timeout_s)."""
    spec = InferenceGroup.from_yaml(params.spec_file)
    update = {k: v for k, v in (("name", params.name), ("version", params.version)) if v}
    with changing_fleet(f"deploy of group {update.get('name', spec.name)}"):
        if params.weights_url:
            cache = cache_dir_for(params.weights_url)
            pull_weights(params.weights_url, cache)
            update["model"] = ModelRef(path=str(cache), dtype=spec.model.dtype)
        spec = InferenceGroup.model_validate({**spec.model_dump(), **update})
        kv_expiry(spec)  # the KV its members will share expires, before any is written
        name = start_group(spec)
        status = await_group_ready(name, params.ready_timeout_s)
        register_group(name, params.weight)
        return status
