"""
support/cpu_layers.py: model.py's layers on a CPU, for inference, with their linear products as oneDNN's. Swapped in
by one visible line in embed.py and in evaluate_sts.py, the way gpt-fast's quantize.py swaps its linear layers;
nothing else swaps anything, and `--no-onednn` leaves model.py's layers as they are.

Each nn.Linear of the encoder's layers becomes oneDNN's product (torch.ops.mkldnn, the operations torch's own
inductor emits on a CPU) with its weight laid out once in oneDNN's blocked format, where F.linear under bf16 autocast
casts and lays it out again at every call; and BERT's and RoBERTa's feed-forward applies its GELU inside the up
product, to the fp32 sums before they are rounded: one pass fewer over the widest activations of the layer, and one
rounding. Attention, the LayerNorms and the residual sums run as model.py writes them. The figures:
docs/measurements.md (all-MiniLM-L6-v2, a whole embed.py process on an AMX Xeon: 1.16x model.py's own layers).

Swapped in where it runs and pays (chosen()): in bf16, on a processor whose oneDNN runs bf16 products (AVX-512 BW,
VL and DQ, or AVX-NE-CONVERT; an AVX2-only one raises). In fp32 F.linear already calls the BLAS on the weight as it
is, with nothing to lay out again, and the swap gave nothing: an AVX2-only AMD EPYC ran a whole embed.py process
12% slower with it (docs/measurements.md).
"""
import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from support.cli import say

OPS = ("_linear_pointwise", "_reorder_linear_weight")  # torch.ops.mkldnn's: private, so checked before use


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN and the operations above; where it has not, said once."""
    ok = torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in OPS)
    if not ok:
        say(f"note: torch {torch.__version__} lacks oneDNN's products (torch.ops.mkldnn.{OPS[0]}); model.py's own "
            "layers run", file=sys.stderr)
    return ok


def chosen(device: torch.device, dtype) -> tuple[bool, str]:
    """(whether embed.py and evaluate_sts.py swap the layers in, why not where they do not): on a CPU, in bf16, where
    this processor runs oneDNN's bf16 products."""
    if device.type != "cpu":
        return False, ""
    if dtype != torch.bfloat16:
        return False, "oneDNN's products pay in bf16 only"
    if not available():
        return False, f"torch {torch.__version__} lacks oneDNN's products"
    if not runs_bf16():
        return False, "oneDNN's bf16 products need AVX-512 or AVX-NE-CONVERT, not available here"
    return True, ""


@functools.cache
def runs_bf16() -> bool:
    """Whether oneDNN's bf16 product runs on this processor, as far as ONEDNN_MAX_CPU_ISA lets it: tried on a small
    one (where it cannot, torch raises: "bf16 path needs the cpu support avx_ne_convert or avx512bw, ...")."""
    try:
        x = torch.ones(2, 16, dtype=torch.bfloat16)
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=torch.bfloat16), None)
        torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def swap_in(model, dtype):
    """`model` for inference on a CPU in `dtype` (None: fp32; bf16): each of BERT's and RoBERTa's feed-forwards a
    PackedFeedForward, every other nn.Linear of the layers a PackedLinear; in place, the weights copied as oneDNN
    lays them out. A GPU, fp16, a torch without oneDNN's products, or bf16 where oneDNN cannot run it (runs_bf16):
    the model as it is. Where the swap pays is chosen()'s."""
    on_cpu = next(model.parameters()).device.type == "cpu" and dtype in (None, torch.float32, torch.bfloat16)
    if not on_cpu or not available() or (dtype == torch.bfloat16 and not runs_bf16()):
        return model
    dtype = dtype or torch.float32
    for layer in model.layers:
        if fused(getattr(getattr(layer, "ffn", None), "act", None)):  # model.FeedForward (ModernBERT's is gated)
            layer.ffn = PackedFeedForward(layer.ffn, dtype)
        for module in list(layer.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child, dtype))
    return model.eval()


def swapped(model) -> bool:
    """Whether swap_in changed anything of `model`."""
    return any(isinstance(m, (PackedLinear, PackedFeedForward)) for m in model.modules())


class PackedLinear(nn.Module):
    """nn.Linear as oneDNN's product in `dtype`, its weight laid out once (a copy, without a gradient) and, where
    `activation` names one, the activation applied to the fp32 sums before they are rounded."""

    def __init__(self, linear: nn.Linear, dtype, activation: tuple[str, str] = ("none", "")):
        super().__init__()
        self.dtype, (self.attr, self.algorithm) = dtype, activation
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype), None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype)

    def forward(self, x):
        x = x.to(self.dtype)  # as autocast would cast it
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.attr, [], self.algorithm)


class PackedFeedForward(nn.Module):
    """model.FeedForward without dropout, ln(x + down(act(up(x)))), its activation inside up's product."""

    def __init__(self, ffn, dtype):
        super().__init__()
        self.up = PackedLinear(ffn.up, dtype, fused(ffn.act))
        self.down = PackedLinear(ffn.down, dtype)
        self.ln = ffn.ln

    def forward(self, x):
        return self.ln(x + self.down(self.up(x)))


def fused(act) -> tuple[str, str] | None:
    """oneDNN's name for an activation it applies inside a product: GELU, exact (BERT's) or in its tanh form."""
    if act is F.gelu:
        return "gelu", "none"
    if isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"}:
        return "gelu", "tanh"
    return None
