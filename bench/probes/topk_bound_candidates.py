"""How many candidates the CUDA top-k's CTA path gathers per row under each lower bound.

Models src/cuda/topk_select.cu's vector path on the CPU: thread t of a 256-thread CTA holds cells
4 * (v * 256 + t) .. + 3 of a row (v < ceil(pages / 1024)), its maximum is its "lane maximum", and
every page whose score reaches the bound is gathered and ranked by counting (O(candidates^2)).
Bounds, for `slots` chosen pages:
  warps  the largest of the 8 warps' slots-th largest lane maxima (every CTA kernel before f04516c,
         and the CTA-a-row kernel since);
  union  the slots-th largest of the 32 values made of each warp's top 4 lane maxima;
  tight  max(warps, union): the many-row kernel since f04516c.
Scores: each page's maximum of 128 standard normal dot products (independent pages), and the same
with the last 128 pages raised by `boost` (a recent window that scores higher, as attention to
recent context often does: the case where the union alone falls short).

    python3 bench/probes/topk_bound_candidates.py
"""
import numpy as np

THREADS, WARPS, TOPS, LOCAL = 256, 8, 4, 1


def candidates(row, slots):
    count = row.size - LOCAL  # the trailing local page is forced, not selected
    vectors = -(-count // (4 * THREADS))
    cells = np.full(vectors * 4 * THREADS, -np.inf, np.float32)
    cells[:count] = row[:count]
    lane_max = cells.reshape(vectors, THREADS, 4).max(axis=(0, 2))
    ranked = np.sort(lane_max.reshape(WARPS, 32), axis=1)[:, ::-1]
    warps = ranked[:, slots - 1].max()
    union = np.sort(ranked[:, :TOPS].ravel())[::-1][slots - 1]
    pages = row[:count]
    return [(pages >= b).sum() for b in (warps, union, max(warps, union))]


def main(slots=15, rows=200, seed=1):
    rng = np.random.default_rng(seed)
    print(f"{'pages':>6} {'boost':>5}  mean candidates a row: warps / union / tight (max)")
    for pages in (1200, 2048, 4096):
        for boost in (0.0, 1.0, 2.0):
            counts = []
            for _ in range(rows):
                row = rng.standard_normal((pages, 128), dtype=np.float32).max(axis=1)
                row[pages - LOCAL - 128:pages - LOCAL] += boost
                counts.append(candidates(row, slots))
            mean, worst = np.mean(counts, axis=0), np.max(counts, axis=0)
            print(f"{pages:6d} {boost:5.1f}  " + " / ".join(f"{m:6.1f} ({w:3d})"
                                                          for m, w in zip(mean, worst)))


if __name__ == "__main__":
    main()
