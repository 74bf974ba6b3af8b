"""Convert a megatron_darl (dist_checkpointing) Qwen3 checkpoint back to Hugging Face.

    python tools/convert_megatron_to_hf.py --megatron-dir DIR --out-dir DIR [--tp N --pp M]

Writes sharded safetensors with ``model.safetensors.index.json``, ``config.json`` and the
tokenizer files, loadable by ``transformers.AutoModelForCausalLM.from_pretrained``. ``--tp/--pp``
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
    add_common_args(parser, tp_help="TP ranks to load with", pp_help="pipeline ranks to load with")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tools.conversion import megatron_to_hf_worker, run_conversion, validate_megatron_dir  # torch: after parsing

    code = run_conversion(PROG, args, args.megatron_dir, validate_megatron_dir,
                          megatron_to_hf_worker, src_flag="--megatron-dir",
                          max_shard_bytes=int(args.max_shard_gb * 1024**3))
    if code == 0:
        print(f"wrote {args.out_dir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
