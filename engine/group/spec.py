"""The InferenceGroup spec: one atomic serving unit (roles x instances x members), read from YAML.

A group is either one `colocated` role, or `prefill` + `decode` with an optional `encoder`.
Each role runs `instances` independent instances; an instance of strategy `DEP<n>` is n members (ranks)
that start, fail and are rebuilt together. `TP1` is one member; `TP<n>` for n > 1 is refused (not built).
"""

from __future__ import annotations

import math
import os
import re
import string
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.core.engine_config import EngineKnobs
from engine.runtime.errors import TideflowError
from engine.api.fault_config import FaultConfig
from engine.runtime.paths import home

Role = Literal["encoder", "prefill", "decode", "colocated"]
ROLE_ORDER: tuple[Role, ...] = ("encoder", "prefill", "decode", "colocated")
MAX_MEMBERS_PER_INSTANCE = 64
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
PARALLEL = re.compile(r"^(DEP|TP)([1-9][0-9]*)$")
# Kubernetes resource quantity, e.g. "500m", "2", "16Gi", "1.5G".
QUANTITY = re.compile(r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE])?$")
QUANTITY_FACTORS = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
                    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60}
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


class GroupSpecError(TideflowError):
    """An InferenceGroup spec file cannot be read or fails validation; the message names the field."""


class ModelRef(BaseModel):
    """Which weights the group serves: a local checkpoint dir or a published weights version."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str | None = Field(None, description="checkpoint directory; `${VAR}` and `~` are expanded when resolved")
    uri: str | None = Field(None, description="published weights version, e.g. s3://bucket/models/name/v1/ or file:///...")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="override the checkpoint dtype")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelRef":
        if (self.path is None) == (self.uri is None):
            raise ValueError("set exactly one of model.path or model.uri")
        if self.uri is not None and not re.match(r"^(s3://[^/]+/.+|file:///.+)", self.uri):
            raise ValueError(f"model.uri {self.uri!r} must be s3://bucket/prefix/ or file:///path")
        if self.path is not None:
            self.expanded_path()
        return self

    def expanded_path(self, env: Mapping[str, str] | None = None) -> str:
        """`path` with `${VAR}` taken from `env` (default: this process; TIDEFLOW_HOME defaults to ~/.tideflow) and `~` expanded."""
        if self.path is None:
            raise GroupSpecError("model.path is not set (the model is given by model.uri)")
        values = {"TIDEFLOW_HOME": str(home())} | dict(os.environ if env is None else env)
        try:
            expanded = string.Template(self.path).substitute(values)
        except KeyError as exc:
            raise ValueError(f"model.path {self.path!r} uses ${{{exc.args[0]}}}, which is not set") from None
        except ValueError:
            raise ValueError(f"model.path {self.path!r} has a malformed ${{...}} reference") from None
        return os.path.expanduser(expanded)


class Resources(BaseModel):
    """What one member (one process / pod) asks for."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: str = Field("1", description="CPU cores as a Kubernetes quantity, e.g. '500m', '4'; the member computes on "
                                      "this many threads, rounded up (`serve --threads`), so members sharing a host "
                                      "do not each spin on every core")
    memory: str = Field("4Gi", description="memory as a Kubernetes quantity, e.g. '16Gi'")
    gpus: int = Field(0, ge=0, le=16, description="GPUs per member (nvidia.com/gpu on Kubernetes; locally its own "
                                                  "GPUs via CUDA_VISIBLE_DEVICES); a member with GPUs computes on cuda")

    @field_validator("cpu", "memory", mode="before")
    @classmethod
    def _quantity(cls, value: object) -> str:
        text = str(value)
        if not QUANTITY.match(text):
            raise ValueError(f"{text!r} is not a Kubernetes quantity (e.g. '500m', '2', '16Gi')")
        return text

    @property
    def threads(self) -> int:
        """The member's compute threads: its CPU share rounded up ('500m' -> 1, '2' -> 2, '2500m' -> 3)."""
        parsed = QUANTITY.match(self.cpu)
        cores = float(parsed.group(1)) * QUANTITY_FACTORS.get(parsed.group(3) or "", 1.0)
        return max(1, math.ceil(cores - 1e-9))


class EngineArgs(EngineKnobs):
    """roles[].engine: the engine's own knobs (engine.core.engine_config.EngineKnobs, the same defaults as
    `tideflow serve`), plus faults for drills."""

    faults: FaultConfig | None = Field(None, description="drills only: faults every member injects (errors, slow tokens), "
                                                         "e.g. to rehearse a canary rollback")
    engine_core: Literal["thread", "process"] = Field(
        "thread", description="thread: the engine steps in the API server's process; process: in a process of its own "
                              "(`serve --engine-core process`; colocated DEP1 roles)")
    api_server_count: int = Field(1, ge=1, le=16, description="API server processes in front of an engine core in a "
                                                              "process of its own (`serve --api-server-count`)")
    max_connections_per_address: int | None = Field(
        None, ge=1, description="connections one address (the router's, in a fleet) may hold to a member (`serve "
                                "--max-connections-per-address`); None: 256 + max_num_seqs + max_queue, one for "
                                "every request the engine admits past any address's allowance")


