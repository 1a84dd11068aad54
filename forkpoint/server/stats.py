"""What the server says in its log: a start-up summary and a periodic stats line like vLLM's,
both built from `LLM.metrics()` snapshots (the engine thread's latest, never the engine itself).

    forkpoint.server: model /models/qwen (served as qwen), float32 on cpu, max_model_len 4096, loaded in 3.1 s
    forkpoint.server: pools: 2048 KV blocks x 16 tokens (32768 tokens), 64 state slots, 32 checkpoint slots
    forkpoint.server: checkpoints on: marker '<|mamba_checkpoint|>', at most 4 per request, ...
    forkpoint.server: prompt 812.4 tokens/s, generation 96.0 tokens/s | running 4, waiting 0 |
        KV 12.3% (252/2048), state slots 4/64, checkpoint slots 3/32 | checkpoints: 3 hits, 1,536 prompt
        tokens reused, hit rate 65.2% of prompt tokens since start | by kind chat_turn 48.0%, marker 9.1%;
        2 evicted; misses template_divergence 3 | speculative: mean acceptance length 2.40, 84 of 180 draft
        tokens accepted (46.7%), per position 0.72, 0.45, 0.23
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import sys
import time
from collections.abc import Callable

from forkpoint.kernels import kernel_variants
from forkpoint.llm import LLM
from forkpoint.server.config import MarkerPolicy, ServerConfig
from forkpoint.server.gc_pauses import GENERATIONS
from forkpoint.server.json_body import BodyLimits
from forkpoint.speculative_config import SpeculativeConfig

logger = logging.getLogger("forkpoint.server")

# counters whose change means the engine did something in an interval
ACTIVITY_KEYS = ("prompt_tokens_total", "prompt_tokens_computed", "generation_tokens_total", "requests_finished",
                 "requests_aborted")


def startup_summary(llm: LLM, config: ServerConfig, max_request_bytes: int, body_limits: BodyLimits,
                    load_time_s: float | None) -> list[str]:
    """The lines the server logs once at start-up."""
    return (engine_summary(llm, config.served_model_name, config.marker_policy, load_time_s)
            + server_summary(config, max_request_bytes, body_limits))


def engine_summary(llm: LLM, served_model_name: str, marker_policy: MarkerPolicy,
                   load_time_s: float | None) -> list[str]:
    """The start-up lines on the engine: model, memory, pools, checkpoints, graphs, tiers, kernels (built
    where the engine runs: in its own process with --engine-process)."""
    engine = llm.engine
    cfg = engine.config
    values = engine.metrics()
    loaded = f", loaded in {load_time_s:.1f} s" if load_time_s is not None else ""
    lines = [
        f"model {engine.model_path} (served as {served_model_name}), {str(engine.dtype).removeprefix('torch.')} "
        f"on {engine.device}, max_model_len {engine.max_model_len}{loaded}",
        engine.startup.summary(),
        f"memory: {engine.memory.summary()}",
        f"pools: {values['kv_blocks_total']} KV blocks x {cfg.block_size} tokens "
        f"({values['kv_blocks_total'] * cfg.block_size} tokens), {values['state_slots_total']} state slots, "
        f"{values['checkpoint_slots_total']} checkpoint slots; at most {cfg.max_num_seqs} sequences and "
        f"{cfg.max_num_batched_tokens} tokens per step",
    ]
    if cfg.enable_checkpoints:
        lines.append(f"checkpoints on: marker {cfg.checkpoint_token!r} (id {llm.checkpoint_token_id}), at most "
                     f"{cfg.max_checkpoints_per_request} per request, consumers wait at most "
                     f"{cfg.checkpoint_wait_s:g} s for a producer; marker in client text: {marker_policy.value}")
    else:
        lines.append("checkpoints off: markers and checkpoint controls are ignored")
    lines.append(engine.runner.graph_summary() if engine.graphs_off_reason is None
                 else f"CUDA graphs: off, every step runs eagerly ({engine.graphs_off_reason})")
    lines.append(speculative_summary(cfg.speculative_config))
    lines.append(host_tier_summary(values))
    if cfg.enable_checkpoints:
        lines.append(disk_tier_summary(values, cfg.checkpoint_dir))
    variants = kernel_variants(engine.device.type == "cuda")
    lines.append("kernels: " + ", ".join(f"{op} {variant}" for op, variant in variants.items()))
    return lines


def server_summary(config: ServerConfig, max_request_bytes: int, body_limits: BodyLimits) -> list[str]:
    """The start-up lines on the HTTP server: its parser and loop, the request limits, the stats interval."""
    stats = f"{config.log_stats_interval_s:g} s" if config.log_stats else "- (--disable-log-stats)"
    return [http_summary(),
            f"requests: at most {max_request_bytes:,} bytes (--max-request-bytes), {body_limits.max_objects:,} JSON "
            f"objects (--max-request-objects) and {body_limits.max_values:,} values (--max-request-values), "
            f"{config.max_waiting_requests} prompts waiting (--max-waiting-requests); stats every {stats}"]


def http_summary(available: Callable[[str], bool] | None = None) -> str:
    """The start-up line on what uvicorn serves with: it picks httptools and uvloop when they are installed
    (both are forkpoint's dependencies), else the pure-Python h11 parser and asyncio's loop, which cost the
    event loop, and the GIL it shares with the engine thread, more per streamed chunk (the 256-session
    profile on the H200, without them: ~4% of the GIL samples in h11's send). available: whether a module
    can be imported (default: importlib's finder)."""
    available = available or (lambda name: importlib.util.find_spec(name) is not None)
    parser = "httptools" if available("httptools") else "h11"
    loop = "uvloop" if sys.platform != "win32" and available("uvloop") else "asyncio"
    line = f"HTTP: {parser} parser, {loop} event loop"
    if (parser, loop) != ("httptools", "uvloop") and sys.platform != "win32":
        line += " (pip install httptools uvloop: the faster ones, used once installed)"
    return line


def speculative_summary(spec: SpeculativeConfig | None) -> str:
    """The start-up line on speculative decoding."""
    if spec is None:
        return "speculative decoding: off (--speculative-config)"
    return (f"speculative decoding: {spec.method} head drafts {spec.num_speculative_tokens} tokens per step, the "
            "model verifies them in one forward (steps with drafts run eagerly; sequences with penalties or "
            "logits processors, structured outputs included, decode one token a step)")


def host_tier_summary(values: dict[str, float]) -> str:
    """The start-up line on the host-memory tier that evicted checkpoints spill to."""
    capacity = values.get("host_tier_capacity_bytes")
    if not capacity:
        return ("host tier: off (--checkpoint-host-bytes 0, the default on CPU, where the pools are host memory "
                "already): an evicted checkpoint is gone")
    return (f"host tier: {capacity / 2**30:.1f} GiB of host memory (--checkpoint-host-bytes): evicted checkpoints "
            "spill there (state rows and KV blocks) and come back on a hit")


def disk_tier_summary(values: dict[str, float], directory: str | None) -> str:
    """The start-up line on the disk tier (files that survive a restart)."""
    if directory is None:
        return "disk tier: off (--checkpoint-dir): checkpoints do not survive a restart"
    return (f"disk tier: {directory}, {values.get('disk_tier_checkpoints', 0):.0f} checkpoint files of this model "
            f"found, at most {values.get('disk_tier_capacity_bytes', 0) / 2**30:.1f} GiB (--checkpoint-dir-bytes): "
            "checkpoints are written through and read back, verified, on a miss in memory")


def _disk_traffic(values: dict[str, float], delta: Callable[[str], float]) -> str:
    """' | disk tier: ...' for the stats line, or '' without a disk tier."""
    if "disk_tier_capacity_bytes" not in values:
        return ""
    rejected = sum(delta(key) for key in values if key.startswith("disk_files_rejected_"))
    return (f" | disk tier: {delta('checkpoints_saved_to_disk'):.0f} saved, "
            f"{delta('checkpoints_loaded_from_disk'):.0f} loaded, {rejected:.0f} rejected, "
            f"{values.get('disk_tier_checkpoints', 0):.0f} files ({values.get('disk_tier_bytes', 0) / 2**30:.2f} GiB)")


def _tier_traffic(values: dict[str, float], delta: Callable[[str], float]) -> str:
    """' | host tier: ...' for the stats line, or '' without a host tier."""
    if "host_tier_capacity_bytes" not in values:
        return ""
    return (f" | host tier: {delta('checkpoints_spilled'):.0f} spilled, {delta('checkpoints_restored'):.0f} "
            f"restored, {delta('checkpoints_dropped_from_host'):.0f} dropped, "
            f"{delta('checkpoints_unspilled_passed'):.0f} passed turns not spilled, "
            f"{values.get('host_tier_checkpoints', 0):.0f} held ({values.get('host_tier_bytes', 0) / 2**30:.2f} of "
            f"{values['host_tier_capacity_bytes'] / 2**30:.1f} GiB)")


class StatsLine:
    """Builds the periodic stats line from successive metrics snapshots. `line(values, now)` returns
    None while the engine stays idle (after one line that shows it idle).

    Prompt throughput counts computed prompt tokens (vLLM's); reused tokens are those a
    checkpoint supplied (`prompt_tokens_total - prompt_tokens_computed`, so a prompt's reused share
    counts from its arrival, its computed share as it is computed)."""

    def __init__(self, values: dict[str, float], now: float) -> None:
        self._last = dict(values)
        self._last_time = now
        self._quiet = True  # nothing to say until the engine does something

    def line(self, values: dict[str, float], now: float) -> str | None:
        last, elapsed = self._last, max(now - self._last_time, 1e-9)
        self._last, self._last_time = dict(values), now
        active = values.get("num_running", 0) or values.get("num_waiting", 0) or any(
            values.get(key, 0) != last.get(key, 0) for key in ACTIVITY_KEYS)
        if not active and self._quiet:
            return None
        self._quiet = not active

        def delta(key: str) -> float:
            return values.get(key, 0) - last.get(key, 0)

        total = values.get("prompt_tokens_total", 0)
        reused_so_far = total - values.get("prompt_tokens_computed", 0)
        reused = delta("prompt_tokens_total") - delta("prompt_tokens_computed")
        share = f"{100 * reused_so_far / total:.1f}%" if total else "-"
        kv_used, kv_total = values.get("kv_blocks_used", 0), values.get("kv_blocks_total", 0)
        return (f"prompt {delta('prompt_tokens_computed') / elapsed:.1f} tokens/s, generation "
                f"{delta('generation_tokens_total') / elapsed:.1f} tokens/s | running {values.get('num_running', 0)}, "
                f"waiting {values.get('num_waiting', 0)} | KV {100 * kv_used / max(kv_total, 1):.1f}% "
                f"({kv_used}/{kv_total}), state slots {values.get('state_slots_used', 0)}/"
                f"{values.get('state_slots_total', 0)}, checkpoint slots {values.get('checkpoint_slots_used', 0)}/"
                f"{values.get('checkpoint_slots_total', 0)} | checkpoints: {delta('checkpoint_hits'):.0f} hits, "
                f"{max(reused, 0):,.0f} prompt tokens reused, hit rate {share} of prompt tokens since start"
                + _tier_traffic(values, delta) + _disk_traffic(values, delta) + _by_kind(values, last)
                + _speculation(values, delta) + _gc(delta))


def _gc(delta: Callable[[str], float]) -> str:
    """' | GC: ...' for the stats line (the interval's garbage collections), or '' without any."""
    count = sum(delta(f"gc_collections_gen{g}") for g in GENERATIONS)
    if count <= 0:
        return ""
    seconds = sum(delta(f"gc_pause_seconds_gen{g}") for g in GENERATIONS)
    return (f" | GC: {count:.0f} collections, {1000 * seconds:.0f} ms (oldest generation "
            f"{delta('gc_collections_gen2'):.0f}, {1000 * delta('gc_pause_seconds_gen2'):.0f} ms)")


def _speculation(values: dict[str, float], delta: Callable[[str], float]) -> str:
    """' | speculative: ...' for the stats line (the interval's acceptance, as vLLM's SpecDecoding
    line), or '' when nothing was verified in it."""
    verifications = delta("spec_verifications")
    if verifications <= 0:
        return ""
    drafted, accepted = delta("spec_draft_tokens"), delta("spec_accepted_tokens")
    positions = sorted(int(key.removeprefix("spec_draft_tokens_pos_")) for key in values
                       if key.startswith("spec_draft_tokens_pos_"))
    rates = [delta(f"spec_accepted_tokens_pos_{i}") / max(delta(f"spec_draft_tokens_pos_{i}"), 1) for i in positions]
    return (f" | speculative: mean acceptance length {(accepted + verifications) / verifications:.2f}, "
            f"{accepted:.0f} of {drafted:.0f} draft tokens accepted ({100 * accepted / max(drafted, 1):.1f}%), "
            "per position " + ", ".join(f"{rate:.2f}" for rate in rates))


SAVED_PREFIX = "checkpoint_tokens_saved_"
MISS_PREFIX = "cache_misses_"


def _by_kind(values: dict[str, float], last: dict[str, float]) -> str:
    """The interval's reuse by checkpoint kind (share of its prompt tokens), evictions and misses by reason."""
    prompt = values.get("prompt_tokens_total", 0) - last.get("prompt_tokens_total", 0)
    saved = {key.removeprefix(SAVED_PREFIX): values[key] - last.get(key, 0) for key in values
             if key.startswith(SAVED_PREFIX) and values[key] > last.get(key, 0)}
    misses = {key.removeprefix(MISS_PREFIX): values[key] - last.get(key, 0) for key in values
              if key.startswith(MISS_PREFIX) and values[key] > last.get(key, 0)}
    evicted = values.get("checkpoints_evicted", 0) - last.get("checkpoints_evicted", 0)
    parts = []
    if saved and prompt > 0:
        parts.append("by kind " + ", ".join(f"{kind} {100 * n / prompt:.1f}%" for kind, n in sorted(saved.items())))
    if evicted:
        parts.append(f"{evicted:.0f} evicted")
    if misses:
        parts.append("misses " + ", ".join(f"{reason} {n:.0f}" for reason, n in sorted(misses.items())))
    return " | " + "; ".join(parts) if parts else ""


async def log_stats_forever(snapshot: Callable[[], dict[str, float]], interval_s: float) -> None:
    """Log `StatsLine` every `interval_s` seconds until cancelled."""
    stats = StatsLine(snapshot(), time.monotonic())
    while True:
        await asyncio.sleep(interval_s)
        line = stats.line(snapshot(), time.monotonic())
        if line is not None:
            logger.info("%s", line)
