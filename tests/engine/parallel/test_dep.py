"""DEP2 (two real processes over gloo) gives the logits of one process, before and after live rebalances."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.offline.default_model import TINY_CONFIG, write_default_model
from engine.parallel.eplb import Placement, rebalance_experts
from engine.parallel.expert_lb import ExpertLBConfig
from engine.model.loader import load_model
from engine.core.model_runner import ModelRunner, SeqStep
from engine.parallel.dep import DEPConfig, DEPRank, initial_placement
from engine.parallel.dist import DistConfig
from engine.parallel.launch import RankError, run_ranks
from harness.dep_replay import ReplayJob, ReplayStep, SeqSpec, replay_rank
from tideflow_kernels.tiles import to_tiles

pytestmark = pytest.mark.fleet  # starts processes or servers (tests/conftest.py)

EIGHT_EXPERTS = TINY_CONFIG.model_copy(update={"num_experts": 8})


@pytest.fixture(scope="module")
def moe8_dir(tmp_path_factory):
    return write_default_model(tmp_path_factory.mktemp("moe8"), EIGHT_EXPERTS, seed=1)


def _schedule() -> list[ReplayStep]:
    """Uneven batches (rank 1 idle in one step, rank 0 in another) around rebalances."""
    g = torch.Generator().manual_seed(7)
    tok = lambda n: torch.randint(0, EIGHT_EXPERTS.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = tok(12), tok(5), tok(20)
    lens = {"a": 12, "b": 5, "c": 20}
    blocks = {"a": [0], "b": [1], "c": [2, 3]}

    def seq(name: str, tokens: list[int]) -> SeqSpec:
        start = lens[name] - len(tokens)
        return SeqSpec(tokens=tokens, start=start, block_table=blocks[name])

    def decode(*names: str) -> list[SeqSpec]:
        out = []
        for n in names:
            lens[n] += 1
            out.append(seq(n, tok(1)))
        return out

    steps = [ReplayStep(batches=[[seq("a", a), seq("b", b)], [seq("c", c)]])]
    steps.append(ReplayStep(batches=[decode("a", "b"), []]))
    steps.append(ReplayStep(batches=[[], decode("c")]))
    steps.append(ReplayStep(rebalance=True))
    steps.append(ReplayStep(batches=[decode("a", "b"), decode("c")]))
    skewed = rebalance_experts(torch.tensor([[1, 1, 1, 1, 1, 1, 1, 50], [40, 1, 1, 1, 1, 1, 1, 1]]), 2, 4)
    steps.append(ReplayStep(rebalance=True, placement=skewed))
    steps.append(ReplayStep(batches=[decode("a"), decode("c")]))
    return steps


def _single_process(model_dir, steps: list[ReplayStep]) -> list[list[torch.Tensor] | None]:
    """The same steps with both ranks' batches merged into one batch of one full model."""
    runner = ModelRunner(load_model(model_dir), num_blocks=8, block_size=16)
    out = []
    for step in steps:
        if step.rebalance:
            out.append(None)
            continue
        merged = [s for batch in step.batches for s in batch]
        logits = runner.step([SeqStep(s.tokens, s.start, s.block_table) for s in merged])
        sizes = [len(b) for b in step.batches]
        out.append(list(logits.split(sizes)))
    return out


def _max_diff(results, reference) -> float:
    worst = 0.0
    for i, ref in enumerate(reference):
        if ref is None:
            continue
        for rank, res in enumerate(results):
            got = torch.tensor(res.logits[i]).reshape(-1, EIGHT_EXPERTS.vocab_size)
            assert got.shape == ref[rank].shape
            if got.numel():
                worst = max(worst, float((got - ref[rank]).abs().max()))
    return worst


