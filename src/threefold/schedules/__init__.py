"""Pipeline schedules as data, in pure Python (no torch): the registry (registry.py: one `ScheduleKind`
per schedule, `build_schedule`, `validate`), the action vocabulary (actions.py), the posting of the
point-to-point actions (posting.py), the execution rules (replay.py, stream_replay.py) and
PipeDream-2BW's timeline (two_bw_timeline.py). The config, the pipeline runtime, the simulator and
the planner read it; it reads none of them. See docs/pipeline.md."""
