"""
What the GPU check needs from ../shared, packed to travel to the lent GPU machine, which does not see ../shared and
takes at most 64 MiB of the working tree: all-MiniLM-L6-v2 with its weights in fp16 (45 MB instead of 90; the check
turns them back into fp32 there, so both of section j's sides load the same weights), the 16 Gutenberg books the
check trains on, STS-B dev, and STS-B train, whose sentences bench/embed_profile.py embeds on that machine's
processor (issue 55). Laid out as ../shared is, so that DECLUTR_SHARED can point at it.

    python bench/gpu_assets.py                      # writes gpu-assets/ (ignored by git), from ../shared
    DECLUTR_SHARED=gpu-assets bash bench/gpu_check.sh            # there, with carry ["gpu-assets"] (docs/gpu.md)
    python3 bench/embed_profile.py --shared gpu-assets --threads 2 --lines 23000   # there too, on its CPU
"""
import argparse
import shutil
import sys
from pathlib import Path

import safetensors.torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import bench, shared_assets  # noqa: E402

BOOKS = 16  # gpu_check.documents() takes the first 16 books, in name order
FILES = {"model": Path("models/all-MiniLM-L6-v2"), "books": Path("data/corpus/gutenberg"),
         "stsb": Path("data/sts/stsbenchmark/sts-dev.csv"), "stsb train": Path("data/sts/stsbenchmark/sts-train.csv")}


def pack(shared: Path, out: Path) -> int:
    """Writes the assets under `out` (which must not exist); returns their bytes."""
    model = shared / FILES["model"]
    books = sorted((shared / FILES["books"]).glob("*.txt"))[:BOOKS]
    for what, path in (("all-MiniLM-L6-v2", model / "model.safetensors"), ("STS-B dev", shared / FILES["stsb"]),
                       ("STS-B train", shared / FILES["stsb train"])):
        if not path.exists():
            sys.exit(f"{path}: not found ({what}); point DECLUTR_SHARED at the shared assets")
    if len(books) < BOOKS:
        sys.exit(f"{shared / FILES['books']}: {len(books)} books, the check needs {BOOKS}")
    shutil.copytree(model, out / FILES["model"], ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = safetensors.torch.load_file(model / "model.safetensors")
    half = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}  # ids stay ints
    safetensors.torch.save_file(half, out / FILES["model"] / "model.safetensors")
    (out / FILES["books"]).mkdir(parents=True)
    for book in books:
        shutil.copy(book, out / FILES["books"] / book.name)
    (out / FILES["stsb"]).parent.mkdir(parents=True)
    for stsb in (FILES["stsb"], FILES["stsb train"]):
        shutil.copy(shared / stsb, out / stsb)
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file())


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "gpu-assets"), help="a folder that does not exist yet")
    ap.add_argument("--shared", default=shared_assets(ROOT))
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        sys.exit(f"{out}: exists; remove it or name another --out")
    size = pack(Path(args.shared), out)
    print(f"wrote {out}: {size / 2**20:.1f} MiB (with the repository, under the 64 MiB that travel)")


if __name__ == "__main__":
    main()
