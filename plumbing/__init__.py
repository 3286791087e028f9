"""Running a script, everything a reader of the algorithms can skip, one job per module: the
command line and config (cli), TRL's flag names (trl_flags) and defaults (trl_defaults), default
lengths fitted to the model (lengths), a user's mistake said in one message (errors), the run folder
(rundir), checkpoints (checkpoints), model files and loading (models), logging (logs), a user's
`module:function` code (user_code) and the worker processes that run it (workers). `python -m plumbing export OUT_DIR [DEST]` writes the Hugging
Face export of a run's resumable checkpoint."""
