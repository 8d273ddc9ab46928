"""Answer scoring: SQuAD v1.1 normalisation, exact match, token F1 and substring EM.

The normalisation and the EM/F1 definitions follow the official SQuAD v1.1 evaluation script
(``evaluate-v1.1.py``) exactly, including its edge cases:

- text is lowercased, ASCII punctuation (``string.punctuation``) is removed, the articles
  ``a``/``an``/``the`` are removed as whole words, and whitespace runs become one space;
- two answers that both normalise to ``""`` are an exact match (EM 1), but their F1 is 0
  (there is no common token);
- a prediction is scored against every gold answer and the best score is kept, per metric.

Unicode: the official script only strips ASCII punctuation, and so does this module; we keep
that behaviour so scores stay comparable with published numbers. Consequences:
``str.lower`` is Unicode-aware (``"CAFÉ" -> "café"``), ``str.split`` splits on any Unicode
whitespace (no-break space, ideographic space), ``\\b`` in the article regex is Unicode-aware,
but non-ASCII punctuation such as ``« » “ ” ’ — 。 ！`` is *kept* (``"«Paris»"`` does not
exactly match ``"Paris"``; sub-EM still gives it credit). Accents are not folded and no Unicode
normal form is applied (``"é"`` precomposed and ``"e\\u0301"`` differ), as in the official script.

Sub-EM (``sub_em``) is 1 when the normalised prediction contains the normalised gold answer or
the other way round. An empty (after normalisation) prediction or gold answer scores 0, so
``"" in anything`` can never give credit.

HotpotQA's rule (``hotpot_rules=True``, from the official ``hotpot_evaluate_v1.py``): when the
normalised prediction or gold answer is one of ``yes``/``no``/``noanswer`` and the two differ,
F1 is 0. We apply the same rule to sub-EM (otherwise ``"yes or no"`` would match both ``"yes"``
and ``"no"``); EM is unaffected (the answers differ, so EM is already 0).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Iterable, Mapping, Sequence

METRICS = ("em", "f1", "sub_em")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
_HOTPOT_SPECIAL = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower, drop ASCII punctuation, drop articles, fix whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _f1_normalized(pred: str, gold: str) -> float:
    pred_tokens, gold_tokens = pred.split(), gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _sub_em_normalized(pred: str, gold: str) -> float:
    if not pred or not gold:
        return 0.0
    return float(gold in pred or pred in gold)


def _hotpot_mismatch(pred: str, gold: str) -> bool:
    return pred != gold and (pred in _HOTPOT_SPECIAL or gold in _HOTPOT_SPECIAL)


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return max((float(pred == normalize_answer(a)) for a in _check_answers(answers)))


def f1(prediction: str, answers: Sequence[str], hotpot_rules: bool = False) -> float:
    """Best token-multiset F1 between the prediction and any gold answer."""
    return score_answer(prediction, answers, hotpot_rules)["f1"]


def sub_em(prediction: str, answers: Sequence[str], hotpot_rules: bool = False) -> float:
    """1.0 if the normalised prediction and any normalised gold answer contain one another."""
    return score_answer(prediction, answers, hotpot_rules)["sub_em"]


def score_answer(prediction: str, answers: Sequence[str], hotpot_rules: bool = False) -> dict[str, float]:
    """Score one prediction against its gold answers: ``{"em", "f1", "sub_em"}``, each in [0, 1].

    Each metric is the maximum over the gold answers (taken separately per metric, as in the
    official scripts).
    """
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    pred = normalize_answer(prediction)
    best = dict.fromkeys(METRICS, 0.0)
    for answer in _check_answers(answers):
        gold = normalize_answer(answer)
        em = float(pred == gold)
        if hotpot_rules and _hotpot_mismatch(pred, gold):
            f1_score, sub = 0.0, 0.0
        else:
            f1_score, sub = _f1_normalized(pred, gold), _sub_em_normalized(pred, gold)
        best["em"] = max(best["em"], em)
        best["f1"] = max(best["f1"], f1_score)
        best["sub_em"] = max(best["sub_em"], sub)
    return best


def aggregate(scores: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Mean of every numeric field over examples, plus ``n`` (the number of examples).

    ``em``/``f1``/``sub_em`` always appear (0.0 with no examples); other fields whose values
    are numbers (not bools) are averaged over the examples that have them; the rest is ignored.
    """
    scores = list(scores)
    extra = {k for s in scores for k, v in s.items() if _is_number(v)} - set(METRICS) - {"n"}
    keys = list(METRICS) + sorted(extra)
    out: dict[str, float] = {"n": len(scores)}
    for key in keys:
        values = [float(s[key]) for s in scores if _is_number(s.get(key))]
        out[key] = sum(values) / len(values) if values else 0.0
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_answers(answers: Sequence[str]) -> Sequence[str]:
    if isinstance(answers, str):
        raise TypeError("answers must be a list of strings, got a single str (wrap it: [answer])")
    if not answers:
        raise ValueError("answers is empty: give at least one gold answer")
    for a in answers:
        if not isinstance(a, str):
            raise TypeError(f"every gold answer must be a str, got {type(a).__name__}: {a!r}")
    return answers
