"""
support/cpu_layers.py: model.py's layers as a CPU runs them faster, swapped in the way gpt-fast's quantize.py swaps its
linear layers, each in one visible line; nothing else swaps anything. Two swaps:

short_rows (train.py, embed.py and evaluate_sts.py on a CPU): each layer's attention written out for rows of up to
SHORT_ROWS tokens without dropout, as two batched matmuls around a softmax.

swap_in (embed.py and evaluate_sts.py, for inference, unless --no-onednn): the layers' linear products as oneDNN's.
Each nn.Linear of the encoder's layers becomes oneDNN's product (torch.ops.mkldnn, the operations torch's own
inductor emits on a CPU) with its weight laid out once in oneDNN's blocked format, where F.linear under bf16 autocast
casts and lays it out again at every call; and BERT's and RoBERTa's feed-forward applies its GELU inside the up
product, to the fp32 sums before they are rounded: one pass fewer over the widest activations of the layer, and one
rounding. The LayerNorms and the residual sums run as model.py writes them. The figures:
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
from support.device import runs_as

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


def for_inference(model, device: torch.device, dtype, flags):
    """embed.py's and evaluate_sts.py's swap, `model` being on `device`: short rows' attention written out on a CPU,
    and oneDNN's products where chosen() says they pay and --no-onednn does not refuse them (flags: their
    support.device.OnDevice). -> (the model, what runs, in the words of the first line that says so: runs_as)."""
    short_rows(model)
    swap, why_not = chosen(device, dtype)
    if flags.onednn and swap:
        model = swap_in(model, dtype)
    return model, runs_as(device, dtype, flags.dtype, swapped(model), why_not if flags.onednn else "")


# Rows of a few dozen tokens (sentences, STS pairs) attend faster on a CPU as two batched matmuls around a softmax than
# in torch's flash kernel, whose fixed cost per (row, head) is several times their arithmetic, once the keys are padded
# to a multiple of 8 for the softmax to run on whole vectors (13 keys as 16: 3x faster). all-MiniLM-L6-v2 on STS-B's
# sentences in bf16: the whole forward 10% faster; from about 128 tokens the kernel wins. Attention dropout (BERT's and
# RoBERTa's training) keeps the fused kernel, which applies it; ModernBERT has none, so on a CPU its training takes the
# written-out attention for chunks of up to 64 tokens too. A GPU keeps its kernels.
SHORT_ROWS = 64


def short_rows(model):
    """Each layer's `attention` (model.py's and ModernBERT's) as short_row_attention around it, in place, where the
    model is on a CPU; a model on a GPU as it is."""
    if next(model.parameters()).device.type == "cpu":
        for module in model.modules():
            fused = getattr(module, "attention", None)
            if callable(fused) and getattr(fused, "func", None) is not short_row_attention:
                module.attention = functools.partial(short_row_attention, fused)
    return model


def short_row_attention(fused, q, k, v, mask, dropout_p: float):
    """model.attention's softmax(q k^T / sqrt(hd), where mask) v, written out for rows of up to SHORT_ROWS tokens on a
    CPU without dropout; `fused` (model.attention) for the rest."""
    if dropout_p > 0 or q.device.type != "cpu" or q.shape[-2] > SHORT_ROWS:
        return fused(q, k, v, mask, dropout_p)
    # The keys padded to a multiple of 8, masked there. k and v made contiguous first: padded by nothing, F.pad keeps
    # its input's strides, which a compiled graph misreads (issue 81)
    extra = -k.shape[-2] % 8
    keys = torch.ones(k.shape[-2], dtype=torch.bool, device=k.device) if mask is None else mask
    k, v = F.pad(k.contiguous(), (0, 0, 0, extra)), F.pad(v.contiguous(), (0, 0, 0, extra))
    keys = F.pad(keys, (0, extra), value=False)  # (B, nh, T', hd) and (..., T')
    # The product q k^T in the inputs' precision (bf16 under autocast), then the scaling, the mask and the softmax in
    # fp32, as the flash kernel keeps its scores. Masked by adding the lowest finite score, not -inf, so that a query
    # that sees no key (a row of padding) stays finite; the scaling and the mask in one pass
    lowest = torch.zeros(keys.shape, device=q.device)
    lowest.masked_fill_(~keys, torch.finfo(torch.float32).min)
    scores = torch.add(lowest, q @ k.transpose(-1, -2), alpha=q.shape[-1] ** -0.5)  # (B, nh, T, T')
    return scores.softmax(-1).to(v.dtype) @ v  # (B, nh, T, hd)


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
