"""Optional BEV fusion block: LiDAR pillars + camera features -> bird's-eye-view occupancy.

Static shapes throughout (graph-capturable): points come bucketed and NaN-padded
(`lidar.bucket_points`), invalid points are scattered into a spare "trash" cell that is
dropped afterwards, so no data-dependent shapes or host syncs appear.

Data flow (C = fpn_channels, G = bev_grid, cams = cameras per sample):
  points [B, N, 3] m (base frame)  --PillarScatter-->  pillars [B, C, G, G]
  image features P5 [B*cams, C, h, w]  --tokens + learned camera/position embeddings-->
      [B, cams*h*w, C]
  BEV queries = learned [G*G, C] + pillars  --cross-attention (SDPA) over image tokens-->
      fused [B, C, G, G]  --1x1 conv-->  occupancy logits [B, 1, G, G]
The lift from image to BEV is geometric when the cameras are given (T_cam_from_base, K):
every BEV cell centre (at the middle of bev_z_range) is projected into every camera, and the
attention of that cell is biased towards the P5 tokens around its projection (a Gaussian of
`sigma` tokens) and away from the cameras that do not see it (`camera_attention_bias`). A cell
no camera sees attends freely (no bias). Without cameras the attention is learned only.
Grid convention: cell (row i, col j) covers x in [-R + i*d, -R + (i+1)*d), y likewise with j,
d = 2R / G, R = bev_range (m).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lidar import project_points


class PillarScatter(nn.Module):
    """Per-point MLP, then mean of the point features of each BEV cell (a pillar).

    forward(points [B, N, 3] m, NaN rows = padding) -> [B, C, G, G] (zeros in empty cells).
    """

    def __init__(self, channels: int, grid: int, half_range: float,
                 z_range: tuple[float, float]) -> None:
        super().__init__()
        self.grid, self.half_range = grid, float(half_range)
        self.z_lo, self.z_hi = float(z_range[0]), float(z_range[1])
        # inputs per point: x, y, z (m, scaled) + offset from the cell centre (2, in cells)
        self.mlp = nn.Sequential(nn.Linear(5, channels), nn.ReLU(inplace=True),
                                 nn.Linear(channels, channels))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        b, n, _ = points.shape
        g, r = self.grid, self.half_range
        cell = 2.0 * r / g  # m
        x, y, z = points[..., 0], points[..., 1], points[..., 2]  # [B, N]
        fx, fy = (x + r) / cell, (y + r) / cell  # [B, N] continuous cell coordinates
        ok = (fx >= 0) & (fx < g) & (fy >= 0) & (fy < g) & (z >= self.z_lo) & (z < self.z_hi)
        ix = fx.nan_to_num(0.0).clamp(0, g - 1).floor()
        iy = fy.nan_to_num(0.0).clamp(0, g - 1).floor()
        feats = torch.stack([x / r, y / r, z / max(abs(self.z_lo), abs(self.z_hi)),
                             fx - ix - 0.5, fy - iy - 0.5], dim=-1)  # [B, N, 5]
        feats = torch.where(ok[..., None], feats, torch.zeros_like(feats))
        feats = self.mlp(feats.to(self.mlp[0].weight.dtype))  # [B, N, C]
        c = feats.shape[-1]
        # flat cell index per point; invalid points go to the trash cell g*g
        idx = torch.where(ok, ix.long() * g + iy.long(), torch.full_like(ix, g * g).long())
        idx = idx + torch.arange(b, device=points.device)[:, None] * (g * g + 1)  # [B, N]
        flat_idx = idx.reshape(-1)
        # scatter_add (not index_add): it exports to ONNX (ScatterElements, reduction=add)
        sums = feats.new_zeros(b * (g * g + 1), c).scatter_add_(
            0, flat_idx[:, None].expand(-1, c), feats.reshape(-1, c))
        counts = feats.new_zeros(b * (g * g + 1)).scatter_add_(
            0, flat_idx, torch.ones_like(flat_idx, dtype=feats.dtype))
        mean = sums / counts.clamp(min=1.0)[:, None]  # [B*(G*G+1), C]
        mean = mean.view(b, g * g + 1, c)[:, : g * g]  # drop the trash cell
        return mean.transpose(1, 2).reshape(b, c, g, g)


def camera_attention_bias(T_cam_from_base: torch.Tensor, K: torch.Tensor,
                          image_hw: tuple[int, int], feat_hw: tuple[int, int], stride: float,
                          grid: int, half_range: float, z: float, sigma: float = 1.0
                          ) -> torch.Tensor:
    """Attention bias [G*G, cams*h*w] of the BEV queries over the image tokens (the order of
    `BEVFusion.image_tokens`): -(token distance to the cell's projection)^2 / (2 sigma^2) in
    the cameras that see the cell centre (in front, 0.1 m or more, inside image_hw px),
    -1e4 in the others; 0 everywhere for a cell no camera sees. T_cam_from_base [cams, 4, 4],
    K [cams, 3, 3] px; feat_hw = (h, w) of the tokens, `stride` px per token; fp32 math."""
    with torch.autocast(T_cam_from_base.device.type, enabled=False):  # geometry in fp32
        return _camera_attention_bias(T_cam_from_base.float(), K.float(), image_hw, feat_hw,
                                      stride, grid, half_range, z, sigma)


def _camera_attention_bias(T: torch.Tensor, Kf: torch.Tensor, image_hw: tuple[int, int],
                           feat_hw: tuple[int, int], stride: float, grid: int,
                           half_range: float, z: float, sigma: float) -> torch.Tensor:
    dev = T.device
    cams, (h, w), g = T.shape[0], feat_hw, grid
    d = 2.0 * half_range / g
    c = -half_range + (torch.arange(g, device=dev, dtype=torch.float32) + 0.5) * d  # [G] m
    x = c[:, None].expand(g, g)  # row i: x
    y = c[None, :].expand(g, g)  # col j: y
    pts = torch.stack([x, y, torch.full_like(x, z)], -1).reshape(-1, 3)  # [G*G, 3] m
    uv, zc, _ = project_points(pts, T, Kf, image_hw, min_depth=0.1)  # [cams, G*G, 2], [..]
    u, v = uv[..., 0], uv[..., 1]  # px (a camera that does not see the cell: masked below)
    vis = (zc > 0.1) & (u >= 0) & (u < image_hw[1]) & (v >= 0) & (v < image_hw[0])
    tu, tv = u / stride - 0.5, v / stride - 0.5  # token coordinates (centres at integers)
    r = torch.arange(h, device=dev, dtype=torch.float32)
    s = torch.arange(w, device=dev, dtype=torch.float32)
    d2 = (tv[..., None, None] - r[:, None]) ** 2 + (tu[..., None, None] - s[None, :]) ** 2
    bias = torch.where(vis[..., None, None], -d2 / (2.0 * sigma * sigma),
                       torch.full_like(d2, -1e4))  # [cams, G*G, h, w]
    bias = torch.where(vis.any(0)[None, :, None, None], bias, torch.zeros_like(bias))
    return bias.permute(1, 0, 2, 3).reshape(g * g, cams * h * w)


class BEVFusion(nn.Module):
    """BEV queries (learned + LiDAR pillars) cross-attend to the image tokens of all cameras.

    forward(points [B, N, 3] m, image_feats [B*cams, C, h, w], cameras=None) -> occupancy
    logits [B, 1, G, G]. cameras = (T_cam_from_base [cams, 4, 4], K [cams, 3, 3] px,
    image_hw (H, W) px, stride px per token): the geometric lift (`camera_attention_bias`),
    the same rig for every sample. `max_tokens_hw` bounds h*w for the learned position
    embedding.
    """

    def __init__(self, channels: int, grid: int, half_range: float,
                 z_range: tuple[float, float], heads: int, max_cameras: int = 8,
                 max_tokens_hw: int = 64 * 64) -> None:
        super().__init__()
        if channels % heads:
            raise ValueError(f"parameter 'bev_heads' = {heads}: must divide {channels}")
        self.grid, self.heads, self.half_range = grid, heads, float(half_range)
        self.z_mid = 0.5 * (float(z_range[0]) + float(z_range[1]))  # m, height of the cells
        self.pillars = PillarScatter(channels, grid, half_range, z_range)
        self.query = nn.Parameter(torch.randn(grid * grid, channels) * 0.02)  # [G*G, C]
        self.cam_embed = nn.Parameter(torch.randn(max_cameras, channels) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(max_tokens_hw, channels) * 0.02)
        self.norm_q = nn.LayerNorm(channels)
        self.norm_kv = nn.LayerNorm(channels)
        self.q_proj = nn.Linear(channels, channels)
        self.kv_proj = nn.Linear(channels, 2 * channels)
        self.out_proj = nn.Linear(channels, channels)
        self.ffn = nn.Sequential(nn.LayerNorm(channels), nn.Linear(channels, 2 * channels),
                                 nn.GELU(), nn.Linear(2 * channels, channels))
        self.occ = nn.Conv2d(channels, 1, 1)

    def image_tokens(self, feats: torch.Tensor, batch: int) -> torch.Tensor:
        """[B*cams, C, h, w] -> [B, cams*h*w, C] with camera and position embeddings."""
        bc, c, h, w = feats.shape
        cams = bc // batch
        if cams * batch != bc or cams > self.cam_embed.shape[0]:
            raise ValueError(f"BEV: {bc} images do not split into {batch} samples of "
                             f"<= {self.cam_embed.shape[0]} cameras")
        if h * w > self.pos_embed.shape[0]:
            raise ValueError(f"BEV: {h}x{w} feature map exceeds {self.pos_embed.shape[0]} "
                             "position embeddings")
        t = feats.flatten(2).transpose(1, 2).reshape(batch, cams, h * w, c)
        t = t + self.cam_embed[:cams, None, :].to(t.dtype) + self.pos_embed[: h * w].to(t.dtype)
        return t.reshape(batch, cams * h * w, c)

    def forward(self, points: torch.Tensor, image_feats: torch.Tensor,
                cameras: tuple[torch.Tensor, torch.Tensor, tuple[int, int], float] | None = None
                ) -> torch.Tensor:
        b = points.shape[0]
        g, nh = self.grid, self.heads
        pillars = self.pillars(points.float())  # [B, C, G, G]
        c = pillars.shape[1]
        q0 = pillars.flatten(2).transpose(1, 2) + self.query.to(pillars.dtype)  # [B, G*G, C]
        kv = self.norm_kv(self.image_tokens(image_feats, b).to(q0.dtype))  # [B, T, C]
        q = self.q_proj(self.norm_q(q0)).view(b, g * g, nh, c // nh).transpose(1, 2)
        k, v = self.kv_proj(kv).view(b, -1, 2, nh, c // nh).permute(2, 0, 3, 1, 4)
        mask = None
        if cameras is not None:  # [1, 1, G*G, cams*h*w], broadcast over samples and heads
            T, K, image_hw, stride = cameras
            mask = camera_attention_bias(T, K, image_hw, tuple(image_feats.shape[-2:]), stride,
                                         g, self.half_range, self.z_mid).to(q.dtype)[None, None]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, nh, G*G, C/nh]
        x = q0 + self.out_proj(att.transpose(1, 2).reshape(b, g * g, c))
        x = x + self.ffn(x)
        return self.occ(x.transpose(1, 2).reshape(b, c, g, g))  # [B, 1, G, G] logits
