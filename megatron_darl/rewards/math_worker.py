"""Helper process for ``math_pool``: math-verify checks in a main thread, one JSON line each.

Reads ``{"response", "reference", "cfg"}`` lines on stdin and answers each with
``{"reward": float}`` or ``{"error": "ValueError", "message": str}``; exits at end of input.
"""

import json
import sys

from megatron_darl.rewards.math_answer import MathRewardConfig, verify_inline


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        cfg = MathRewardConfig(**{**request["cfg"], "isolation": "inline"})
        try:
            reply = {"reward": verify_inline(request["response"], request["reference"], cfg)}
        except ValueError as exc:
            reply = {"error": "ValueError", "message": str(exc)}
        except Exception as exc:  # any other verifier failure is a miss, as inline
            reply = {"reward": 0.0, "note": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