MAX_INSTANCES = 256  # a bound a cluster would accept; larger fleets are several groups
MAX_MEMBERS = 1024  # members of one group: one atomic unit that starts, fails and is rebuilt together
MAX_WARM_POOL = 64  # silent standby groups of one spec
MAX_ROUTER_REPLICAS = 64
MAX_SPEC_BYTES = 1 << 20  # a spec file is a page of YAML; larger is a mistake (or /dev/zero)


class RoleSpec(BaseModel):
    """One role of the group and how many instances of which shape run it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role = Field(description="what this role's members do")
    instances: int = Field(1, ge=1, le=MAX_INSTANCES, description=f"independent instances of this role (1..{MAX_INSTANCES})")
    parallel: str = Field("DEP1", description="strategy per instance: DEP<n>, n members, n a power of two <= 64 "
                                              "(TP1 is one member too; TP<n> for n > 1 is refused: not implemented)")
    resources: Resources = Field(default_factory=Resources, description="per member")
    engine: EngineArgs = Field(default_factory=EngineArgs, description="engine args of every member")
    port_base: int | None = Field(None, ge=1024, le=65535, description="first port of this role's members (local backend)")
    redundant_experts: int = Field(0, ge=0, le=4096, description="DEP roles: expert slots per MoE layer beyond one per "
                                                                 "expert, for replicas of hot experts the expert LB "
                                                                 "places and moves live (`serve --redundant-experts`)")
    eplb_interval_steps: int = Field(1000, gt=0, description="DEP roles: steps between checks of the ranks' expert "
                                                             "load (`serve --eplb-interval-steps`)")
    eplb_threshold: float = Field(1.1, ge=1.0, description="DEP roles: rebalance when max/mean rank load exceeds this "
                                                           "(`serve --eplb-threshold`)")

    @model_validator(mode="after")
    def _experts_on_dep(self) -> "RoleSpec":
        if self.redundant_experts and self.members_per_instance < 2:
            raise ValueError(f"redundant_experts {self.redundant_experts} needs a DEP role of 2 members or more, not "
                             f"{self.parallel}: one member holds every expert once")
        return self

    @field_validator("parallel")
    @classmethod
    def _parallel(cls, value: str) -> str:
        match = PARALLEL.match(value)
        if not match:
            raise ValueError(f"{value!r} is not a strategy like DEP1, DEP8 or TP1")
        n = int(match.group(2))
        if n > MAX_MEMBERS_PER_INSTANCE or n & (n - 1):
            raise ValueError(f"{value!r}: the degree must be a power of two <= {MAX_MEMBERS_PER_INSTANCE}")
        if match.group(1) == "TP" and n > 1:
            raise ValueError(f"{value!r}: tensor parallelism is not implemented (no member would shard attention or "
                             f"the dense layers); use DEP{n} (experts sharded over {n} members, attention per member) "
                             "or TP1")
        return value

    @model_validator(mode="after")
    def _ports(self) -> "RoleSpec":
        if self.port_base is not None:
            last = self.port_base + self.instances * self.members_per_instance - 1
            if last > 65535:
                raise ValueError(f"port_base {self.port_base}: its {self.instances * self.members_per_instance} members "
                                 f"would need ports up to {last}, past 65535; lower port_base")
        return self

    @property
    def ports(self) -> range:
        """The ports this role's members take on the local backend (empty when port_base is unset)."""
        if self.port_base is None:
            return range(0)
        return range(self.port_base, self.port_base + self.instances * self.members_per_instance)

    @model_validator(mode="after")
    def _engine_core(self) -> "RoleSpec":
        e = self.engine
        if e.api_server_count > 1 and e.engine_core != "process":
            raise ValueError("engine.api_server_count above 1 needs engine.engine_core: process")
        if e.engine_core == "process" and (self.role != "colocated" or self.members_per_instance > 1):
            raise ValueError(f"engine.engine_core: process serves colocated DEP1 roles only, not {self.role} "
                             f"{self.parallel}")
        return self

    @property
    def strategy(self) -> Literal["DEP", "TP"]:
        return PARALLEL.match(self.parallel).group(1)  # type: ignore[union-attr,return-value]

    @property
    def members_per_instance(self) -> int:
        return int(PARALLEL.match(self.parallel).group(2))  # type: ignore[union-attr]


