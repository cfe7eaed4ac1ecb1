"""Pipeline schedules as data, in pure Python (no torch): the table of schedules (table.py: one
`ScheduleKind` per schedule), their compute orders (orders.py), the machinery that reads the table
(registry.py: `build_schedule`, `validate`, and the table's names), the action vocabulary
(actions.py), the posting of the point-to-point actions (posting.py), the execution rules
(replay.py, stream_replay.py) and PipeDream-2BW's timeline (two_bw_timeline.py). The config, the
pipeline runtime, the simulator and the planner read it; it reads none of them (a schedule's own
runtime and step are named in its entry by their import path, imported by the runner that uses them).
See docs/pipeline.md."""
