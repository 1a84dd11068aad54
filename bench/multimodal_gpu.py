"""1-to-N scoring with images on one GPU at Qwen3.5-35B-A3B shapes: the issue-6 table on the H200.

Model: the text model of `bench/e2e_gpu.py` (Qwen3.5-35B-A3B shapes: 40 layers, hidden 2048, 256
experts top-8; 34.7 B parameters) inside a `Qwen3_5MoeForConditionalGeneration` config, with the
vision tower at the released size (`vision_config` of Qwen3.5-35B-A3B, which equals transformers'
`Qwen3_5MoeVisionConfig` defaults except `out_hidden_size` = the text width 2048: depth 27, width
1152, MLP 4304, 16 heads, patch 16, temporal patch 2, 2x2 merge, 48 x 48 learned positions) and the
released mrope section [11, 11, 10]. Seeded random bf16 weights (`load_format="dummy"`, which
initialises the vision tower too: LayerNorms identity, the rest N(0, 0.02)); the real Qwen3.5
tokenizer and preprocessing (65,536 to 16,777,216 pixels, one image token per 32 x 32 pixels).

Workload (the seed's shape), fresh seeded text and images for every run, so nothing matches an
earlier run: an anchor of P = 624 tokens (random text ids around one 448 x 448 image = 196 image
tokens), the checkpoint marker, then N suffixes of 350-650 tokens, each random text around its own
image (256 x 256 to 448 x 320: 64-140 tokens). max_tokens 1, greedy, all N added at once.
- ON: prompts `anchor + marker + suffix_i`: one producer, N - 1 consumers.
- OFF: prompts of the same lengths and image sizes (other random text and pixels) without the
  marker, on the same engine (two 70 GB models do not fit on one GPU): no checkpoint is
  registered, so every request computes its whole prompt.
Both keep the image embedding cache (the engine's default), so OFF encodes the anchor image once
too (the `images encoded` column shows it): the gain measured is the prefix compute. Steps that
compute image tokens run eagerly; with CUDA graphs on (the engine's default, `--enforce-eager`
turns them off) text-only steps may replay graphs.

Per N (`--n`, default 9, first; then `--extra-n`, default 4,16,64, while `--time-budget` allows):
one untimed pair for the shapes, then `--repeats` timed pairs in alternating order; medians.
requests/s = N / wall from the first add_request to the last output; TTFT of a request = its first
output - the start of its add_request (image decoding and hashing included); ideal ratio
sum(P + S_i) / (P + sum S_i). The vision tower alone is timed on one run's N + 1 images.

Usage:
    python bench/multimodal_gpu.py --out bench/results        # H200: multimodal_gpu_h200.{json,png}
    python bench/multimodal_gpu.py --smoke                    # tiny model, CPU float32, < 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(BENCH, ".."))
sys.path.insert(0, BENCH)

from e2e_gpu import full_config, param_counts, tiny_config  # noqa: E402  (the e2e benchmark's text model)
from host_info import VOCAB_LIMIT, code_version, machine_info  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.inputs.default_model import ensure_default_model  # noqa: E402
from forkpoint.inputs.images import ImageProcessorConfig, batch_pixel_values, smart_resize  # noqa: E402

# vision_config of the released Qwen3.5-35B-A3B (out_hidden_size is set to the text width)
VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, hidden_act="gelu_pytorch_tanh",
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=2304)
TINY_VISION = dict(VISION, depth=2, hidden_size=64, intermediate_size=128, num_heads=4)
# preprocessor_config.json of the Qwen3.5 releases
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
IMAGE_TOKEN_IDS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
                   "vision_end_token_id": 248054}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SUFFIX_IMAGES = ((256, 256), (320, 320), (384, 288), (448, 320), (288, 416))  # (width, height): 64-140 tokens


# ---------------------------------------------------------------- model directory

def multimodal_config(text: dict, vision: dict) -> dict:
    """A `qwen3_5_moe` config.json: `text` (a `qwen3_5_moe_text` config) as text_config, `vision` as
    vision_config; the mrope section splits the rotary frequencies as the release does (11/11/10 of 32)."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    half = int(text["head_dim"] * text["rope_parameters"]["partial_rotary_factor"]) // 2
    t_h = round(half * 11 / 32)
    text["model_type"] = "qwen3_5_moe_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [t_h, t_h, half - 2 * t_h],
                               "mrope_interleaved": True}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text,
            "vision_config": {**vision, "model_type": "qwen3_5_moe_vision", "out_hidden_size": text["hidden_size"]},
            "tie_word_embeddings": text.get("tie_word_embeddings", False), **IMAGE_TOKEN_IDS}


