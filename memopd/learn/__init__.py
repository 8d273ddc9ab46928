"""The learner, as components around one short step (see :mod:`memopd.learn.trainer`):

    trainer.py       the fit loop and the step: rollout -> pack -> advantages -> teacher ->
                     loss weights -> PPO + OPD update -> metrics; wires the components
    options.py       CoreConfig: the run's options, one slice per component
    actor.py         the rollout worker (built through agents.backends.factory)
    advantage.py     rewards, trajectory weights, cut episodes, GRPO / GAE, the step's metrics
    teachers/        one module per teacher kind, each declaring what it provides
    estimators/      one module per distillation estimator, each declaring what it needs
    needs.py         the one check of the run's needs against the teacher's capabilities
    update.py        the PPO + OPD epochs; owns the optimizers and the schedule
    student.py       the student in its distributed world (twin, wrappers, critic, reference)
    checkpointer.py  the run directory and its checkpoints
    observers.py     held-out evaluations, the RCE audit, sample episodes, the final export
    plugin.py        the plugin interface, the rules between plugins, --plugin resolution
    registry.py      classes by name, module:Class or entry point (plugins, estimators)
    state.py         the typed train state a checkpoint keeps
    models.py        student defaults and warm start, the auto teacher, the critic
    env_check.py     checks of --env and its settings before any model work

The training methods beyond PPO + OPD are plugins; the command line (memopd.train) composes the
built-in ones' options into its config. No module here names one.
"""
