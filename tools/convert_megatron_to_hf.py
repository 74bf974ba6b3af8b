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

from megatron_darl.models.qwen3.conversion import (  # noqa: E402
    ConversionJob,
    megatron_to_hf_worker,
    run_job,
    staged_output_dir,
    validate_megatron_dir,
)
from megatron_darl.trainer.parallel import LocalWorkerError  # noqa: E402

PROG = "convert_megatron_to_hf"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-dir", required=True, help="checkpoint with megatron_darl.json")
    parser.add_argument("--out-dir", required=True, help="HF model dir to create")
    parser.add_argument("--tp", type=_positive, default=1, help="TP ranks to load with")
    parser.add_argument("--pp", type=_positive, default=1, help="pipeline ranks to load with")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors file size")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out-dir")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print worker tracebacks")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate_megatron_dir(args.megatron_dir, args.tp, args.pp)
        with staged_output_dir(args.out_dir, args.force) as tmp:
            job = ConversionJob(src_dir=str(Path(args.megatron_dir).resolve()), out_dir=str(tmp),
                                tp=args.tp, pp=args.pp, progress=not args.no_progress,
                                max_shard_bytes=int(args.max_shard_gb * 1024**3))
            run_job(megatron_to_hf_worker, job)
    except (ValueError, OSError, RuntimeError) as exc:
        if args.verbose and isinstance(exc, LocalWorkerError):
            print(exc.details, file=sys.stderr)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
