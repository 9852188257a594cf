"""`tideflow serve` flags of a DEP member and the settings they make (light: no torch import at parse time)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DEPServeConfig(BaseModel):
    """Where this rank sits in its DEP instance and how the instance keeps its experts balanced."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0, description="this member's rank (--dep-rank)")
    size: int = Field(gt=1, description="ranks in the instance (--dep-size)")
    dist_addr: str = Field(pattern=r"^[^:\s]+:[0-9]{1,5}$", description="HOST:PORT of rank 0's rendezvous store (--dist-addr)")
    timeout_s: float = Field(30.0, gt=0, description="a collective waiting longer than this fails the instance")
    rebalance_interval_steps: int = Field(1000, gt=0, description="steps between expert rebalance checks")
    imbalance_threshold: float = Field(1.1, ge=1.0, description="rebalance when max/mean rank load exceeds this")
    idle_wait_s: float = Field(0.002, gt=0, le=0.1, description="wait between polls when no rank has work")
    redundant_experts: int = Field(0, ge=0, le=4096, description="physical expert slots per MoE layer beyond one per "
                                                                 "expert, spread over the ranks: replicas of hot "
                                                                 "experts (--redundant-experts)")

    def dist_config(self, device: str = "cpu"):
        """The engine.parallel.dist.DistConfig of this rank, computing on `device` (the engine's --device)."""
        from engine.parallel.dist import DistConfig

        host, port = self.dist_addr.rsplit(":", 1)
        return DistConfig(rank=self.rank, world_size=self.size, host=host, port=int(port), timeout_s=self.timeout_s,
                          device=device)


def add_arguments(parser) -> None:
    """The `tideflow serve` flags of a DEP member (the group backends pass the first three)."""
    parser.add_argument("--dep-rank", type=int, default=0, help="rank of this member in its DEP instance")
    parser.add_argument("--dep-size", type=int, default=1, help="ranks of the DEP instance (1: no expert parallelism)")
    parser.add_argument("--dist-addr", help="HOST:PORT where rank 0 serves the instance's rendezvous")
    parser.add_argument("--dist-timeout-s", type=float, default=30.0,
                        help="a collective waiting longer than this exits the rank (the group is rebuilt)")
    parser.add_argument("--eplb-interval-steps", type=int, default=1000, help="steps between expert rebalance checks")
    parser.add_argument("--eplb-threshold", type=float, default=1.1,
                        help="rebalance experts when max/mean rank load exceeds this")
    parser.add_argument("--redundant-experts", type=int, default=0,
                        help="extra expert slots per MoE layer over the instance, for replicas of hot experts "
                             "(experts + this must split evenly over the ranks)")


def dep_serve_config(args) -> DEPServeConfig | None:
    """The DEP settings of `tideflow serve`, or None for a single-process engine."""
    if args.dep_size <= 1:
        if args.redundant_experts:
            raise ValueError("--redundant-experts needs a DEP instance (--dep-size > 1): one process holds every "
                             "expert once and has no rank to spread a replica to")
        return None
    if not args.dist_addr:
        raise ValueError("--dist-addr HOST:PORT is required with --dep-size > 1")
    return DEPServeConfig(rank=args.dep_rank, size=args.dep_size, dist_addr=args.dist_addr,
                          timeout_s=args.dist_timeout_s, rebalance_interval_steps=args.eplb_interval_steps,
                          imbalance_threshold=args.eplb_threshold, redundant_experts=args.redundant_experts)
