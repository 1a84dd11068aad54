"""The vision tower's configuration of a multimodal Qwen3.5 checkpoint (`VisionConfig`, read from
config.json's `vision_config`), part of `ModelConfig` (config.py)."""

from __future__ import annotations

from dataclasses import dataclass

# activation names of vision MLPs -> torch.nn.functional.gelu's `approximate`
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a multimodal Qwen3.5 checkpoint (`vision_config` in config.json) and the
    ids of the tokens that place images in a prompt.

    A patch is `in_channels x temporal_patch_size x patch_size x patch_size` pixels; every
    `spatial_merge_size**2` neighbouring patches become one `<|image_pad|>` token of width
    `out_hidden_size` (== the text model's hidden size).
    """

    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, vision: dict, raw: dict) -> VisionConfig:
        """`vision`: the `vision_config` entry; `raw`: the whole config (token ids live at its top level)."""
        rope = dict(vision.get("rope_parameters") or {})
        patch, temporal = vision.get("patch_size", 16), vision.get("temporal_patch_size", 2)
        if not isinstance(patch, int) or not isinstance(temporal, int):
            raise ValueError(f"vision_config patch_size {patch!r} / temporal_patch_size {temporal!r}: only square "
                             "integer patches are supported")
        config = cls(
            depth=int(vision.get("depth", 27)),
            hidden_size=int(vision.get("hidden_size", 1152)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            intermediate_size=int(vision.get("intermediate_size", 4304)),
            num_heads=int(vision.get("num_heads", 16)),
            in_channels=int(vision.get("in_channels", 3)),
            patch_size=patch,
            temporal_patch_size=temporal,
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            out_hidden_size=int(vision.get("out_hidden_size", 3584)),
            num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            image_token_id=int(raw.get("image_token_id", 248056)),
            video_token_id=int(raw.get("video_token_id", 248057)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
        )
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError("vision_config hidden_size / num_heads must be a multiple of 4 (2-D rotary embedding)")
        if config.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {config.hidden_act!r}: forkpoint knows "
                             f"{sorted(VISION_ACTIVATIONS)}")
        side = int(config.num_position_embeddings**0.5)
        if side * side != config.num_position_embeddings:
            raise ValueError("vision_config num_position_embeddings must be a square number")
        return config
