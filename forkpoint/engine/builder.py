"""The engine's composition root: from an `EngineConfig` to the parts `LLMEngine` loops over.

    config -> model dir, config.json, generation defaults, tokenizer (marker registered)
           -> output processor, grammar compiler, image prompt processor
           -> model (or tensor-parallel ranks), CUDA graphs, pools, host tier, checkpoint registry
           -> scheduler, input processor, runner (sampling state inside)

Graphs are captured before the pools: their pieces never touch the pools, and the pools' sizing then
sees the graphs' buffers and memory pool as used.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.reuse_rates import ReuseRates
from forkpoint.cache.sizing import (
    default_disk_tier_bytes,
    default_host_tier_bytes,
    physical_memory_bytes,
    pools_of_sizes,
)
from forkpoint.cache.state_pool import StatePool
from forkpoint.config import EngineConfig, ModelConfig
from forkpoint.distributed.runner import TensorParallelRunner
from forkpoint.engine.attention_parity import attention_parity
from forkpoint.engine.output_processor import OutputProcessor
from forkpoint.engine.scheduler import Scheduler
from forkpoint.engine.startup import MemoryPlan, StartupTimer
from forkpoint.inputs.default_model import DEFAULT_MODEL_NOTICE, ensure_default_model
from forkpoint.inputs.generation_config import GenerationDefaults
from forkpoint.inputs.multimodal import ImagePromptProcessor, image_prompt_processor
from forkpoint.inputs.processor import InputProcessor, PromptLimits
from forkpoint.inputs.tokenizer import load_tokenizer
from forkpoint.models.loader import build_model
from forkpoint.models.mtp import mtp_layer_count
from forkpoint.runner.disk_io import open_disk_tier
from forkpoint.runner.model_runner import ModelRunner
from forkpoint.runner.multimodal import MultimodalInputs
from forkpoint.runner.piecewise import PiecewiseForward, default_cuda_graph_sizes, graph_blocker
from forkpoint.runner.precompile import CompilePlan, default_workers, marker_path, precompile
from forkpoint.runner.speculative import MTPDrafter
from forkpoint.runner.storage import DeviceStorage, plan_storage
from forkpoint.runner.warmup import warmup_max_context
from forkpoint.structured import GrammarCompiler
from forkpoint.vision_config import VisionConfig

logger = logging.getLogger("forkpoint")


def _tokenizer_spells_images(tokenizer, vision: VisionConfig) -> bool:
    """Whether the tokenizer spells the image placeholder with the ids config.json gives the model."""
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = tokenizer.encode(placeholder, add_special_tokens=False)
    return ids == [vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id]


def _stores_mtp_weights(model_path: Path) -> bool:
    """Whether the safetensors checkpoint in `model_path` stores any `mtp.*` tensor: the names from its
    shard index, else from the files' headers (nothing else is read)."""
    index = model_path / "model.safetensors.index.json"
    try:
        if index.is_file():
            names = list(json.loads(index.read_text())["weight_map"])
        else:
            names = []
            files = sorted(model_path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"no *.safetensors weights in {model_path}")
            for file in files:
                with safe_open(str(file), framework="pt") as handle:
                    names.extend(handle.keys())
    except (OSError, json.JSONDecodeError, KeyError, SafetensorError) as err:
        raise ValueError(f"cannot read the tensor names of the checkpoint in {model_path}: {err}") from err
    return any(name.startswith("mtp.") for name in names)


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine is built from. runner: a `ModelRunner`, or rank 0's
    `TensorParallelRunner`; registry: None without checkpoints; graphs_off_reason: why no CUDA graphs
    run (None when some do)."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    model_path: Path
    model_config: ModelConfig
    generation_defaults: GenerationDefaults
    tokenizer: object
    checkpoint_token_id: int | None
    eos_token_ids: set[int]
    max_model_len: int
    output_processor: OutputProcessor
    grammars: GrammarCompiler
    images: ImagePromptProcessor
    block_pool: BlockPool
    state_pool: StatePool
    registry: CheckpointRegistry | None
    scheduler: Scheduler
    inputs: InputProcessor
    runner: ModelRunner | TensorParallelRunner
    graphs_off_reason: str | None
    startup: StartupTimer  # each start-up phase's seconds, for the start-up log
    memory: MemoryPlan  # what fits in the pools and the host tier, for the start-up log


