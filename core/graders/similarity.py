"""Text similarity metrics, each equal to a reference implementation on the same strings (tests pin it):

fuzzy_match   rapidfuzz `fuzz.ratio` / 100 (the normalized Indel similarity of the two character sequences)
bleu          sacrebleu `sentence_bleu` / 100 (13a tokens, exp smoothing, effective order)
gleu          nltk `sentence_gleu` over whitespace tokens (n-grams 1..4)
rouge_n/l     rouge-score's F-measure (its tokenizer: lowercase ASCII letters and digits, no stemming)
cosine        of two embedding vectors
Pure Python: the API and the workers share it without the reference libraries installed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Hashable, Sequence


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence, bit-parallel (Allison-Dix / Hyyrö): O(len(b)) big-int steps."""
    if not a or not b:
        return 0
    masks: dict[Hashable, int] = {}
    for i, symbol in enumerate(a):
        masks[symbol] = masks.get(symbol, 0) | (1 << i)
    full = (1 << len(a)) - 1
    row = full
    for symbol in b:
        matches = row & masks.get(symbol, 0)
        row = ((row + matches) | (row - matches)) & full
    return len(a) - row.bit_count()


def fuzzy_match(text: str, reference: str) -> float:
    """1 - Indel distance / total length (rapidfuzz's fuzz.ratio / 100); two empty strings are equal."""
    total = len(text) + len(reference)
    return 1.0 if total == 0 else 2 * lcs_length(text, reference) / total


_13A = [(re.compile(r"([\{-\~\[-\` -\&\(-\+\:-\@\/])"), r" \1 "), (re.compile(r"([^0-9])([\.,])"), r"\1 \2 "),
        (re.compile(r"([\.,])([^0-9])"), r" \1 \2"), (re.compile(r"([0-9])(-)"), r"\1 \2 ")]


def tokens_13a(line: str) -> list[str]:
    """mteval-v13a's tokens, as sacrebleu's default tokenizer makes them."""
    line = line.rstrip().replace("<skipped>", "").replace("-\n", "").replace("\n", " ")
    if "&" in line:
        line = line.replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
    line = f" {line} "
    for pattern, replacement in _13A:
        line = pattern.sub(replacement, line)
    return line.split()


def ngrams(tokens: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    """Counts of the n-grams of one order."""
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def bleu(text: str, reference: str, max_order: int = 4) -> float:
    """Sentence BLEU in [0, 1]: sacrebleu's defaults (exp smoothing, effective order, brevity penalty)."""
    hyp, ref = tokens_13a(text), tokens_13a(reference)
    correct, total = [], []
    for n in range(1, max_order + 1):
        hyp_n, ref_n = ngrams(hyp, n), ngrams(ref, n)
        correct.append(sum(min(count, ref_n[gram]) for gram, count in hyp_n.items()))
        total.append(sum(hyp_n.values()))
    if not any(correct):
        return 0.0
    penalty = 1.0 if len(hyp) >= len(ref) else math.exp(1 - len(ref) / len(hyp))
    logs, smooth = [], 1.0
    for n in range(max_order):
        if total[n] == 0:
            break  # effective order: orders the hypothesis is too short for do not count
        if correct[n] == 0:
            smooth *= 2
            logs.append(math.log(1 / (smooth * total[n])))
        else:
            logs.append(math.log(correct[n] / total[n]))
    return penalty * math.exp(sum(logs) / len(logs))


def gleu(text: str, reference: str, min_order: int = 1, max_order: int = 4) -> float:
    """Google-BLEU: min(precision, recall) over all n-grams of orders min..max (nltk's sentence_gleu)."""
    hyp, ref = text.split(), reference.split()
    matched = possible_hyp = possible_ref = 0
    for n in range(min_order, max_order + 1):
        hyp_n, ref_n = ngrams(hyp, n), ngrams(ref, n)
        matched += sum((hyp_n & ref_n).values())
        possible_hyp += sum(hyp_n.values())
        possible_ref += sum(ref_n.values())
    denominator = max(possible_hyp, possible_ref)
    return 0.0 if denominator == 0 else matched / denominator


def tokens_rouge(text: str) -> list[str]:
    """rouge-score's default tokens: lowercased runs of ASCII letters and digits."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).split()


def _f_measure(overlap: int, predicted: int, target: int) -> float:
    precision, recall = overlap / max(predicted, 1), overlap / max(target, 1)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def rouge_n(text: str, reference: str, n: int) -> float:
    """ROUGE-n F-measure of the text against the reference."""
    hyp, ref = ngrams(tokens_rouge(text), n), ngrams(tokens_rouge(reference), n)
    return _f_measure(sum((hyp & ref).values()), sum(hyp.values()), sum(ref.values()))


def rouge_l(text: str, reference: str) -> float:
    """ROUGE-L F-measure: the longest common token subsequence."""
    hyp, ref = tokens_rouge(text), tokens_rouge(reference)
    if not hyp or not ref:
        return 0.0
    return _f_measure(lcs_length(ref, hyp), len(hyp), len(ref))


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 when either is all zeros)."""
    if len(a) != len(b):
        raise ValueError(f"vectors of different lengths ({len(a)} and {len(b)})")
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return 0.0 if norm == 0 else sum(x * y for x, y in zip(a, b, strict=True)) / norm


def text_metric(metric: str, text: str, reference: str) -> float:
    """Every metric computed from the two texts alone (cosine needs embeddings: core.graders.run)."""
    if metric == "fuzzy_match":
        return fuzzy_match(text, reference)
    if metric == "bleu":
        return bleu(text, reference)
    if metric == "gleu":
        return gleu(text, reference)
    if metric == "rouge_l":
        return rouge_l(text, reference)
    if metric.startswith("rouge_") and metric[6:].isdigit():
        return rouge_n(text, reference, int(metric[6:]))
    raise ValueError(f"no text metric {metric!r}")
