#!/usr/bin/env python3
"""Same-run A/B of two builds from the JSON files of `msaidx bench`, `msaidx bench --decode` or
`msaidx e2e`: B / A per entry (the mean of each side's runs, so A B B A orders count), then the
geomean, range and how many entries B made faster, per measured field.

usage: python3 bench/ab_compare.py A=a1.json[,a2.json...] B=b1.json[,b2.json...]
                                   [--backend persistent] [--by FIELD] [--rows]

  bench    per shape of --backend (default persistent): score_us, topk_us, call_us, fused_us
  decode   per configuration: layer_us_memset, layer_us_read, score_us_memset, score_us_read
  e2e      per configuration of --backend (default auto): ms_per_forward, fused_ms_per_forward
--by groups the geomeans by an entry key as well (bench: max_kv or heads; decode: dtype,
requests or context; e2e: tp, prefill or context). --rows prints every entry.
"""
import argparse
import json
import math
import statistics
import sys

FIELDS = {
    "bench": ("score_us", "topk_us", "call_us", "fused_us"),
    "decode": ("layer_us_memset", "layer_us_read", "score_us_memset", "score_us_read"),
    "e2e": ("ms_per_forward", "fused_ms_per_forward"),
}


def kind_of(data):
    if "shapes" in data:
        return "bench"
    if "rows" in data:
        return "decode"
    if "configs" in data:
        return "e2e"
    raise SystemExit("ab_compare: not a JSON of msaidx bench, bench --decode or e2e")


def entries(data, kind, backend):
    """{key: (attributes, {field: value})} of one file."""
    out = {}
    if kind == "bench":
        for s in data["shapes"]:
            r = s["results"].get(backend or "persistent")
            if r:
                out[s["name"]] = ({"max_kv": s["max_kv"], "heads": s["heads"]}, r)
    elif kind == "decode":
        for r in data["rows"]:
            key = (r["dtype"], r["heads"], r["requests"], r["context"])
            out[key] = ({"dtype": r["dtype"], "heads": r["heads"], "requests": r["requests"],
                         "context": r["context"]}, r)
    else:
        for c in data["configs"]:
            r = c["results"].get(backend or "auto")
            if r and r.get("state") == "ok":
                key = (c["tp"], c["prefill"], c["context"])
                out[key] = ({"tp": c["tp"], "prefill": c["prefill"], "context": c["context"]}, r)
    return out


def load(side):
    name, _, paths = side.partition("=")
    if not paths:
        raise SystemExit(f"ab_compare: {side!r}: expected NAME=file.json[,file.json...]")
    files = [json.load(open(p)) for p in paths.split(",")]
    kinds = {kind_of(f) for f in files}
    if len(kinds) != 1:
        raise SystemExit(f"ab_compare: {name}: files of different tools")
    return name, kinds.pop(), files


def geomean(values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


def mean_field(runs, key, field):
    values = [run[key][1].get(field) for run in runs if key in run]
    values = [v for v in values if isinstance(v, (int, float)) and v > 0]
    return statistics.mean(values) if values else None


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--backend")
    parser.add_argument("--by")
    parser.add_argument("--rows", action="store_true")
    args = parser.parse_args(argv)
    name_a, kind, files_a = load(args.a)
    name_b, kind_b, files_b = load(args.b)
    if kind != kind_b:
        raise SystemExit("ab_compare: A and B come from different tools")
    runs_a = [entries(f, kind, args.backend) for f in files_a]
    runs_b = [entries(f, kind, args.backend) for f in files_b]
    keys = [k for k in runs_a[0] if all(k in r for r in runs_a + runs_b)]
    print(f"{kind}: {len(keys)} entries, {len(files_a)} run(s) of {name_a}, "
          f"{len(files_b)} of {name_b}")
    for field in FIELDS[kind]:
        ratios = {}
        for k in keys:
            a, b = mean_field(runs_a, k, field), mean_field(runs_b, k, field)
            if a and b:
                ratios[k] = b / a
        if not ratios:
            continue
        values = list(ratios.values())
        print(f"  {field}: {name_b} / {name_a} {geomean(values):.3f} geomean "
              f"({min(values):.3f} .. {max(values):.3f}), {name_b} faster on "
              f"{sum(v < 1 for v in values)} of {len(values)}")
        if args.by:
            groups = {}
            for k, v in ratios.items():
                attributes = runs_a[0][k][0]
                if args.by not in attributes:
                    raise SystemExit(f"ab_compare: --by {args.by}: not a key of these entries "
                                     f"({', '.join(attributes)})")
                groups.setdefault(attributes[args.by], []).append(v)
            for group, vs in sorted(groups.items()):
                print(f"    {args.by} {group}: {geomean(vs):.3f} ({len(vs)})")
        if args.rows:
            for k, v in ratios.items():
                print(f"    {k}: {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
