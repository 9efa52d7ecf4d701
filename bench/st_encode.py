"""
sentence-transformers' side of bench/embed_speed.py: one whole process that loads a model with one of its backends,
encodes a file of lines with its defaults (batch 32) and saves the rows; and, once beforehand, the exported models
those backends read. Run with the Python of a virtual environment made from bench/requirements-backends.txt (its
ONNX and OpenVINO backends need an older transformers than the tests' oracle).

    python bench/st_encode.py prepare MODEL_COPY                         # onnx/, its int8 model, openvino/
    python bench/st_encode.py encode MODEL lines.txt out.npy             # PyTorch, fp32 (its default)
    python bench/st_encode.py encode MODEL lines.txt out.npy --bf16      # PyTorch, bf16 weights
    python bench/st_encode.py encode MODEL lines.txt out.npy --backend onnx [--int8]
    python bench/st_encode.py encode MODEL lines.txt out.npy --backend openvino
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.cli import bench, optional  # noqa: E402


def int8_config() -> str:
    """The instruction set sentence-transformers' int8 export is made for: the best this processor has."""
    flags = Path("/proc/cpuinfo").read_text().split()
    return next((isa for isa, flag in (("avx512_vnni", "avx512_vnni"), ("avx512", "avx512f"), ("avx2", "avx2"))
                 if flag in flags), "arm64")


def int8_file() -> str:
    """The int8 model prepare() writes and encode --int8 reads, named by us: sentence-transformers' own name says
    the weights' type too, which its quantisation config picks per instruction set (model_quint8_avx2.onnx on an
    AVX2 processor, model_qint8_avx512_vnni.onnx on another)."""
    return f"onnx/model_int8_{int8_config()}.onnx"


def prepare(model: Path):
    """Export the model for the ONNX backend (fp32, then dynamically quantised to int8 for this processor) and for
    OpenVINO, into the model's own folder (a copy: the shared assets are read-only)."""
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    onnx = SentenceTransformer(str(model), backend="onnx", device="cpu")
    onnx.save_pretrained(str(model))
    suffix = Path(int8_file()).stem.removeprefix("model_")  # the exported file: onnx/model_{suffix}.onnx
    export_dynamic_quantized_onnx_model(onnx, int8_config(), str(model), file_suffix=suffix)
    try:
        SentenceTransformer(str(model), backend="openvino", device="cpu").save_pretrained(str(model))
    except Exception as e:  # OpenVINO did not install or export here: its arm is left out
        print(f"openvino: not prepared ({type(e).__name__}: {e})", file=sys.stderr)


def encode(a):
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs = {}
    if a.bf16:
        kwargs["model_kwargs"] = {"torch_dtype": torch.bfloat16}
    if a.int8:
        kwargs["model_kwargs"] = {"file_name": int8_file()}
    model = SentenceTransformer(a.model, backend=a.backend, device="cpu", **kwargs)
    lines = Path(a.input).read_text(encoding="utf-8").splitlines()
    np.save(a.output, model.encode(lines).astype(np.float32))


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare").add_argument("model")
    enc = sub.add_parser("encode")
    enc.add_argument("model")
    enc.add_argument("input")
    enc.add_argument("output")
    enc.add_argument("--backend", default="torch", choices=["torch", "onnx", "openvino"])
    enc.add_argument("--bf16", action="store_true")
    enc.add_argument("--int8", action="store_true")
    a = ap.parse_args()
    optional("sentence_transformers", "-r requirements-dev.txt, or bench/requirements-backends.txt")
    prepare(Path(a.model)) if a.cmd == "prepare" else encode(a)


if __name__ == "__main__":
    main()
