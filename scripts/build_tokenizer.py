"""Train the bundled byte-level BPE tokenizer on the bundled corpus (reproducible: same corpus -> same file).

    PYTHONPATH=src .venv/bin/python scripts/build_tokenizer.py

Writes src/paraseek/assets/tokenizer/tokenizer.json: 2048 entries exactly (the tiny test models have vocab_size 2048),
ids 0 and 1 are the special tokens "<|bos|>" and "<|eos|>" (eos separates documents in the training stream).
"""

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "src" / "paraseek" / "assets"
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>"]


def build(corpus: Path, vocab_size: int) -> Tokenizer:
    files = sorted(corpus.glob("*.txt"))
    if not files:
        raise SystemExit(f"no .txt files in {corpus}")
    # GPT-2 style byte-level BPE: every byte has a token, so any text encodes without <unk>.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even those the corpus lacks
        show_progress=False,
    )
    # Feed files in sorted order, one document each, so the merge counts (and ties) are the same every run.
    tok.train_from_iterator((f.read_text(encoding="utf-8") for f in files), trainer, length=len(files))
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}: the corpus is too small")
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=ASSETS / "corpus")
    ap.add_argument("--out", type=Path, default=ASSETS / "tokenizer" / "tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=2048)
    args = ap.parse_args()
    tok = build(args.corpus, args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out), pretty=False)
    print(f"wrote {args.out} ({tok.get_vocab_size()} tokens, {args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
