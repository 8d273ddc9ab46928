"""The learner, as components around one short step (see :mod:`memopd.learn.trainer`):

    options.py    TrainConfig: the options of memopd.train, one slice per component
    trainer.py    the fit loop and the step: rollout -> pack -> advantages -> teacher ->
                  loss weights -> PPO + OPD update -> metrics
    actor.py      the rollout worker (built through agents.backends.factory)
    advantage.py  rewards, trajectory weights, cut episodes, GRPO / GAE
    teacher.py    the Teacher interface: local and FSDP-sharded teachers
    remote_teacher.py  a teacher behind a stock vllm serve (--teacher URL)
    update.py     the PPO + OPD epochs, scales, clipping, rollout/trainer mismatch
    plugin.py     the plugin interface: rollout, loss weights, end of step, options, state
    state.py      the typed train state a checkpoint keeps
    models.py     student defaults and warm start, the auto teacher, the critic
    env_check.py  checks of --env and its settings before any model work

The built-in methods beyond PPO + OPD are plugins in :mod:`memopd.plugins`.
"""
