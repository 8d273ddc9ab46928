"""The learner's contract with an agent (memopd.contexts.check_contract): records that lack what a
mode, the reward or the teacher mask needs are refused, naming the episode, its agent and the
field; the typed Episode.agent field reads legacy records."""

from __future__ import annotations

import copy
import json

import pytest

from agents.records import Episode, RecordError
from memopd.contexts import ContractError, PackingError, check_contract
from memopd.packing import pack_episodes


@pytest.fixture(scope="module")
def episodes(tiny):
    """Real records: the oracle's episodes on LongQA (tiny tokenizer, no model calls)."""
    from memopd.sft import oracle_episodes

    return oracle_episodes("memgym/LongQA-v0", {"num_chunks": 2}, tiny[1], 3, seed=0, progress=False)


def test_good_records_pass_every_mode(episodes):
    assert all(e.agent == "oracle" for e in episodes)
    for mode in ("aligned", "persistent"):
        check_contract(episodes, mode, teacher_roles=("memory", "answer"), reward="f1")
        pack_episodes(episodes, 4096, mode=mode)  # and they pack


def test_missing_spans_refused_for_the_persistent_control_only(episodes):
    eps = copy.deepcopy(episodes)
    eps[1].invocations[1].spans = None
    check_contract(eps, "aligned")  # aligned restores each call as recorded: no spans needed
    with pytest.raises(ContractError, match=r"episode 1 \(.*, agent oracle\) invocation 1 has no spans.*"
                                            r"Invocation.spans"):
        check_contract(eps, "persistent")
    with pytest.raises(PackingError, match=r"episode 1 \(.*, agent oracle\) invocation 1 has no spans"):
        pack_episodes(eps, 4096, mode="persistent")  # the same message from unit building


def test_memory_span_outside_the_private_prompt_and_a_changed_prefix_are_refused(episodes):
    eps = copy.deepcopy(episodes)
    eps[0].invocations[1].spans = {"memory": [0, 2]}  # inside the shared prefix
    with pytest.raises(ContractError, match=r"episode 0 \(.*agent oracle\) invocation 1: spans\['memory'\]"):
        check_contract(eps, "persistent")
    eps = copy.deepcopy(episodes)
    inv = eps[2].invocations[1]
    inv.prompt_ids[0] += 1  # the task prefix of call 1 is not call 0's
    with pytest.raises(ContractError, match=r"episode 2 \(.*agent oracle\) invocation 1: its shared prefix"):
        check_contract(eps, "persistent")


def test_a_record_edited_after_sampling_is_refused_with_its_field(episodes):
    eps = copy.deepcopy(episodes)
    eps[0].invocations[0].logprobs.pop()
    with pytest.raises(ContractError, match=r"episode 0 \(.*agent oracle\) invocation 0: logprobs has"):
        check_contract(eps, "aligned")
    eps = copy.deepcopy(episodes)
    eps[1].invocations[0].role = "note"
    with pytest.raises(ContractError, match=r"episode 1 .* invocation 0: role 'note' is not one of"):
        check_contract(eps, "aligned")


def test_reward_and_metrics_must_be_there_and_finite(episodes):
    eps = copy.deepcopy(episodes)
    eps[2].metrics = {"accuracy": 1.0}
    check_contract(eps, "aligned")  # no reward asked for
    with pytest.raises(ContractError, match=r"episode 2 \(.*agent oracle\): Episode.metrics has no 'f1' "
                                            r"\(it has \['accuracy'\]\)"):
        check_contract(eps, "aligned", reward="f1")
    eps = copy.deepcopy(episodes)
    eps[0].reward = float("nan")
    with pytest.raises(ContractError, match=r"episode 0 .*: Episode.reward is nan, not a finite number"):
        check_contract(eps, "aligned")


def test_teacher_mask_must_select_some_sampled_token(episodes):
    answers_only = copy.deepcopy(episodes)
    for e in answers_only:
        e.invocations = [i for i in e.invocations if i.role == "answer"]
        e.agent = "reader"
    check_contract(answers_only, "aligned", teacher_roles=("answer",))
    with pytest.raises(ContractError, match=r"agent reader: the teacher mask selects role\(s\) \['memory'\] but "
                                            r"every sampled token is in a call of role \['answer'\].*Invocation.role"):
        check_contract(answers_only, "aligned", teacher_roles=("memory",))


def test_episodes_without_any_model_call_are_refused(episodes):
    eps = copy.deepcopy(episodes)
    for e in eps:
        e.invocations = []
    with pytest.raises(ContractError, match=r"agent oracle: 3 episodes hold no sampled token"):
        check_contract(eps, "aligned")
    with pytest.raises(ContractError, match=r"episode 0: expected an agents.records.Episode"):
        check_contract([e.invocations for e in eps], "aligned")


def test_episode_agent_is_a_typed_field_that_adopts_legacy_meta(episodes):
    d = episodes[0].to_dict()
    assert d["agent"] == "oracle" and "agent" not in d["meta"]
    legacy = {k: v for k, v in d.items() if k != "agent"}
    legacy["meta"] = {**d["meta"], "agent": "memagent"}  # how records were written before the field
    old = Episode.from_json(json.dumps(legacy))
    assert old.agent == "memagent" and "agent" not in old.meta
    assert Episode.from_dict(old.to_dict()) == old  # and it round-trips as a field
    with pytest.raises(RecordError, match="agent must be the agent's name"):
        Episode.from_dict({**d, "agent": 3})