class EngineBuilder:
    """Builds `EngineParts` from a config (`build()`, once). `reuse_rates`: the registry's measured costs
    to start from (cache/reuse_rates.py; default: none measured)."""

    def __init__(self, config: EngineConfig, reuse_rates: ReuseRates | None = None) -> None:
        self.config = config
        self.reuse_rates = reuse_rates

    def build(self) -> EngineParts:
        config = self.config
        startup = StartupTimer()
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        model_path = Path(config.model) if config.model else None
        if model_path is None:
            model_path = ensure_default_model()
            logger.warning(DEFAULT_MODEL_NOTICE)
        self.model_path = model_path
        self.model_config = ModelConfig.from_hf_dir(model_path).with_quantization(config.quantization,
                                                                                 config.load_format)
        self.generation_defaults = GenerationDefaults.from_model_dir(model_path)
        marker = config.checkpoint_token if config.enable_checkpoints else None
        loaded = load_tokenizer(Path(config.tokenizer) if config.tokenizer else model_path, checkpoint_token=marker)
        if loaded.base_vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer has {loaded.base_vocab_size} tokens but the model's embedding only "
                f"{self.model_config.vocab_size}: tokenizer and model do not belong together"
            )
        self.tokenizer = loaded.tokenizer
        self.checkpoint_token_id = loaded.checkpoint_token_id
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                        options=config.structured_outputs_config)

        vision = self.model_config.vision
        max_images = config.max_images_per_prompt
        if vision is not None and max_images > 0 and not _tokenizer_spells_images(self.tokenizer, vision):
            logger.warning("the tokenizer does not encode <|vision_start|><|image_pad|><|vision_end|> as the ids in "
                           "config.json: serving this multimodal checkpoint text-only (images are rejected)")
            max_images = 0
        self.images = image_prompt_processor(vision, model_path, max_images=max_images,
                                             min_pixels=config.image_min_pixels, max_pixels=config.image_max_pixels)

        startup.lap("config and tokenizer")
        torch.manual_seed(config.seed)
        parallel = None  # ranks > 0 in worker processes (forkpoint/distributed/runner.py)
        self.graphs_off_reason: str | None = None  # why no CUDA graphs run, when none do
        if config.tensor_parallel_size > 1:
            self.graphs_off_reason = "tensor parallelism runs eagerly"
            parallel = TensorParallelRunner.start(config, self.model_config, model_path, self.device, self.dtype,
                                                  with_vision=self.images.processor is not None)
            model, piecewise = parallel.model, None
            self.block_pool, self.state_pool = parallel.make_pools(config, self.max_model_len)
        else:
            graph_sizes = self._graph_sizes()
            if graph_sizes is not None and self._compile_in_workers(graph_sizes):
                startup.lap("parallel compile")
            model = build_model(self.model_config, model_path, config.load_format, self.device, self.dtype,
                                config.seed, with_vision=self.images.processor is not None,
                                mtp_layers=self._mtp_layers(model_path))
            startup.lap("load weights")
            # graphs before the pools: their pieces never touch the pools, and the pools' sizing then
            # sees the graphs' buffers and memory pool as used
            piecewise = None if graph_sizes is None else PiecewiseForward(model, graph_sizes, self.device, capture=True)
            startup.lap("graphs capture")
            storage = self._make_storage(model)
        startup.lap("pools" if parallel is None else "tensor-parallel ranks: weights, pools")
        # bookkeeping only: the host tier's directory (its copies are the step plans' device writes)
        shapes = model.pool_shapes(self.dtype)
        host_bytes = self._host_tier_bytes() if config.enable_checkpoints else 0
        host = (HostTier(host_bytes, shapes.slot_bytes, shapes.block_bytes(config.block_size))
                if host_bytes > 0 else None)
        disk = None  # the disk tier: its directory here, its writer in the storage (tensor_parallel_size 1)
        if config.enable_checkpoints and config.checkpoint_dir is not None:
            root = Path(config.checkpoint_dir).expanduser()
            disk_config = replace(config, checkpoint_dir_bytes=config.checkpoint_dir_bytes
                                  or default_disk_tier_bytes(root))
            disk, writer = open_disk_tier(disk_config, model_path, Path(config.tokenizer or model_path),
                                          shapes, self.device, self.dtype)
            storage.attach_disk(writer)
        self.registry = (CheckpointRegistry(self.state_pool.checkpoints, self.block_pool, host, disk,
                                            self.reuse_rates, restore_rule=config.checkpoint_restore_rule)
                         if config.enable_checkpoints else None)
        memory = MemoryPlan(checkpoint_rows=self.state_pool.checkpoints.count,
                            request_rows=self.state_pool.requests.count, row_bytes=shapes.slot_bytes,
                            num_kv_blocks=self.block_pool.num_blocks, block_size=config.block_size,
                            block_bytes=shapes.block_bytes(config.block_size), host_bytes=host_bytes,
                            on_gpu=self.device.type == "cuda")
        logger.info("%s", memory.summary())
        parity = config.attention_parity_tokens or attention_parity(self.model_config)
        self.scheduler = Scheduler(config, self.block_pool, self.state_pool, self.registry,
                                   vocab_size=self.model_config.vocab_size, attention_parity=parity)
        self.inputs = InputProcessor(self.tokenizer, self.checkpoint_token_id, self.images, PromptLimits(
            vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len, block_size=config.block_size,
            max_kv_blocks=self.block_pool.num_blocks, max_checkpoints=config.max_checkpoints_per_request))
        multimodal = None if model.visual is None else MultimodalInputs(
            model.visual, self.images.processor, config.image_embedding_cache_bytes, self.device)
        if parallel is not None:
            parallel.serve_images(multimodal)
        drafter = (MTPDrafter(model, config.speculative_config.num_speculative_tokens)
                   if config.speculative_config is not None else None)
        self.runner = parallel or ModelRunner(model, storage, self.device, multimodal, piecewise, drafter)
        startup.lap("runner")
        if getattr(self.runner, "warmup", None) is not None:  # measured inside the runner's construction
            startup.split_last("runner, decode graphs", "warm-up", self.runner.warmup.seconds)
        return EngineParts(
            config=config, device=self.device, dtype=self.dtype, model_path=self.model_path,
            model_config=self.model_config, generation_defaults=self.generation_defaults, tokenizer=self.tokenizer,
            checkpoint_token_id=self.checkpoint_token_id, eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len, output_processor=self.output_processor, grammars=self.grammars,
            images=self.images, block_pool=self.block_pool, state_pool=self.state_pool, registry=self.registry,
            scheduler=self.scheduler, inputs=self.inputs, runner=self.runner,
            graphs_off_reason=self.graphs_off_reason, startup=startup, memory=memory)

    # ------------------------------------------------------------------ set-up
    def _mtp_layers(self, model_path: Path) -> int:
        """MTP layers to build: those config.json declares when speculative decoding is asked for, else 0.
        ValueError when it is asked for and the model has none."""
        if self.config.speculative_config is None:
            return 0
        count = mtp_layer_count(model_path)
        if count == 0 or self.model_config.mamba2 is not None:
            raise ValueError(f"speculative_config method 'mtp' needs a model with MTP layers, but {model_path}'s "
                             "config.json declares none (mtp_num_hidden_layers / num_nextn_predict_layers): drop "
                             "speculative_config or use a Qwen3.5 / Qwen3-Next checkpoint that has its mtp.* weights")
        if self.config.load_format != "dummy" and not _stores_mtp_weights(model_path):
            raise ValueError(f"speculative_config method 'mtp' needs the model's MTP weights, but the checkpoint in "
                             f"{model_path} stores no mtp.* tensors although config.json declares {count} MTP "
                             "layer(s) (some conversions and quantisations drop them): use a checkpoint that keeps "
                             "them, or drop speculative_config")
        return count

    def _graph_sizes(self) -> tuple[int, ...] | None:
        """The piecewise buckets the engine will capture, or None when it runs eagerly (the reason in
        `graphs_off_reason`)."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.enforce_eager:
            self.graphs_off_reason = "enforce_eager" if cfg.enforce_eager else f"no CUDA device ({self.device})"
            return None
        reason = graph_blocker(self.model_config, self.dtype)
        if reason is not None:
            logger.warning("CUDA graphs off, every step runs eagerly: %s", reason)
            self.graphs_off_reason = reason
            return None
        return tuple(sorted(set(cfg.cuda_graph_sizes or default_cuda_graph_sizes(cfg.max_num_batched_tokens))))

    def _compile_in_workers(self, sizes: tuple[int, ...]) -> bool:
        """On a cold start, compile the kernels of the capture (buckets `sizes`) and the warm-up in worker
        processes first (runner/precompile.py). False when none ran: workers off, or the Triton cache
        already holds this plan's kernels."""
        if self.config.startup_compile_workers == 0:
            return False
        from triton import knobs  # CUDA machines only

        cache_dir = Path(knobs.cache.dir)
        cfg = self.config
        # the request rows plan_pools gives when memory is plenty (cache/sizing.py `_request_slots`)
        spares = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config is not None else 0
        plan = CompilePlan(self.model_config, str(self.dtype).removeprefix("torch."), sizes,
                           num_request_slots=cfg.num_state_slots or cfg.max_num_seqs * (1 + spares),
                           block_size=cfg.block_size,
                           max_context=warmup_max_context(self.model_config.max_position_embeddings, sizes[-1]),
                           device=str(torch.device("cuda", torch.cuda.current_device()) if self.device.index is None
                                      else self.device))
        if marker_path(plan, cache_dir).exists():
            logger.info("kernel cache warm for this model and these step sizes: no start-up compile workers")
            return False
        workers = cfg.startup_compile_workers
        if workers is None:
            workers = default_workers(plan, torch.cuda.mem_get_info(self.device)[0])
        if workers < 1:
            return False
        report = precompile(plan, workers, cache_dir)
        logger.info("%s", report.summary())
        return True

    def _host_tier_bytes(self) -> int:
        """checkpoint_host_bytes, or when not given a size from this machine (cache/sizing.py)."""
        cfg = self.config
        if cfg.checkpoint_host_bytes is not None:
            return cfg.checkpoint_host_bytes
        return default_host_tier_bytes(physical_memory_bytes(), self.device.type == "cuda", cfg.tensor_parallel_size)

    def _make_storage(self, model) -> DeviceStorage:
        """The pools' bookkeeping (`block_pool`, `state_pool`) and the runner's storage, sized from the
        model's declarations (cache/sizing.py)."""
        # the image embedding cache fills later on this device (runner/multimodal.py): set it aside
        reserved = self.config.image_embedding_cache_bytes if self.images.processor is not None else 0
        shapes = model.pool_shapes(self.dtype)
        sizes = plan_storage(self.config, shapes, self.max_model_len, self.device, reserved)
        self.block_pool, self.state_pool = pools_of_sizes(sizes, self.config.block_size)
        # on CUDA the host tier's copies run on a copy stream into an arena of pinned pages
        # (runner/host_copies.py); the CPU keeps the plain copies, the reference. A size the user gave
        # is pinned ahead, in the background from start-up on, so that pinning (slow, and in the driver
        # beside the step loop's launches) is over before the tier fills; the size taken from the
        # machine is pinned as the tier first fills (several engines in one process, tests, hold
        # only what they use)
        arena = self._host_tier_bytes() if self.config.enable_checkpoints and self.device.type == "cuda" else 0
        return DeviceStorage(sizes, self.config.block_size, shapes, self.device, host_arena_bytes=arena,
                             pin_host_arena_ahead=self.config.checkpoint_host_bytes is not None)
