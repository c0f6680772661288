"""``tadm tokenizer train``: train the byte-level BPE tokenizer (with a mask token) on a corpus."""

from __future__ import annotations

import argparse

from tadm.cli.common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer tools (train a byte-level BPE with a mask token)")
    actions = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    t = actions.add_parser(
        "train",
        help="train a byte-level BPE tokenizer on a corpus",
        description=(
            "Train a byte-level BPE (<|endoftext|> = id 0 as BOS/EOS, <|mask|> = the last id) and save "
            "tokenizer.json + tadm_tokenizer.json into --out; use it with data.tokenizer=DIR."
        ),
    )
    t.add_argument("--source", default="brown", help="corpus: 'brown' (bundled), a .txt/.jsonl file or directory")
    t.add_argument("--vocab-size", type=positive_int, default=4096, metavar="V", help="ids including the mask")
    t.add_argument("--out", required=True, metavar="DIR", help="directory to write the tokenizer into")
    t.add_argument("--text-field", default="text", help="JSON field holding the text (.jsonl sources)")
    t.add_argument("--min-frequency", type=positive_int, default=2, metavar="N", help="minimum count of a merge")
    t.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from tadm.training.data import load_texts
    from tadm.training.tokenization import train_bpe_tokenizer

    texts = load_texts(args.source, text_field=args.text_field)
    tok = train_bpe_tokenizer(texts, args.vocab_size, save_dir=args.out, min_frequency=args.min_frequency)
    print(
        f"saved {tok.name} tokenizer to {args.out}: vocab_size {tok.vocab_size} (mask included), "
        f"bos/eos id {tok.bos_id}, mask id {tok.mask_id}"
    )
    return 0