class RouterSpec(BaseModel):
    """The gateway in front of the group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(1, ge=1, le=MAX_ROUTER_REPLICAS, description=f"router processes / pods (1..{MAX_ROUTER_REPLICAS})")
    port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible API port")


class Member(BaseModel):
    """One rank of one instance of one role: the unit a backend starts and observes."""

    model_config = ConfigDict(frozen=True)

    role: Role
    instance: int = Field(ge=0, description="instance index within the role")
    rank: int = Field(ge=0, description="rank within the instance; 0 is the leader")
    size: int = Field(gt=0, description="members of this instance")


class InferenceGroup(BaseModel):
    """An atomic group: registered only when every member is ready, rebuilt whole on any failure."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="DNS-1123 label naming the group (and its Kubernetes objects)")
    version: str = Field(description="release version of what the group serves")
    model: ModelRef = Field(description="the weights")
    roles: list[RoleSpec] = Field(min_length=1, max_length=len(ROLE_ORDER),
                                  description="colocated alone, or prefill + decode (+ encoder)")
    warm_pool: int = Field(0, ge=0, le=MAX_WARM_POOL,
                           description=f"silent standby groups kept loaded and warm (0..{MAX_WARM_POOL})")
    transfer: Literal["shm", "tcp"] = Field("shm", description="KV transport between prefill and decode")
    router: RouterSpec = Field(default_factory=RouterSpec, description="gateway")
    labels: dict[str, str] = Field(default_factory=dict, description="extra labels on everything the group creates")

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        # 63 less room for the "-<role>-standby" suffix backends append.
        if len(value) > 40 or not DNS_LABEL.match(value):
            raise ValueError(f"{value!r} must be a DNS-1123 label of at most 40 characters: lowercase a-z, 0-9 and '-'")
        return value

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if not value or not LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"{value!r} must be usable as a label value: <= 63 of A-Z a-z 0-9 - _ .")
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not LABEL_KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
                raise ValueError(f"label key {key!r} is not a valid Kubernetes label key")
            if not LABEL_VALUE.match(item) or len(item) > 63:
                raise ValueError(f"label {key!r} value {item!r} is not a valid Kubernetes label value")
            if key.startswith("tideflow.dev/") or key.startswith("app.kubernetes.io/"):
                raise ValueError(f"label key {key!r} is reserved for tideflow")
        return value

    @model_validator(mode="after")
    def _shape(self) -> "InferenceGroup":
        names = [r.role for r in self.roles]
        dupes = sorted(n for n, count in Counter(names).items() if count > 1)
        if dupes:
            raise ValueError(f"roles: {', '.join(dupes)} listed more than once")
        present = set(names)
        if "colocated" in present and present != {"colocated"}:
            raise ValueError("roles: 'colocated' must be the only role")
        if "colocated" not in present and not {"prefill", "decode"} <= present:
            missing = sorted({"prefill", "decode"} - present)
            raise ValueError(f"roles: a disaggregated group needs prefill and decode; missing {', '.join(missing)}")
        if self.total_members > MAX_MEMBERS:
            raise ValueError(f"roles: {self.total_members} members in one group, over {MAX_MEMBERS}; split the fleet "
                             "into several groups")
        for i, first in enumerate(self.roles):
            for second in self.roles[i + 1:]:
                if first.ports and second.ports and first.ports.start < second.ports.stop \
                        and second.ports.start < first.ports.stop:
                    raise ValueError(f"roles: {first.role} ports {first.ports.start}-{first.ports.stop - 1} and "
                                     f"{second.role} ports {second.ports.start}-{second.ports.stop - 1} overlap")
        return self

    def role(self, name: Role) -> RoleSpec:
        """The spec of role `name`; KeyError if the group has none."""
        for spec in self.roles:
            if spec.role == name:
                return spec
        raise KeyError(f"group {self.name!r} has no role {name!r}")

    def members(self) -> Iterator[Member]:
        """Every member, role by role (encoder, prefill, decode, colocated), instance by instance, rank by rank."""
        for spec in sorted(self.roles, key=lambda r: ROLE_ORDER.index(r.role)):
            size = spec.members_per_instance
            for instance in range(spec.instances):
                for rank in range(size):
                    yield Member(role=spec.role, instance=instance, rank=rank, size=size)

    @property
    def serving_capacity(self) -> int:
        """Members that produce tokens (colocated and decode): the unit in which groups of different shapes share
        traffic, so a group twice as wide takes twice the requests."""
        return sum(r.instances * r.members_per_instance for r in self.roles if r.role in ("colocated", "decode"))

    @property
    def total_members(self) -> int:
        return sum(r.instances * r.members_per_instance for r in self.roles)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "InferenceGroup":
        """Load a spec file; errors name the file and the field."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SPEC_BYTES + 1)  # bounded: a spec read from an endless file is refused, not eaten
            if len(raw) > MAX_SPEC_BYTES:
                raise GroupSpecError(f"{path}: a group spec is at most {MAX_SPEC_BYTES} bytes; this one is larger")
            data = yaml.safe_load(raw.decode())
        except RecursionError:
            raise GroupSpecError(f"{path}: cannot read group spec: nested too deeply") from None
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
            raise GroupSpecError(f"{path}: cannot read group spec: {_first_line(exc)}") from None
        if not isinstance(data, dict):
            raise GroupSpecError(f"{path}: a group spec is a YAML mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise GroupSpecError(f"{path}: {describe(exc)}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def _first_line(exc: Exception) -> str:
    """YAML errors point at the line with a multi-line excerpt; the CLI promises one line."""
    return " ".join(str(exc).split())[:300]


def describe(exc: ValidationError) -> str:
    """'roles.1.parallel: <message>' for each error, so the field is named first."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "spec"
        parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)
