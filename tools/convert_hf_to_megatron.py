"""Convert a Hugging Face Qwen3 checkpoint to a Megatron dist_checkpointing checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out-dir DIR --tp N --pp M \
        [--dtype bf16|fp32]

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

from megatron_darl.models.qwen3.conversion import (  # noqa: E402
    DTYPES,
    ConversionJob,
    hf_to_megatron_worker,
    run_job,
    staged_output_dir,
    validate_hf_dir,
)
from megatron_darl.trainer.parallel import LocalWorkerError  # noqa: E402

PROG = "convert_hf_to_megatron"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="HF model dir (config.json + safetensors)")
    parser.add_argument("--out-dir", required=True, help="Megatron checkpoint dir to create")
    parser.add_argument("--tp", type=_positive, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=_positive, default=1, help="pipeline-parallel ranks")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out-dir")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="print worker tracebacks")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate_hf_dir(args.hf_dir, args.tp, args.pp)
        with staged_output_dir(args.out_dir, args.force) as tmp:
            job = ConversionJob(src_dir=str(Path(args.hf_dir).resolve()), out_dir=str(tmp),
                                tp=args.tp, pp=args.pp, dtype=args.dtype,
                                progress=not args.no_progress)
            run_job(hf_to_megatron_worker, job)
    except (ValueError, OSError, RuntimeError) as exc:
        if args.verbose and isinstance(exc, LocalWorkerError):
            print(exc.details, file=sys.stderr)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} (tp={args.tp}, pp={args.pp}, dtype={args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
