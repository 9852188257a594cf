"""`tideflow profile`: what one role shape does, measured, for capacity planning to read.

A plan is only as good as its per-replica figures, and those depend on the host, the dtype and the kernels, so
they are measured on the shape itself rather than taken from a datasheet: prefill TTFT and tokens/s against input
length and batch, decode inter-token latency and tokens/s against concurrent sequences and context, and the
memory sums a fit check needs (KV bytes per token, weight bytes, the KV budget and how many tokens it holds).
Each point runs in this process on an engine built as `tideflow serve` builds one, with distinct random prompts
(no prefix-cache hits), after a warm-up; a point that does not fit the KV budget is recorded as refused with its
reason instead of measured under preemption.
"""

from __future__ import annotations

import platform
import statistics
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.core.sampling_params import SamplingParams
from engine.runtime.paths import default_model_dir, home
from tideflow_kernels import isa
from tideflow_kernels.atomic_file import atomic_write_text

Progress = Callable[[str], None]


def _positive_sorted(values: list[int]) -> list[int]:
    if not values:
        raise ValueError("give at least one value")
    if any(v < 1 for v in values):
        raise ValueError(f"every value must be >= 1, got {values}")
    return sorted(set(values))


class ProfileSpec(BaseModel):
    """The role shape to profile and the sweep over it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_dir: Path | None = Field(None, description="checkpoint directory (None: the default model)")
    device: str = Field("cpu", description="cpu, cuda or cuda:<index>")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="None: the checkpoint's")
    kv_cache_bytes: int = Field(1 << 30, gt=0, description="the KV budget, as the role's members would get it")
    max_num_seqs: int = Field(64, ge=1, description="running batch cap, as the role's members would get it")
    input_lens: list[int] = Field([64, 256, 1024], description="prefill: prompt lengths")
    prefill_batches: list[int] = Field([1, 4], description="prefill: prompts arriving together")
    concurrency: list[int] = Field([1, 8, 32], description="decode: sequences decoding at once")
    contexts: list[int] = Field([128, 1024], description="decode: tokens of context each sequence holds")
    decode_tokens: int = Field(32, ge=4, le=4096, description="decode: tokens generated per sequence at each point")

    _lists = field_validator("input_lens", "prefill_batches", "concurrency", "contexts")(
        lambda v: _positive_sorted(v))


class PrefillPoint(BaseModel):
    input_len: int
    batch: int
    ttft_s: float | None = Field(None, description="median time from submitting the batch to a prompt's first token")
    tokens_per_s: float | None = Field(None, description="prompt tokens of the batch / time to its last first token")
    refused: str | None = Field(None, description="why the point was not measured")


class DecodePoint(BaseModel):
    concurrency: int
    context: int
    itl_s: float | None = Field(None, description="median inter-token latency while all the sequences decode at once")
    itl_p90_s: float | None = None
    tokens_per_s: float | None = Field(None, description="tokens out of all sequences per second once all decode")
    refused: str | None = None


class MemoryFigures(BaseModel):
    kv_bytes_per_token: int = Field(description="K and V of one token over every layer, in the serving dtype")
    weights_bytes: int = Field(description="the model's parameters in memory")
    buffers_bytes: int = Field(description="its buffers beside them (rotary tables and the like)")
    kv_budget_bytes: int = Field(description="what the KV cache holds: its blocks x block size x bytes per token")
    kv_tokens: int = Field(description="tokens the KV budget holds")


class RoleProfile(BaseModel):
    """A shape's measured figures: what `tideflow profile` writes and capacity planning reads."""

    model: str
    model_dir: str
    host: str = Field(description="where it was measured (CPU model and cores, or the GPU)")
    device: str
    dtype: str
    threads: int
    created_at: datetime
    prefill: list[PrefillPoint]
    decode: list[DecodePoint]
    memory: MemoryFigures


def host_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "unknown CPU"
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            model = value.strip() if key.strip() == "model name" else model
            flags = set(value.split()) if key.strip() == "flags" else flags
    except OSError:
        pass
    amx = "AMX" if any(f.startswith("amx") for f in flags) else "no AMX"
    return f"{model}, {torch.get_num_threads()} threads, {amx}"


