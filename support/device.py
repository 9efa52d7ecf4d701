"""
support/device.py: where the numbers are computed, and in what. Token rows padded into a batch and copied to the
device without waiting, the next item prepared while this one runs, the device and precision that --device and
--dtype mean, attention and oneDNN's linear layers on a CPU, the random state a GradCache replay restores, and
what torch.compile built (torch's CPU threads: support/threads.py).
"""
import concurrent.futures
import contextlib
import functools
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from support import kernels
from support.cli import UserError, flag, say
from support.threads import usable_cpus


def padding_mask(lengths, T: int) -> np.ndarray:
    """(B, T) bool: True at the real tokens of rows of these lengths, padded on the right to T."""
    return np.arange(T)[None] < np.asarray(lengths)[:, None]


def pad_rows(rows, pad_id: int, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token id rows of any lengths -> (B, T) int64 ids padded on the right to the longest (or to `width`, if wider),
    and their 0/1 mask."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    ids = np.full((len(rows), max(width, int(lengths.max(initial=0)))), pad_id, dtype=np.int64)
    mask = padding_mask(lengths, ids.shape[1])
    if len(rows):
        ids[mask] = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    return ids, mask.astype(np.int64)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device. To a GPU from page-locked memory and without waiting: the copy runs while the host
    goes on, and the GPU never waits for the host to stage it (torch's pinned-memory cache keeps the buffer until the
    copy is done)."""
    if not array.flags.c_contiguous or min(array.strides, default=0) < 0:  # a reversed view, even of one element
        array = array.copy()
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def prefetched(items, work):
    """work(item) for each item, in order, the next one computed in a thread while the caller uses this one."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead = None
        for item in items:
            nxt = pool.submit(work, item)
            if ahead is not None:
                yield ahead.result()
            ahead = nxt
        if ahead is not None:
            yield ahead.result()


# -----------------------------------------------------------------------------------------------
# Device and precision


@dataclass
class OnDevice:  # embed.py's and evaluate_sts.py's: a score is that of the embeddings embed.py writes
    dtype: str = flag("auto", "auto: bf16 if the GPU/CPU has it; else GPU fp16, CPU fp32",
                      choices=("auto", "fp32", "bf16", "fp16"))
    device: str = flag("auto", "auto (a GPU if torch sees one, else the CPU), cpu, cuda, cuda:1 ...")
    threads: int = flag(0, "torch CPU threads; 0: the cores free when it starts (as train.py's)", low=0,
                        high=usable_cpus(), why="the CPUs this process may use")


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX, or AVX512-BF16); elsewhere oneDNN emulates it, about 400x
    slower than fp32 (a 2048^2 matmul on an AVX2-only AMD EPYC: 0.27 against 113 GFLOP/s)."""
    asks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch >= 2.5 can tell; 2.4 cannot: fp32
    return any(getattr(torch.cpu, ask, lambda: False)() for ask in asks)


def autocast_dtype(name: str, device: torch.device, cpu_bf16: bool = False):
    """--dtype as the dtype autocast computes in (None: fp32, no autocast). auto: bf16 on a GPU with bf16 tensor cores,
    fp16 on one without (a T4, a V100; the original DeCLUTR trained in fp16, loss-scaled); on a CPU, bf16 where it
    multiplies bf16 in hardware and `cpu_bf16` asks for it (embedding), else fp32 (training)."""
    if name == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "auto" and cpu_bf16 and cpu_has_bf16():
        return torch.bfloat16
    return {"auto": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


# The attention kernels every forward may use, chosen on purpose rather than left to torch's dispatcher, whose first
# choice changes with the torch version (docs/gpu.md): on a GPU, flash attention where a batch has no padding (fp16 and
# bf16 only), the memory-efficient kernel wherever there is a mask (all of training) or fp32, the math kernel only for
# a head size neither takes. cuDNN's is left out: it rounds the dropout probability (0.1 becomes a multiple of 1/16),
# has had NaN gradients and wrong results on Hopper (pytorch#196678, #139298, #169849), and builds a graph for every
# new batch shape. A CPU has flash and math only, and keeps its choice: the list leaves out nothing it has.
ATTENTION_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


# Rows of a few dozen tokens (sentences, STS pairs) attend faster on a CPU as two batched matmuls around a softmax
# than in its flash kernel, whose fixed cost per (row, head) is several times the arithmetic at these lengths
# (all-MiniLM-L6-v2 on STS-B's sentences, 14 tokens: attention from 15-16% of the forward to 7-8%; the kernel wins
# again from about 128 tokens; docs/measurements.md). GPUs, and training's dropout, keep the fused kernels.
SHORT_ROWS = 64


def attention(q, k, v, mask, dropout_p: float = 0.0):
    """softmax(q k^T / sqrt(hd), where mask) v for (B, nh, T, hd) q, k, v and a bool mask broadcast to (B, nh, T, T)
    (None: everything): scaled_dot_product_attention in the kernels of ATTENTION_KERNELS, or on a CPU, for rows of
    up to SHORT_ROWS tokens without dropout, the same written out, the softmax in fp32 as the flash kernel's is."""
    # Dropout tested first, so that a compiled training step never guards its graph on a batch's length
    if dropout_p > 0 or q.device.type != "cpu" or q.shape[-2] > SHORT_ROWS:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    fused = _fused_rows(q, k, v, mask)
    if fused is not None:
        return fused
    # Rows of up to 8 tokens several to a product where only keys are masked; not in a compiled graph, which would
    # guard on T <= 8 and build a second graph for the short chunks
    B, _, T, _ = q.shape
    if not torch.compiler.is_compiling() and T <= 8 and (mask is None or mask.shape == (B, 1, 1, T)):
        return _rows_together(q, k, v, mask, 16 // T)
    # Keys padded to a multiple of 8 and masked there: the softmax runs on whole vectors (13 keys padded to 16: 3x
    # faster). Always, even by 0 (the pad's copy is the one matmul would make), so a compiled graph never guards on T
    extra = -k.shape[-2] % 8
    mask = torch.ones(k.shape[-2], dtype=torch.bool, device=k.device) if mask is None else mask
    k, v, mask = F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra)), F.pad(mask, (0, extra), value=False)
    # Masked by adding the lowest finite score, not -inf: a query with no key to see gets a finite mean, not NaN
    lowest = torch.zeros(mask.shape, device=q.device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    scores = torch.add(lowest, torch.matmul(q, k.transpose(-1, -2)), alpha=q.shape[-1] ** -0.5)  # (B, nh, T, T'), fp32
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)  # (B, nh, T, hd)


