"""Profiles on a GPU: a fused norm's forward + backward, then generate() unpatched and patched (device time per
kernel, host time per function).

    python scripts/profile_gpu.py --model llama-3.2-1b-shape --prompt-len 2048 --decode-tokens 16

Exit status: 0 (also without a GPU, after saying so), 2 bad input. The work is done by
harness.profile_gpu; this file only reads the command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Lets the script run from a checkout that was not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_rmsnorm.tools import cli  # noqa: E402  (imports no torch)


def _main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(prog="profile_gpu.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b-shape", help="preset, save_pretrained dir or Hub id")
    parser.add_argument("--prompt-len", type=cli.at_least(1), default=2048)
    parser.add_argument("--decode-tokens", type=cli.at_least(2), default=16)
    parser.add_argument("--norm-shape", type=cli.at_least(1), nargs=2, default=[4096, 2048],
                        metavar=("ROWS", "HIDDEN"),
                        help="shape of the profiled forward + backward calls (default 4096 2048)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("profile_gpu.py needs a CUDA (or ROCm) GPU and none is available: nothing to profile.")
        return cli.EXIT_OK
    from hf_rmsnorm.ops import backend

    backend.configure("cuda")
    from harness.profile_gpu import profile_backward, profile_generate

    profile_backward(*args.norm_shape)
    profile_generate(args.model, args.prompt_len, args.decode_tokens)
    return cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Runs the profile; returns the exit status."""
    return cli.run("profile_gpu.py", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
