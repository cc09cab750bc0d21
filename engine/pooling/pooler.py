"""Pooler: one request's last hidden states (every prompt position, after the final norm) -> one vector, as
sentence-transformers' Pooling and Normalize modules compute it."""

import torch
import torch.nn.functional as F

from engine.pooling.config import PoolerConfig
from engine.pooling.params import PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.config = config

    def __call__(self, hidden_states: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """hidden_states: [prompt_len, hidden_size]; a float32 vector of hidden_size on the same device."""
        kind = self.config.pooling_type
        if kind == "LAST":
            pooled = hidden_states[-1].float()
        elif kind == "CLS":
            pooled = hidden_states[0].float()
        else:  # MEAN, summed in float32 so a long prompt loses nothing in bfloat16
            pooled = hidden_states.float().mean(dim=0)
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
