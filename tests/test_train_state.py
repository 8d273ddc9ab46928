"""The typed train state a checkpoint keeps, and the older checkpoint layout read into it."""

from __future__ import annotations

from memopd.train import TrainState


def test_a_checkpoint_of_the_older_layout_is_read_into_the_typed_state():
    # the trainer state as checkpoints held it before the learner's components: a `history` grab-bag
    legacy = {"step": 4, "format": "safetensors", "scheduler": {}, "bad_steps": 1,
              "history": {"eval_teacher": {"f1": 1.0}, "eval_before": {"f1": 0.1}, "eval_after": {"f1": 0.5},
                          "eval_after_step": 3, "train_clock": 12.5, "depth": 2},
              "rows": [{"step": 4, "loss": 0.3}], "stale_queue": [[{"episode_id": "step1/0/0"}]],
              "async": {"runs": [[0, 7]]}}
    s = TrainState.from_checkpoint(legacy)
    assert (s.step, s.bad_steps, s.train_clock) == (4, 1, 12.5)
    assert (s.eval_teacher, s.eval_before, s.eval_after, s.eval_after_step) == ({"f1": 1.0}, {"f1": 0.1},
                                                                              {"f1": 0.5}, 3)
    assert s.rows == [{"step": 4, "loss": 0.3}]
    assert s.plugins == {"turn_opd": {"depth": 2}, "staleness": {"queue": [[{"episode_id": "step1/0/0"}]]},
                         "async": {"units": {"runs": [[0, 7]]}}}


def test_the_typed_state_round_trips_through_a_checkpoint_dict():
    s = TrainState(step=7, bad_steps=0, train_clock=1.5, eval_before={"f1": 0.2}, rows=[{"step": 7}],
                   plugins={"turn_opd": {"depth": 3}})
    assert TrainState.from_checkpoint({"step": 7, "train_state": s.to_dict()}) == s
