"""Kernel configurations of rungs 7 and 8, and the mirrors of their shared-memory layouts.

Pure arithmetic (no CUDA), so the CPU tests check every plan. Each ``*_smem_bytes`` mirrors the
``OFF_*`` layout of its kernel; the sessions compare it with the compiled module's ``ft_smem_bytes``
(or ``ft_bwd_smem``) and refuse to run on a mismatch.
"""

from __future__ import annotations

import math

from fasttrain.contract import INPUT_DIM
from fasttrain.errors import FasttrainError

SMEM_LIMIT = 227 * 1024   # opt-in shared memory per block on sm_90
SM_SMEM = 228 * 1024      # shared memory per SM on sm_90 (each resident block also reserves 1 KB)
NW = 8                    # warps of a rung-7 block
TARGET_BLOCKS = 120       # rung 7: about one block per SM of an H100 (132)
MLP_MAX_LAYERS = 6
GRID_SMS = 132            # an H100 SXM / H200: the largest grid a plan may ask for (checked against the device)


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def _align128(x: int) -> int:
    return (x + 127) // 128 * 128


# --- rung 7: fused_step.cu -----------------------------------------------------------------------


# Programmatic dependent launch pays where a step's kernels are short: measured on an H200 against plain
# launches (dev/cuda/step_breakdown.py --pdl, results/record/round2-h200/ab-v6-*), with v6 a step of mlp:128x3 -18%,
# 1024x3 -12%, 2048x3 -6%, 4096x3 -1%, but 8192x3 +0.7% (+1.8% over the record's 5000 steps), so auto was off above
# 4096 x 4096. v8 loads what a kernel's predecessor does not write before it waits, which PDL lets overlap the
# predecessor's drain, so auto is on at every width: the record's mlp:8192x3 (3 seeds each, same run,
# results/record/nvidia-h200, fused_step v9) takes 2.51 s with PDL against 2.58 s without.
def step_pdl(choice: str) -> bool:
    """Whether rung 7 launches with programmatic dependent launch: ``choice`` on / off, or auto (on)."""
    return choice != "off"


def _tile(width: int, mt: int, bwd: bool = False, min_blocks: int = TARGET_BLOCKS) -> int:
    """Columns per block: the widest of 64/32/16/8 that divides ``width`` and still gives ``min_blocks``
    blocks, else 8; capped so that the per-thread registers do not spill: ft_fwd holds mt * tile/8
    accumulator tiles (<= 16); ft_bwd about 16 mt + 6 mt nj + 8 nj (<= 200)."""
    for tile in (64, 32, 16, 8):
        nj = tile // 8
        fits = (16 * mt + 6 * mt * nj + 8 * nj <= 200) if bwd else (mt * nj <= 16)
        if width % tile == 0 and fits and width // tile >= min_blocks:
            return tile
    return 8


def step_bwd_smem(mt: int, bi: int, stages: int = 4, cluster_part: bool = True) -> int:
    """Mirror of ft_bwd's shared memory (the module's ``ft_bwd_smem``): the H_in strip [B_p][BI+8] fp16, then
    the per-warp rings (a stage: 16 rows of W^T at a stride of BI+8 floats (8 when BI = 8), 16 rows of g^T at
    B_p+8), which the dH reduction buffer [8][B_p][BI+1] fp32 reuses, then (v7, ``cluster_part``) the block's
    dH partial [B_p][BI] fp32 that its cluster reads."""
    bp = 16 * mt
    strip, reduction = bp * (bi + 8) * 2, NW * bp * (bi + 1) * 4
    ws = 8 if bi == 8 else bi + 8
    stage = 16 * ws * 4 + 16 * (bp + 8) * 2
    return strip + max(NW * stages * stage, reduction) + (bp * bi * 4 if cluster_part else 0)