def make_model_dir(cfg: dict, directory: Path) -> Path:
    """config.json, preprocessor_config.json and the Qwen3.5 tokenizer files (no weights: dummy load)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
    source = ensure_default_model()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)
    return directory


# ---------------------------------------------------------------- workload

@dataclass
class Workload:
    """ON and OFF prompts of one run pair: the same lengths and image sizes, different random
    content (text ids and pixels), so neither run finds the other's checkpoint or cached images."""

    on: list[dict]          # anchor + marker + suffix_i, with multi_modal_data
    off: list[dict]         # another anchor + suffix_i of the same lengths, no marker
    anchor_len: int         # P, image tokens included
    suffix_lens: list[int]  # S_i, image tokens included

    @property
    def ideal(self) -> float:
        p = self.anchor_len
        return sum(p + s for s in self.suffix_lens) / (p + sum(self.suffix_lens))


def image_tokens(size: tuple[int, int], processor: ImageProcessorConfig) -> int:
    """<|image_pad|> tokens of a width x height image after smart_resize."""
    height, width = smart_resize(size[1], size[0], processor.factor, processor.min_pixels, processor.max_pixels)
    return (height // processor.factor) * (width // processor.factor)


def noise_image(rng: np.random.Generator, size: tuple[int, int]):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def make_workload(seed: int, n: int, args, processor: ImageProcessorConfig, marker: int) -> Workload:
    """Shapes from `seed` (suffix lengths, image sizes, where each image sits), content from
    `seed`'s ON and OFF streams."""
    shape = np.random.default_rng(seed)
    vs, pad, ve = (IMAGE_TOKEN_IDS[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id"))
    anchor_size = tuple(args.anchor_image)
    anchor_text = args.anchor_len - image_tokens(anchor_size, processor) - 2
    if anchor_text < 2:
        raise ValueError(f"--anchor-len {args.anchor_len} leaves no text beside a {anchor_size} image")
    suffixes = []  # (image size, text tokens, where the image goes)
    for _ in range(n):
        size = SUFFIX_IMAGES[int(shape.integers(len(SUFFIX_IMAGES)))]
        total = int(shape.integers(args.suffix_range[0], args.suffix_range[1] + 1))
        text = max(0, total - image_tokens(size, processor) - 2)
        suffixes.append((size, text, int(shape.integers(0, text + 1))))
    prompts = {}
    for mode, stream in (("on", 1), ("off", 2)):
        rng = np.random.default_rng([seed, stream])
        words = rng.integers(0, VOCAB_LIMIT, anchor_text).tolist()
        anchor = words[: anchor_text // 2] + [vs, pad, ve] + words[anchor_text // 2:]
        anchor_image = noise_image(rng, anchor_size)
        prompts[mode] = []
        for size, text, cut in suffixes:
            words = rng.integers(0, VOCAB_LIMIT, text).tolist()
            ids = anchor + ([marker] if mode == "on" else []) + words[:cut] + [vs, pad, ve] + words[cut:]
            prompts[mode].append({"prompt_token_ids": ids,
                                  "multi_modal_data": {"image": [anchor_image, noise_image(rng, size)]}})
    suffix_lens = [text + image_tokens(size, processor) + 2 for size, text, _ in suffixes]
    return Workload(prompts["on"], prompts["off"], args.anchor_len, suffix_lens)


# ---------------------------------------------------------------- runs

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(llm: LLM, prompts: list[dict], tag: str) -> dict:
    """All prompts at once, max_tokens 1; wall, TTFTs and the engine counters' deltas."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    before = llm.metrics()
    sync(engine.device)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    started, first, finished = {}, {}, {}
    t0 = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        started[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id not in first and output.outputs[0].token_ids:
                first[output.request_id] = now
            if output.finished:
                finished[output.request_id] = output
    sync(engine.device)
    wall = time.perf_counter() - t0
    after = llm.metrics()
    outs = [finished[i] for i in ids]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("prompt_tokens_computed", "images_encoded",
                                                              "image_cache_hits", "checkpoint_hits", "steps")}
    return {"wall_s": wall, "ttft_s": [first[i] - started[i] for i in ids],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "prompt_lens": [len(o.prompt_token_ids) for o in outs], **delta}


def checks(work: Workload, on: dict, off: dict) -> dict:
    """What must hold whatever the speed: token accounting, exact anchor reuse, one encode per
    distinct image (N + 1 in both modes: the anchor image is cached within a run)."""
    p, s, n = work.anchor_len, work.suffix_lens, len(work.suffix_lens)
    return {
        "prompt_lens_match": on["prompt_lens"] == off["prompt_lens"] == [p + x for x in s],
        "on_computed_is_ideal": on["prompt_tokens_computed"] == p + sum(s),
        "off_computed_is_all": off["prompt_tokens_computed"] == sum(p + x for x in s),
        "consumers_reused_anchor": sorted(on["num_cached_tokens"]) == [0] + [p] * (n - 1),
        "off_reused_nothing": not any(off["num_cached_tokens"]),
        "images_encoded_once": on["images_encoded"] == off["images_encoded"] == n + 1,
    }


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(n: int, pairs: list[dict]) -> dict:
    def med(mode: str, fn) -> float:
        return statistics.median(fn(pair[mode]) for pair in pairs)

    rows = {}
    for mode in ("on", "off"):
        rows[mode] = {
            "requests_per_s": med(mode, lambda r: n / r["wall_s"]),
            "wall_s": med(mode, lambda r: r["wall_s"]),
            "ttft_p50_ms": med(mode, lambda r: 1e3 * pct(r["ttft_s"], 50)),
            "ttft_p99_ms": med(mode, lambda r: 1e3 * pct(r["ttft_s"], 99)),
            "prompt_tokens_computed": med(mode, lambda r: r["prompt_tokens_computed"]),
            "computed_tokens_per_s": med(mode, lambda r: r["prompt_tokens_computed"] / r["wall_s"]),
            "images_encoded": med(mode, lambda r: r["images_encoded"]),
            "steps": med(mode, lambda r: r["steps"]),
        }
    speedup = statistics.median(pair["off"]["wall_s"] / pair["on"]["wall_s"] for pair in pairs)
    ideal = statistics.median(pair["ideal"] for pair in pairs)
    failed = sorted({k for pair in pairs for k, v in pair["checks"].items() if v is False})
    return {"N": n, "repeats": len(pairs), "on": rows["on"], "off": rows["off"], "speedup": speedup, "ideal": ideal,
            "fraction_of_ideal": speedup / ideal, "anchor_len": pairs[0]["anchor_len"],
            "suffix_len_range": [min(min(p["suffix_lens"]) for p in pairs), max(max(p["suffix_lens"]) for p in pairs)],
            "failed_checks": failed}


def time_vision(llm: LLM, work: Workload, reps: int = 3) -> dict:
    """The vision tower alone on one workload's images (anchor + one per suffix), synchronised."""
    engine = llm.engine
    device, images = engine.device, engine.images
    sources = [work.on[0]["multi_modal_data"]["image"][0]] + [p["multi_modal_data"]["image"][1] for p in work.on]
    t0 = time.perf_counter()
    loaded = [images.load({"image": [source]})[0] for source in sources]
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pixels, grids = batch_pixel_values(loaded, images.processor)
    preprocess_s = time.perf_counter() - t0
    visual = engine.runner.model.visual
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        out = visual(torch.from_numpy(pixels), grids.tolist())
        sync(device)
        times.append(time.perf_counter() - t0)
    return {"images": len(loaded), "patches": int(pixels.shape[0]), "image_tokens": int(out.shape[0]),
            "decode_hash_ms": 1e3 * load_s, "preprocess_ms": 1e3 * preprocess_s,
            "tower_ms": [1e3 * t for t in times], "tower_ms_best": 1e3 * min(times),
            "finite": bool(torch.isfinite(out).all()),
            "tower_params": sum(p.numel() for p in visual.parameters())}


def measure_n(llm: LLM, args, n: int, processor: ImageProcessorConfig, repeats: int) -> dict:
    marker = llm.checkpoint_token_id
    warm = make_workload(10_000 + n, n, args, processor, marker)
    run(llm, warm.on, f"warm-on-{n}")
    run(llm, warm.off, f"warm-off-{n}")
    pairs = []
    for repeat in range(repeats):
        work = make_workload(1000 * n + repeat, n, args, processor, marker)
        pair = {"anchor_len": work.anchor_len, "suffix_lens": work.suffix_lens, "ideal": work.ideal}
        for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
            pair[mode] = run(llm, work.on if mode == "on" else work.off, f"{mode}-{n}-{repeat}")
        pair["checks"] = checks(work, pair["on"], pair["off"])
        pairs.append(pair)
        print(f"  N={n:3d} repeat {repeat}: on {pair['on']['wall_s']:.3f} s ({pair['on']['steps']} steps), "
              f"off {pair['off']['wall_s']:.3f} s ({pair['off']['steps']} steps), ideal {work.ideal:.2f}x, "
              f"failed checks {[k for k, v in pair['checks'].items() if not v] or 'none'}", flush=True)
    return {"summary": summarize(n, pairs), "pairs": pairs}


# ---------------------------------------------------------------- report

def table(results: dict) -> str:
    lines = ["| N | ckpt | requests/s | TTFT p50 / p99 (ms) | prompt tokens computed | computed tok/s | "
             "images encoded | steps | on/off | ideal | of ideal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        for mode in ("on", "off"):
            r = row[mode]
            ratio = (f"{row['speedup']:.2f}x | {row['ideal']:.2f}x | {100 * row['fraction_of_ideal']:.0f}%"
                     if mode == "on" else " | | ")
            lines.append(f"| {row['N']} | {mode} | {r['requests_per_s']:.2f} | {r['ttft_p50_ms']:.0f} / "
                         f"{r['ttft_p99_ms']:.0f} | {r['prompt_tokens_computed']:,.0f} | "
                         f"{r['computed_tokens_per_s']:,.0f} | {r['images_encoded']:.0f} | {r['steps']:.0f} | "
                         f"{ratio} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(results["rows"], key=lambda r: r["N"])
    ns = [r["N"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for mode, style in (("on", "-o"), ("off", "--s")):
        axes[0].plot(ns, [r[mode]["requests_per_s"] for r in rows], style, label=f"checkpoints {mode}")
        axes[2].plot(ns, [r[mode]["ttft_p50_ms"] for r in rows], style, label=f"checkpoints {mode} (p50)")
    axes[1].plot(ns, [r["speedup"] for r in rows], "-o", label="measured on/off")
    axes[1].plot(ns, [r["ideal"] for r in rows], ":^", label="ideal sum(P+S_i)/(P+sum S_i)")
    for ax, title, ylabel in zip(axes, ("requests/s (max_tokens=1)", "speedup", "TTFT p50"),
                                 ("requests/s", "x", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (suffixes per anchor, one image each)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"forkpoint 1-to-N with images: {results['model']}, P={results['rows'][0]['anchor_len']} "
                 f"(one image), {results['machine'].get('gpu', 'cpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def gpu_info(device: torch.device) -> dict:
    info = {"device": str(device)}
    for module in ("transformers", "triton", "fla"):
        try:
            info[module] = getattr(__import__(module), "__version__", "?")
        except ImportError:
            info[module] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gb=props.total_memory / 1e9, sms=props.multi_processor_count)
    return info


# ---------------------------------------------------------------- main

def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny text model and vision tower, CPU float32")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    parser.add_argument("--n", type=int, default=9)
    parser.add_argument("--extra-n", type=parse_ints, default=None, help="default 4,16,64 (4 with --smoke)")
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs per N (default 5, 2 with --smoke)")
    parser.add_argument("--extra-repeats", type=int, default=None, help="timed pairs per extra N (default 3, 1)")
    parser.add_argument("--anchor-len", type=int, default=624)
    parser.add_argument("--anchor-image", type=int, nargs=2, default=(448, 448), metavar=("W", "H"))
    parser.add_argument("--suffix-range", type=int, nargs=2, default=(350, 650))
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs (default: the engine's; steps with image tokens run eagerly anyway)")
    parser.add_argument("--time-budget", type=float, default=210.0,
                        help="seconds from the start after which no further N is started (predicted)")
    parser.add_argument("--out", default=None, help="default bench/results (a temporary folder with --smoke)")
    parser.add_argument("--name", default=None, help="default multimodal_gpu_h200 (multimodal_gpu_smoke)")
    args = parser.parse_args()
    start = time.perf_counter()
    smoke = args.smoke
    args.device = args.device or ("cpu" if smoke else "cuda")
    args.dtype = args.dtype or ("float32" if smoke else "bfloat16")
    args.extra_n = args.extra_n if args.extra_n is not None else ([4] if smoke else [4, 16, 64])
    args.repeats = args.repeats or (2 if smoke else 5)
    args.extra_repeats = args.extra_repeats or (1 if smoke else 3)
    args.name = args.name or ("multimodal_gpu_smoke" if smoke else "multimodal_gpu_h200")
    out = Path(args.out or (tempfile.mkdtemp(prefix="multimodal_gpu_") if smoke else os.path.join(BENCH, "results")))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    text = tiny_config() if smoke else full_config()
    cfg = multimodal_config(text, TINY_VISION if smoke else VISION)
    results = {"model": ("tiny Qwen3.5-MoE + tiny vision tower" if smoke
                         else "Qwen3.5-35B-A3B shapes with its vision tower (random bf16 weights)"),
               "config": cfg, "text_params": param_counts(text), "args": {k: v for k, v in vars(args).items()},
               "machine": machine_info(gpu_info(device)), "code": code_version(), "command": " ".join(sys.argv),
               "rows": [], "skipped": []}

    def save() -> None:
        results["total_s"] = time.perf_counter() - start
        (out / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    tmp = tempfile.TemporaryDirectory()
    try:
        model_dir = make_model_dir(cfg, Path(tmp.name) / "model")
        t0 = time.perf_counter()
        extra = {"enforce_eager": True} if args.enforce_eager else {}  # only engines that know the field
        llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, device=args.device,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, **extra)
        engine = llm.engine
        sync(device)
        results["engine"] = {
            "init_s": time.perf_counter() - t0,
            "params_in_model": sum(t.numel() for t in engine.runner.model.parameters()),
            "kv_blocks": engine.block_pool.num_blocks, "state_slots": engine.state_pool.requests.count,
            "checkpoint_slots": engine.state_pool.checkpoints.count,
            "image_embedding_cache_bytes": engine.config.image_embedding_cache_bytes,
            "cuda_graphs": getattr(engine.runner, "piecewise", None) is not None,
        }
        if device.type == "cuda":
            results["engine"]["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 1e9
        print(f"engine ready in {results['engine']['init_s']:.1f} s ({time.perf_counter() - start:.0f} s since "
              f"start): {results['engine']}", flush=True)
        processor = engine.images.processor
        if processor is None or engine.runner.model.visual is None:
            raise RuntimeError("the engine did not load the vision tower: images would be rejected")

        # warm-up (untimed): compile and autotune every kernel shape of the N = 9 runs, twice
        t0 = time.perf_counter()
        warm = make_workload(99, args.n, args, processor, llm.checkpoint_token_id)
        for i in range(2):
            run(llm, warm.on, f"warm0-on-{i}")
            run(llm, warm.off, f"warm0-off-{i}")
        results["warmup_s"] = time.perf_counter() - t0
        print(f"warm-up {results['warmup_s']:.1f} s", flush=True)
        try:
            results["vision_tower"] = time_vision(llm, make_workload(98, args.n, args, processor,
                                                                     llm.checkpoint_token_id))
            print(f"vision tower alone: {results['vision_tower']}", flush=True)
        except Exception:  # evidence only: never lose the rows for it
            results["vision_tower_error"] = traceback.format_exc()[-2000:]
            print(results["vision_tower_error"], flush=True)
        save()

        seconds_per_token = None
        for n in [args.n] + [n for n in args.extra_n if n != args.n]:
            repeats = args.repeats if n == args.n else args.extra_repeats
            if seconds_per_token is not None:
                mean_s = sum(args.suffix_range) / 2
                tokens = args.anchor_len + n * mean_s + n * (args.anchor_len + mean_s)
                predicted = (repeats + 1) * tokens * seconds_per_token
                elapsed = time.perf_counter() - start
                if elapsed + predicted > args.time_budget:
                    print(f"skip N={n}: {elapsed:.0f} s elapsed, {predicted:.0f} s predicted, budget "
                          f"{args.time_budget:.0f} s", flush=True)
                    results["skipped"].append({"N": n, "elapsed_s": elapsed, "predicted_s": predicted})
                    continue
            measured = measure_n(llm, args, n, processor, repeats)
            row = measured["summary"]
            results["rows"].append(row)
            pairs = measured["pairs"]
            results.setdefault("pairs", {})[str(n)] = pairs
            # the slowest run's seconds per computed token (fixed step costs included): a cautious forecast
            seconds_per_token = max([seconds_per_token or 0.0] + [p[m]["wall_s"] / p[m]["prompt_tokens_computed"]
                                                                  for p in pairs for m in ("on", "off")])
            print(f"N={n}: on {row['on']['requests_per_s']:.2f} req/s, off {row['off']['requests_per_s']:.2f} req/s, "
                  f"on/off {row['speedup']:.2f}x, ideal {row['ideal']:.2f}x ({100 * row['fraction_of_ideal']:.0f}%), "
                  f"failed checks {row['failed_checks']}", flush=True)
            save()
        engine.check_integrity()
    except Exception:
        results["error"] = traceback.format_exc()[-3000:]
        print(results["error"], flush=True)
    finally:
        tmp.cleanup()
        save()
        if results["rows"]:
            plot(results, out / f"{args.name}.png")
            print(table(results))
            failed = [(r["N"], r["failed_checks"]) for r in results["rows"] if r["failed_checks"]]
            print(f"failed checks: {failed or 'none'}")
        print(f"wrote {out / (args.name + '.json')} in {results['total_s']:.0f} s", flush=True)
    if smoke:
        rows = results["rows"]
        assert rows and "error" not in results, results.get("error")
        assert not any(r["failed_checks"] for r in rows), [r["failed_checks"] for r in rows]
        print("smoke: OK")


if __name__ == "__main__":
    main()
