"""Linear layers split over a tensor-parallel group.

Each parameter carries a `weight_loader(param, full_tensor, shard_id)` that takes the tensor as
the checkpoint stores it (unsharded, possibly one of several fused parts) and copies this rank's
slice into place. The model never needs to know how many ranks there are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.parallel import SINGLE_RANK, TPGroup


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ReplicatedLinear(_Linear):
    """Every rank holds the whole weight (small projections such as the MTP `fc`)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE_RANK):
        super().__init__(in_features, out_features, tp)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; no communication. Checkpoint shape [out, in]."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE_RANK):
        super().__init__(in_features, tp.shard(out_features, "out_features"), tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], tp: TPGroup = SINGLE_RANK):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), tp)

    def weight_loader(self, param, loaded, shard_id: int) -> None:
        per_rank = [s // self.tp.size for s in self.output_sizes]
        offset = sum(per_rank[:shard_id])
        rows = per_rank[shard_id]
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, self.tp.rank * rows, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split over ranks, KV heads replicated if fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TPGroup = SINGLE_RANK):
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"num_key_value_heads={num_kv_heads} cannot be replicated over {tp.size} ranks")
            self.num_kv_heads = 1
        self._kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        _Linear.__init__(self, hidden_size, out, tp)

    def weight_loader(self, param, loaded, shard_id: str) -> None:
        d = self.head_dim
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q_rows), loaded.narrow(0, self.tp.rank * q_rows, q_rows)
        else:
            kv_rank = self.tp.rank // self._kv_replicas
            start = q_rows + (0 if shard_id == "k" else kv_rows)
            dst, src = param.data.narrow(0, start, kv_rows), loaded.narrow(0, kv_rank * kv_rows, kv_rows)
        dst.copy_(src)


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial outputs summed with one all-reduce."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE_RANK):
        super().__init__(tp.shard(in_features, "in_features"), out_features, tp)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))
