"""memgym.scoring against an independent copy of the official SQuAD v1.1 / HotpotQA logic."""

import re
import string
from collections import Counter

import pytest

from memgym.scoring import aggregate, exact_match, f1, normalize_answer, score_answer, sub_em


# --- Reference: the official evaluate-v1.1.py functions, written out independently -----------
def ref_normalize_answer(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def ref_f1_score(prediction, ground_truth):
    prediction_tokens = ref_normalize_answer(prediction).split()
    ground_truth_tokens = ref_normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def ref_exact_match_score(prediction, ground_truth):
    return ref_normalize_answer(prediction) == ref_normalize_answer(ground_truth)


def ref_metric_max_over_ground_truths(metric_fn, prediction, ground_truths):
    return max(metric_fn(prediction, gt) for gt in ground_truths)


def ref_hotpot_f1(prediction, ground_truth):
    # hotpot_evaluate_v1.py: the yes/no/noanswer rule, then SQuAD F1.
    p, g = ref_normalize_answer(prediction), ref_normalize_answer(ground_truth)
    if p in ["yes", "no", "noanswer"] and p != g:
        return 0
    if g in ["yes", "no", "noanswer"] and p != g:
        return 0
    return ref_f1_score(prediction, ground_truth)


# (prediction, gold answers): articles, punctuation, case, whitespace, several golds, unicode, empty.
CASES = [
    ("The Eiffel Tower", ["Eiffel Tower"]),
    ("an apple a day", ["apple day"]),
    ("theatre", ["the atre"]),  # 'the' inside a word is not an article
    ("Anthem", ["them"]),
    ("A. Lincoln", ["Lincoln"]),
    ("U.S.A.", ["USA"]),
    ("rock 'n' roll", ["rock n roll"]),
    ("  New\tYork \n City ", ["new york city"]),
    ("PARIS", ["paris"]),
    ("Paris, France", ["Paris", "France", "Paris France"]),
    ("the the the", ["the"]),
    ("cat cat dog", ["cat dog dog"]),  # multiset overlap, not set overlap
    ("1,000,000", ["1000000"]),
    ("1 000 000", ["1000000"]),
    ("Barack Obama", ["Obama", "President Barack Obama"]),
    ("wrong", ["right", "also right"]),
    ("", ["something"]),
    ("", [""]),
    ("a", ["the"]),
    ("...", ["!!!"]),
    ("something", [""]),
    ("Café Müller", ["café müller"]),
    ("CAFÉ", ["café"]),
    ("«Paris»", ["Paris"]),  # non-ASCII punctuation is kept by the official logic
    ("“quoted”", ["quoted"]),
    ("l’amour", ["l'amour"]),
    ("東京。", ["東京"]),
    ("New\u00a0York", ["new york"]),  # no-break space splits like any whitespace
    ("東京\u3000タワー", ["東京 タワー"]),
    ("Straße", ["STRASSE"]),  # str.lower does not case-fold ß
    ("e\u0301tude", ["\u00e9tude"]),  # no Unicode normal form is applied
    ("The Ärzte", ["ärzte"]),
    ("yes", ["no"]),
    ("no", ["No."]),
    ("yes it is", ["yes"]),
]


@pytest.mark.parametrize("prediction,answers", CASES)
def test_matches_official_squad_v11(prediction, answers):
    got = score_answer(prediction, answers)
    assert got["em"] == float(ref_metric_max_over_ground_truths(ref_exact_match_score, prediction, answers))
    assert got["f1"] == pytest.approx(ref_metric_max_over_ground_truths(ref_f1_score, prediction, answers))
    assert exact_match(prediction, answers) == got["em"]
    assert f1(prediction, answers) == got["f1"]
    for a in answers:
        assert normalize_answer(a) == ref_normalize_answer(a)
    assert normalize_answer(prediction) == ref_normalize_answer(prediction)


@pytest.mark.parametrize("prediction,answers", CASES)
def test_matches_official_hotpot_f1(prediction, answers):
    got = score_answer(prediction, answers, hotpot_rules=True)
    assert got["f1"] == pytest.approx(ref_metric_max_over_ground_truths(ref_hotpot_f1, prediction, answers))
    assert got["em"] == score_answer(prediction, answers)["em"]


def test_known_values():
    assert score_answer("the cat sat", ["a cat"]) == {"em": 0.0, "f1": pytest.approx(2 / 3), "sub_em": 1.0}
    assert score_answer("The Cat!", ["cat"]) == {"em": 1.0, "f1": 1.0, "sub_em": 1.0}
    # Max over golds is taken per metric: F1 from one gold, sub-EM from another.
    s = score_answer("red blue", ["red green", "blue"])
    assert s == {"em": 0.0, "f1": pytest.approx(2 / 3), "sub_em": 1.0}


def test_unicode_behaviour_documented():
    assert normalize_answer("  CAFÉ  au LAIT ") == "café au lait"
    assert normalize_answer("«Paris»") == "«paris»"  # kept: not in string.punctuation
    assert score_answer("«Paris»", ["Paris"]) == {"em": 0.0, "f1": 0.0, "sub_em": 1.0}
    assert normalize_answer("A\u00a0B\u3000C") == "b c"  # 'a' removed, Unicode spaces split
    assert normalize_answer("e\u0301") != normalize_answer("\u00e9")


def test_empty_strings():
    # Official v1.1: two empty answers match exactly but have F1 0; sub-EM never credits empty.
    assert score_answer("", [""]) == {"em": 1.0, "f1": 0.0, "sub_em": 0.0}
    assert score_answer("", ["Paris"]) == {"em": 0.0, "f1": 0.0, "sub_em": 0.0}
    assert score_answer("the", ["Paris"])["sub_em"] == 0.0  # normalises to empty
    assert score_answer("Paris", ["the"])["sub_em"] == 0.0


def test_sub_em_both_directions():
    assert sub_em("Paris", ["The city of Paris, France"]) == 1.0
    assert sub_em("He was born in Paris in 1900.", ["Paris"]) == 1.0
    assert sub_em("Pari", ["Paris"]) == 1.0  # substring on characters, as the name says
    assert sub_em("London", ["Paris"]) == 0.0


def test_hotpot_rule():
    assert score_answer("yes it is", ["yes"])["f1"] == pytest.approx(0.5)
    assert score_answer("yes it is", ["yes"], hotpot_rules=True) == {"em": 0.0, "f1": 0.0, "sub_em": 0.0}
    assert score_answer("yes or no", ["no"], hotpot_rules=True)["sub_em"] == 0.0
    assert score_answer("no", ["yes"], hotpot_rules=True)["f1"] == 0.0
    assert score_answer("Yes.", ["yes"], hotpot_rules=True) == {"em": 1.0, "f1": 1.0, "sub_em": 1.0}
    # Not a special answer on either side: the rule changes nothing.
    assert score_answer("the yes men", ["yes men"], hotpot_rules=True)["f1"] == 1.0


def test_bad_input():
    with pytest.raises(TypeError, match="single str"):
        score_answer("x", "x")
    with pytest.raises(ValueError, match="at least one"):
        score_answer("x", [])
    with pytest.raises(TypeError, match="prediction must be a str"):
        score_answer(None, ["x"])
    with pytest.raises(TypeError, match="gold answer must be a str"):
        score_answer("x", ["x", 3])


def test_aggregate():
    scores = [score_answer("x y", ["x y"]), score_answer("x", ["y"]), score_answer("y z", ["x y"])]
    agg = aggregate(scores)
    assert agg["n"] == 3
    assert agg["em"] == pytest.approx(1 / 3)
    assert agg["f1"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert agg["sub_em"] == pytest.approx(1 / 3)
    assert aggregate([]) == {"n": 0, "em": 0.0, "f1": 0.0, "sub_em": 0.0}


def test_aggregate_ignores_non_numeric_fields():
    rows = [{"id": "a", "em": 1.0, "f1": 1.0, "sub_em": 1.0, "missing": False, "steps": 2},
            {"id": "b", "em": 0.0, "f1": 0.5, "sub_em": 0.0, "missing": True, "steps": 4}]
    assert aggregate(rows) == {"n": 2, "em": 0.5, "f1": 0.75, "sub_em": 0.5, "steps": 3.0}
