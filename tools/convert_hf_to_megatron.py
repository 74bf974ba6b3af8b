"""Convert a Hugging Face Qwen3 checkpoint to a Megatron dist_checkpointing checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out-dir DIR --tp N --pp M [--dtype bf16]

The output reloads at any TP/PP (``--tp/--pp`` choose how many local ranks convert and the
layout recorded in ``megatron_darl.json``); it also carries the HF ``config.json`` and tokenizer
files so ``tools/convert_megatron_to_hf.py`` can go back. Inputs are validated before any
work; on error one line goes to stderr, the exit code is 1 and no output directory is left.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.conversion_args import DTYPE_NAMES, add_common_args, new_parser  # noqa: E402 (no torch)

PROG = "convert_hf_to_megatron"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser(PROG, __doc__)
    parser.add_argument("--hf-dir", required=True, help="HF model dir (config.json + safetensors)")
    parser.add_argument("--out-dir", required=True, help="Megatron checkpoint dir to create")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32", help="parameter dtype of the checkpoint")
    add_common_args(parser, tp_help="tensor-parallel ranks", pp_help="pipeline-parallel ranks")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.conversion import hf_to_megatron_worker, run_conversion, validate_hf_dir  # torch: after parsing

    code = run_conversion(PROG, args, args.hf_dir, validate_hf_dir, hf_to_megatron_worker,
                          src_flag="--hf-dir", dtype=args.dtype)
    if code == 0:
        print(f"wrote {args.out_dir} (tp={args.tp}, pp={args.pp}, dtype={args.dtype})")
    return code


if __name__ == "__main__":
    sys.exit(main())
