# Chapter 10's claims: the learner's page reveals nothing by itself, so this file
# answers every card with its reference (a reveal needs a graded attempt), reveals
# them all, and holds each card's number against the formula it illustrates.
from dtlab.lab.drill import NotAnsweredYet

unanswered = next(c.key for c in CARDS if c.key not in drill.graded)
try:
    drill.reveal(unanswered)
    raise AssertionError("a card was revealed before it was answered")
except NotAnsweredYet:
    pass
for card in CARDS:
    graded = drill.answer(card.key, card.reference())
    assert graded.passed, graded.feedback()
results = drill.reveal_all()
assert set(results) == {c.key for c in CARDS}, "every card has a reveal"
assert all(m.text for m in results.values()), "every card shows its model answer"
assert results["zero3_vs_fsdp"].value == 1.5, "ZeRO-3 sends 1.5x DDP's bytes"
fsdp = results["fsdp_shards"]
assert fsdp.value == fsdp.predicted, "FSDP holds Ψ/N of the weights, to the byte"
tp = results["tp_in_node"]
assert tp.value == tp.predicted, "TP's wire bytes per layer equal the estimate"
ddp = results["ddp_traffic"]
assert ddp.value == ddp.predicted, "DDP sends 2(N-1)/N·Ψ·4 bytes, to the byte"
# ZeRO-3 holds 1/N of stage 0's model states on N = 4 ranks, but for AdamW's
# 4-byte step counters
assert abs(results["zero_stages"].value - 4) < 1e-3, results["zero_stages"].value
assert results["accelerate_vs_deepspeed"].value < 1e-6, "accelerate trains to DDP"
assert results["processes"].value == 4, "one process per rank"
# measured over predicted, where a card predicts: bytes exactly; the bubble is the
# simulator against (p - 1)/(m + p - 1)
ratios = {k: m.value / m.predicted for k, m in results.items() if m.predicted}
assert all(abs(r - 1) < 1e-3 for r in ratios.values()), ratios