def _fused_rows(q, k, v, mask):
    """attention() in one pass (support/kernels.cpp) where q, k and v are the views model.py makes of one bf16 q|k|v
    product, (B, T, 3, nh, hd), keys masked on the right or not at all, and nothing needs a gradient: (B, nh, T, hd),
    a view of (B, T, nh, hd); else None. 14-token rows, 2,048 tokens, one thread: 0.87 ms a layer against 1.86."""
    B, nh, T, hd = q.shape
    H, step = nh * hd, nh * hd * q.element_size()
    if q.dtype != torch.bfloat16 or torch.is_grad_enabled() or torch.compiler.is_compiling() or \
            not q.stride() == k.stride() == v.stride() == (T * 3 * H, hd, 3 * H, 1) or \
            (k.data_ptr() - q.data_ptr(), v.data_ptr() - q.data_ptr()) != (step, 2 * step) or \
            not q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
        return None
    if mask is None:
        lengths = torch.full((B,), T, dtype=torch.int64)
    elif mask.shape == (B, 1, 1, T) and mask.dtype == torch.bool:
        keys = mask.reshape(B, T)
        lengths = keys.sum(1)
        if int(lengths.min()) < 1 or not torch.equal(keys, torch.arange(T) < lengths[:, None]):
            return None
    else:
        return None
    y = kernels.attention_rows(q.as_strided((B * T, 3 * H), (3 * H, 1)), lengths, B, T, nh)  # the product itself
    return None if y is None else y.view(B, T, nh, hd).transpose(1, 2)


def add_norm(ln, x, y):
    """ln(x + y): the residual sum, normalised as BERT does (post-LN; ModernBERT's ln is the identity). On a CPU in bf16
    without gradients, one pass (support/kernels.cpp) whose result is rounded to bf16 once: the residual stream goes on
    in bf16, as the next product reads it (all-MiniLM-L6-v2: lowest cosine to fp32 0.999945 against torch's bf16
    0.999946, STS-B dev unchanged). 2,048 tokens at H=384, one thread, an AMX Xeon: 0.50 ms against 0.69 with an fp32
    result as well (half the bytes of a pass that memory bounds), torch's own operations 2.0."""
    if isinstance(ln, torch.nn.LayerNorm) and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) \
            and y.dtype == torch.bfloat16 and x.dim() == 2 and x.shape == y.shape and x.is_contiguous() and \
            y.is_contiguous() and ln.weight is not None and ln.bias is not None and \
            ln.weight.dtype == torch.float32 and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        out = kernels.add_layer_norm(x, y, ln.weight, ln.bias, ln.eps)
        if out is not None:
            return out
    return ln(x + y)


