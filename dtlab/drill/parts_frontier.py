"""The graded parts of the drill's cards on chapter 12's frontier: FP8 scaling,
zero-bubble V schedules, sharded Muon. Vocabulary and constructors:
:mod:`~dtlab.drill.parts`; each number comes from :mod:`dtlab.estimate` (or, for
Muon, from :mod:`dtlab.muon.estimate` on shapes that :mod:`dtlab.estimate` gives)."""

from __future__ import annotations

from dtlab import estimate as est
from dtlab.drill.parts import C, N
from dtlab.muon import muon_flops, muon_traffic

__all__ = ["PARTS"]


def _v_bubble(p: int, m: int) -> float:
    """ZB-V's idle share with a chunk's F, B and W equal (t_f = 1, t_b = 2 per rank's
    layers): 1 - m(t_f + t_b) / step."""
    step = est.pipeline_step_time(p, m, 1.0, 2.0, schedule="zb_v", t_w=1.0)
    return 1 - m * 3.0 / step


def _shapes(m) -> list[tuple[int, int]]:
    """The hidden matrices of a model preset with a gated MLP: per layer q, k, v,
    o (h × h) and gate, up, down (h × d_ff, either way round)."""
    per_layer = [(m.d_model, m.d_model)] * 4 + [(m.d_ff, m.d_model)] * 3
    return per_layer * m.n_layers


def _owner_flops_share(shapes, n: int) -> float:
    """The busiest rank's Newton–Schulz FLOPs under owner-compute, over a rank's
    under the naive design (every rank orthogonalizes every matrix)."""
    return max(muon_flops(shapes, n, "owner")) / max(muon_flops(shapes, n, "naive"))


PARTS: dict[str, tuple] = {
    "fp8_scaling": (
        N(
            "gather_fp8",
            "Ψ = 7e9, FSDP over N = 8, every weight all-gathered in FP8 (e4m3): "
            "bytes each GPU sends to gather all the weights once",
            "GB",
            lambda: est.wire_bytes("all_gather", 1 * 7e9, 8),  # 1 byte a parameter
        ),
        N(
            "states_fp8",
            "The same model trained with FP8 matmuls and mixed-precision Adam, not "
            "sharded: bytes of model states (weights, gradients, optimizer) per GPU",
            "GB",
            lambda: est.zero_memory_per_device(7e9, 1, 0)["total"],  # FP8: no change
        ),
        C(
            "e5m2",
            "Which tensors does the standard FP8 recipe cast to e5m2?",
            ["gradients"],
            ["the loss"],
            {
                "weights": "weights need precision more than range: e4m3's third "
                "mantissa bit",
                "activations": "activations are forward operands, cast to e4m3 "
                "with the weights",
                "the fp32 master weights": "the master copy never leaves fp32: only "
                "a matmul's operands are cast",
            },
        ),
        C(
            "delayed_saturates",
            "Under delayed scaling, when does a cast saturate?",
            ["when amax jumps above every amax in the history"],
            ["when the history is longer than the tensor"],
            {
                "when amax falls below the history's": "a falling amax leaves values "
                "low in the format: they lose precision, not range",
                "never: the history's maximum bounds every tensor": "the history holds "
                "earlier tensors only; the one in hand is cast before its amax joins",
            },
        ),
    ),
    "zero_bubble_v": (
        N(
            "zb_v_bubble",
            "p = 4 ranks, m = 8 microbatches, ZB-V, with a chunk's F, B and W taking "
            "equal times: the bubble's share of the step",
            "%",
            lambda: _v_bubble(4, 8),
        ),
        N(
            "zb_v_held",
            "The same: microbatch-chunks (each half a rank's layers) of activations "
            "every rank holds at its peak",
            "count",
            lambda: est.pipeline_in_flight(4, 0, 8, "zb_v"),
        ),
        C(
            "split",
            "A zero-bubble schedule splits each backward into:",
            [
                "the input's gradient, sent upstream at once",
                "the weights' gradient, run later in idle slots",
            ],
            ["one backward per layer, each on its own rank"],
            {
                "one microbatch's forward overlapped with another's backward": "that "
                "is DualPipe's pairing, which hides communication; the split is "
                "inside one backward"
            },
        ),
        C(
            "price",
            "What does ZB-V cost compared with 1F1B at the same p and m?",
            ["every rank holds as many activations as 1F1B's first stage"],
            ["fewer FLOPs per step"],
            {
                "a longer step": "with equal times its step is the shortest of the "
                "pipeline schedules: only (p − 1)·t_f/2 of start-up"
            },
        ),
    ),
    "muon_sharding": (
        N(
            "naive_bytes",
            "LLaMA-2 7B's hidden matrices (32 layers of four 4096 × 4096 and three "
            "4096 × 11008) on N = 8 data-parallel ranks, fp32 gradients and "
            "parameters, a bf16 Newton–Schulz input: bytes each rank sends per step "
            "when every matrix is gathered whole on every rank",
            "GB",
            lambda: (
                muon_traffic(_shapes(est.MODELS["7B"]), 8, "naive").total_wire_bytes
            ),
        ),
        N(
            "owner_flops",
            "The same with each matrix orthogonalized by one owner: the busiest "
            "rank's Newton–Schulz FLOPs as a share of a rank's in the naive design",
            "%",
            lambda: _owner_flops_share(_shapes(est.MODELS["7B"]), 8),
        ),
        C(
            "why",
            "Why can a rank not run Muon on its ZeRO-1 slice alone?",
            ["Newton–Schulz needs the whole matrix"],
            ["Muon keeps no optimizer state"],
            {
                "Muon's momentum is not element-wise": "the momentum is an "
                "element-wise running average, as Adam's is; only the "
                "orthogonalization mixes elements"
            },
        ),
        C(
            "owner_sync",
            "Owner-compute sharded Muon: what does each step send?",
            ["one reduce-scatter of gradients", "one all-gather of updated parameters"],
            ["an all-reduce of the momentum"],
            {
                "an all-gather of every matrix before Newton–Schulz": "that is the "
                "naive design, which repeats the orthogonalization on every rank"
            },
        ),
    ),
}
