"""``tadm tokenizer train``: train the byte-level BPE tokenizer (with a mask token) on a corpus."""

from __future__ import annotations

import argparse
from pathlib import Path

from tadm.cli.common import CLIError, nonempty, output_dir, positive_int
from tadm.training.provenance import read_provenance, train_recorded_tokenizer
from tadm.training.tokenization import META_FILENAME, TOKENIZER_FILENAME


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer tools (train a byte-level BPE with a mask token)")
    actions = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION")
    t = actions.add_parser(
        "train",
        help="train a byte-level BPE tokenizer on a corpus",
        description=(
            "Train a byte-level BPE (<|endoftext|> = id 0 as BOS/EOS, <|mask|> = the last id) and save "
            "tokenizer.json + tadm_tokenizer.json + tokenizer_provenance.json (what it was trained on) into "
            "--out; use it with data.tokenizer=DIR. An existing tokenizer in --out is replaced only with --overwrite."
        ),
    )
    t.add_argument("--source", type=nonempty, default="brown",
                   help="corpus: 'brown' (bundled, the default), a .txt/.jsonl file or directory")
    t.add_argument("--vocab-size", type=positive_int, default=4096, metavar="V", help="ids including the mask (default: 4096)")
    t.add_argument("--out", type=output_dir, required=True, metavar="DIR", help="directory to write the tokenizer into")
    t.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSON field holding the text (.jsonl, Parquet and Arrow sources; default: text)")
    t.add_argument("--min-frequency", type=positive_int, default=2, metavar="N", help="minimum count of a merge (default: 2)")
    t.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --out")
    t.set_defaults(func=run_train)


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse a directory holding a tokenizer as --out unless --overwrite (a file is refused by its type)."""
    if overwrite or not any((out / name).exists() for name in (TOKENIZER_FILENAME, META_FILENAME)):
        return
    record = read_provenance(out)
    what = f" (trained on {record.get('source')!r}, vocab size {record.get('vocab_size')})" if record else ""
    raise CLIError(f"--out {str(out)!r} already holds a tokenizer{what}; pass --overwrite to replace it, "
                   "or choose another --out")


def run_train(args: argparse.Namespace) -> int:
    _check_out(Path(args.out), args.overwrite)
    tok = train_recorded_tokenizer(args.source, args.vocab_size, args.out, text_field=args.text_field,
                                   min_frequency=args.min_frequency)
    print(
        f"saved {tok.name} tokenizer to {args.out}: vocab_size {tok.vocab_size} (mask included), "
        f"bos/eos id {tok.bos_id}, mask id {tok.mask_id}"
    )
    return 0
