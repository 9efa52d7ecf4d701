"""
support/device.py: where the numbers are computed, and in what. Token rows padded into a batch and copied to the
device without waiting, the next item prepared while this one runs, the device and precision that --device and
--dtype mean, the attention kernels a forward may use, the random state a GradCache replay restores, and what
torch.compile built (torch's CPU threads: support/threads.py; oneDNN's layers on a CPU: support/cpu_layers.py).
"""
import concurrent.futures
import contextlib
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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
    onednn: bool = flag(True, "on a CPU in bf16, where the processor runs them, the layers' linear products as "
                              "oneDNN's, weights laid out once and GELU inside (support/cpu_layers.py); "
                              "--no-onednn: model.py's own layers, as written")


# oneDNN's instruction sets with bf16 products in hardware, as ONEDNN_MAX_CPU_ISA names them (its documentation);
# capped below them (AVX2, AVX512_CORE, ...), oneDNN runs bf16 as a processor without them would
BF16_ISAS = {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
             "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT"}


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX, or AVX512-BF16) and oneDNN may use it (ONEDNN_MAX_CPU_ISA,
    as a test runs as a lesser processor); elsewhere oneDNN emulates it, about 400x slower than fp32 (a 2048^2
    matmul on an AVX2-only AMD EPYC: 0.27 against 113 GFLOP/s)."""
    asks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch >= 2.5 can tell; 2.4 cannot: fp32
    return not onednn_capped() and any(getattr(torch.cpu, ask, lambda: False)() for ask in asks)


def onednn_capped() -> str:
    """ONEDNN_MAX_CPU_ISA (or its older name) where it caps oneDNN below bf16's instructions, else ""."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    return "" if cap.upper() in BF16_ISAS else cap


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


def runs_as(device: torch.device, dtype, asked: str, swapped: bool, why_not: str = "") -> str:
    """What a forward runs, in one line (embed.py and evaluate_sts.py say it, as gpt-fast says its mode): the device,
    the precision and why --dtype auto chose it, and whether oneDNN's products were swapped in
    (support/cpu_layers.py), or why not (`why_not`, support.cpu_layers.chosen's)."""
    where = "the CPU" if device.type == "cpu" else f"{device} ({device_name(device)})"
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    why = ""
    if asked == "auto" and device.type == "cpu":
        why = (" (--dtype auto: this CPU multiplies bf16, with AMX or AVX512-BF16)" if dtype else
               f" (--dtype auto: ONEDNN_MAX_CPU_ISA={onednn_capped()} leaves oneDNN no bf16 instructions)"
               if onednn_capped() else " (--dtype auto: this CPU has neither AMX nor AVX512-BF16 for bf16)")
    elif asked == "auto":
        why = " (--dtype auto)"
    if device.type != "cpu":
        layers = ""
    elif swapped:
        layers = ", oneDNN's products swapped in (support/cpu_layers.py; --no-onednn: model.py's layers)"
    else:
        layers = ", model.py's layers as written" + (f" ({why_not})" if why_not else "")
    return f"on {where} in {precision}{why}{layers}"


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
    """torch.compile for chunks of every shape: one graph for them all (support.chunks.Chunks gives every chunk the
    same kinds of input). Sizes that are equal by chance when a graph is traced are not taken for one size (dynamo's
    "duck sizing"): a chunk of 2 spans with 2 MLM targets would otherwise build a graph of its own."""
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "use_duck_shape"):  # torch >= 2.5
        fx_config.use_duck_shape = False
    return torch.compile(fn, dynamic=True)


def compiled_graphs() -> tuple[int, bool]:
    """(graphs torch.compile has built in this process, whether it reached its recompile limit and fell back to eager).
    support.chunks.Chunks gives every chunk the same kinds of input, so a run builds one graph, two with GradCache
    (with and without gradients)."""
    counters = torch._dynamo.utils.counters
    gave_up = any(k.startswith("Dynamo recompile limit") for k in counters["unimplemented"])
    return counters["stats"]["unique_graphs"], gave_up


def say_compiled():
    """--compile's last line: how many graphs it built, and whether it ever gave up and ran chunks eager."""
    graphs, gave_up = compiled_graphs()
    say(f"--compile: {graphs} graph(s) compiled" + (
        "; the recompile limit was reached, and the chunks after it ran eager" if gave_up else ""))
