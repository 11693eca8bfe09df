"""Summarises bench/ab_run.sh: per precision, new/old score time per shape, each side's fastest of
its runs (the runs are ABBA-ordered, so neither side owns the cooler GPU), geomean and worst.
Usage: python3 bench/ab_compare.py OUT_DIR"""

import glob
import json
import math
import sys


def fastest(paths):
    best = {}
    for path in paths:
        for shape in json.load(open(path))["shapes"]:
            result = shape.get("results", {}).get("persistent")
            if result and result.get("score_us"):
                name = shape["name"]
                best[name] = min(best.get(name, math.inf), result["score_us"])
    return best


def main(out):
    for precision in ("exact", "fp8"):
        old = fastest(glob.glob(f"{out}/ab_old_{precision}_*.json"))
        new = fastest(glob.glob(f"{out}/ab_new_{precision}_*.json"))
        names = sorted(set(old) & set(new))
        if not names:
            print(f"{precision}: no runs")
            continue
        ratio = {name: new[name] / old[name] for name in names}
        geomean = math.exp(sum(math.log(r) for r in ratio.values()) / len(ratio))
        worst = max(names, key=ratio.get)
        over = sorted((n for n in names if ratio[n] > 1.05), key=ratio.get, reverse=True)
        print(f"{precision}: {len(names)} shapes, new/old geomean {geomean:.3f}, "
              f"worst {worst} {ratio[worst]:.3f}, best {min(ratio.values()):.3f}, "
              f"above 1.05: {len(over)} {[(n, round(ratio[n], 3)) for n in over]}")


if __name__ == "__main__":
    main(sys.argv[1])
