/* Every tuning constant of the CUDA scorers (H200 / sm_90a), with the reason for its value. Plain C
 * so that the host tests of the schedule read the same numbers. Changing one changes generated
 * code: re-run the 78-shape bench (bench/README.md) and bench/sass_summary.sh before keeping it. */
#ifndef MSAIDX_TUNING_SM90_H
#define MSAIDX_TUNING_SM90_H

/* ---- persistent scorer (score_persistent_sm90.cu) ---- */

/* Query rows per task: two consumer warpgroups x two 64-row wgmma sub-tiles share every key page
 * loaded into shared memory, so each page read from L2 feeds 256 rows. */
#define MSAIDX_PERSISTENT_TILE_ROWS 256

/* Key pages (16 KB FP8) in flight per SM. The exact scorer widens every page into a ring of FP16
 * pages (32 KB each) that its consumers read: 3 of them, so that either consumer warpgroup may run
 * a page ahead of the other while the next page is widened, leave room for 4 key stages next to
 * the two 32 KB Q slots in the 227 KB of shared memory: 4 pages in flight from L2/HBM, one more
 * than the BF16 scorer needs at the same page rate. The fast-accumulation scorer widens nothing
 * and spends that room on 10 key stages, which its faster page rate needs to cover the L2/HBM
 * latency. */
/* Both overridable from the compiler's command line for experiments. */
#ifndef MSAIDX_PERSISTENT_EXACT_STAGES
#define MSAIDX_PERSISTENT_EXACT_STAGES 4
#endif
#ifndef MSAIDX_PERSISTENT_EXACT_WIDE_STAGES
#define MSAIDX_PERSISTENT_EXACT_WIDE_STAGES 3
#endif
#define MSAIDX_PERSISTENT_FAST_STAGES 10

/* BF16 key pages (32 KB) in flight per SM: with two 64 KB BF16 Q slots, 3 is what the 227 KB of
 * shared memory hold. */
#define MSAIDX_PERSISTENT_BF16_STAGES 3

/* Q tiles in flight: the producer loads the next task's tile while the consumers still read the
 * current one into registers. */
#define MSAIDX_PERSISTENT_Q_SLOTS 2

/* Register split of the 384 threads (launch: 168 each = 64512 of the SM's 65536). The producer
 * warpgroup (the TMA warp, and on the exact scorer the two widening warps) needs 56 without
 * spilling; the consumers' two 64-row sub-tiles (2 x 64 accumulators) and their FP16 Q fragments
 * (64) need 224. setmaxnreg moves the difference. */
#define MSAIDX_PERSISTENT_LAUNCH_REGISTERS 168
#define MSAIDX_PERSISTENT_PRODUCER_REGISTERS 56
#define MSAIDX_PERSISTENT_CONSUMER_REGISTERS 224

/* The plan resolves the first tasks of every CTA (tasks k < this x num_sms), so that their key
 * pages wait on one read instead of a chain (counts, segments, tile, block table) while the
 * producer locates the CTA's later tasks itself. 4 rather than 1: the producer's own search then
 * starts behind four tasks of work (H200, 78 shapes: fast score geomean 0.986x, q8k_kv8k_h1
 * 19.8 -> 17.2 us; exact unchanged). */
#define MSAIDX_PERSISTENT_RESOLVED_WAVES 4

/* Chunk sizes the plan weighs: 1, 2, 3, ..., 64 pages. Above 64 the finishing wave gets uneven for
 * no saving. */
#define MSAIDX_PERSISTENT_CHUNK_CHOICES 64

/* A chunk of a power of two pages is kept unless another size saves at least this share of the
 * busiest CTA's time by the plan's count. Measured on the H200 with E4M3 (2026-12-01), with the
 * 64-page chunk forced to 63, 65 or 66 pages: q128_kv1024k_h2 1.28x, 1.28x, 1.14x the time,
 * q128_kv1024k_h1 1.07x, 1.05x, 1.03x, although the count saves 0-2 %. The score stores are the
 * cause: with them switched off, 63 pages cost the 1M-key shapes 0.99-1.00x of 64. A task's stretch
 * of a score row then starts inside a 32-byte sector that another CTA writes tens of microseconds
 * later. The causal prefills that other sizes serve save 3-23 % by the count and 1-22 % measured.
 */
#define MSAIDX_PERSISTENT_ODD_CHUNK_MIN_SAVING_PERCENT 3

/* What a task costs beyond its pages (its Q tile, the pipeline's restart), in quarters of the time
 * one page takes: about one page. Overridable from the compiler's command line for experiments. */
#ifndef MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS
#define MSAIDX_PERSISTENT_TASK_OVERHEAD_QUARTERS 4
#endif

/* A fused score + top-k call keeps each row's maximum over each task's pages when the deal's
 * chunks have at least this many pages: the top-k of a long row then reads the maxima (1/8 of its
 * cells or fewer) and only the chunks that can hold a chosen page. Below 8 the maxima would cost
 * the workspace more and save the top-k little; the area is sized for 8 (1/8 of the scores). */
