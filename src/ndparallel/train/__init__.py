"""``ndparallel train``: a run set up (``setup``, ``model``, ``run_inputs``, ``output_dir``, ``preflight``), then
the loop (``loop``: steps, saves, logs), evaluation (``evaluate``) and what the run leaves behind (``finish``);
around them the schedule (``schedule``: learning rate and the save/eval/log cadence), the log window of
steps (``log_window``, timed by ``phase_timer``), what rank 0 says and writes (``run_log``, ``setup_progress``,
``progress``, ``metrics``, ``tracking``, ``summary``) and the out-of-memory report (``oom``).

Layer: the top of the library: it may import every package below (``config``, ``planner``, ``weights``,
``optim``, ``step``, ``data``, ...); only the commands (``cli``, ``validate``) import it.
"""
