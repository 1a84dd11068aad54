"""The Qwen3.5 / Qwen3.5-MoE vision tower (transformers' `Qwen3_5VisionModel`), plain PyTorch.

    pixel_values [N, C*Tp*P*P] --patch embed--> [N, D] + learned position embedding, resampled
      bilinearly (align_corners) from a side x side table to each image's grid
    --depth x ViT block (LayerNorm, attention with 2-D rotary over (row, col), GELU-tanh MLP);
      attention never crosses images--> [N, D]
    --merger: LayerNorm, then every merge**2 consecutive patches (one 2x2 block) concatenated,
      MLP--> [N / merge**2, out_hidden_size]: one row per <|image_pad|> token, in block order.

Patch rows arrive in merge-block order (see inputs/images.py), so the merged rows follow the
image's (block row, block col) raster, which is what the rotary positions of the text model assume.
Parameter names follow the checkpoints' `model.visual.*` (the loader maps them to `visual.*`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from forkpoint.config import VISION_ACTIVATIONS, VisionConfig

_EPS = 1e-6


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride, applied as the matmul it is."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [N, C*Tp*P*P] -> [N, D]."""
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
        """x: [N, D]; cos, sin: [N, head_dim] fp32; cu_seqlens: image boundaries. -> [N, D]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            segment = [t[start:end].transpose(0, 1)[None] for t in (q, k, v)]  # [1, heads, n_i, head_dim]
            out[start:end] = F.scaled_dot_product_attention(*segment)[0].transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = VISION_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, D] in merge-block order -> [N / merge**2, out_hidden_size]."""
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTransformer(nn.Module):
    """`forward(pixel_values [N, C*Tp*P*P], grid_thw) -> [N / merge**2, out_hidden_size]` for the
    images whose (t, h, w) patch grids are listed in `grid_thw`, in that order."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.side = int(config.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        device = self.pos_embed.weight.device
        x = self.patch_embed(pixel_values.to(device))
        rows, cols, heights, widths, cu_seqlens = [], [], [], [], [0]
        for t, h, w in grid_thw:
            t, h, w = int(t), int(h), int(w)
            row, col = _block_order(h, w, self.config.spatial_merge_size, device)
            for _ in range(t):  # each frame is its own attention segment
                rows.append(row)
                cols.append(col)
                heights.append(torch.full_like(row, h))
                widths.append(torch.full_like(col, w))
                cu_seqlens.append(cu_seqlens[-1] + h * w)
        if cu_seqlens[-1] != x.shape[0]:
            raise ValueError(f"grid_thw describes {cu_seqlens[-1]} patches but pixel_values has {x.shape[0]}")
        row, col, heights, widths = (torch.cat(parts) for parts in (rows, cols, heights, widths))
        x = x + self._position_embedding(row, col, heights, widths).to(x.dtype)
        cos, sin = self._rotary(row, col)
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return self.merger(x)

    def _position_embedding(self, row: torch.Tensor, col: torch.Tensor, heights: torch.Tensor,
                            widths: torch.Tensor) -> torch.Tensor:
        """Bilinear (align_corners) resampling of the side x side table at each patch: [N, D]."""
        side = self.side
        row_taps, row_weights = _taps(row, heights, side)
        col_taps, col_weights = _taps(col, widths, side)
        index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
        weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)  # fp32 weights, as transformers

    def _rotary(self, row: torch.Tensor, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] fp32: the first quarter of frequencies rotates by row, the second by col."""
        quarter = self.config.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, quarter, 2, dtype=torch.float32, device=row.device) / quarter))
        freqs = torch.cat((row.float()[:, None] * inv_freq, col.float()[:, None] * inv_freq), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _block_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of an h x w grid, listed by merge block: [h*w] long each."""
    row = torch.arange(h, device=device)[:, None].expand(h, w)
    col = torch.arange(w, device=device)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return row.reshape(shape).transpose(1, 2).flatten(), col.reshape(shape).transpose(1, 2).flatten()


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table rows around each index of an axis of length `size` mapped onto [0, side-1]
    (align_corners), and their linear weights: ([N, 2] long, [N, 2] fp32)."""
    source = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(source)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the whole head, in fp32. x: [N, heads, head_dim]."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)