class _Stamps:
    """Token arrival times of one request, from the engine's sink."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.done = threading.Event()
        self.error: str | None = None

    def __call__(self, out) -> None:
        self.times.extend([time.perf_counter()] * max(1, len(out.token_ids)))
        if out.finished:
            self.error = getattr(out, "error", None)
            self.done.set()


def _run(engine, prompts: list[list[int]], max_tokens: int, timeout_s: float = 600.0) -> tuple[float, list[_Stamps]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sinks = [_Stamps() for _ in prompts]
    t0 = time.perf_counter()
    for prompt, sink in zip(prompts, sinks):
        engine.submit(prompt, params, sink)
    for sink in sinks:
        if not sink.done.wait(timeout_s):
            raise TimeoutError(f"a profiling request did not finish in {timeout_s:g} s")
        if sink.error:
            raise RuntimeError(f"a profiling request failed: {sink.error}")
    return t0, sinks


def profile_role(spec: ProfileSpec, progress: Progress | None = None) -> RoleProfile:
    """Build the engine, sweep the spec's points, and return the figures (nothing written)."""
    from engine.core.engine_config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.model.config import read_config
    from engine.model.loader import load_model
    from engine.model.tokenizer import Tokenizer
    from tideflow_kernels.startup import arch_for, startup_ops

    say = progress or (lambda _msg: None)
    isa.cap_libraries()  # $TIDEFLOW_NO_AMX in a process that did not start as a tideflow command (a flow run)
    device = torch.device(spec.device)
    model_dir = (spec.model_dir or default_model_dir()).resolve()
    if not (model_dir / "config.json").exists():
        raise ValueError(f"no checkpoint at {model_dir} (config.json missing): name one, or run `tideflow model init`")
    config = read_config(model_dir)
    longest = max(max(spec.input_lens) + 1, max(spec.contexts) + spec.decode_tokens)
    if longest > config.max_position_embeddings:
        raise ValueError(f"the sweep needs sequences of {longest} tokens; the model's context is "
                         f"{config.max_position_embeddings}")
    startup_ops(arch_for(device), progress=say)
    model = load_model(model_dir, spec.dtype, spec.device)
    engine_config = EngineConfig(kv_cache_bytes=spec.kv_cache_bytes, max_num_seqs=spec.max_num_seqs,
                                 max_queue=max(max(spec.prefill_batches), max(spec.concurrency)) + 1,
                                 max_batch_tokens=max(2048, max(spec.input_lens)), max_wait_ms=0,
                                 dtype=spec.dtype, device=spec.device, max_client_tokens=0)
    engine = LLMEngine(model, Tokenizer(model_dir), engine_config)
    engine.start()
    try:
        engine.warm_up()
        memory = _memory(engine, model)
        rng = np.random.default_rng(0)

        def prompts(n: int, length: int) -> list[list[int]]:  # distinct: nothing is served from the prefix cache
            return rng.integers(3, config.vocab_size, (n, length)).tolist()

        prefill = []
        for length in spec.input_lens:
            for batch in spec.prefill_batches:
                say(f"prefill: {batch} x {length} tokens")
                prefill.append(_prefill_point(engine, prompts(batch, length), memory))
        decode = []
        for context in spec.contexts:
            for n in spec.concurrency:
                say(f"decode: {n} sequences at {context} tokens of context")
                decode.append(_decode_point(engine, prompts(n, context), spec.decode_tokens, memory,
                                            spec.max_num_seqs))
    finally:
        engine.stop()
    return RoleProfile(model=config.architecture, model_dir=str(model_dir), host=host_name(device),
                       device=str(device), dtype=str(model.config.torch_dtype).removeprefix("torch."),
                       threads=torch.get_num_threads(), created_at=datetime.now(timezone.utc),
                       prefill=prefill, decode=decode, memory=memory)


def _memory(engine, model) -> MemoryFigures:
    from engine.model.packed_linear import weight_bytes

    c = model.config  # K and V per layer, [blocks, block_size, kv_heads, head_dim] each (engine.model.paged)
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=c.torch_dtype).element_size()
    kv_tokens = engine.kv_blocks * engine.config.block_size
    return MemoryFigures(kv_bytes_per_token=per_token,
                         weights_bytes=weight_bytes(model),  # packed projections too (measured at load)
                         buffers_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                         kv_budget_bytes=per_token * kv_tokens, kv_tokens=kv_tokens)