def _rows_together(q, k, v, mask, G: int):
    """attention() for rows of T <= 8 tokens, G at a time as one row of G*T (9 to 16), each query masked to its own
    row's keys: the same sums in a G-th of the (row, head)s, each of which costs the products and the softmax a fixed
    time (3-token rows: 3.2 ms against 5.7 a layer, 2,048 tokens, bf16; 8: 2.1 against 3.3; docs/measurements.md)."""
    B, nh, T, hd = q.shape
    n = -(-B // G) * G  # rows made a multiple of G with rows of zeros, whose outputs are dropped

    def together(x):  # (B, nh, T, hd) -> (n/G, nh, G*T, hd): views where B is a multiple of G
        x = x.transpose(1, 2) if n == B else F.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, 0, 0, n - B))
        return x.reshape(n // G, G * T, nh, hd).transpose(1, 2)

    keys = torch.ones(n, T, dtype=torch.bool, device=q.device) if mask is None else \
        F.pad(mask.reshape(B, T), (0, 0, 0, n - B), value=True)
    keys = keys.reshape(n // G, 1, 1, G * T)
    row = torch.arange(G * T, device=q.device) // T
    y = attention(together(q), together(k), together(v), keys & (row[:, None] == row[None]))  # (n/G, nh, G*T, hd)
    return y.transpose(1, 2).reshape(n, T, nh, hd)[:B].transpose(1, 2)  # (B, nh, T, hd)


# -----------------------------------------------------------------------------------------------
# oneDNN's linear layers for a CPU forward


class PackedLinear(torch.nn.Module):
    """An nn.Linear as oneDNN runs it on a CPU, its weight laid out once in oneDNN's blocked format (F.linear in bf16
    lays it out again at every call) and, where one follows, the activation applied to the fp32 sums before they are
    rounded: one pass over the output fewer, and one rounding. For inference: the weight is a copy, with no gradient."""

    def __init__(self, linear: torch.nn.Linear, dtype, activation: tuple[str, str] = ("none", "")):
        super().__init__()
        self.dtype, (self.attr, self.algorithm) = dtype, activation
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype), None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        # BERT's exact GELU in bf16 as a pass of our own over the rounded product (support/kernels.cpp), cheaper than
        # oneDNN's inside it (the product with it 2.52 ms against 3.28 at 2,048 x 1,536, one thread, an AMX Xeon):
        # the GELU torch's autocast computes, of the bf16 product (all-MiniLM-L6-v2: STS-B dev 86.73, fp32 86.72)
        self.own_gelu = activation == ("gelu", "none") and dtype == torch.bfloat16 and kernels.library() is not None

    def forward(self, x):
        x = x.to(self.dtype)  # as autocast would, where the model runs under it (add_norm's bf16 output: as it is)
        if self.own_gelu and not torch.compiler.is_compiling():
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            if y.is_contiguous() and kernels.gelu_(y):
                return y
            return F.gelu(y)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.attr, [], self.algorithm)


def fusable(act) -> tuple[str, str] | None:
    """oneDNN's name for an activation it applies inside a product: GELU, exact (BERT's) or in its tanh form."""
    if act is F.gelu:
        return "gelu", "none"
    if isinstance(act, functools.partial) and act.func is F.gelu and act.keywords == {"approximate": "tanh"}:
        return "gelu", "tanh"
    return None


# Laying the weights out costs what about 1,000 tokens' products gain by it, whatever the model's size (both scale with
# its weights; all-MiniLM-L6-v2, bf16 and fp32, Zen 4): a call with fewer runs the layers as they are (one sentence:
# 9-10 ms against 18)
PACK_FROM_TOKENS = 1024


@contextlib.contextmanager
def packed_linears(model, dtype, tokens: int = PACK_FROM_TOKENS):
    """While a model embeds `tokens` on a CPU: each nn.Linear of its layers run as a PackedLinear in `dtype` (None:
    fp32), and a feed-forward's GELU (model.FeedForward's `up` and `act`; not a gated one) applied inside the product
    before it; the model as it was afterwards. One feed-forward of all-MiniLM-L6-v2 on 2,048 tokens: 12.3-13.0 ms
    against 17.5-18.8 in bf16 (docs/measurements.md). A GPU, fp16, training, a torch without oneDNN, or fewer than
    PACK_FROM_TOKENS tokens: nothing changes."""
    applies = next(model.parameters()).device.type == "cpu" and dtype in (None, torch.float32, torch.bfloat16)
    if not applies or tokens < PACK_FROM_TOKENS or model.training or not torch.backends.mkldnn.is_available():
        yield
        return
    dtype, swapped = dtype or torch.float32, []  # (module, attribute, what it held)
    try:
        for module in list(model.layers.modules()):
            act = None if getattr(module, "glu", False) else fusable(getattr(module, "act", None))
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    swapped.append((module, name, child))
                    setattr(module, name, PackedLinear(child, dtype, act if name == "up" and act else ("none", "")))
            if act and isinstance(getattr(module, "up", None), PackedLinear):
                swapped.append((module, "act", module.act))
                module.act = _identity  # the GELU is up's now
        yield
    finally:
        for module, name, before in reversed(swapped):
            setattr(module, name, before)


