"""bench/ab_compare.py on made-up JSON of the three tools: B / A per entry from the mean of each
side's runs, geomeans per field and per group."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "ab_compare.py")


def run(tmp_path, a_files, b_files, *extra):
    def write(name, data):
        path = tmp_path / name
        path.write_text(json.dumps(data))
        return str(path)
    a = ",".join(write(f"a{i}.json", d) for i, d in enumerate(a_files))
    b = ",".join(write(f"b{i}.json", d) for i, d in enumerate(b_files))
    return subprocess.run([sys.executable, TOOL, f"A={a}", f"B={b}", *extra], check=True,
                          capture_output=True, text=True).stdout


def bench(scale):
    shapes = [{"name": f"s{i}", "max_kv": kv, "heads": 1,
               "results": {"persistent": {"score_us": 10.0 * (i + 1), "topk_us": 4.0 * scale[i],
                                          "call_us": 12.0, "fused_us": 12.0}}}
              for i, kv in enumerate((8192, 8192, 32768))]
    return {"shapes": shapes}


def test_bench_ratios_and_groups(tmp_path):
    out = run(tmp_path, [bench([1, 1, 1])], [bench([0.5, 0.5, 2.0])], "--by", "max_kv")
    assert "bench: 3 entries" in out
    assert "topk_us: B / A 0.794 geomean (0.500 .. 2.000), B faster on 2 of 3" in out
    assert "max_kv 8192: 0.500 (2)" in out and "max_kv 32768: 2.000 (1)" in out
    assert "score_us: B / A 1.000 geomean" in out


def test_decode_means_each_sides_runs(tmp_path):
    def decode(us):
        return {"rows": [{"dtype": "fp8", "heads": 1, "requests": 1, "context": 8192,
                          "layer_us_memset": us, "layer_us_read": us, "score_us_memset": us,
                          "score_us_read": us}]}
    out = run(tmp_path, [decode(10.0), decode(12.0)], [decode(11.0), decode(11.0)])
    assert "2 run(s) of A, 2 of B" in out
    assert "layer_us_memset: B / A 1.000 geomean" in out


def test_e2e_skips_failed_configs(tmp_path):
    def e2e(ms, state="ok"):
        return {"configs": [
            {"tp": 1, "prefill": 512, "context": 8192,
             "results": {"auto": {"state": "ok", "ms_per_forward": ms}}},
            {"tp": 4, "prefill": 512, "context": 8192,
             "results": {"auto": {"state": state, "ms_per_forward": ms}}}]}
    out = run(tmp_path, [e2e(2.0)], [e2e(1.0, state="failed")])
    assert "e2e: 1 entries" in out
    assert "ms_per_forward: B / A 0.500 geomean" in out
