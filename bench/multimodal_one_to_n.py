"""CPU benchmark of prefix checkpoints across images on the seed's 1-to-N workload shape.

Model: the embedded default model (4-layer Qwen3.5-MoE text model, hidden 256, real Qwen3.5
tokenizer, random weights) has no vision tower, so this script builds a multimodal checkpoint from
it once: a `Qwen3_5MoeForConditionalGeneration` (transformers) whose language model carries the
default model's exact text weights and whose vision tower is small and random (depth 4, width 256,
4 heads, patch 16, 2x2 merge; one image token per 32x32 pixels). It is cached next to the default
model (`$FORKPOINT_CACHE`, default `~/.cache/forkpoint`).

Workload, per repeat (fresh seeded text and images, so ON never finds a checkpoint from earlier):
an anchor of about P = 624 tokens including one image (`--anchor-image`, 120 tokens), then N = 9
requests `anchor + marker + suffix_i`, each suffix 350-650 tokens including its own image; all
submitted at once, greedy, max_tokens=1 (scoring). ON: checkpoints enabled; OFF: the same prompts
without the marker and `enable_checkpoints=False`. Both keep the image-embedding cache (the
engine's default), so OFF also encodes the anchor image only once; the counted `images encoded`
shows it. Ideal ratio of computed prompt tokens: sum(P + S_i) / (P + sum S_i).

Usage:
    python bench/multimodal_one_to_n.py               # writes bench/results/multimodal_one_to_n.{json,png}
    python bench/multimodal_one_to_n.py --repeats 5 --n 9
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import VOCAB_LIMIT, machine_info, probe_gflops  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.inputs import qwen_vocab  # noqa: E402
from forkpoint.inputs.default_model import default_cache_root, default_model_config, ensure_default_model  # noqa: E402

MODEL_NAME = "bench-default-qwen3_5_moe-vision-v1"
VISION = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=256, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "merge_size": 2,
                "temporal_patch_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 1048576},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
TOKEN_PIXELS = 32  # one image token per 32 x 32 pixels


def build_multimodal_default(directory: Path) -> None:
    """The default model's text weights plus a small random vision tower, saved as a HF model dir."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    default = ensure_default_model()
    text_config = default_model_config()
    config = tf.Qwen3_5MoeConfig(text_config=text_config.to_dict(), vision_config=VISION, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.Qwen3_5MoeForConditionalGeneration(config)
        with torch.no_grad():
            for name, param in model.model.visual.named_parameters():
                if "norm" in name:
                    param.fill_(1.0 if name.endswith("weight") else 0.0)
                elif param.ndim >= 2:
                    param.normal_(0.0, 1.0 / math.sqrt(param[0].numel()))
                else:
                    param.zero_()
    directory.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    # swap the random language model for the default model's exact weights (same on-disk layout)
    saved = load_file(str(directory / "model.safetensors"))
    text = {"model.language_model." + name.removeprefix("model."): tensor
            for name, tensor in load_file(str(default / "model.safetensors")).items()}
    ours = {name for name in saved if name.startswith("model.language_model.")}
    if ours != set(text):
        raise RuntimeError(f"default model weights do not fit: {sorted(ours ^ set(text))[:4]}")
    saved.update(text)
    saved.pop("lm_head.weight", None)  # tied to the embedding
    save_file(saved, str(directory / "model.safetensors"), metadata={"format": "pt"})
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((default / name).read_bytes())
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (directory / "README.md").write_text("Benchmark model: forkpoint's default model (random weights) plus a small "
                                         "random vision tower. Output is meaningless.\n")


def model_dir() -> Path:
    directory = default_cache_root() / MODEL_NAME
    if not (directory / "README.md").is_file():
        print(f"building {directory} (once)", file=sys.stderr)
        build_multimodal_default(directory)
    return directory


def noise_image(rng: np.random.Generator, width: int, height: int):
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def make_workload(seed: int, n: int, anchor_len: int, anchor_image: tuple[int, int], suffix_range: tuple[int, int],
                  marker: int, image_ids: tuple[int, int, int]) -> tuple[list[dict], list[dict], int, list[int]]:
    """(ON prompts, OFF prompts, anchor tokens, suffix tokens): images inline as VS PAD VE, expanded by forkpoint."""
    rng = np.random.default_rng(seed)
    vs, pad, ve = image_ids
    image_tokens = (anchor_image[0] // TOKEN_PIXELS) * (anchor_image[1] // TOKEN_PIXELS)
    text = anchor_len - image_tokens - 2
    before = rng.integers(0, VOCAB_LIMIT, text // 2).tolist()
    after = rng.integers(0, VOCAB_LIMIT, text - text // 2).tolist()
    anchor = before + [vs, pad, ve] + after
    anchor_img = noise_image(rng, *anchor_image)
    on, off, suffix_lens = [], [], []
    for _ in range(n):
        width, height = (int(x) for x in rng.choice([(256, 256), (320, 224), (224, 352), (288, 288)]))
        tokens = (width // TOKEN_PIXELS) * (height // TOKEN_PIXELS)
        total = int(rng.integers(suffix_range[0], suffix_range[1] + 1))
        words = rng.integers(0, VOCAB_LIMIT, total - tokens - 2).tolist()
        cut = int(rng.integers(0, len(words) + 1))
        suffix = words[:cut] + [vs, pad, ve] + words[cut:]
        images = {"image": [anchor_img, noise_image(rng, width, height)]}
        on.append({"prompt_token_ids": anchor + [marker] + suffix, "multi_modal_data": images})
        off.append({"prompt_token_ids": anchor + suffix, "multi_modal_data": images})
        suffix_lens.append(total)
    return on, off, anchor_len, suffix_lens


class VisionTimer:
    """Wall time inside the vision tower (forward hooks)."""

    def __init__(self, llm: LLM) -> None:
        self.total, self._t0 = 0.0, 0.0
        visual = llm.engine.runner.model.visual
        visual.register_forward_pre_hook(lambda *_: setattr(self, "_t0", time.perf_counter()))
        visual.register_forward_hook(lambda *_: setattr(self, "total", self.total + time.perf_counter() - self._t0))


def run(llm: LLM, timer: VisionTimer, prompts: list[dict], tag: str) -> dict:
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=1)
    before, vision_before = llm.metrics(), timer.total
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    submitted, first, finished = {}, {}, {}
    t0 = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
        submitted[request_id] = time.perf_counter()
    while len(finished) < len(ids):
        for output in engine.step():
            now = time.perf_counter()
            if output.request_id not in first and output.outputs[0].token_ids:
                first[output.request_id] = now
            if output.finished:
                finished[output.request_id] = output
    wall = time.perf_counter() - t0
    after = llm.metrics()
    outs = [finished[i] for i in ids]
    return {"wall_s": wall, "ttft_s": [first[i] - submitted[i] for i in ids],
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "num_cached_tokens": [o.num_cached_tokens for o in outs],
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
            "images_encoded": after["images_encoded"] - before["images_encoded"],
            "vision_s": timer.total - vision_before, "steps": after["steps"] - before["steps"]}


def summarize(runs: list[dict], n: int) -> dict:
    def med(mode, fn):
        return statistics.median(fn(r[mode]) for r in runs)

    p, s = runs[0]["anchor_len"], runs[0]["suffix_lens"]
    ideal = statistics.median(sum(r["anchor_len"] + x for x in r["suffix_lens"])
                              / (r["anchor_len"] + sum(r["suffix_lens"])) for r in runs)
    rows = {}
    for mode in ("on", "off"):
        rows[mode] = {
            "requests_per_s": med(mode, lambda r: n / r["wall_s"]),
            "wall_s": med(mode, lambda r: r["wall_s"]),
            "wall_min_s": min(r[mode]["wall_s"] for r in runs),
            "ttft_p50_s": med(mode, lambda r: statistics.median(r["ttft_s"])),
            "ttft_max_s": med(mode, lambda r: max(r["ttft_s"])),
            "prompt_tokens_computed": med(mode, lambda r: r["prompt_tokens_computed"]),
            "images_encoded": med(mode, lambda r: r["images_encoded"]),
            "vision_s": med(mode, lambda r: r["vision_s"]),
            "steps": med(mode, lambda r: r["steps"]),
        }
    return {"n": n, "anchor_len_first_repeat": p, "suffix_lens_first_repeat": s, "ideal_ratio": ideal,
            "token_ratio": rows["off"]["prompt_tokens_computed"] / rows["on"]["prompt_tokens_computed"],
            "throughput_ratio": statistics.median(r["off"]["wall_s"] / r["on"]["wall_s"] for r in runs),
            "throughput_ratio_best": (min(r["off"]["wall_s"] for r in runs)
                                      / min(r["on"]["wall_s"] for r in runs)),
            "identical_greedy": sum(a == b for r in runs for a, b in zip(r["on"]["tokens"], r["off"]["tokens"])),
            "compared": n * len(runs), "on": rows["on"], "off": rows["off"],
            "consumers_reused_anchor": all(c == r["anchor_len"] for r in runs
                                           for c in sorted(r["on"]["num_cached_tokens"])[1:])}


def print_table(result: dict) -> None:
    m, row = result["machine"], result["summary"]
    print(f"\nmachine: {m['cpu_model']}, {m['cpu_cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
          f"load average at start {m['load_average_start'][0]:.2f}")
    print(f"N = {row['n']}, anchor {row['anchor_len_first_repeat']} tokens (one image), suffixes "
          f"{min(row['suffix_lens_first_repeat'])}-{max(row['suffix_lens_first_repeat'])} tokens "
          "(one image each); "
          f"medians of {result['args']['repeats']} repeats\n")
    print("| checkpoints | requests/s | wall (s) | best wall (s) | TTFT p50 (s) | TTFT max (s) | "
          "prompt tokens computed | images encoded | vision tower (s) | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in ("on", "off"):
        r = row[mode]
        print(f"| {mode} | {r['requests_per_s']:.2f} | {r['wall_s']:.2f} | {r['wall_min_s']:.2f} | "
              f"{r['ttft_p50_s']:.2f} | {r['ttft_max_s']:.2f} | {r['prompt_tokens_computed']:,.0f} | "
              f"{r['images_encoded']:.0f} | "
              f"{r['vision_s']:.2f} | {r['steps']:.0f} |")
    print(f"\nthroughput ratio on/off: paired median {row['throughput_ratio']:.2f}x, "
          f"best-of {row['throughput_ratio_best']:.2f}x; "
          f"computed-token ratio off/on "
          f"{row['token_ratio']:.2f}; ideal sum(P+S_i)/(P+sum S_i) {row['ideal_ratio']:.2f}; greedy tokens identical "
          f"{row['identical_greedy']}/{row['compared']}; consumers reused exactly the anchor: "
          f"{row['consumers_reused_anchor']}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = result["summary"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    labels, colors = ["checkpoints on", "checkpoints off"], ["tab:green", "tab:gray"]
    for ax, key, title in zip(axes, ("requests_per_s", "ttft_p50_s", "prompt_tokens_computed"),
                              ("requests / s", "TTFT p50 (s)", "prompt tokens computed")):
        ax.bar(labels, [row["on"][key], row["off"][key]], color=colors)
        ax.set_title(title)
    fig.suptitle(f"1-to-{row['n']} with images, CPU ({result['machine']['cpu_cores']} cores): "
                 f"throughput {row['throughput_ratio']:.2f}x, ideal {row['ideal_ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=9)
    parser.add_argument("--anchor-len", type=int, default=624)
    parser.add_argument("--anchor-image", type=int, nargs=2, default=(384, 320), metavar=("W", "H"))
    parser.add_argument("--suffix-range", type=int, nargs=2, default=(350, 650))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "multimodal_one_to_n")
    args = parser.parse_args()

    directory = model_dir()
    llm_on = LLM(str(directory), max_num_seqs=64)
    llm_off = LLM(str(directory), max_num_seqs=64, enable_checkpoints=False)
    timers = {"on": VisionTimer(llm_on), "off": VisionTimer(llm_off)}
    image_ids = tuple(qwen_vocab.special_token_id(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    machine = machine_info()
    warm_on, warm_off, *_ = make_workload(999, args.n, args.anchor_len, tuple(args.anchor_image),
                                          tuple(args.suffix_range), llm_on.checkpoint_token_id, image_ids)
    for _ in range(2):  # warm-up: first calls of every op and allocation size
        run(llm_on, timers["on"], warm_on, "warm-on")
        run(llm_off, timers["off"], warm_off, "warm-off")
    runs = []
    for repeat in range(args.repeats):
        on, off, anchor_len, suffix_lens = make_workload(repeat, args.n, args.anchor_len, tuple(args.anchor_image),
                                                         tuple(args.suffix_range), llm_on.checkpoint_token_id,
                                                         image_ids)
        order = ("on", "off") if repeat % 2 == 0 else ("off", "on")
        record = {"anchor_len": anchor_len, "suffix_lens": suffix_lens, "probe_gflops": probe_gflops()}
        for mode in order:
            llm, prompts = (llm_on, on) if mode == "on" else (llm_off, off)
            record[mode] = run(llm, timers[mode], prompts, f"{mode}-{repeat}")
        runs.append(record)
        print(f"repeat {repeat}: on {record['on']['wall_s']:.2f} s, off {record['off']['wall_s']:.2f} s, "
              f"probe {record['probe_gflops']:.0f} GFLOP/s", file=sys.stderr)
    result = {"args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "out"},
              "model": str(directory), "vision_config": VISION, "machine": machine, "summary": summarize(runs, args.n),
              "runs": [{k: v for k, v in r.items()} for r in runs]}
    for r in result["runs"]:
        for mode in ("on", "off"):
            r[mode] = {k: v for k, v in r[mode].items() if k != "tokens"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print_table(result)


if __name__ == "__main__":
    main()