def _identity(x):  # a function, as the activation it stands in for (a module there would be registered as a child)
    return x


def autocast(dtype, device: torch.device):
    """torch.autocast in `dtype` (autocast_dtype's), or nothing for fp32 (None)."""
    if dtype in (None, torch.float32):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class compute:
    """The context a forward runs in: autocast in `dtype` (autocast_dtype's; fp32, None, is no autocast at all) and
    the attention kernels of ATTENTION_KERNELS. Entered again and again (GradCache enters it once a chunk). The
    kernels are the process's, autocast is a thread's own: a thread of the caller's enters autocast() alone."""

    def __init__(self, dtype, device: torch.device):
        self.dtype, self.device = dtype, device

    def __enter__(self):
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(sdpa_kernel(list(ATTENTION_KERNELS)))
        self.stack.enter_context(autocast(self.dtype, self.device))
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)


def device_and_dtype(device: str, dtype: str):
    """--device and --dtype, for embed.py and evaluate_sts.py alike: an STS score is the score of the embeddings that
    embed.py writes. auto: bf16 on a GPU that has it, else fp16; bf16 on a CPU that multiplies it in hardware (AMX or
    AVX512-BF16: 2-3x fp32's speed, cosine to fp32 above 0.9999), else fp32."""
    device = pick_device(device)
    if dtype == "fp16" and device.type == "cpu":
        raise UserError("--dtype fp16 is for GPUs; on a CPU embeddings are computed in bf16 or fp32")
    if dtype == "bf16" and device.type == "cpu" and not cpu_has_bf16():
        say("warning: --dtype bf16: this CPU has neither AMX nor AVX512-BF16, so bf16 is emulated, about 400x slower "
            "than fp32 in matrix products; --dtype auto picks fp32 here", file=sys.stderr)
    return device, autocast_dtype(dtype, device, cpu_bf16=True)


def device_name(device: torch.device) -> str:
    """What a device is, as a person names it: the GPU's model, or the CPU's (Linux's /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"CPU ({model})" if model else "CPU"


def pick_device(name: str) -> torch.device:
    """--device: auto, cpu, cuda or cuda:N, as a device this torch has; a GPU always by its index (NCCL and DDP want
    one)."""
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: not a device this project runs on (auto, cpu, cuda, cuda:N)", code=2)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: this torch sees no GPU (torch.cuda.is_available() is False)", code=2)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)", code=2)
    return torch.device("cuda", index)


# -----------------------------------------------------------------------------------------------
# Random state and compiled graphs


def rng_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


COMPILE_FLOOR = (2, 5)  # 2.4's guards fail on every call here ("name 'FloatTrueDiv' is not defined"): a graph a chunk


def check_compile():
    """--compile on a torch that builds one graph for a run (docs/gpu.md), or one line saying which it needs."""
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < COMPILE_FLOOR:
        raise UserError(f"--compile needs torch >= {'.'.join(map(str, COMPILE_FLOOR))} (this is {torch.__version__}, "
                        "whose compiler builds a graph for every chunk); leave --compile out, or upgrade torch", code=2)


def compiled(fn):
    """torch.compile for chunks of every shape: one graph for them all (Spans gives every chunk the same kinds of
    input). Sizes that are equal by chance when a graph is traced are not taken for one size (dynamo's "duck
    sizing"): a chunk of 2 spans with 2 MLM targets would otherwise build a graph of its own."""
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "use_duck_shape"):  # torch >= 2.5
        fx_config.use_duck_shape = False
    return torch.compile(fn, dynamic=True)


def compiled_graphs() -> tuple[int, bool]:
    """(graphs torch.compile has built in this process, whether it reached its recompile limit and fell back to eager).
    Spans gives every chunk the same kinds of input, so a run builds one graph, two with GradCache (with and without
    gradients)."""
    counters = torch._dynamo.utils.counters
    gave_up = any(k.startswith("Dynamo recompile limit") for k in counters["unimplemented"])
    return counters["stats"]["unique_graphs"], gave_up


def say_compiled():
    """--compile's last line: how many graphs it built, and whether it ever gave up and ran chunks eager."""
    graphs, gave_up = compiled_graphs()
    say(f"--compile: {graphs} graph(s) compiled" + (
        "; the recompile limit was reached, and the chunks after it ran eager" if gave_up else ""))
