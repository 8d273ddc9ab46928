"""Episodes JSONL: lossless round trip; a corrupt or truncated line is reported, not fatal."""

from __future__ import annotations

import json
import math

import pytest

from agents.records import Episode, Invocation, RecordError, load_episodes, save_episodes


def make_episode(k: int) -> Episode:
    inv_mem = Invocation(prompt_ids=[1, 2, 3, 4], response_ids=[7, 8, 2], logprobs=[-0.1, -1e-17, -math.pi],
                         position_ids=[0, 1, 2, 3, 4, 5, 6], prefix_len=2, role="memory", turn=0,
                         policy_version=3, finish_reason="eos", sampling={"temperature": 0.7, "top_p": 1.0},
                         timing={"start": 1.7e9 + k, "latency_s": 0.25}, response_text="hé ☃",
                         meta={"spans": {"memory": [2, 2]}, "oracle": False})
    inv_ans = Invocation(prompt_ids=[1, 2, 9], response_ids=[5], logprobs=[-2.5e-08],
                         position_ids=[10, 11, 12, 13], prefix_len=2, role="answer", turn=1, finish_reason="length")
    return Episode(episode_id=f"ep{k}", task_id="memgym/LongQA-v0", sample_id=f"s{k}", invocations=[inv_mem, inv_ans],
                   reward=0.5 + k, metrics={"em": 0.0, "f1": 0.5, "sub_em": 1.0}, prediction="acme",
                   answers=["acme", "Acme Corp"], question="which company?", seed=k, group_id="g0",
                   meta={"agent": "memagent"})


def test_round_trip_is_lossless(tmp_path):
    episodes = [make_episode(k) for k in range(3)]
    path = tmp_path / "eps.jsonl"
    assert save_episodes(path, episodes) == 3
    report = load_episodes(path)
    assert report.errors == []
    assert report.episodes == episodes  # dataclass equality: every field, floats bit-exact
    assert report.episodes[0].invocations[0].logprobs[2] == -math.pi


def test_append_adds_lines(tmp_path):
    path = tmp_path / "eps.jsonl"
    save_episodes(path, [make_episode(0)])
    save_episodes(path, [make_episode(1)], append=True)
    assert [e.episode_id for e in load_episodes(path).episodes] == ["ep0", "ep1"]


def test_corrupt_and_truncated_lines_are_reported_with_line_numbers(tmp_path):
    path = tmp_path / "eps.jsonl"
    save_episodes(path, [make_episode(k) for k in range(4)])
    lines = path.read_text(encoding="utf-8").splitlines()
    bad_lengths = json.loads(lines[2])
    bad_lengths["invocations"][0]["logprobs"] = [-0.1]  # one log-prob for three response tokens
    lines[1] = lines[1][: len(lines[1]) // 2]  # truncated mid-record (a crash while writing)
    lines[2] = json.dumps(bad_lengths)
    path.write_text("\n".join(lines + ["{not json"]) + "\n", encoding="utf-8")

    report = load_episodes(path)
    assert [e.episode_id for e in report.episodes] == ["ep0", "ep3"]
    assert [line for line, _ in report.errors] == [2, 3, 5]
    assert "invalid JSON" in report.errors[0][1]
    assert "invocation 0" in report.errors[1][1] and "logprobs" in report.errors[1][1]

    with pytest.raises(RecordError, match=r"eps\.jsonl:2: invalid JSON"):
        load_episodes(path, strict=True)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="episodes file not found"):
        load_episodes(tmp_path / "nope.jsonl")


def test_invalid_invocation_is_refused():
    with pytest.raises(RecordError, match="position_ids"):
        Invocation(prompt_ids=[1, 2], response_ids=[3], logprobs=[-1.0], position_ids=[0, 1], prefix_len=1)
    with pytest.raises(RecordError, match="prefix_len"):
        Invocation(prompt_ids=[1, 2], response_ids=[], logprobs=[], position_ids=[0, 1], prefix_len=3)


def test_spans_are_a_typed_field_and_legacy_meta_is_adopted(tmp_path):
    ep = make_episode(0)  # built with the old meta["spans"]
    inv = ep.invocations[0]
    assert inv.spans == {"memory": [2, 2]} and "spans" not in inv.meta
    legacy = Invocation(prompt_ids=[1, 2, 3], response_ids=[4], logprobs=[-1.0], position_ids=[0, 1, 2, 3],
                        prefix_len=1, meta={"memory_span": [1, 2]})
    assert legacy.spans == {"memory": [1, 2]}
    with pytest.raises(RecordError, match=r"spans\['memory'\]"):
        Invocation(prompt_ids=[1, 2], response_ids=[], logprobs=[], position_ids=[0, 1], prefix_len=0,
                   spans={"memory": [1, 5]})
    save_episodes(tmp_path / "e.jsonl", [ep])
    assert load_episodes(tmp_path / "e.jsonl").episodes[0].invocations[0].spans == {"memory": [2, 2]}


def test_wrong_shapes_and_binary_lines_are_reported_not_raised(tmp_path):
    good = make_episode(0).to_json()
    path = tmp_path / "mixed.jsonl"
    bad_invocation = json.dumps({**json.loads(good), "invocations": ["not an object"]})
    bad_ids = json.loads(good)
    bad_ids["invocations"][0]["prompt_ids"] = ["a", "b", "c", "d"]
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\n" + (good + "\n").encode() + (bad_invocation + "\n").encode()
                     + (json.dumps(bad_ids) + "\n").encode() + b'{"invocations": 5, "episode_id": 1, '
                     b'"task_id": 1, "sample_id": 1}\n[1, 2]\n')
    report = load_episodes(path)
    assert len(report.episodes) == 1
    msgs = dict(report.errors)
    assert "binary" in msgs[1] and "binary" in msgs[3] and "invalid JSON" in msgs[2]  # line 4 is good
    assert "JSON object" in msgs[5] and "integers" in msgs[6]
    assert "must be a list" in msgs[7] and "JSON object" in msgs[8]


def test_to_dict_is_asdict_without_its_deep_copy():
    """The writer's conversion against the standard library's: the same dict, equal and of the same
    container types, with new lists (a caller may change the dict without changing the record)."""
    from dataclasses import asdict

    ep = make_episode(0)
    ep.invocations[0].topk_ids, ep.invocations[0].topk_logprobs = [[7, 1], [8, 2], [2, 3]], [[-0.1, -3.0]] * 3
    ep.meta.update({"nested": {"pair": (1, [2.5, None]), "flag": True}, "cut": 2})
    ours, stdlib = ep.to_dict(), asdict(ep)
    assert ours == stdlib and json.dumps(ours) == json.dumps(stdlib)

    def types(x):
        if isinstance(x, dict):
            return {k: types(v) for k, v in x.items()}
        return [type(x).__name__, *map(types, x)] if isinstance(x, (list, tuple)) else type(x).__name__

    assert types(ours) == types(stdlib)
    ours["invocations"][0]["prompt_ids"].append(99)
    ours["meta"]["nested"]["pair"][1].append(0)
    assert ep.invocations[0].prompt_ids == [1, 2, 3, 4] and ep.meta["nested"]["pair"][1] == [2.5, None]
