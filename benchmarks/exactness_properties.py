"""Property-based exactness at scale: random float64 cases (family, batch, length, padding side and
lengths, packed documents, prompt boundary, chunk and head-chunk sizes, tied heads, sliding
windows), each checked against plain autograd on every parameter gradient.

    python benchmarks/exactness_properties.py --cases 2000 --out benchmarks/results/exactness

Writes summary.json (cases run, failures, worst error, how the cases spread over the options).
The CI test (tests/testing/test_exact_properties.py) runs 200 cases of the same strategy.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from tqdm import tqdm

from leanbp.testing import check_case, exact_cases

TOL = 1e-12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--out", default="benchmarks/results/exactness")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = []
    bar = tqdm(total=args.cases, desc="exact cases", unit="case")

    @seed(args.seed)
    @settings(max_examples=args.cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(exact_cases())
    def run(case):
        error = check_case(case)
        results.append((case, error))
        bar.update(1)
        bar.set_postfix(worst=f"{max(e for _, e in results):.1e}")

    t0 = time.time()
    failure = None
    try:
        run()
    except Exception as e:  # hypothesis re-raises the first (shrunk) failure
        failure = repr(e)
    bar.close()
    failures = [(c, e) for c, e in results if not e <= TOL]
    worst_case, worst = max(results, key=lambda r: r[1])
    summary = {
        "cases": len(results), "tolerance": TOL, "failures": len(failures), "worst_error": worst,
        "worst_case": worst_case.__dict__, "seconds": round(time.time() - t0, 1), "hypothesis_failure": failure,
        "spread": {name: dict(collections.Counter(str(getattr(c, name)) for c, _ in results))
                   for name in ("family", "padding", "batch", "tied")},
        "sliding_window_cases": sum(c.window is not None for c, _ in results),
        "command": f"python benchmarks/exactness_properties.py --cases {args.cases} --seed {args.seed}",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("cases", "failures", "worst_error", "seconds")}))


if __name__ == "__main__":
    main()