def step_fwd_smem(mt: int, bo: int, fu: int, cluster_part: bool = True) -> int:
    """Mirror of ft_fwd's shared memory (the module's ``ft_fwd_smem``): per warp a ring of FU + 1 stages (a
    stage: BO rows x 16 k of W^T fp32, then B_p rows x 16 k of H_in), which the K-split reduction buffer
    [8][B_p][BO+1] fp32 reuses, then (v7, ``cluster_part``) the block's partial [B_p][BO] fp32."""
    bp = 16 * mt
    stage = bo * 16 * 4 + bp * 16 * 2
    return max(NW * (fu + 1) * stage, NW * bp * (bo + 1) * 4) + (bp * bo * 4 if cluster_part else 0)


def step_first_smem(mt: int, bo: int) -> int:
    """Mirror of ft_bwd_fwd_x's shared memory (the module's ``ft_bwd_fwd_x_smem``): the block's W^T rows
    [BO][784 + 4] fp32, X_k [B_p][784 + 8] in the operand type (reused by the reduction [8][B_p][BO+1] fp32), the
    next batch's pixels [B_p][784], g^T rows [BO][B_p + 8], the two batches' row indices, X_k's pixels [B_p][784]."""
    bp = 16 * mt
    return (bo * (INPUT_DIM + 4) * 4 + max(bp * (INPUT_DIM + 8) * 2, NW * bp * (bo + 1) * 4) + bp * INPUT_DIM
            + bo * (bp + 8) * 2 + 2 * bp * 4 + bp * INPUT_DIM)


def _default_fu(mt: int, bo: int, fwd_minb: int, cluster_part: bool = True) -> int:
    """k-steps of W ft_fwd keeps in flight a warp: the deepest ring (8, 6, 4, 3, 2 or 1 stages ahead) with which
    ``fwd_minb`` blocks share an SM's shared memory (BO 64 at batch 32: 4, i.e. 160 KB of W and H_in in flight an SM)."""
    for fu in (8, 6, 4, 3, 2, 1):
        smem = step_fwd_smem(mt, bo, fu, cluster_part)
        if smem <= SMEM_LIMIT and fwd_minb * (smem + 1024) <= SM_SMEM:
            return fu
    return 1


CLUSTER_SPLITS = (1, 2, 4, 8)   # blocks of one thread-block cluster (8: the portable maximum)


