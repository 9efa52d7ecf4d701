"""
support/kernels.py: support/kernels.cpp built and called. The first forward that can use it (a CPU, bf16, no
gradients) builds it with the system's C++ compiler (`$CXX`, else c++ or g++; about a second) for this processor
into $XDG_CACHE_HOME/declutr/kernels, once a machine; later processes load it. With no compiler, a failed build, or
DECLUTR_CPU_KERNELS=0, nothing is built and torch's operations run as before (support/device.py decides where).
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from support.files import cache_dir

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=fast",
         "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"]
_lock, _loaded = threading.Lock(), {}  # the library once a process: {"lib": ctypes.CDLL or None}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "")) or shutil.which("c++") or shutil.which("g++")


def _processor() -> str:
    """What -march=native builds for: a library built on another processor (a shared home folder) may not run here."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), info[:4096])
    except OSError:
        return platform.processor() + platform.machine()


def _build(cxx: str) -> Path:
    """The library for this source, compiler and processor: built into the cache unless already there. Written under
    a temporary name and renamed, so a process that loads it never sees half a file."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(encoding="utf-8"), cxx, version, *FLAGS, _processor()])
                         .encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels"
    path = folder / f"kernels-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".building-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def library():
    """The built kernels (ctypes), or None where they cannot be had; tried once a process."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def _load():
    cxx = compiler()
    if os.environ.get("DECLUTR_CPU_KERNELS", "1") == "0" or cxx is None:
        return None
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, subprocess.SubprocessError) as e:  # a compiler that cannot build it: torch's operations, said once
        why = getattr(e, "stderr", None) or str(e)
        print(f"declutr: the CPU kernels did not build with {cxx} ({why.strip().splitlines()[-1][:200]}); torch's "
              "operations run instead (DECLUTR_CPU_KERNELS=0 skips trying)", file=sys.stderr, flush=True)
        return None
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.attention_rows.restype = lib.add_layer_norm.restype = ctypes.c_int
    lib.attention_rows.argtypes = [P, P, P, I64, I64, I64, I64, ctypes.c_float]
    lib.add_layer_norm.argtypes = [P, ctypes.c_int, P, P, P, ctypes.c_float, P, I64, I64]
    lib.gelu_bf16.restype, lib.gelu_bf16.argtypes = ctypes.c_int, [P, I64]
    return lib


def attention_rows(qkv, lengths, B: int, T: int, n_head: int):
    """softmax(q k^T / sqrt(hd)) v of each row's first lengths[b] keys, for a (B*T, 3H) bf16 q|k|v product -> (B*T, H)
    bf16, heads side by side; None where the kernels are not built or not for this shape. The kernel holds no GIL:
    batches on several threads run at once."""
    lib, H = library(), qkv.shape[1] // 3
    if lib is None:
        return None
    y = torch.empty(B * T, H, dtype=torch.bfloat16)
    failed = lib.attention_rows(qkv.data_ptr(), y.data_ptr(), lengths.data_ptr(), B, T, n_head, H // n_head,
                                (H // n_head) ** -0.5)
    return None if failed else y


def add_layer_norm(x, y, weight, bias, eps: float):
    """LayerNorm(x + y) for (N, H) fp32 or bf16 x and bf16 y, fp32 weight and bias -> (N, H) bf16, summed and
    normalised in fp32; None where the kernels are not built or not for this H."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    failed = lib.add_layer_norm(x.data_ptr(), int(x.dtype == torch.bfloat16), y.data_ptr(), weight.data_ptr(),
                                bias.data_ptr(), eps, out.data_ptr(), x.shape[0], x.shape[1])
    return None if failed else out


def gelu_(x) -> bool:
    """GELU in place on a contiguous bf16 tensor (BERT's exact one, Phi within 3.3e-5); False where the kernels are not
    built, and x as it was."""
    lib = library()
    return lib is not None and lib.gelu_bf16(x.data_ptr(), x.numel()) == 0