#define MSAIDX_PERSISTENT_MAXIMA_MIN_CHUNK 8

/* ... and only from this many score cells (rows x the plan's pages a row): the scorer that keeps
 * maxima costs 1.5-2.5 % more, which the top-k repays only where reading every score takes long.
 * Measured on the H200 (4 runs each, 2026-12-04): from 2^24 cells (q512_kv1024k_h4, q2k_kv512k_h2
 * and up) fused 0.92-0.99x of the call; below it (q512_kv512k_h2 / h4, q512_kv1024k_h2,
 * q2k_kv512k_h1) 1.00-1.05x, so those keep the plain kernels. */
#ifndef MSAIDX_PERSISTENT_MAXIMA_MIN_CELLS
#define MSAIDX_PERSISTENT_MAXIMA_MIN_CELLS (INT64_C(1) << 24)
#endif

/* ---- dense / split scorer (score_dense.cu) ---- */

/* Query rows per work item: 4 warps as 2 x 2 over rows x keys, each warp 32 rows x 64 keys with
 * its Q fragments in registers for the whole item. */
#define MSAIDX_CUDA_TILE_ROWS 64

/* cp.async stages of key pages: 3 keeps a page in flight behind the one being scored while E4M3
 * CTAs (8 KB Q + 3 x 16 KB pages) still fit three to an SM, and BF16 CTAs (16 KB + 3 x 32 KB) two.
 */
#define MSAIDX_DENSE_STAGES 3

/* split: page chunks sized so that the items number about this many per SM (enough to balance
 * ragged batches across the SMs). */
#define MSAIDX_CUDA_SPLIT_ITEMS_PER_SM 8
/* split: no item shorter than this many pages (its Q tile load must pay off). */
#define MSAIDX_CUDA_SPLIT_MIN_PAGES 8

/* ---- top-k (topk_select.cu, topk_select.cuh, topk_chunked.cuh) ---- */

/* Rows of at most this many candidate pages are selected by one warp, 32 score keys per lane in
 * registers; longer rows by a whole CTA. */
#define MSAIDX_TOPK_WARP_MAX_PAGES 1024
/* Batches of at most a wave of rows (decode) whose rows may have more candidates than this take
 * a CTA a row even when a warp would hold them: past 256 a warp's row takes its 32-keys-a-lane
 * form, and one decode row of 1024 pages (128K tokens) was 1.05-1.07x slower by a warp than by a
 * CTA on the H200; rows of 64-256 pages were 0.89-1.00x by a warp. */
#define MSAIDX_TOPK_WAVE_ROW_CTA_MIN_PAGES 256
/* Warps of a top-k CTA, a short row each: 8 warps, 256 threads. */
#define MSAIDX_TOPK_WARP_ROWS_PER_CTA 8
/* A long row's CTA: 256 threads x 32 keys per thread in registers hold rows up to 8192 pages
 * (vLLM's pitch: 1M tokens) without a second pass. */
#define MSAIDX_TOPK_BLOCK_THREADS 256
#define MSAIDX_TOPK_BLOCK_MAX_PER_THREAD 32
/* Top-k CTAs resident per SM: 256 threads at the 64 registers the 32 keys a thread keeps need fill
 * the register file four times. Where rows may be long, batches of at most this many rows per SM
 * get a CTA a row (decode: each long row its own slot); larger ones a wave of CTAs or more. */
#define MSAIDX_TOPK_CTAS_PER_SM 4
/* Candidates ranked by counting in shared memory (warp, CTA): on real scores tens to ~150 of 8192
 * keys reach the bound; a row whose candidates overflow takes the exact bitwise search instead. */
#define MSAIDX_TOPK_WARP_GATHER 64
#define MSAIDX_TOPK_BLOCK_GATHER 256
/* A CTA selecting many rows one after another tightens its bound with the warps' top lane maxima
 * on rows of at most this many float4 a thread (4: 4096 pages); on 8 the second selection pushes
 * that kernel past its 64 registers (spills). */
#define MSAIDX_TOPK_TIGHT_BOUND_MAX_VECTORS 4
/* A fused call's long rows from their chunk maxima, a warp each (select_chunked_row): a lane keys
 * up to 8 chunks, so rows of up to 256 chunks (8192 pages in chunks of 32, 4096 in chunks of 16);
 * rows of fewer than 2 chunks per slot read most of their chunks anyway and take the plain path.
 * Up to 32 chunks reach the threshold (on real scores about slots), their pages read 16 loads a
 * lane at a time (64 registers, no spill, in topk_kernel). */
#define MSAIDX_TOPK_CHUNK_KEYS_PER_LANE 8
#define MSAIDX_TOPK_CHUNKED_MIN_CHUNKS_PER_SLOT 2
#define MSAIDX_TOPK_CHUNK_LIST 32
#define MSAIDX_TOPK_CHUNK_LOADS_PER_LANE 16

#endif
