"""Outlier channels for int8 activations over GGUF blocks: the few input channels of a norm-fed product
that are multiplied exactly, in fp32, beside the int8 product of the rest.

Why: int8 arithmetic on the blocks (``prefill_arithmetic``/``decode_arithmetic`` int8,
kernels/gguf_int8.py) quantizes x per 32-block with one scale, its largest value over 127. The residual
stream of a Llama carries a few "massive" channels, the same ones at every layer and for any input
(SmolLM2-135M: channels 247, 507, 308, 260 and 17 reach 6-100x a row's RMS after the norms), so every
block holding one quantizes its other 31 values with a step sized for the outlier. Taking those
channels out of the quantization and adding ``x[:, channels] @ W[:, channels].T`` in fp32 halves the
mode's error on the default model (measured in a one-off sweep over the accuracy texts, mean |d loglik|
against fp32: 0.059 -> 0.035; docs/weights.md has the served figures).

- Which products: those fed by an RMSNorm (q/k/v, gate/up, the LM head), where the massive channels
  are. o_proj's and down's inputs have no fixed outliers (down's move from row to row over 1,500
  channels), so a fixed set does not help there.
- Which channels: ``CHANNELS`` per product, the largest ``max |x| / rms(row)`` over one exact
  forward pass of ``CALIBRATION_TOKENS`` token ids drawn from a fixed seed (``calibrate``), run once at
  load before any product turns int8. No text is needed: the massive channels come from the weights,
  and in the sweep channels calibrated on random ids served as well as ones calibrated on prose.
- Cost: ``CHANNELS`` columns of fp32 weight per product, kept [channels, N] (1.1 MiB for the default
  model), and in the int8 kernels' epilogue one fp32 multiply-add per channel, output and row: 8 fp32
  channels cost what 32 int8 ones do (a 576-wide input: ~6% of those products). 8, not 16: in a one-off
  sweep the mean |d loglik| was the same for 8, 16 and 32 (0.034-0.037), 0.042 for 4.
"""

from __future__ import annotations

import logging
import os

import torch

from radixserve.model.gguf import GGUFLinear
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger("radixserve.model")

ENV = "RADIXSERVE_INT8_OUTLIERS"  # "0": every channel goes through the int8 quantization, as before
CHANNELS = 8
CALIBRATION_TOKENS = 128
SEED = 0
PAGE = 16


def norm_fed(model: LlamaForCausalLM) -> list[GGUFLinear]:
    """The GGUF products whose input is an RMSNorm's output: each layer's q/k/v and gate/up, and the
    LM head."""
    found: list[GGUFLinear] = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            if isinstance(m, GGUFLinear):
                found.append(m)
    if isinstance(model.lm_head, GGUFLinear):
        found.append(model.lm_head)
    return found


def calibrate(model: LlamaForCausalLM, linears: list[GGUFLinear]) -> dict[GGUFLinear, torch.Tensor]:
    """Each of ``linears``' ``max |x| / rms(row)`` per input channel (fp32 [in_features]) over one exact
    prefill of ``CALIBRATION_TOKENS`` fixed token ids, every row through the LM head."""
    from radixserve.cache.page_pool import KVPool
    from radixserve.model.attention import select_backend
    from radixserve.model.runner import ModelRunner, SeqChunk

    cfg = model.config
    device = model.norm.weight.device
    generator = torch.Generator().manual_seed(SEED)
    hi = min(cfg.vocab_size, 40000)
    ids = torch.randint(min(100, hi // 2), hi, (CALIBRATION_TOKENS,), generator=generator).tolist()
    pages = -(-CALIBRATION_TOKENS // PAGE)
    pool = KVPool(cfg.num_layers, pages + 1, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    runner = ModelRunner(model, pool, select_backend("auto", device), device, native_step=False)
    peaks: dict[GGUFLinear, torch.Tensor] = {}

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(module, GGUFLinear)
        x = args[0].detach().float().reshape(-1, module.in_features)
        ratio = (x.abs() / x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)).amax(0)
        peaks[module] = ratio if module not in peaks else torch.maximum(peaks[module], ratio)

    hooks = [m.register_forward_pre_hook(record) for m in linears]
    try:
        with torch.inference_mode():
            runner.run([SeqChunk(ids, 0, len(ids), list(range(1, pages + 1)), want_all_logits=True)])
    finally:
        for h in hooks:
            h.remove()
    return peaks


def apply(model: LlamaForCausalLM) -> int:
    """Give each norm-fed GGUF product its ``CHANNELS`` outlier channels (``GGUFLinear.use_outliers``),
    calibrated now in exact arithmetic (call before any product turns int8). Returns how many products
    got them (0 where ``ENV`` is "0")."""
    if os.environ.get(ENV, "1") == "0":
        logger.info("int8 activations: no outlier channels (%s=0)", ENV)
        return 0
    linears = [m for m in norm_fed(model) if m.in_features > CHANNELS]
    if not linears:  # no norm-fed block products: nothing to calibrate, and the K/V stay as they were
        return 0
    peaks = calibrate(model, linears)
    for m in linears:
        m.use_outliers(torch.topk(peaks[m], CHANNELS).indices.sort().values)
    model.outlier_channels = CHANNELS
    logger.info(
        "int8 activations: %d input channels of each of %d norm-fed products are multiplied in fp32 "
        "(outliers, calibrated at load)",
        CHANNELS,
        len(linears),
    )
    return len(linears)
