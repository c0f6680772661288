"""``tadm convert``: a checkpoint released by another code base -> a tadm model directory.

    tadm convert SOURCE OUT [--weights ema|live] [--num-heads N] [--time-conditioning on|off]
                 [--max-seq-len L] [--list-weights] [--overwrite]

SOURCE is a released MDLM-family checkpoint (:mod:`tadm.nn.released_mdlm`): a Hub-layout directory
or Hub id (``config.json`` + ``model.safetensors``, e.g. ``kuleshov-group/mdlm-owt``) or a Lightning
``.ckpt``. The command says what it loaded (layout, weights, sizes, the number of tensors mapped key by
key) and writes OUT as a tadm ``mdlm`` model (``config.json`` + ``model.safetensors``), which
``tadm.nn.load_model``, ``tadm sample --model`` and ``base.backbone=mdlm`` read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tadm.cli.common import CLIError, nonempty, output_dir, positive_int
from tadm.nn.hub import CONFIG_NAME, WEIGHTS_NAME
from tadm.nn.released_mdlm import load_released_mdlm

_SWITCH = {"on": True, "off": False}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert a released MDLM-family checkpoint (Hub layout or Lightning .ckpt) to a tadm model",
        description="Read a checkpoint in the layout MDLM's code releases (kuleshov-group/mdlm models/dit.py: a Hub "
                    "directory or id with config.json + model.safetensors, or a Lightning .ckpt), map every weight "
                    "into tadm's MDLM with its shape checked, say what was loaded and save it as a tadm model.")
    p.add_argument("source", type=nonempty, metavar="SOURCE", help="Hub-layout directory, Hub id, or .ckpt file")
    p.add_argument("out", type=output_dir, metavar="OUT", help="directory to write the tadm model into")
    p.add_argument("--weights", choices=("ema", "live"), default=None,
                   help="a .ckpt's EMA weights (default when present; what the released Hub weights are) or its "
                        "training weights")
    p.add_argument("--num-heads", type=positive_int, default=None, metavar="N",
                   help="attention heads, when the checkpoint's config does not say (MDLM-OWT: 12)")
    p.add_argument("--time-conditioning", choices=tuple(_SWITCH), default=None,
                   help="override the config's time conditioning")
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="L",
                   help="override the config's model length")
    p.add_argument("--list-weights", action="store_true", help="print every weight's released name -> tadm name")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not args.overwrite and any((out / name).exists() for name in (CONFIG_NAME, WEIGHTS_NAME)):
        raise CLIError(f"{out} already holds a model; pass --overwrite to replace it, or choose another OUT")
    loaded = load_released_mdlm(args.source, weights=args.weights, num_heads=args.num_heads,
                                time_conditioning=_SWITCH.get(args.time_conditioning),
                                max_seq_len=args.max_seq_len)
    for line in loaded.describe():
        print(line)
    if args.list_weights:
        for line in loaded.mapping_lines():
            print(line)
    loaded.model.save_pretrained(out)
    print(f"wrote {out} (tadm mdlm model: {CONFIG_NAME} + {WEIGHTS_NAME}); load it with tadm.nn.load_model")
    return 0
