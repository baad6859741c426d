"""Linear layers split over a tensor-parallel group.

Each parameter carries a `weight_loader(param, full_tensor, shard_id)` that takes the tensor as
the checkpoint stores it (unsharded, possibly one of several fused parts) and copies this rank's
slice into place. The model never needs to know how many ranks there are.

Every layer states, in rows and columns of its logical [out, in] weight, where a part lands in the
local parameter and where this rank's slice starts in the checkpoint tensor (`_row_range`,
`_col_range`); one loader applies that to every parameter, including the packed weights and the
scales of a quantized layer (`engine.quant.linear`), whose rows and columns cover `row_div` and
`col_div` logical ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tp_group import SINGLE_RANK, TPGroup


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, quant=None,
                 row_parts: list[int] | None = None, cols_sharded: bool = False):
        # quant: None (the model dtype), or the layer's kind (engine.quant.layouts.LinearQuant, or its kind name)
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        if quant is None:
            self.quant = None
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            from engine.quant.layouts import LinearQuant
            from engine.quant.linear import create_weights
            spec = quant if isinstance(quant, LinearQuant) else LinearQuant(quant)
            self.quant = spec.kind                      # the kernels' family: fp8, fp8_channel, nvfp4, int
            # the finest row/column granule a rank's slice or a fused part may start at
            row_granule = math.gcd(*(row_parts or [out_features]))
            create_weights(self, spec, in_features, out_features, row_granule, cols_sharded, tp.size)

    def _row_range(self, shard_id) -> tuple[int, int, int]:
        """(first local row, first checkpoint row, rows) of part `shard_id` on this rank."""
        return 0, 0, self.out_features

    def _col_range(self) -> tuple[int, int]:
        """(first checkpoint column, columns) of this rank."""
        return 0, self.in_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.load_rows(param, loaded if loaded.numel() == 1 else expand_loaded(param, loaded), shard_id)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of part `shard_id` from `loaded` (already expanded to the param's
        row granule: see `expand_loaded`)."""
        if getattr(param, "along_cols", False):
            self._load_cols(param, loaded, shard_id)
            return
        rdiv, cdiv = getattr(param, "row_div", 1), getattr(param, "col_div", 1)
        dst0, src0, rows = self._row_range(shard_id)
        dst = param.data.narrow(0, dst0 // rdiv, -(-rows // rdiv))
        if getattr(param, "quantized", False) and loaded.numel() == 1:
            dst.fill_(loaded.reshape(()).item())               # a per-tensor scale: every row of the part
            return
        src = loaded.narrow(0, src0 // rdiv, -(-rows // rdiv))
        if param.dim() == 2 and not getattr(param, "cols_whole", False):
            c0, cols = self._col_range()
            src = src.narrow(1, c0 // cdiv, -(-cols // cdiv))
        dst.copy_(src)

    def _load_cols(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """A vector over the input columns (an act-order g_idx): this rank's columns. Fused parts share the
        input, so they share it: GPTQ orders the columns by the Hessian of that input, the same for q, k
        and v (and for gate and up); a checkpoint where they differ is refused."""
        c0, cols = self._col_range()
        mine = loaded.narrow(0, c0, cols)
        if getattr(param, "loaded_once", False):
            if not torch.equal(param.data, mine.to(param.dtype)):
                from engine.errors import ModelLoadError
                raise ModelLoadError(f"differs from the other fused parts' (shard {shard_id!r}): one act-order "
                                     "g_idx per fused layer is supported")
            return
        param.data.copy_(mine)
        param.loaded_once = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            from engine.quant.linear import apply
            return apply(self, x)
        if x.is_cuda:
            from engine.kernels.linear import gemv
            return gemv.dense(x, self.weight)
        return F.linear(x, self.weight)


def expand_loaded(param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor at the granule of `param` (FP8 block scales repeated down to the rank's
    row and column granule); other tensors unchanged. Rows of the result are in units of
    `param.row_div` rows of the layer."""
    expand = getattr(param, "expand_loaded", None)
    return loaded if expand is None else expand(loaded)


class ReplicatedLinear(_Linear):
    """Every rank holds the whole weight (small projections such as the MTP `fc`)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE_RANK, quant: str | None = None):
        super().__init__(in_features, out_features, tp, quant)


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; no communication. Checkpoint shape [out, in]."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE_RANK, quant: str | None = None,
                 row_parts: list[int] | None = None):
        rows = tp.shard(out_features, "out_features")
        super().__init__(in_features, rows, tp, quant, row_parts or [rows])

    def _row_range(self, shard_id):
        return 0, self.tp.rank * self.out_features, self.out_features


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate and up)."""

    def __init__(self, in_features: int, output_sizes: list[int], tp: TPGroup = SINGLE_RANK, quant: str | None = None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), tp, quant, [s // tp.size for s in output_sizes])

    def _row_range(self, shard_id: int):
        per_rank = [s // self.tp.size for s in self.output_sizes]
        rows = per_rank[shard_id]
        return sum(per_rank[:shard_id]), self.tp.rank * rows, rows


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split over ranks, KV heads replicated if fewer than ranks.
    `q_rows_per_head` > 1: each head's q rows carry more than the query (Qwen3.5's gated attention:
    the query and its output gate, 2 x head_dim rows per head)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TPGroup = SINGLE_RANK, quant: str | None = None, q_rows_per_head: int = 1):
        self.head_dim = head_dim
        self.q_rows_per_head = q_rows_per_head
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"num_key_value_heads={num_kv_heads} cannot be replicated over {tp.size} ranks")
            self.num_kv_heads = 1
        self._kv_replicas = max(1, tp.size // num_kv_heads)
        q_rows, kv_rows = q_rows_per_head * self.num_heads * head_dim, self.num_kv_heads * head_dim
        _Linear.__init__(self, hidden_size, q_rows + 2 * kv_rows, tp, quant, [q_rows, kv_rows])

    def _row_range(self, shard_id: str):
        d = self.head_dim
        q_rows, kv_rows = self.q_rows_per_head * self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            return 0, self.tp.rank * q_rows, q_rows
        kv_rank = self.tp.rank // self._kv_replicas
        return q_rows + (0 if shard_id == "k" else kv_rows), kv_rank * kv_rows, kv_rows


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial outputs summed with one all-reduce, unless the
    caller sets `reduce = False` and sums them itself (engine.layers.reduce_add_norm fuses that sum with
    the residual add and the next norm)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = SINGLE_RANK, quant: str | None = None):
        super().__init__(tp.shard(in_features, "in_features"), out_features, tp, quant, cols_sharded=True)
        self.reduce = True

    def _col_range(self):
        return self.tp.rank * self.in_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.tp.all_reduce(y) if self.reduce else y


def quant_format(cfg, prefix: str, parts: list[str]):
    """The quantized kind (engine.quant.layouts.LinearQuant) of the linear layer made of checkpoint modules
    prefix.part (a `ModelConfig`'s scheme), or None."""
    return None if cfg.quant is None else cfg.quant.layer_format(prefix, parts)
