"""The README's Python example: score one small batch and select its blocks on the cpu backend.

Run from the repository root after `make` with `PYTHONPATH=python python3 examples/quickstart.py`
(or anywhere once the package is installed); tests/python/test_examples.py runs it.
"""
import numpy as np

import msaidx

rng = np.random.default_rng(0)
T, H, D, PAGE = 3, 4, 128, 128

# One request: 3 new tokens after a 300-token prefix (303 tokens of context, 3 pages), its pages
# scattered over a cache of 4 physical pages.
cu_seqlens_q = np.array([0, T], dtype=np.int32)
seq_lens = np.array([303], dtype=np.int32)
block_table = np.array([[2, 0, 3]], dtype=np.int32)

q = msaidx.e4m3_from_float(rng.standard_normal((T, H, D), dtype=np.float32))  # uint8 E4M3 codes
k_cache = msaidx.e4m3_from_float(rng.standard_normal((4, PAGE, D), dtype=np.float32))

scores = msaidx.prefill_scores(q, k_cache, block_table, cu_seqlens_q, seq_lens)  # float32 [T, H, pitch]
nvp = msaidx.num_valid_pages(cu_seqlens_q, seq_lens)  # int32 [T]: visible pages of each token
blocks = msaidx.topk_select(scores, nvp, topk=16, init_blocks=0, local_blocks=1)  # int32 [T, H, 16]

print("scores", scores.shape, "visible pages", nvp.tolist())
print("token 2, head 0: blocks", blocks[2, 0, :4].tolist(), "scores", [f"{s:.3f}" for s in scores[2, 0]])
