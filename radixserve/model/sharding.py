"""Tensor-parallel shards of a loaded model: each rank keeps its part of every weight, in place.

- Column-parallel (the output rows split, no communication): the fused QKV projection (the rank's
  query heads and its KV heads) and gate/up (the rank's slice of each).
- Row-parallel (the input columns split, then ``RowParallel`` sums the ranks' partial products with
  an fp32 all-reduce): o_proj and down_proj.
- Vocab-parallel: the embedding and the LM head keep ``ceil(vocab / N)`` rows each (the last rank's
  padded with zeros). A looked-up id outside the rank's rows gives zeros, and one all-reduce makes the
  full embedding (exact: one nonzero term per element); the LM head's logits are gathered on rank 0
  for sampling.
- KV heads: sharded where N divides their count, replicated where their count divides N (each rank
  then holds the one KV head its query heads read). Each rank's KV pool holds its heads only.
- Every weight format shards the same way: fp32/bf16 ``Linear``, int8 ``Int8Linear`` (rows with their
  scales; a column slice keeps its row's scale) and GGUF blocks (rows of blocks; a column split must
  fall on a block boundary, checked by ``check_tensor_parallel`` before anything is loaded twice).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.gguf import GGUFEmbedding, GGUFLinear
from radixserve.model.gguf_blocks import CHUNK, FORMATS, is_blocks
from radixserve.model.layers import Linear
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.model_config import ModelConfig
from radixserve.model.quant import Int8Linear
from radixserve.parallel import comm


def _fits(cfg: ModelConfig, n: int) -> bool:
    kv = cfg.num_kv_heads
    return cfg.num_heads % n == 0 and (kv % n == 0 or n % kv == 0) and cfg.intermediate_size % n == 0


def check_tensor_parallel(cfg: ModelConfig, n: int, quantization: str | None = None) -> None:
    """Refuse a ``tensor_parallel_size`` the model cannot be split by, naming the counts it must divide
    and the sizes that work (ValueError)."""
    valid = [k for k in range(1, cfg.num_heads + 1) if _fits(cfg, k)]
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
    if n > cfg.num_heads:
        raise ValueError(
            f"tensor_parallel_size {n} is more ranks than the model's {cfg.num_heads} query heads "
            f"(sizes that work: {', '.join(map(str, valid))})"
        )
    if not _fits(cfg, n):
        raise ValueError(
            f"tensor_parallel_size {n} does not split the model: it must divide its {cfg.num_heads} query "
            f"heads and {cfg.intermediate_size} MLP rows, and divide or be a multiple of its "
            f"{cfg.num_kv_heads} KV heads (sizes that work: {', '.join(map(str, valid))})"
        )
    if quantization == "gguf":
        for what, cols in (("o_proj", cfg.num_heads * cfg.head_dim), ("down_proj", cfg.intermediate_size)):
            # The smallest block of any type here; a k-quant weight's 256 are checked where it is cut.
            if (cols // n) % CHUNK:
                raise ValueError(
                    f"tensor_parallel_size {n} splits the GGUF {what}'s {cols} input columns into "
                    f"{cols // n} per rank, not whole blocks of {CHUNK}"
                )


def local_kv_heads(cfg: ModelConfig, n: int) -> int:
    """KV heads each rank holds (and its pool's head count)."""
    return cfg.num_kv_heads // n if cfg.num_kv_heads % n == 0 else 1


class RowParallel(nn.Module):
    """A row-parallel product: this rank's partial sum, then the fp32 all-reduce over the ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = comm.all_reduce(self.inner(x))
        return out


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[start, start + rows)`` of the table; the full embedding after an all-reduce."""

    def __init__(self, inner: nn.Module, start: int, rows: int) -> None:
        super().__init__()
        self.inner, self.start, self.rows = inner, start, rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x: torch.Tensor = self.inner(torch.where(inside, local, torch.zeros_like(local)))
        out: torch.Tensor = comm.all_reduce(x.masked_fill(~inside.unsqueeze(-1), 0))
        return out


class VocabParallelHead(nn.Module):
    """This rank's logits, gathered on rank 0 into the full ``[rows, vocab]`` (the other ranks get
    their own part back: only rank 0 samples)."""

    def __init__(self, inner: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.inner, self.vocab_size = inner, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden).float()
        full = comm.gather_rows(local)
        return local if full is None else full[:, : self.vocab_size]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def _pad(t: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)])


def keep_rows(m: nn.Module, index: torch.Tensor, pad_to: int = 0) -> None:
    """Keep output rows ``index`` (ascending) of a Linear of any format, padded with zero rows to
    ``pad_to``."""
    rows = max(pad_to, len(index))
    if isinstance(m, Linear):
        m.weight = _param(_pad(m.weight.data.index_select(0, index), rows))
        m.packed = None  # made again by prepack, from the shard
        for name in ("qweight", "qscale", "fast_weight"):  # the many-rows copies (model/arithmetic.py)
            if getattr(m, name) is not None:
                setattr(m, name, getattr(m, name).index_select(0, index).contiguous())
    elif isinstance(m, Int8Linear):
        m.qweight = _pad(m.qweight.index_select(0, index), rows).contiguous()
        m.scale = _pad(m.scale.index_select(0, index), rows, 1.0).contiguous()
    elif isinstance(m, GGUFLinear):
        kept, outliers, offset = [], [], 0
        for i, qtype in enumerate(m.qtypes):
            w = m._parameters.pop(f"weight{i}")
            assert w is not None
            n = w.shape[0]
            sel = index[(index >= offset) & (index < offset + n)] - offset
            offset += n
            if len(sel):
                kept.append((w.data.index_select(0, sel), qtype))
                pair = m.outliers[i]  # the outlier channels' weight columns [k, N]: the same rows kept
                outliers.append(None if pair is None else (pair[0], pair[1].index_select(1, sel)))
        pad = rows - len(index)
        kept[-1] = (_pad(kept[-1][0], kept[-1][0].shape[0] + pad), kept[-1][1])
        last = outliers[-1]
        if last is not None and pad:
            outliers[-1] = (last[0], _pad(last[1].t(), last[1].shape[1] + pad).t().contiguous())
        for j, (part, _) in enumerate(kept):
            m.register_parameter(f"weight{j}", _param(part))
        m.qtypes = [q for _, q in kept]
        m.outliers = outliers
    else:
        raise TypeError(f"cannot shard a {type(m).__name__}")
    bias = getattr(m, "bias", None)
    if bias is not None:
        m.bias = _param(_pad(bias.data.index_select(0, index), rows))
    m.out_features = rows