@pytest.mark.parametrize("exchange", ["alltoall", "p2p"])
def test_dep2_matches_one_process_through_live_rebalances(moe8_dir, exchange):
    steps = _schedule()
    lb = ExpertLBConfig(num_redundant=2, imbalance_threshold=1.0)
    job = ReplayJob(dep=DEPConfig(model_dir=str(moe8_dir), num_blocks=8, exchange=exchange, lb=lb), steps=steps)
    results = run_ranks(replay_rank, 2, job, timeout_s=120)
    diff = _max_diff(results, _single_process(moe8_dir, steps))
    print(f"DEP2[{exchange}] vs one process: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-5
    planned, explicit = results[0].placements
    assert results[1].placements == [planned, explicit]
    assert len(planned[0]) == 10  # 8 experts + 2 redundant: the live plan added replicas
    assert explicit == steps[5].placement.phy2log
    assert results[0].step_bytes > 0 and results[1].step_bytes > 0


def test_dep2_with_replicas_from_the_start(moe8_dir):
    placement = rebalance_experts(torch.tensor([[90, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 60, 30, 1, 1, 1]]), 2, 6)
    _, _, logcnt = placement.maps()
    assert int(logcnt.max()) > 1
    steps = _schedule()[:3]
    job = ReplayJob(dep=DEPConfig(model_dir=str(moe8_dir), num_blocks=8, exchange="allgather"), placement=placement,
                    steps=steps)
    results = run_ranks(replay_rank, 2, job, timeout_s=120)
    diff = _max_diff(results, _single_process(moe8_dir, steps))
    print(f"DEP2 with {placement.num_physical} physical experts vs one process: max |logit diff| = {diff:.2e}")
    assert diff <= 1e-5
    # every rank counted its own routing: 37 + 2 + 1 tokens, top-2, two MoE layers
    assert sum(r.routed for r in results) == (12 + 5 + 20 + 2 + 1) * 2 * 2


@pytest.mark.parametrize("fault", ["low_memory", "stage_error"])
def test_a_refused_or_failed_move_keeps_the_old_placement_on_every_rank(moe8_dir, fault):
    """A rebalance that one rank cannot take (too little memory for the new weights beside the old, or its staging
    fails after the exchange) leaves both ranks on the old placement, and the steps after it still give the logits
    of one process."""
    skewed = rebalance_experts(torch.tensor([[1, 1, 1, 1, 1, 1, 1, 50], [40, 1, 1, 1, 1, 1, 1, 1]]), 2, 4)
    steps = _schedule()[:3] + [ReplayStep(rebalance=True, placement=skewed, fault=fault, fault_rank=1)] + \
        _schedule()[4:5]
    job = ReplayJob(dep=DEPConfig(model_dir=str(moe8_dir), num_blocks=8), steps=steps)
    results = run_ranks(replay_rank, 2, job, timeout_s=120)
    contiguous = [list(range(8))] * 2
    assert [r.placements for r in results] == [[contiguous], [contiguous]]
    assert [r.failed_moves for r in results] == [1, 1]
    assert _max_diff(results, _single_process(moe8_dir, steps)) <= 1e-5


def test_redundant_experts_start_replicated_and_must_split_over_the_ranks():
    placement = initial_placement(2, 8, 2, 2)
    assert placement.num_physical == 10 and placement.slots_per_rank == 5
    _, _, logcnt = placement.maps()
    assert int(logcnt.sum()) == 2 * 10 and int(logcnt.max()) == 2
    assert initial_placement(2, 8, 2, 0) == Placement.contiguous(2, 8, 2)
    with pytest.raises(ValueError, match="8 experts \\+ 3 replicas do not split evenly over 2 ranks"):
        initial_placement(2, 8, 2, 3)


def test_a_failing_rank_is_reported_and_reaped(tmp_path):
    job = ReplayJob(dep=DEPConfig(model_dir=str(tmp_path / "missing")), steps=[ReplayStep(rebalance=True)])
    with pytest.raises(RankError, match="no config.json"):
        run_ranks(replay_rank, 2, job, timeout_s=60)


def test_placement_for_another_world_size_is_refused(moe8_dir):
    with pytest.raises(ValueError, match="placement is for 4 ranks"):
        DEPRank(DistConfig(rank=0, world_size=1, port=1), DEPConfig(model_dir=str(moe8_dir)),
                Placement.contiguous(2, 8, 4))


def test_dep1_runs_without_a_process_group(moe8_dir):
    """One rank holds every expert: same logits as the plain runner, and an all-idle step is skipped."""
    rank = DEPRank(DistConfig(rank=0, world_size=1, port=1), DEPConfig(model_dir=str(moe8_dir), num_blocks=8))
    seqs = [SeqStep(list(range(1, 9)), 0, [0]), SeqStep([5, 6, 7], 0, [1])]
    ref = ModelRunner(load_model(moe8_dir), num_blocks=8).step(seqs)
    assert float((rank.step(seqs) - ref).abs().max()) <= 1e-5
    assert rank.step([]).shape == (0, EIGHT_EXPERTS.vocab_size)
    assert rank.steps == 1


def test_the_kv_cache_is_sized_from_the_memory_left_after_the_weights(moe8_dir, monkeypatch):
    """Sized before loading, a fraction of free GPU memory would count the weights' memory twice (issue #23): the
    rank asks how much memory is left only once its weights are loaded, and sizes the cache from that."""
    import engine.core.kv_cache
    import engine.parallel.dep as dep

    loaded, asked = [], []
    real_load = dep.load_model

    def load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        loaded.append(model)
        return model

    def available(device):
        asked.append(bool(loaded))
        return 64 << 20

    monkeypatch.setattr(dep, "load_model", load)
    monkeypatch.setattr(engine.core.kv_cache, "available_memory", available)
    rank = DEPRank(DistConfig(rank=0, world_size=1, port=1),
                   DEPConfig(model_dir=str(moe8_dir), num_blocks=None, kv_cache_fraction=0.5))
    assert asked == [True]
    per_block = engine.core.kv_cache.kv_bytes_per_block(rank.config, 16)
    assert rank.runner.num_blocks == (32 << 20) // per_block
    by_bytes = DEPRank(DistConfig(rank=0, world_size=1, port=1),
                       DEPConfig(model_dir=str(moe8_dir), num_blocks=None, kv_cache_bytes=per_block * 5))
    assert by_bytes.runner.num_blocks == 5 and asked == [True]


def test_experts_kept_tiled_move_between_slots_row_major_and_land_tiled(moe8_dir):
    """A rank keeping its experts tiled (tideflow_kernels.tiles: bf16 on AMX hosts) sends them row-major and
    tiles what it receives, so ranks with and without the tiles exchange experts alike."""
    rank = DEPRank(DistConfig(rank=0, world_size=1, port=1), DEPConfig(model_dir=str(moe8_dir), num_blocks=8))
    for moe in rank.model.moe_layers():  # what use_tiles does on an AMX host; the reference reads both layouts
        e = moe.experts
        e.w13, e.w2, e.tiled = nn.Parameter(to_tiles(e.w13.data), False), nn.Parameter(to_tiles(e.w2.data), False), True
    seqs = [SeqStep(list(range(1, 9)), 0, [0]), SeqStep([5, 6, 7], 0, [1])]
    ref = ModelRunner(load_model(moe8_dir), num_blocks=8).step(seqs)
    replicas = rebalance_experts(torch.tensor([[1, 1, 1, 1, 1, 1, 1, 50], [40, 1, 1, 1, 1, 1, 1, 1]]), 1, 3)
    assert rank.rebalance(replicas) is replicas
    assert all(m.experts.tiled and m.experts.w13.shape[0] == 11 for m in rank.model.moe_layers())
    assert float((rank.step(seqs) - ref).abs().max()) <= 1e-5