def _split_tile(width: int, mt: int, split: int, bwd: bool) -> int:
    """The tile of a layer whose blocks are split ``split`` ways over a cluster: the widest tile whose strips,
    times ``split``, still give TARGET_BLOCKS blocks."""
    return _tile(width, mt, bwd=bwd, min_blocks=-(-TARGET_BLOCKS // split))


# Measured on an H200 (dev/cuda/step_breakdown.py --clusters, results/record/round2-h200/clusters-*): a cluster of
# 2 blocks at one block an SM fits 66 at once, so 2048 / 4096-wide layers run in one wave of 64 clusters; a cluster
# of 4 fits only 30 at once (120 SMs), so 32 clusters take two waves (2048x2048 backward 23.7 us against 14.6 at 2
# and 16.7 unsplit). The first layer's forward (49 k-steps) measured slower split (5.1 -> 5.7 us at 2048).
AUTO_SPLIT = 2


def auto_split(width: int, mt: int, bwd: bool) -> int:
    """The split of a hidden-to-hidden layer when none is asked: AUTO_SPLIT where it doubles the layer's tile
    (so the split buys fewer H_in / g^T re-reads, not more blocks), else 1."""
    return AUTO_SPLIT if _split_tile(width, mt, AUTO_SPLIT, bwd) == 2 * _tile(width, mt, bwd=bwd) else 1


def step_plan(shapes, mt: int, bo: int | None = None, bi: int | None = None, stages: int | None = None,
              bwd_minb: int | None = None, fwd_minb: int | None = None, fu: int | None = None,
              osplit: int | None = None, fsplit: int | None = None, bsplit: int | None = None,
              cluster_part: bool = True) -> list[dict]:
    """Per-layer kernel configuration of rung 7; ``shapes`` = [(out_p, in_p)] of W^T per layer.

    ``bo`` / ``bi``: columns per ft_fwd / ft_bwd block, used for the layers they divide (else the default
    tile); ``stages``: ring depth of ft_bwd (default the deepest of 4..2 whose ``bwd_minb`` blocks fit in an
    SM's shared memory); ``bwd_minb`` / ``fwd_minb``: ``__launch_bounds__`` minimum blocks per SM (default 1);
    ``fu``: W k-steps ft_fwd keeps in flight a warp (default :func:`_default_fu`); ``osplit``: blocks over the output rows
    of the first layer's backward (default: chosen at launch from the occupancy). The first layer needs no dH,
    so its backward tile is not held to TARGET_BLOCKS strips: the output-row split supplies the blocks.

    v7, ``fsplit``: blocks of one cluster that split the k-steps of each ft_fwd (``FC``, every layer but the
    last); ``bsplit``: blocks of one cluster that split the output rows of each hidden-to-hidden ft_bwd and sum
    their dH through distributed shared memory (``BC`` = the layer's ``osplit``). A split widens the layer's
    default tile (BO / BI) so that strips x split still give TARGET_BLOCKS blocks; 1: v6's kernels, sum for sum.
    Unset (auto): a split of 2 on the hidden-to-hidden layers where it doubles the tile (:func:`auto_split`).
    ``cluster_part``: the kernel's shared memory has the partial the cluster reads (False: the versions before v7)."""
    for name, val in (("bo", bo), ("bi", bi)):
        if val is not None and val not in (8, 16, 32, 64):
            raise FasttrainError(f"rung 7 {name} must be 8, 16, 32 or 64, got {val}")
    for name, val in (("fsplit", fsplit), ("bsplit", bsplit)):
        if val is not None and val not in CLUSTER_SPLITS:
            raise FasttrainError(f"rung 7 {name} must be 1, 2, 4 or 8, got {val}")
    auto_f, auto_b = fsplit is None, bsplit is None
    bwd_minb, fwd_minb = bwd_minb or 1, fwd_minb or 1
    plan = []
    last = len(shapes) - 1
    for i, (out_p, in_p) in enumerate(shapes):
        hidden = 0 < i < last
        fs = (auto_split(out_p, mt, bwd=False) if hidden else 1) if auto_f else fsplit
        bs = (auto_split(in_p, mt, bwd=True) if hidden else 1) if auto_b else bsplit
        p_bo = bo if (bo is not None and i < last and out_p % bo == 0) else (
            _split_tile(out_p, mt, fs, bwd=False) if i < last else 16)
        # the forward's k-steps split fs ways (each block keeps at least one k-step a warp)
        p_fc = fs if (i < last and fs > 1 and p_bo % fs == 0 and in_p // 16 >= fs * NW) else 1
        # the hidden-to-hidden backward's output rows split bs ways (each warp keeps at least one chunk)
        p_bc_wanted = bs if (hidden and bs > 1 and out_p // 16 >= bs * NW) else 1
        if bi is not None and in_p % bi == 0:
            p_bi = bi
        else:
            p_bi = _tile(in_p, mt, bwd=True, min_blocks=1) if i == 0 else _split_tile(in_p, mt, p_bc_wanted, bwd=True)
        p_bc = p_bc_wanted if p_bi % p_bc_wanted == 0 else 1
        fits = [k for k in ((stages,) if stages else (4, 3, 2))
                if step_bwd_smem(mt, p_bi, k, cluster_part) <= SMEM_LIMIT]
        if i == last and i > 0:   # the last layer's ft_fwd is never launched: share the previous module
            p_bo = plan[-1]["BO"]
        p_fu = fu or _default_fu(mt, p_bo, fwd_minb, cluster_part)
        if step_fwd_smem(mt, p_bo, p_fu, cluster_part) > SMEM_LIMIT:
            raise FasttrainError(f"rung 7: ft_fwd with BO {p_bo}, batch {16 * mt} and {p_fu} k-steps in flight "
                                 f"needs more than {SMEM_LIMIT} bytes of shared memory; lower --step-fu")
        if not fits:
            raise FasttrainError(f"rung 7: ft_bwd with BI {p_bi}, batch {16 * mt} and {stages or 2} stages "
                                 f"needs more than {SMEM_LIMIT} bytes of shared memory")
        # the deepest ring with which bwd_minb blocks share an SM's shared memory (else the shallowest)
        depth = next((k for k in fits if bwd_minb * (step_bwd_smem(mt, p_bi, k, cluster_part) + 1024) <= SM_SMEM),
                     fits[-1])
        plan.append({"in_p": in_p, "out_p": out_p, "BO": p_bo, "BI": p_bi, "S": depth, "MINB": bwd_minb,
                     "FMINB": fwd_minb, "FU": p_fu, "FC": p_fc,
                     # None on the first layer: chosen at launch; the hidden layers' bsplit is a cluster
                     "osplit": osplit if i == 0 else p_bc})
    return plan


def step_tiled(choice: str) -> bool:
    """Whether rung 7 stores the hidden-to-hidden layers' W^T tiled (``choice`` tiled / rows, or auto: tiled)."""
    return choice != "rows"


def tile_master(wt, bo: int):
    """A row-major W^T [out][in] (CuPy or NumPy) in fused_step.cu's tiled order (w_at): tiles of ``bo`` rows x 16
    inputs, row-major inside, the tiles of a band of ``bo`` rows in input order; same shape, the storage permuted."""
    out_p, in_p = wt.shape
    return wt.reshape(out_p // bo, bo, in_p // 16, 16).transpose(0, 2, 1, 3).copy().reshape(out_p, in_p)


def untile_master(tiled, bo: int):
    """The inverse of :func:`tile_master`: the row-major W^T."""
    out_p, in_p = tiled.shape
    return tiled.reshape(out_p // bo, in_p // 16, bo, 16).transpose(0, 2, 1, 3).reshape(out_p, in_p)


def step_defines(p: dict, mt: int, bf16: int) -> dict:
    return {"FT_MT": mt, "FT_BO": p["BO"], "FT_BI": p["BI"], "FT_BF16": bf16, "FT_S": p["S"], "FT_MINB": p["MINB"],
            "FT_FMINB": p["FMINB"], "FT_FU": p["FU"]}


def blocks_per_sm(regs: int, smem: int, threads: int = NW * 32) -> int:
    """Resident blocks an SM can hold (registers in 256-register steps per warp, shared memory + 1 KB a block)."""
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (warp_regs * (threads // 32))
    by_smem = SM_SMEM // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads))


# --- rung 8, logreg: fused_logreg.cu ----------------------------------------------------------------


def logreg_smem_bytes(cluster: int, kt: int, mt: int, stages: int) -> int:
    """Mirror of fused_logreg.cu's layout: barriers, the pixel ring and its labels, two activation buffers,
    the W copy, g, the own partial logits and the reduce-scatter slots of every peer."""
    bp, kf = mt * 16, kt * 16
    xs = kf + 8
    rows_per_cta = -(-bp // cluster)
    off = _align128(512 + stages * bp * kf)
    off = _align128(off + stages * bp * 4)
    off = _align128(off + 2 * bp * xs * 2)
    off = _align128(off + 16 * xs * 2)
    off = _align128(off + bp * 24 * 2)
    off = _align128(off + bp * 12 * 4)
    off = _align128(off + cluster * rows_per_cta * 12 * 4)
    return off + 2 * 8 * 8


def logreg_plan(batch: int, cluster: int | None = 7, stages: int | None = None) -> dict:
    """Rung 8 logreg: k-tiles per CTA and the deepest ring that fits in shared memory (cluster None: 7)."""
    cluster = 7 if cluster is None else cluster
    ktiles = INPUT_DIM // 16  # 49
    if not 1 <= cluster <= 8:
        raise FasttrainError(f"rung 8 cluster size must be 1..8, got {cluster}")
    kt = math.ceil(ktiles / cluster)
    if (cluster - 1) * kt >= ktiles:
        raise FasttrainError(f"rung 8: a cluster of {cluster} leaves a CTA without features; use 4, 5, 6 or 7")
    mt = math.ceil(batch / 16)
    if mt > 12:  # beyond 192 rows the ring, the activations and the partial logits outgrow shared memory
        raise FasttrainError(f"rung 8 logreg supports batch sizes up to 192, got {batch}; use --rung 7")
    for s in ((stages,) if stages else (6, 5, 4, 3, 2)):
        size = logreg_smem_bytes(cluster, kt, mt, s)
        if size <= SMEM_LIMIT:
            return {"FT_C": cluster, "FT_KT": kt, "FT_MT": mt, "FT_STAGES": s, "FT_PW": 1 if kt <= 8 else 2,
                    "smem": size}
    hint = "a smaller batch" if cluster == 7 else "the default cluster of 7 or a smaller batch"
    raise FasttrainError(f"rung 8 logreg with batch {batch} and a cluster of {cluster} does not fit in shared "
                         f"memory; use {hint}")


# --- rung 8, small MLPs: fused_mlp.cu (and its compact fallback) ---------------------------------------

MLP_LAYOUTS = ("blocked", "compact")


def mlp_smem_bytes(cluster: int, mt: int, nl: int, stages: int, layout: str = "blocked") -> int:
    """Mirror of fused_mlp.cu's layout. ``blocked`` (the default build): activations in 16-unit blocks, one
    per CTA, and the reduce-scatter partials staged by destination; ``compact`` (FT_COMPACT=1): one
    [B_p][H_p + 8] activation buffer and no staging."""
    bp, hp = mt * 16, 16 * cluster
    hs, nlm = hp + 8, max(nl - 1, 1)
    h_elems = bp * hs if layout == "compact" else cluster * bp * 24   # one activation buffer
    off = _align128(256 + (nl + 1) * 64)
    off = _align128(off + stages * bp * INPUT_DIM)
    off = _align128(off + stages * bp * 4)
    off = _align128(off + 16 * (INPUT_DIM + 8) * 2)
    off = _align128(off + nlm * 16 * hs * 2)
    off = _align128(off + 16 * hs * 2)
    off = _align128(off + 2 * h_elems * 2)
    off = _align128(off + nlm * h_elems * 2)
    off = _align128(off + 7 * bp * 18 * 4)
    off = _align128(off + bp * 24 * 2)
    off = _align128(off + 2 * bp * 24 * 2)
    off = _align128(off + nlm * cluster * bp * 16 * 4)
    if layout == "blocked":
        off = _align128(off + nlm * cluster * bp * 16 * 4)
    return off + 2 * 7 * 8


def _check_mlp_shape(spec, batch: int) -> int:
    widths = spec.hidden
    if len(widths) > MLP_MAX_LAYERS:
        raise FasttrainError(f"engine cuda rung 8 supports up to {MLP_MAX_LAYERS} hidden layers, got {len(widths)}; "
                             "use --rung 7")
    mt = math.ceil(batch / 16)
    if mt > 4:
        raise FasttrainError(f"engine cuda rung 8 runs MLPs with batch sizes up to 64, got {batch}; use --rung 7")
    return mt


def mlp_plan(spec, batch: int, stages: int | None = None, layout: str = "auto") -> dict:
    """Rung 8 MLP configuration: one CTA per 16 hidden units (cluster <= 8, so width <= 128), batch <= 64.
    ``layout`` auto: the blocked build where it fits in shared memory, else the compact fallback."""
    widths = spec.hidden
    hp = pad16(widths[0])
    if len(set(widths)) != 1 or hp > 128:
        raise FasttrainError(
            f"engine cuda rung 8 keeps the whole model on one cluster of up to 8 SMs: hidden widths up to 128, "
            f"got {spec.name}; use --rung 7 (fused kernels in a CUDA graph)"
        )
    mt = _check_mlp_shape(spec, batch)
    cluster = hp // 16
    for lay in (MLP_LAYOUTS if layout == "auto" else (layout,)):
        for s in ((stages,) if stages else (4, 3, 2)):
            size = mlp_smem_bytes(cluster, mt, len(widths), s, lay)
            if size <= SMEM_LIMIT:
                return {"FT_C": cluster, "FT_MT": mt, "FT_NL": len(widths), "FT_STAGES": s,
                        "FT_COMPACT": int(lay == "compact"), "smem": size, "layout": lay}
    raise FasttrainError(f"engine cuda rung 8: {spec.name} with batch {batch} does not fit in shared memory"
                         + ("" if layout == "auto" else f" with the {layout} layout") + "; use --rung 7")


# --- rung 8, wider MLPs: fused_grid.cu --------------------------------------------------------------


def grid_smem_bytes(h: int, nl: int, a: int, b: int, mt: int) -> int:
    """Mirror of fused_grid.cu's layout: per layer the fp32 master tile, its fp16/bf16 copy, the input strip
    and the bias; then the output strip, the split-K scratch, the logits, the pixels and labels."""
    bp, ta, tb, last = 16 * mt, h // a, h // b, nl + 1
    size = 0
    for layer in range(1, last + 1):
        it = 112 if layer == 1 else ta
        ot = 16 if layer == last else tb
        size += _align128(ot * (it + 4) * 4) + _align128(ot * (it + 8) * 2) + _align128(bp * (it + 8) * 2) \
            + _align128(ot * 4)
    size += _align128(bp * (max(tb, 16) + 8) * 2) + _align128(64 * bp * 4) + _align128(bp * 16 * 4) \
        + _align128(2 * bp * 112) + _align128(2 * bp * 4)
    return size + 128


def grid_plan(spec, batch: int, sm_count: int = GRID_SMS) -> dict:
    """Tiles for fused_grid.cu: hidden layers cut into A x B tiles (B % A == 0, TB = H/B in 16/32/64,
    TA = H/A a multiple of 16), layer 1 into 7 x B, the last layer into A; one CTA per tile of the
    largest layer, all resident (<= sm_count CTAs, one an SM). The plan with the most CTAs wins."""
    widths = spec.hidden
    h = pad16(widths[0])
    if len(set(widths)) != 1 or widths[0] != h:
        raise FasttrainError(f"engine cuda rung 8 needs equal hidden widths that are multiples of 16, got {spec.name}; "
                             "use --rung 7")
    mt = _check_mlp_shape(spec, batch)
    nl = len(widths)
    best = None
    for b in (32, 16, 12, 8, 4, 2):
        if h % b or h // b not in (16, 32, 64):
            continue
        for a in (x for x in range(1, b + 1) if b % x == 0):
            if h % a or (h // a) % 16:
                continue
            grid = max(7 * b, a * b if nl >= 2 else 0, a)
            smem = grid_smem_bytes(h, nl, a, b, mt)
            if grid > sm_count or smem + 16 > SMEM_LIMIT:
                continue
            key = (grid, -a)
            if best is None or key > best[0]:
                best = (key, {"FT_H": h, "FT_NL": nl, "FT_A": a, "FT_B": b, "FT_MT": mt, "grid": grid, "smem": smem})
    if best is None:
        raise FasttrainError(
            f"engine cuda rung 8 cannot keep {spec.name} (batch {batch}) on chip: its weight tiles need more than "
            f"{sm_count} SMs' shared memory (widths 256..1024 fit); use --rung 7 (fused kernels in a CUDA graph)"
        )
    return best[1]
