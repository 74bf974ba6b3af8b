"""Convert a megatron_darl (dist_checkpointing) Qwen3 checkpoint back to Hugging Face.

    python tools/convert_megatron_to_hf.py --megatron-dir DIR --out-dir DIR [--tp N --pp M]

``--megatron-dir`` is a training checkpoint (``runs/<run>/checkpoints/step_NNNNNN``) or one of
``convert_hf_to_megatron.py``. Writes sharded safetensors with ``model.safetensors.index.json``,
``config.json`` and the tokenizer files the checkpoint carries, loadable by
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``. A checkpoint without tokenizer files
is refused in one line naming it (an HF dir without them loads as an empty tokenizer), unless
``--tokenizer-dir`` names the HF model whose tokenizer to take. ``--tp/--pp``
(default 1/1) choose how many local ranks load the checkpoint (any layout works: the checkpoint
reshards on load). On error one line goes to stderr, exit code 1, nothing is left behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.conversion_args import add_common_args, new_parser  # noqa: E402 (no torch)

PROG = "convert_megatron_to_hf"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser(PROG, __doc__)
    parser.add_argument("--megatron-dir", required=True, help="checkpoint with megatron_darl.json")
    parser.add_argument("--out-dir", required=True, help="HF model dir to create")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="largest safetensors file, in GiB")
    parser.add_argument("--tokenizer-dir", default="",
                        help="take the tokenizer files from this HF model dir (a checkpoint saved without them)")
    add_common_args(parser, tp_help="TP ranks to load with", pp_help="pipeline ranks to load with")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.conversion import megatron_to_hf_worker, run_conversion, validate_megatron_dir  # torch: after parsing

    def validate(src, tp, pp):
        return validate_megatron_dir(src, tp, pp, tokenizer_dir=args.tokenizer_dir)

    tokenizer_dir = str(Path(args.tokenizer_dir).resolve()) if args.tokenizer_dir else ""
    code = run_conversion(PROG, args, args.megatron_dir, validate, megatron_to_hf_worker,
                          src_flag="--megatron-dir", max_shard_bytes=int(args.max_shard_gb * 1024**3),
                          tokenizer_dir=tokenizer_dir)
    if code == 0:
        print(f"wrote {args.out_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