def _prefill_point(engine, batch: list[list[int]], memory: MemoryFigures) -> PrefillPoint:
    n, length = len(batch), len(batch[0])
    if n * (length + 1) > memory.kv_tokens:
        return PrefillPoint(input_len=length, batch=n, refused=f"needs {n * (length + 1)} KV tokens, the budget "
                                                                 f"holds {memory.kv_tokens}")
    t0, sinks = _run(engine, batch, 1)
    firsts = [s.times[0] - t0 for s in sinks]
    return PrefillPoint(input_len=length, batch=n, ttft_s=statistics.median(firsts),
                        tokens_per_s=n * length / max(firsts))


def _decode_point(engine, batch: list[list[int]], tokens: int, memory: MemoryFigures, cap: int) -> DecodePoint:
    n, context = len(batch), len(batch[0])
    need = n * (context + tokens)
    if need > memory.kv_tokens:
        return DecodePoint(concurrency=n, context=context, refused=f"needs {need} KV tokens, the budget holds "
                                                                   f"{memory.kv_tokens}")
    if n > cap:
        return DecodePoint(concurrency=n, context=context, refused=f"more sequences than max_num_seqs {cap}")
    _, sinks = _run(engine, batch, tokens)
    # the window where all n decode at once: from the last one's first token (the others' prompts were prefilled
    # in steps beside their decodes) to the first one's last token (after it, fewer than n remain)
    start, end = max(s.times[0] for s in sinks), min(s.times[-1] for s in sinks)
    inside = [[t for t in s.times if start <= t <= end] for s in sinks]
    gaps = np.concatenate([np.diff(ts) for ts in inside])
    gaps = gaps[gaps > 0]  # tokens that arrived in one output share one stamp
    if end <= start or not len(gaps):
        return DecodePoint(concurrency=n, context=context, refused=f"the {n} sequences never decoded all at once "
                                                                   "(their prompts' prefill outlasted the first "
                                                                   "one's decode): raise decode_tokens")
    counted = sum(sum(1 for t in ts if t > start) for ts in inside)
    return DecodePoint(concurrency=n, context=context, itl_s=float(np.median(gaps)),
                       itl_p90_s=float(np.percentile(gaps, 90)), tokens_per_s=counted / (end - start))


def save_profile(profile: RoleProfile, out: Path | None = None) -> Path:
    """Write it whole or not at all; default $TIDEFLOW_HOME/profiles/<model dir>-<dtype>-<device>.json."""
    out = out or home() / "profiles" / f"{Path(profile.model_dir).name}-{profile.dtype}-{profile.device.replace(':', '')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, profile.model_dump_json(indent=2))
    return out


def as_markdown(profile: RoleProfile) -> str:
    """The profile as two tables and the memory sums, for a terminal or a Prefect artifact (markdown)."""
    ms = lambda s: "-" if s is None else f"{1000 * s:.1f}"  # noqa: E731
    rate = lambda r: "-" if r is None else f"{r:.0f}"  # noqa: E731
    lines = [f"{profile.model} on {profile.host}, {profile.dtype}, {profile.device}, {profile.threads} threads", "",
             "| prefill: input tokens | batch | TTFT p50 ms | prompt tok/s | refused |", "|---|---|---|---|---|"]
    lines += [f"| {p.input_len} | {p.batch} | {ms(p.ttft_s)} | {rate(p.tokens_per_s)} | {p.refused or ''} |"
              for p in profile.prefill]
    lines += ["", "| decode: context | sequences | ITL p50 ms | ITL p90 ms | output tok/s | refused |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {d.context} | {d.concurrency} | {ms(d.itl_s)} | {ms(d.itl_p90_s)} | {rate(d.tokens_per_s)} | "
              f"{d.refused or ''} |" for d in profile.decode]
    m = profile.memory
    lines += ["", f"KV {m.kv_bytes_per_token} bytes a token; weights {m.weights_bytes / 1e6:.1f} MB (+ "
                  f"{m.buffers_bytes / 1e6:.1f} MB of buffers); KV budget "
                  f"{m.kv_budget_bytes / 1e6:.1f} MB = {m.kv_tokens} tokens"]
    return "\n".join(lines)