def keep_cols(m: nn.Module, start: int, end: int, keep_bias: bool) -> None:
    """Keep input columns ``[start, end)`` of a Linear of any format; its bias only where ``keep_bias``
    (one rank adds it to the row-parallel sum)."""
    if isinstance(m, Linear):
        m.weight = _param(m.weight.data[:, start:end])
        m.packed = None
        for name in ("qweight", "fast_weight"):  # a row's int8 scale holds for any of its columns
            if getattr(m, name) is not None:
                setattr(m, name, getattr(m, name)[:, start:end].contiguous())
    elif isinstance(m, Int8Linear):
        m.qweight = m.qweight[:, start:end].contiguous()
    elif isinstance(m, GGUFLinear):
        m.undo_input_order()
        for i, qtype in enumerate(m.qtypes):
            w = getattr(m, f"weight{i}").data
            if is_blocks(qtype):
                f = FORMATS[qtype]
                if start % f.weights or end % f.weights:
                    raise ValueError(
                        f"cannot split a {f.name} weight (blocks of {f.weights} weights) at columns "
                        f"[{start}, {end}): use a tensor_parallel_size that cuts its rows at whole blocks"
                    )
                w = w.view(w.shape[0], -1, f.bytes)[:, start // f.weights : end // f.weights].reshape(
                    w.shape[0], -1
                )
            else:
                w = w[:, start:end]
            m.register_parameter(f"weight{i}", _param(w))
            # outlier channels in [start, end) stay, renumbered; the others are another rank's
            pair = m.outliers[i]
            if pair is not None:
                inside = (pair[0] >= start) & (pair[0] < end)
                m.outliers[i] = (
                    (pair[0][inside] - start, pair[1][inside].contiguous()) if inside.any() else None
                )
    else:
        raise TypeError(f"cannot shard a {type(m).__name__}")
    bias = getattr(m, "bias", None)
    if bias is not None and not keep_bias:
        m.bias = _param(torch.zeros_like(bias.data))
    m.in_features = end - start


def shard_model(model: LlamaForCausalLM, rank: int, n: int) -> None:
    """Cut ``model`` (loaded whole) down to rank ``rank``'s shard of ``n``, in place, and prepack the
    shards' matmul copies."""
    cfg = model.config
    check_tensor_parallel(cfg, n, model.quantization)
    d, q_size, kv_size = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    heads, kv_heads = cfg.num_heads // n, local_kv_heads(cfg, n)
    kv_first = rank * kv_heads if cfg.num_kv_heads % n == 0 else rank // (n // cfg.num_kv_heads)
    q_rows = torch.arange(rank * heads * d, (rank + 1) * heads * d)
    kv_rows = torch.arange(kv_first * d, (kv_first + kv_heads) * d)
    qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    inter = cfg.intermediate_size // n
    mlp_rows = torch.arange(rank * inter, (rank + 1) * inter)
    gate_up_rows = torch.cat([mlp_rows, cfg.intermediate_size + mlp_rows])
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        keep_rows(attn.qkv_proj, qkv_rows)
        keep_cols(attn.o_proj, rank * heads * d, (rank + 1) * heads * d, rank == 0)
        setattr(attn, "o_proj", RowParallel(attn.o_proj))  # noqa: B010 - a Linear slot
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.q_size, attn.kv_size = heads * d, kv_heads * d
        keep_rows(mlp.gate_up_proj, gate_up_rows)
        keep_cols(mlp.down_proj, rank * inter, (rank + 1) * inter, rank == 0)
        setattr(mlp, "down_proj", RowParallel(mlp.down_proj))  # noqa: B010
    rows = -(-cfg.vocab_size // n)
    vocab_rows = torch.arange(rank * rows, min(cfg.vocab_size, (rank + 1) * rows))
    embed, head = model.embed_tokens, model.lm_head
    tied = isinstance(head, Linear) and isinstance(embed, nn.Embedding) and head.weight is embed.weight
    assert isinstance(embed, nn.Embedding | GGUFEmbedding)
    embed.weight = _param(_pad(embed.weight.data.index_select(0, vocab_rows), rows))
    if tied:  # one table for both, as before
        assert isinstance(head, Linear)
        head.weight, head.out_features, head.packed = embed.weight, rows, None
    else:
        keep_rows(head, vocab_rows, rows)
    model.embed_tokens = VocabParallelEmbedding(embed, rank * rows, rows)  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(head, cfg.vocab_size)  # type: ignore[assignment]
    model.prepack()
