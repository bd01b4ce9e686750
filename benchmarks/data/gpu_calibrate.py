"""Fit a cluster profile to the GPU this runs on (``coplan calibrate --device cuda --procs 1``
through its Python API, so the device needs no command-line extras), for the GPU benchmark's second
pricing of each run (``bench_gpu.py all --profile``):

    PYTHONPATH=. python3 benchmarks/data/gpu_calibrate.py OUT.json [--quick]

A noisy fit is still written (the residual check off): it is a second opinion beside the preset's.
The fitted cluster, its residuals and every measurement behind it are printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

from coplan.hardware.calibrate import calibrate, write_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    cal = calibrate("cuda", procs=1, quick=args.quick, max_residual=None)
    write_profile(cal, args.out)
    json.dump(cal.to_dict(), sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main()
