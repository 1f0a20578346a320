"""The interview drill's cards: each a question with a rubric of the facts and
numbers a strong answer contains (:class:`Point`), the misconceptions it must not
contain, and follow-ups graded the same way; :func:`grade` scores an answer and
names what is missing; :class:`MockRound` times a round of cards.

Taught in chapter 10 (interview drill), and checked by :mod:`.ch10_drill`.

The rubric reads the answer as text, so it checks that the facts are *there*, not
that the reasoning joining them holds: it is the interviewer's checklist, not the
interviewer.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

__all__ = ["Point", "Card", "Grade", "CARDS", "all_cards", "grade", "MockRound"]


@dataclass(frozen=True)
class Point:
    """One fact a strong answer contains: earned when any of ``patterns`` (regular
    expressions, on the answer lower-cased, with −, ×, Ψ written -, x, psi)
    matches."""

    label: str
    patterns: tuple[str, ...]

    def earned(self, text: str) -> bool:
        return any(re.search(p, text) for p in self.patterns)


@dataclass(frozen=True)
class Card:
    """A question, its rubric, the misconceptions it must not contain (``(pattern,
    correction)``) and its follow-ups (cards keyed ``"<card>/<follow-up>"``)."""

    key: str
    question: str
    points: tuple[Point, ...]
    misconceptions: tuple[tuple[str, str], ...] = ()
    follow_ups: tuple[Card, ...] = ()
    pass_mark: float = 0.75


@dataclass
class Grade:
    """What :func:`grade` found: the points earned of the rubric, the missing ones
    by label, the misconceptions with their corrections."""

    key: str
    earned: list[str]
    missing: list[str]
    misconceptions: list[str]
    pass_mark: float
    seconds: float | None = None

    @property
    def score(self) -> float:
        total = len(self.earned) + len(self.missing)
        return len(self.earned) / total if total else 1.0

    @property
    def passed(self) -> bool:
        return self.score >= self.pass_mark and not self.misconceptions

    def __str__(self) -> str:
        lines = [
            f"{self.key}: {len(self.earned)}/{len(self.earned) + len(self.missing)}"
        ]
        lines += [f"  missing: {m}" for m in self.missing]
        lines += [f"  wrong: {m}" for m in self.misconceptions]
        return "\n".join(lines)


def _normalise(text: str) -> str:
    text = str(text).lower()
    for a, b in (("−", "-"), ("–", "-"), ("×", "x"), ("ψ", "psi"), ("·", " ")):
        text = text.replace(a, b)
    return re.sub(r"\s+", " ", text)


P = Point  # the rubrics below read as tables


CARDS: dict[str, Card] = {
    c.key: c
    for c in (
        Card(
            "ddp_traffic",
            "How many bytes does each GPU send per step under DDP, and why does it "
            "not grow with the number of GPUs?",
            (
                P("the gradients are all-reduced", (r"all-?reduce",)),
                P(
                    "ring: a reduce-scatter then an all-gather",
                    (r"reduce-?scatter.*all-?gather", r"all-?gather.*reduce-?scatter"),
                ),
                P(
                    "2(N−1)/N·Ψ·bytes per GPU, about 2Ψ",
                    (r"2 ?\(n ?- ?1\) ?/ ?n", r"\b2 ?psi"),
                ),
                P(
                    "independent of N: bandwidth-optimal",
                    (r"independent of n", r"bandwidth-optimal", r"does not grow"),
                ),
                P("in buckets, overlapped with backward", (r"bucket", r"overlap")),
            ),
            (
                (
                    r"\(n ?- ?1\) ?(x|\*)? ?psi(?! ?/)",
                    "each GPU sends 2(N−1)/N·Ψ, not (N−1)·Ψ: the ring cuts the tensor "
                    "into N chunks",
                ),
            ),
            (
                Card(
                    "ddp_traffic/slower_network",
                    "The network is now 4× slower: what changes?",
                    (
                        P("each all-reduce takes 4× as long", (r"\b4 ?(x|times)",)),
                        P(
                            "less hides behind backward: exposed",
                            (r"expos", r"no longer hid", r"less of it hides"),
                        ),
                        P(
                            "amortise: accumulate, bigger buckets, fewer syncs",
                            (r"accumulat", r"bigger bucket", r"fewer all-?reduces"),
                        ),
                    ),
                ),
            ),
        ),
        Card(
            "zero_stages",
            "What do ZeRO stages 1, 2 and 3 shard, what does each save per GPU for "
            "mixed-precision Adam, and what does stage 3 cost?",
            (
                P(
                    "16 bytes per parameter: 2 + 2 + 12",
                    (r"2 ?\+ ?2 ?\+ ?12", r"\b16 ?(b|bytes)\b"),
                ),
                P("stage 1 shards the optimizer states", (r"stage 1[^.;]*optimi",)),
                P("stage 2 also shards the gradients", (r"stage 2[^.;]*gradient",)),
                P(
                    "stage 3 also shards the parameters",
                    (r"stage 3[^.;]*(param|weight)",),
                ),
                P("stage 3: 3Ψ, 1.5× DDP's traffic", (r"\b3 ?psi", r"1\.5 ?x")),
            ),
            (
                (
                    r"stage 1 (also )?shards (the )?gradients",
                    "stage 1 shards only the optimizer states; the gradients are whole "
                    "until stage 2",
                ),
            ),
            (
                Card(
                    "zero_stages/offload",
                    "ZeRO-Offload: what moves, and how large a model fits on one V100?",
                    (
                        P(
                            "optimizer states (and gradients) in CPU memory",
                            (r"cpu memory", r"host memory", r"on the host"),
                        ),
                        P(
                            "the optimizer step runs on the CPU",
                            (
                                r"(adam|optimizer) (step )?(runs )?on the cpu",
                                r"cpu[^.;]*(adam|optimizer step)",
                            ),
                        ),
                        P("13B on a single V100 (Ren et al. 2021)", (r"\b13 ?b\b",)),
                    ),
                    (
                        (
                            r"\b10 ?b\b",
                            "Ren et al. report 13B on a single V100, not 10B",
                        ),
                    ),
                ),
            ),
        ),
        Card(
            "one_f_one_b",
            "Explain 1F1B: its warm-up, what it holds, and its bubble.",
            (
                P(
                    "warm-up of p − stage − 1 forwards",
                    (r"p ?- ?(i|s|stage|r) ?- ?1 forward",),
                ),
                P(
                    "steady state: one forward, one backward",
                    (r"one forward[^.;]*one backward", r"alternat"),
                ),
                P(
                    "holds at most p − stage microbatches (GPipe: m)",
                    (r"at most p ?- ?(i|s|stage|r)\b",),
                ),
                P(
                    "bubble (p−1)/(m+p−1), as GPipe's",
                    (r"\(p ?- ?1\) ?/ ?\(m ?\+ ?p ?- ?1\)",),
                ),
                P("interleaving divides the bubble by v", (r"interleav",)),
            ),
            (
                (
                    r"warms? up with p ?- ?1 forwards",
                    "the warm-up is p − stage − 1 forwards: p − 1 on the first stage "
                    "only",
                ),
            ),
            (
                Card(
                    "one_f_one_b/more_microbatches",
                    "You double the number of microbatches m. What happens to the "
                    "bubble and to activation memory?",
                    (
                        P(
                            "the bubble shrinks",
                            (r"bubble (shrinks|falls|gets smaller|halves)",),
                        ),
                        P(
                            "1F1B's activation memory stays the same",
                            (r"(stays|remains) the same", r"unchanged"),
                        ),
                        P("GPipe would hold twice as many", (r"gpipe",)),
                    ),
                ),
            ),
        ),
        Card(
            "mixed_precision",
            "Mixed precision with Adam: bytes per parameter, what stays in fp32, and "
            "why does fp16 need a loss scale and bf16 not?",
            (
                P("16 bytes per parameter: 2 + 2 + 12", (r"2 ?\+ ?2 ?\+ ?12",)),
                P("fp32 master weights and moments", (r"master",)),
                P(
                    "fp16's 5 exponent bits: small gradients underflow",
                    (r"underflow", r"flush"),
                ),
                P(
                    "bf16 has fp32's 8 exponent bits: no scaling",
                    (
                        r"bf16 has fp32's 8",
                        r"bf16[^.;]*no (loss )?scal",
                        r"bf16[^.;]*needs no",
                    ),
                ),
                P(
                    "the saving is activations and traffic, not model states",
                    (r"not in model states", r"activations[^.;]*traffic"),
                ),
            ),
            (
                (
                    r"4 extra bytes",
                    "against fp32 Adam's 16 B it costs nothing extra (2 + 2 + 12 "
                    "= 16); "
                    "against pure bf16 (8 B) it is +8, not +4",
                ),
            ),
            (
                Card(
                    "mixed_precision/one_rank_overflows",
                    "One rank finds an inf in its gradients and the others do not. "
                    "What must happen?",
                    (
                        P(
                            "every rank skips the step together",
                            (r"(all|every) ranks? (must )?skip",),
                        ),
                        P(
                            "the found-inf flag is all-reduced (MAX)",
                            (r"all-?reduced? with max", r"\bmax\b"),
                        ),
                        P("every rank backs off the scale", (r"backs? off", r"halves")),
                        P(
                            "else replicas diverge, or collectives hang",
                            (r"diverge", r"hang"),
                        ),
                    ),
                ),
            ),
        ),
        Card(
            "long_context",
            "How do context parallelism and expert parallelism extend 3D "
            "parallelism, and what does each send?",
            (
                P(
                    "CP splits the sequence of every sample: activations ÷ cp",
                    (r"(split|shard)s? (the|every|each) (sample's )?sequence",),
                ),
                P(
                    "CP keeps the weights replicated (gradients over dp·cp)",
                    (r"weights[^.;]*replicated", r"replicat\w* the weights"),
                ),
                P(
                    "ring attention: K/V blocks round the ring, merged by log-sum-exp",
                    (r"log-?sum-?exp", r"online softmax"),
                ),
                P(
                    "Ulysses: all-to-all to a head shard; cp must divide the heads",
                    (r"ulysses[^.]*head", r"head[^.]*ulysses"),
                ),
                P(
                    "EP shards the experts; tokens travel by all-to-all",
                    (r"experts?[^.]*all-?to-?all", r"all-?to-?all[^.]*experts?"),
                ),
                P(
                    "capacity: dropped tokens; the hottest expert's rank is the "
                    "straggler",
                    (r"capacity", r"imbalanc", r"dropped"),
                ),
            ),
            (
                (
                    r"cp (also )?(shards|splits) the (weights|parameters)",
                    "context parallelism replicates the weights, as dp does: only "
                    "the sequence (and its activations) is split",
                ),
            ),
            (
                Card(
                    "long_context/gqa_across_nodes",
                    "The model has 64 query heads and 8 K/V heads, and cp = 16 must "
                    "span two nodes: ring attention or Ulysses?",
                    (
                        P(
                            "Ulysses is bounded by the heads: 8 K/V heads < cp = 16",
                            (r"k ?/ ?v heads", r"kv heads"),
                        ),
                        P(
                            "GQA makes the ring's K/V blocks small",
                            (r"small", r"16x? (fewer|less)", r"8x? (fewer|less)"),
                        ),
                        P(
                            "the ring's sends overlap the block's compute",
                            (r"overlap", r"hid(e|es|den) behind"),
                        ),
                        P(
                            "the ring across nodes (Ulysses inside one: USP)",
                            (r"ring[^.]*across", r"across[^.]*ring", r"\busp\b"),
                        ),
                    ),
                ),
            ),
        ),
    )
}


def all_cards() -> dict[str, Card]:
    """Every card and follow-up by key."""
    out = {}
    for card in CARDS.values():
        out[card.key] = card
        out.update({f.key: f for f in card.follow_ups})
    return out


def grade(key: str, answer: str, seconds: float | None = None) -> Grade:
    """Score ``answer`` to card ``key`` against its rubric."""
    cards = all_cards()
    if key not in cards:
        raise ValueError(f"no card {key!r}: choose one of {sorted(cards)}")
    card, text = cards[key], _normalise(answer)
    earned = [p.label for p in card.points if p.earned(text)]
    missing = [p.label for p in card.points if not p.earned(text)]
    wrong = [fix for pattern, fix in card.misconceptions if re.search(pattern, text)]
    return Grade(key, earned, missing, wrong, card.pass_mark, seconds)


@dataclass
class MockRound:
    """A timed round: ``n`` cards, ``seconds`` for each answer. ``ask()`` gives the
    next question and starts its clock; ``answer(text)`` grades it with the time
    taken; :meth:`summary` names what was missed and what ran over time."""

    n: int = 3
    seconds: float = 180.0
    seed: int = 0
    clock: object = time.monotonic
    grades: list[Grade] = field(default_factory=list)

    def __post_init__(self):
        keys = sorted(all_cards())
        order = torch.randperm(
            len(keys), generator=torch.Generator().manual_seed(self.seed)
        )
        self.keys = [keys[i] for i in order[: self.n]]
        self._asked = None

    def ask(self) -> str | None:
        if len(self.grades) == len(self.keys):
            return None
        key = self.keys[len(self.grades)]
        self._asked = (key, self.clock())
        return all_cards()[key].question

    def answer(self, text: str) -> Grade:
        if self._asked is None:
            raise ValueError("call ask() first: it starts the question's clock")
        key, t0 = self._asked
        self._asked = None
        g = grade(key, text, seconds=self.clock() - t0)
        self.grades.append(g)
        return g

    def summary(self) -> str:
        lines = []
        for g in self.grades:
            late = g.seconds is not None and g.seconds > self.seconds
            lines.append(f"{g}" + (f"\n  over time: {g.seconds:.0f} s" if late else ""))
        return "\n".join(lines)
