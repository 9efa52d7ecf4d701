"""
support/model_tools.py: `python model.py info | convert | scratch`, the tools around the encoder: a checkpoint's
shape, a pytorch_model.bin converted to safetensors, a random-init model with a BPE tokenizer trained on a corpus.
What they need of model.py is handed in.
"""
import argparse
from pathlib import Path

from support import demo, hub
from support.cli import OneLineParser
from support.corpus import document_texts
from support.files import check_out_folder


def run(argv, doc: str, *, load_pretrained, save_pretrained, scratch_encoder):
    """model.py's main: the sub-command argv names, with model.py's loader, saver and scratch_encoder."""
    args = parser(doc).parse_args(argv)
    if args.cmd == "info":
        model, _ = load_pretrained(args.model)
        c, n = model.config, sum(p.numel() for p in model.parameters())
        print(f"{args.model}: {c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
              f"{c.num_attention_heads} heads, vocab {c.vocab_size}, up to {c.max_tokens} tokens, "
              f"{n / 1e6:.1f}M parameters")
    elif args.cmd == "convert":
        out = hub.convert_bin(args.model, args.out)
        load_pretrained(str(out))  # proves the result loads
        print(f"wrote {out / 'model.safetensors'}")
    else:
        out = check_out_folder(Path(args.out), args.overwrite)
        texts = document_texts(args.corpus)
        model, tok = demo.from_scratch(scratch_encoder, args.shape, texts, args.seed, quiet=False)
        save_pretrained(model, tok, out)
        print(f"wrote {out}: {args.shape}, vocab {model.config.vocab_size}")


def parser(doc: str) -> argparse.ArgumentParser:
    """model.py's sub-commands: info, convert, scratch."""
    ap = OneLineParser(prog="model.py", description=doc,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="load a checkpoint and print its shape").add_argument("model")
    cv = sub.add_parser("convert", help="pytorch_model.bin -> model.safetensors (weights_only unpickling)")
    cv.add_argument("model", help="local directory, or hub id whose repo ships only pytorch_model.bin")
    cv.add_argument("--out", help="output directory (default: the model's own directory)")
    sc = sub.add_parser("scratch", help="random init of a named shape, BPE tokenizer trained on --corpus",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sc.add_argument("--shape", default="tiny", choices=list(demo.SHAPES), help="named random-init shape")
    sc.add_argument("--corpus", nargs="+", required=True, help=".txt/.jsonl files (optionally .gz) or folders")
    sc.add_argument("--out", required=True, help="directory to write the checkpoint into")
    sc.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation")
    sc.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    return ap
